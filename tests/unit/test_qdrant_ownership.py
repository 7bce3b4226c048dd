"""The team's Qdrant is theirs (components/gallery/layouts/ownership.py): in Qdrant's local mode, a
careless neighbour's collections and alias beside the gallery's are never dropped or changed by
ingest, upgrade or gc; a name something else holds is refused in one line before any write; a
second gallery using the same alias is refused naming the first one's store; a collection or alias
dropped by another writer is a DamagedObject, one line; a collection the team already serves from
is adopted by export, and stays as it was through an upgrade and gc."""

import uuid

import numpy as np
import pytest

from fastfill.components.experiment.inference import embed
from fastfill.components.gallery.inputs.adopt import adopt, npy_rows, read_manifest
from fastfill.components.gallery.layouts.catalog import ingest
from fastfill.components.gallery.layouts.opening import gallery_at, layout_of
from fastfill.components.gallery.layouts.ownership import OWNER_KEY, STORE_KEY, NotOurs
from fastfill.components.gallery.layouts.qdrant_collection import collection_of, local_client, point_id, release_local
from fastfill.components.gallery.store import DamagedObject, open_store
from fastfill.components.gallery.upgrade import backfill, ending, garbage, planning
from fastfill.components.gallery.upgrade.decider import UpgradeDecider
from fastfill.components.platform.config import GalleryConfig
from tests.gallery_cases import NEW, OLD, N, _gallery, _plan, _png, _put_original
from tests.pg import qdrant_gallery_config


@pytest.fixture
def team(tmp_path):
    """The team's own client of the local-mode folder the test's gallery gets (in this process, the
    one client local mode allows per folder), and the folder and alias."""
    config = qdrant_gallery_config(str(tmp_path / "store")).qdrant
    client = local_client(config.url)
    yield client, config.url, config.alias
    release_local(config.url)


def _team_collection(client, name: str, rows: int, note: str) -> None:
    """A collection of the team's own (no fastfill mark), with points."""
    from qdrant_client import models as qm

    client.create_collection(name, vectors_config=qm.VectorParams(size=4, distance=qm.Distance.EUCLID),
                             metadata={"team.owner": "search"})
    client.upsert(name, points=[qm.PointStruct(id=i, vector=[float(i), 0.0, 0.0, 1.0], payload={"note": f"{note}-{i}"})
                                for i in range(rows)], wait=True)


def _state(client, name: str) -> tuple:
    """What the team would notice changed: the points (payloads and vectors), the metadata."""
    points, _ = client.scroll(name, limit=1000, with_payload=True, with_vectors=True)
    return (sorted((p.id, sorted(p.payload.items()), tuple(p.vector)) for p in points),
            client.get_collection(name).config.metadata)


def _one_line(error: BaseException) -> str:
    text = str(error)
    assert "\n" not in text and "Traceback" not in text, text
    return text


def test_a_neighbours_collections_survive_ingest_upgrade_and_gc_and_a_taken_name_is_refused(tmp_path, models, data,
                                                                                            team):
    _, new, h = models
    client, _, alias = team
    store_uri = str(tmp_path / "store")
    legacy, taken = f"{alias}_emb_legacy", collection_of(alias, NEW)
    _team_collection(client, legacy, 7, "legacy")
    _team_collection(client, taken, 3, "next")
    before = {name: _state(client, name) for name in (legacy, taken)}

    gallery = _gallery(store_uri, models, data, layout="qdrant")
    settings = gallery.manifest()["index"]
    assert settings[OWNER_KEY] and settings[STORE_KEY] == store_uri
    ours = gallery.index.mark_of(collection_of(alias, OLD))
    assert ours == {"gallery": settings[OWNER_KEY], "role": "collection", "store": store_uri}
    assert gallery.index.model_collections() == [collection_of(alias, OLD)]  # not the team's of a like name

    refused = UpgradeDecider.layout_refusal(gallery, NEW, "threads")
    assert refused is not None and f"the collection {taken} exists and is not the product's" in _one_line(
        NotOurs(refused)) and "gallery.qdrant.alias" in refused and refused.endswith("Nothing was written.")
    with pytest.raises(NotOurs, match=rf"the collection {taken} exists and is not the product's .*gallery\.qdrant"
                                      r"\.alias") as raised:
        _plan(gallery, h)
    _one_line(raised.value)
    stored = gallery_at(open_store(store_uri))
    assert stored.manifest()["upgrade"] is None and stored.index.serving().model == OLD.uri
    assert {name: _state(client, name) for name in (legacy, taken)} == before

    client.delete_collection(taken)  # the team gives the name up: the upgrade goes ahead
    gallery = gallery_at(open_store(store_uri))
    plan = _plan(gallery, h)
    for chunk in range(plan.num_chunks):
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, new)
    ending.finish(gallery, plan)
    assert gallery.index.serving().vectors == taken
    deleted = garbage.collect_garbage(gallery)
    assert deleted["features"] == 1 and not gallery.index.exists(collection_of(alias, OLD))
    assert _state(client, legacy) == before[legacy]  # gc left the team's collection of a like name alone
    assert gallery.index.model_collections() == [taken]


