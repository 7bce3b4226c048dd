"""The team's Milvus is theirs (components/gallery/layouts/ownership.py): on a real Milvus Lite
file, a careless neighbour's collections and alias beside the gallery's are never dropped or
changed by ingest, upgrade or gc; a name something else holds is refused in one line before any
write; a second gallery using the same alias is refused naming the first one's store; a collection
or alias dropped by another writer is a DamagedObject, one line, without pymilvus's traceback."""

import logging
import os

import numpy as np
import pytest

from fastfill.components.experiment.inference import embed
from fastfill.components.gallery.layouts.catalog import GalleryError
from fastfill.components.gallery.layouts.milvus_collection import collection_of, milvus_settings
from fastfill.components.gallery.layouts.opening import gallery_at, layout_of
from fastfill.components.gallery.layouts.ownership import OWNER_KEY, STORE_KEY, NotOurs
from fastfill.components.gallery.store import DamagedObject, open_store
from fastfill.components.gallery.upgrade import backfill, ending, garbage, planning
from fastfill.components.gallery.upgrade.decider import UpgradeDecider
from fastfill.components.platform.config import GalleryConfig, MilvusConfig
from tests.gallery_cases import NEW, OLD, N, _gallery, _plan
from tests.pg import milvus_gallery_config


def _where(store_uri: str) -> tuple[str, str]:
    """The Milvus Lite file and the alias a test gallery in ``store_uri`` gets."""
    config = milvus_gallery_config(store_uri).milvus
    return config.uri, config.alias


def _team(uri: str):
    """The team's own client of the same Milvus Lite file."""
    from pymilvus import MilvusClient

    return MilvusClient(uri)


def _team_collection(client, name: str, rows: int, note: str) -> None:
    """A collection of the team's own (no fastfill mark), with rows."""
    from pymilvus import DataType

    schema = client.create_schema(auto_id=False, description=f"the team's {note}")
    schema.add_field("id", DataType.INT64, is_primary=True)
    schema.add_field("vec", DataType.FLOAT_VECTOR, dim=4)
    schema.add_field("note", DataType.VARCHAR, max_length=64)
    client.create_collection(name, schema=schema, properties={"team.owner": "search"})
    index = client.prepare_index_params()
    index.add_index("vec", index_type="FLAT", metric_type="L2")
    client.create_index(name, index, sync=False)
    client.load_collection(name)
    client.insert(name, [{"id": i, "vec": [float(i), 0.0, 0.0, 1.0], "note": f"{note}-{i}"} for i in range(rows)])


def _state(client, name: str) -> tuple:
    """What the team would notice changed: the rows, the description, the properties."""
    rows = client.query(name, filter="id >= 0", output_fields=["id", "note"])
    described = client.describe_collection(name)
    return sorted((r["id"], r["note"]) for r in rows), described["description"], described["properties"]


def _one_line(error: BaseException) -> str:
    text = str(error)
    assert "\n" not in text and "Traceback" not in text, text
    return text


def test_a_neighbours_collections_survive_ingest_upgrade_and_gc_and_a_taken_name_is_refused(tmp_path, models, data):
    _, new, h = models
    store_uri = str(tmp_path / "store")
    uri, alias = _where(store_uri)
    team = _team(uri)
    legacy, taken = f"{alias}_emb_legacy", collection_of(alias, NEW)
    _team_collection(team, legacy, 7, "legacy")
    _team_collection(team, taken, 3, "next")
    before = {name: _state(team, name) for name in (legacy, taken)}

    gallery = _gallery(store_uri, models, data, layout="milvus")
    settings = gallery.manifest()["index"]
    assert settings[OWNER_KEY] and settings[STORE_KEY] == store_uri
    ours = gallery.index.mark_of(collection_of(alias, OLD))
    assert ours == {"gallery": settings[OWNER_KEY], "role": "collection", "store": store_uri}
    assert gallery.index.model_collections() == [collection_of(alias, OLD)]  # not the team's of a like name

    # the next model's collection name is the team's: refused before any work, and at the switch
    refused = UpgradeDecider.layout_refusal(gallery, NEW, "threads")
    assert refused is not None and f"the collection {taken} exists and is not the product's" in _one_line(
        NotOurs(refused)) and "gallery.milvus.alias" in refused and refused.endswith("Nothing was written.")
    with pytest.raises(NotOurs, match=rf"the collection {taken} exists and is not the product's .*gallery\.milvus"
                                      r"\.alias") as raised:
        _plan(gallery, h)
    _one_line(raised.value)
    stored = gallery_at(open_store(store_uri))
    assert stored.manifest()["upgrade"] is None and stored.index.serving().model == OLD.uri
    assert {name: _state(team, name) for name in (legacy, taken)} == before

    team.drop_collection(taken)  # the team gives the name up: the upgrade goes ahead
    gallery = gallery_at(open_store(store_uri))
    plan = _plan(gallery, h)
    for chunk in range(plan.num_chunks):
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, new)
    ending.finish(gallery, plan)
    assert gallery.index.serving().vectors == taken
    deleted = garbage.collect_garbage(gallery)
    assert deleted["features"] == 1 and not team.has_collection(collection_of(alias, OLD))
    assert _state(team, legacy) == before[legacy]  # gc left the team's collection of a like name alone
    assert gallery.index.model_collections() == [taken]


