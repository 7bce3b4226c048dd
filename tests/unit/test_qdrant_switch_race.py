"""A reader's search that the switch overtakes, on a real Qdrant (local mode): the alias checked
at the old model's collection, then moved to the new model's (another vector length) before the
query lands. Qdrant refuses the query's length; the search answers nothing, as it does for any
query of another space's model, and the reader asks again with the new model (the Lance and
pgvector layouts answer nothing the same way): never an error, never another space's answer."""

import pytest

from fastfill.components.gallery.layouts.catalog import GalleryError
from tests.gallery_cases import NEW, OLD, _gallery, _plan


@pytest.fixture
def overtaken(tmp_path, models, data, monkeypatch):
    """A qdrant gallery switched to NEW with its alias put back on OLD's collection, and every
    query_points from here on preceded by the switch's alias move (Qdrant's own call)."""
    from qdrant_client import QdrantClient
    from qdrant_client import models as qm

    _, _, h = models
    gallery = _gallery(str(tmp_path / "store"), models, data, layout="qdrant")
    before = gallery.index.target()
    _plan(gallery, h)
    after = gallery.index.target()
    assert before != after and OLD.dim != NEW.dim
    gallery.index.point(before)
    real = QdrantClient.query_points

    def switched_first(self, *args, **kwargs):
        self.update_collection_aliases(change_aliases_operations=[
            qm.DeleteAliasOperation(delete_alias=qm.DeleteAlias(alias_name=gallery.index.alias)),
            qm.CreateAliasOperation(create_alias=qm.CreateAlias(collection_name=after,
                                                                alias_name=gallery.index.alias))])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(QdrantClient, "query_points", switched_first)
    return gallery, before


def test_a_search_the_switch_overtakes_answers_nothing_instead_of_failing(overtaken):
    gallery, before = overtaken
    queries = gallery.all_features(OLD)[:3]
    ids, distances, models, sources = gallery.index.search(queries, 2, OLD.uri)
    assert ids == [[], [], []] and distances == [[], [], []] and models == [set(), set(), set()]


def test_without_the_model_the_same_race_is_named_not_answered(overtaken):
    gallery, _ = overtaken
    with pytest.raises(GalleryError, match=rf"holds {NEW.dim}-d vectors; the queries are {OLD.dim}-d"):
        gallery.index.search(gallery.all_features(OLD)[:3], 2)