def test_an_alias_or_collection_name_the_team_holds_is_refused_before_any_write(tmp_path, models, data, team):
    from qdrant_client import models as qm

    client, _, alias = team
    store_uri = str(tmp_path / "store")
    _team_collection(client, "products", 5, "products")
    client.update_collection_aliases(change_aliases_operations=[
        qm.CreateAliasOperation(create_alias=qm.CreateAlias(collection_name="products", alias_name=alias))])
    before = _state(client, "products")

    with pytest.raises(NotOurs, match=rf"the alias {alias} \(it points at the collection products\) exists and is not "
                                      r"the product's.*gallery\.qdrant\.alias.*Nothing was written\.$") as raised:
        _gallery(store_uri, models, data, layout="qdrant")
    _one_line(raised.value)
    store = open_store(store_uri)
    names = [c.name for c in client.get_collections().collections]
    assert store.list("") == [] and collection_of(alias, OLD) not in names
    assert {a.alias_name: a.collection_name for a in client.get_aliases().aliases}[alias] == "products"
    assert _state(client, "products") == before

    client.update_collection_aliases(change_aliases_operations=[
        qm.DeleteAliasOperation(delete_alias=qm.DeleteAlias(alias_name=alias))])
    _team_collection(client, alias, 2, "named like the alias")
    with pytest.raises(NotOurs, match=rf"the collection {alias} \(a name the alias would take\) exists and is not "
                                      r"the product's.*gallery\.qdrant\.alias"):
        _gallery(store_uri, models, data, layout="qdrant")
    names = [c.name for c in client.get_collections().collections]
    assert store.list("") == [] and collection_of(alias, OLD) not in names


def test_a_second_gallery_with_the_same_alias_is_refused_naming_the_first_store(tmp_path, models, data, team):
    _, url, alias = team
    first_uri = str(tmp_path / "store")
    first = _gallery(first_uri, models, data, layout="qdrant")
    collection = collection_of(alias, OLD)
    images, labels = data

    second_uri = str(tmp_path / "second")
    same = layout_of("qdrant", GalleryConfig(layout="qdrant", qdrant={"url": url, "alias": alias}))
    with pytest.raises(NotOurs, match=rf"the alias {alias} \(it points at the collection {collection}\) belongs to "
                                      rf"another gallery \({first.manifest()['index'][OWNER_KEY]}, store "
                                      rf"{first_uri}\).*gallery\.qdrant\.alias") as raised:
        ingest(open_store(second_uri), images, embed(models[0], images), OLD, labels=labels, part_size=10, layout=same)
    _one_line(raised.value)
    assert open_store(second_uri).list("") == []
    first = gallery_at(open_store(first_uri))
    assert first.index.serving().vectors == collection and first.index.count(collection) == N
    assert first.missing_features(OLD) == []


def test_a_collection_or_alias_dropped_by_another_writer_is_a_damaged_object(tmp_path, models, data, team):
    from qdrant_client import models as qm

    old, new, h = models
    images, _ = data
    client, _, alias = team
    store_uri = str(tmp_path / "store")
    gallery = _gallery(store_uri, models, data, layout="qdrant")

    client.update_collection_aliases(change_aliases_operations=[
        qm.DeleteAliasOperation(delete_alias=qm.DeleteAlias(alias_name=alias))])
    for call in (lambda: gallery.index.search(embed(old, images[:2]), 3, OLD.uri), gallery.index.embedded_count):
        with pytest.raises(DamagedObject, match=rf"the alias {alias} is not there .*dropped by another writer") as raised:
            call()
        _one_line(raised.value)

    gallery.sync_serving()  # the alias is the gallery's to make again
    plan = _plan(gallery, h)
    switched = collection_of(alias, NEW)
    client.delete_collection(switched)  # the upgrade's collection, dropped mid-upgrade
    positions = planning.order_of(gallery.store, plan.upgrade_id)[:plan.chunk_bounds(0)[1]]
    with pytest.raises(DamagedObject, match=rf"the collection {switched} is not there") as raised:
        gallery.serve_chunk(plan, 0, positions, embed(new, images[positions]), np.ones(len(positions), bool))
    _one_line(raised.value)
    with pytest.raises(DamagedObject, match=rf"the collection {switched} is not there"):
        # one image reader: parallel np.load header parses can trip CPython 3.11.7's ast (gh-106905)
        backfill.backfill_chunk(gallery, plan.upgrade_id, 1, new, read_workers=1)
    assert backfill.done_chunks(gallery.store, plan.upgrade_id) == []

    gallery = gallery_at(open_store(store_uri))
    client.delete_collection(collection_of(alias, OLD))  # the gallery's own model's collection
    with pytest.raises(DamagedObject, match=rf"the collection {collection_of(alias, OLD)} of the gallery's model "
                                            r".* is not there \(dropped by another writer\?\)"):
        gallery.features(OLD, 0)