def test_an_alias_or_collection_name_the_team_holds_is_refused_before_any_write(tmp_path, models, data, caplog):
    store_uri = str(tmp_path / "store")
    uri, alias = _where(store_uri)
    team = _team(uri)
    _team_collection(team, "products", 5, "products")
    team.create_alias("products", alias)
    before = _state(team, "products")

    with pytest.raises(NotOurs, match=rf"the alias {alias} \(it points at the collection products\) exists and is not "
                                      r"the product's.*gallery\.milvus\.alias.*Nothing was written\.$") as raised:
        _gallery(store_uri, models, data, layout="milvus")
    _one_line(raised.value)
    store = open_store(store_uri)
    assert store.list("") == [] and not team.has_collection(collection_of(alias, OLD))
    assert team.describe_alias(alias)["collection_name"] == "products" and _state(team, "products") == before

    team.drop_alias(alias)  # now a collection of the alias's name
    _team_collection(team, alias, 2, "named like the alias")
    with pytest.raises(NotOurs, match=rf"the collection {alias} \(a name the alias would take\) exists and is not "
                                      r"the product's.*gallery\.milvus\.alias"):
        _gallery(store_uri, models, data, layout="milvus")
    assert store.list("") == [] and not team.has_collection(collection_of(alias, OLD))
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no logged tracebacks either


def test_a_second_gallery_with_the_same_alias_is_refused_naming_the_first_store(tmp_path, models, data):
    first_uri = str(tmp_path / "first")
    uri, alias = _where(first_uri)
    first = _gallery(first_uri, models, data, layout="milvus")
    collection = collection_of(alias, OLD)
    images, labels = data

    second_uri = str(tmp_path / "second")
    same = layout_of("milvus", GalleryConfig(layout="milvus", milvus={"uri": uri, "alias": alias}))
    from fastfill.components.gallery.layouts.catalog import ingest

    with pytest.raises(NotOurs, match=rf"the alias {alias} \(it points at the collection {collection}\) belongs to "
                                      rf"another gallery \({first.manifest()['index'][OWNER_KEY]}, store "
                                      rf"{first_uri}\).*gallery\.milvus\.alias") as raised:
        ingest(open_store(second_uri), images, embed(models[0], images), OLD, labels=labels, part_size=10, layout=same)
    _one_line(raised.value)
    assert open_store(second_uri).list("") == []
    first = gallery_at(open_store(first_uri))
    assert first.index.serving().vectors == collection and first.index.count(collection) == N
    assert first.missing_features(OLD) == []


def test_a_collection_or_alias_dropped_by_another_writer_is_a_damaged_object(tmp_path, models, data, caplog):
    old, new, h = models
    images, _ = data
    store_uri = str(tmp_path / "store")
    uri, alias = _where(store_uri)
    gallery = _gallery(store_uri, models, data, layout="milvus")
    team = _team(uri)
    heard: list[logging.LogRecord] = []
    listener = logging.Handler()
    listener.emit = heard.append  # type: ignore[method-assign]
    logging.getLogger("pymilvus").addHandler(listener)
    try:
        team.drop_alias(alias)
        for call in (lambda: gallery.index.search(embed(old, images[:2]), 3, OLD.uri),
                     gallery.index.embedded_count):
            with pytest.raises(DamagedObject, match=rf"the alias {alias} is not there .*dropped by another writer"):
                call()

        gallery.sync_serving()  # the alias is the gallery's to make again
        plan = _plan(gallery, h)
        switched = collection_of(alias, NEW)
        team.drop_collection(switched)  # the upgrade's collection, dropped mid-upgrade
        positions = planning.order_of(gallery.store, plan.upgrade_id)[:plan.chunk_bounds(0)[1]]
        with pytest.raises(DamagedObject, match=rf"the collection {switched} is not there") as raised:
            gallery.serve_chunk(plan, 0, positions, embed(new, images[positions]), np.ones(len(positions), bool))
        _one_line(raised.value)
        with pytest.raises(DamagedObject, match=rf"the collection {switched} is not there"):
            backfill.backfill_chunk(gallery, plan.upgrade_id, 1, new)
        assert backfill.done_chunks(gallery.store, plan.upgrade_id) == []

        gallery = gallery_at(open_store(store_uri))
        team.drop_collection(collection_of(alias, OLD))  # the gallery's own model's collection
        with pytest.raises(DamagedObject, match=rf"the collection {collection_of(alias, OLD)} of the gallery's model "
                                                r".* is not there \(dropped by another writer\?\)"):
            gallery.features(OLD, 0)
    finally:
        logging.getLogger("pymilvus").removeHandler(listener)
    assert heard == [] and not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_the_milvus_lite_file_is_a_db_path_not_a_directory(tmp_path, models, data):
    store_uri = str(tmp_path / "store")
    folder = tmp_path / "team-data"
    folder.mkdir()
    (folder / "notes.txt").write_text("the team's")
    os.makedirs(tmp_path / "x.db")
    for uri, what in ((str(folder), "is a directory that is not a Milvus Lite database"),
                      (str(tmp_path / "x.db"), "is a directory that is not a Milvus Lite database"),
                      (str(tmp_path / "milvus"), "does not end in .db")):
        with pytest.raises(GalleryError, match=rf"gallery\.milvus\.uri {uri} {what}; give the path of a Milvus Lite "
                                               r"\.db file") as raised:
            milvus_settings(MilvusConfig(uri=uri), "l2", store_uri)
        _one_line(raised.value)
    assert sorted(os.listdir(folder)) == ["notes.txt"] and os.listdir(tmp_path / "x.db") == []
    gallery = _gallery(store_uri, models, data, layout="milvus")  # a .db path Milvus Lite made is its own
    uri = gallery.manifest()["index"]["uri"]
    assert os.path.isdir(uri) and milvus_settings(MilvusConfig(uri=uri), "l2", store_uri)["uri"] == uri
