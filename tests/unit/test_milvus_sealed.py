"""On Milvus Lite, rows the product writes are sealed into indexed segments as they are written:
Lite scans a growing segment row by row at every search (2.5 s against 0.26 s a search at
100,000 rows, benchmarks/serving_index.py), so a new gallery, the switch and each chunk end in a
flush of the collection they wrote. The flush is the real one (a recorder around pymilvus's
call)."""

import pytest

from fastfill.components.gallery.layouts.milvus_collection import Collections, collection_of
from fastfill.components.gallery.upgrade import backfill, ending
from tests.gallery_cases import NEW, OLD, _gallery, _plan


@pytest.fixture
def flushed(monkeypatch):
    from pymilvus import MilvusClient

    calls: list[str] = []
    real = MilvusClient.flush

    def recorded(self, collection_name, *args, **kwargs):
        calls.append(collection_name)
        return real(self, collection_name, *args, **kwargs)

    monkeypatch.setattr(MilvusClient, "flush", recorded)
    return calls


def test_a_new_gallery_the_switch_and_each_chunk_are_sealed_on_milvus_lite(tmp_path, models, data, flushed):
    _, new, h = models
    gallery = _gallery(str(tmp_path / "store"), models, data, layout="milvus")
    alias = gallery.index.alias
    assert flushed == [collection_of(alias, OLD)]  # the new gallery's collection, once written
    flushed.clear()
    plan = _plan(gallery, h)
    assert flushed == [collection_of(alias, NEW)]  # the switch's mixed rows
    for chunk in range(plan.num_chunks):
        flushed.clear()
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, new)
        assert flushed == [collection_of(alias, NEW)], chunk
    ending.finish(gallery, plan)
    served = gallery.index.search(gallery.all_features(NEW)[:5], 1, NEW.uri)[0]
    assert [row[0] for row in served] == list(gallery.ids()[:5])


def test_a_milvus_server_is_flushed_after_bulk_writes_only(flushed):
    """A server indexes its growing segments itself and limits flushes: a chunk does not flush."""
    index = Collections({"uri": "http://milvus.invalid:19530", "alias": "g"})
    index.seal("g_emb_x", chunk=True)  # returns before any call: no client is made
    assert flushed == [] and index._client is None