def test_text_ids_are_uuid5_points_with_the_id_in_the_payload(tmp_path, models, data, team):
    client, _, alias = team
    old, _, _ = models
    images, labels = data
    store_uri = str(tmp_path / "store")
    ids = np.array([f"sku-{i:03d}" for i in range(N)], dtype=object)
    ingest(open_store(store_uri), images, embed(old, images), OLD, labels=labels, ids=ids, part_size=10,
           layout=layout_of("qdrant", qdrant_gallery_config(store_uri)))
    gallery = gallery_at(open_store(store_uri))
    point = client.retrieve(collection_of(alias, OLD), ids=[point_id("sku-007")], with_payload=True)[0]
    assert point.payload == {"id": "sku-007", "source": "embedded", "model": OLD.uri}
    found, _, answer_models, _ = gallery.index.search(embed(old, images[7:8]), 1, OLD.uri)
    assert found == [["sku-007"]] and answer_models == [{OLD.uri}]
    np.testing.assert_array_equal(gallery.features(OLD, 0), embed(old, images[:10]))


def test_a_collection_the_team_serves_from_is_adopted_by_export_and_stays_as_it_was(tmp_path, models, data, team):
    """Not where it is: the product's filter on ``model`` and its ``id`` and ``source`` would have to
    be written into the team's points, and an alias cannot take the collection's name (the service
    moves to the alias once either way). The team's ids, image URIs and vectors are read out by
    scroll (docs/serving.md) and adopted under an alias of the gallery's own; the adoption, an
    upgrade, its finish and gc leave the team's collection as it was: never dropped, its points,
    payloads, vectors and configuration the same."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from qdrant_client import models as qm

    old, new, h = models
    images, _ = data
    client, _, alias = team
    features = embed(old, images)
    root = str(tmp_path / "originals")
    for i in range(N):
        _put_original(root, f"img-{i:05d}.png", _png(images[i]))
    skus = [f"sku-{(i * 7) % N:03d}" for i in range(N)]
    client.create_collection("products", vectors_config=qm.VectorParams(size=OLD.dim, distance=qm.Distance.EUCLID),
                             metadata={"team.owner": "search"})
    client.upsert("products", wait=True, points=[qm.PointStruct(
        id=str(uuid.uuid5(uuid.NAMESPACE_URL, skus[i])), vector=features[i].tolist(),
        payload={"sku": skus[i], "photo": f"img-{i:05d}.png", "price": 9.5}) for i in range(N)])

    def as_it_is() -> tuple:
        return _state(client, "products"), client.get_collection("products").config.model_dump_json()

    before = as_it_is()
    ids, uris, vectors, offset = [], [], [], None
    while True:  # the export docs/serving.md shows, a page at a time
        points, offset = client.scroll("products", limit=16, offset=offset, with_payload=["sku", "photo"],
                                       with_vectors=True)
        ids += [p.payload["sku"] for p in points]
        uris += [p.payload["photo"] for p in points]
        vectors += [p.vector for p in points]
        if offset is None:
            break
    pq.write_table(pa.table({"id": ids, "uri": uris}), tmp_path / "items.parquet")
    np.save(tmp_path / "current.npy", np.asarray(vectors, dtype=np.float32))

    store_uri = str(tmp_path / "store")
    adopt(open_store(store_uri), read_manifest(tmp_path / "items.parquet"), OLD, (1, 8, 8), root=root,
          features=npy_rows([tmp_path / "current.npy"]), part_size=10,
          layout=layout_of("qdrant", qdrant_gallery_config(store_uri)))
    gallery = gallery_at(open_store(store_uri))
    rows = [skus.index(sku) for sku in gallery.ids()]
    assert gallery.adopted and alias != "products" and gallery.index.target() == collection_of(alias, OLD)
    np.testing.assert_array_equal(gallery.all_features(OLD), features[rows])
    found, _, spaces, _ = gallery.index.search(features[3:4], 1, OLD.uri)
    assert found == [[skus[3]]] and spaces == [{OLD.uri}]
    assert as_it_is() == before

    plan = _plan(gallery, h)
    for chunk in range(plan.num_chunks):
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, new, read_workers=1)
    ending.finish(gallery, plan)
    np.testing.assert_allclose(gallery.all_features(NEW), embed(new, images)[rows], rtol=1e-5, atol=1e-6)
    found, _, spaces, _ = gallery.index.search(embed(new, images[3:4]), 1, NEW.uri)
    assert found == [[skus[3]]] and spaces == [{NEW.uri}]
    assert garbage.collect_garbage(gallery)["features"] == 1
    names = [c.name for c in client.get_collections().collections]
    assert "products" in names and collection_of(alias, OLD) not in names
    assert {a.alias_name: a.collection_name for a in client.get_aliases().aliases} == {alias: collection_of(alias, NEW)}
    assert as_it_is() == before
