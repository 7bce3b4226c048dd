"""What the gallery components must do on any store (a local folder in the unit tier, a real
S3 HTTP endpoint in the integration tier) and in either layout (the parts, the Lance table): each
case takes (store_uri, models, data, layout); ``CASES`` pairs each with the layouts it applies
to (None: the store alone)."""

import functools
import io
import json
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

from fastfill.components.experiment.inference import apply_alignment, embed
from fastfill.components.experiment.models import AlignmentMap, Embedder
from fastfill.components.gallery.inputs.adopt import adopt
from fastfill.components.gallery.layouts.catalog import IMAGE_CACHE, Gallery, GalleryError, fetch_images, ingest
from fastfill.components.gallery.layouts.opening import gallery_at, layout_of
from fastfill.components.gallery.search.index import GallerySearch
from fastfill.components.gallery.store import (
    AlreadyExists,
    ChecksumMismatch,
    DamagedObject,
    LocalStore,
    ObjectMissing,
    open_store,
)
from fastfill.components.gallery.store import lock as locking
from fastfill.components.gallery.upgrade import backfill, ending, garbage, planning
from fastfill.components.gallery.upgrade.outcome import Decision
from fastfill.components.gallery.upgrade.status import GalleryStatus, gallery_status
from fastfill.components.platform.config import TrainConfig
from fastfill.components.platform.registry import ModelRef

N, OLD_DIM, NEW_DIM = 53, 8, 12


@functools.cache
def make_models():
    torch.manual_seed(0)
    old = Embedder(TrainConfig(backbone="cnn_small", width=4, embedding_dim=OLD_DIM), 1, [0, 1, 2]).eval()
    new = Embedder(TrainConfig(backbone="cnn", width=4, embedding_dim=NEW_DIM), 1, [0, 1, 2, 3]).eval()
    h = AlignmentMap(OLD_DIM, NEW_DIM, [16], uncertainty=True).eval()
    return old, new, h


@functools.cache
def make_data():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(N, 1, 8, 8), dtype=np.uint8)
    labels = rng.integers(0, 4, size=N)
    return images, labels


OLD = ModelRef("embedder", "1", OLD_DIM)
NEW = ModelRef("embedder", "2", NEW_DIM)


LAYOUTS = ("parts", "lance", "pgvector", "milvus", "qdrant")


def writing(layout: str, store_uri: str):
    """What writes a new gallery of ``layout`` (pgvector: in a table of the test's own on the tests'
    PostgreSQL server)."""
    if layout == "pgvector":
        from tests.pg import pg_gallery_config

        return layout_of(layout, pg_gallery_config(store_uri))
    if layout == "milvus":
        from tests.pg import milvus_gallery_config

        return layout_of(layout, milvus_gallery_config(store_uri))
    if layout == "qdrant":
        from tests.pg import qdrant_gallery_config

        return layout_of(layout, qdrant_gallery_config(store_uri))
    return layout_of(layout)


def _gallery(store_uri, models, data, part_size=10, layout="parts") -> Gallery:
    old, _, _ = models
    images, labels = data
    ingest(open_store(store_uri), images, embed(old, images), OLD, labels=labels, ids=np.arange(N) + 1000,
           groups=np.array([f"g{i % 3}" for i in range(N)]), part_size=part_size, layout=writing(layout, store_uri))
    gallery = gallery_at(open_store(store_uri))
    assert gallery.layout == layout
    return gallery


def _plan(gallery: Gallery, h, chunk_size=7, eval_all=True) -> planning.Plan:
    uid = planning.upgrade_id(OLD, NEW)
    for part in range(gallery.num_parts):
        planning.transform_part(gallery, uid, h, part)
    order = planning.make_order(gallery, uid, "sigma", 0)
    plan = planning.Plan(uid, OLD, NEW, "models:/embedder-alignment/1", "sigma", chunk_size, N, N if eval_all else 0, "l2")
    planning.commit_plan(gallery, plan, order)
    return plan


def store_roundtrip_listing_and_create_only(store_uri, models, data, layout=None):
    store = open_store(store_uri)
    store.check()
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    store.put_array("a/x.npy", array)
    store.put_json("a/b/meta.json", {"k": 1})
    store.put("b/raw.bin", b"bytes")
    np.testing.assert_array_equal(store.get_array("a/x.npy"), array)
    assert store.get_json("a/b/meta.json") == {"k": 1}
    assert store.list("a/") == ["a/b/meta.json", "a/x.npy"]
    assert store.exists("b/raw.bin") and not store.exists("b/none")
    store.put_json("lock.json", {"holder": 1}, create_only=True)
    with pytest.raises(AlreadyExists):
        store.put_json("lock.json", {"holder": 2}, create_only=True)
    assert store.get_json("lock.json") == {"holder": 1}
    with pytest.raises(ObjectMissing, match="b/none does not exist"):
        store.get("b/none")
    store.delete("b/raw.bin")
    assert not store.exists("b/raw.bin")
    assert len(store.list("a/")) == 2
    for key in store.list("a/"):
        store.delete(key)
    assert store.list("a/") == []


def _tamper(store_uri: str, key: str, data: bytes) -> None:
    """Change an object's bytes behind the store's back (its recorded checksum stays)."""
    store = open_store(store_uri)
    if isinstance(store, LocalStore):
        (store.root / key).write_bytes(data)
    else:
        head = store.client.head_object(Bucket=store.bucket, Key=store._key(key))
        store.client.put_object(Bucket=store.bucket, Key=store._key(key), Body=data, Metadata=head["Metadata"])


def checksum_mismatch_is_an_error_naming_the_object(store_uri, models, data, layout=None):
    store = open_store(store_uri)
    store.put_array("images/part-00000.npy", np.zeros((2, 1, 4, 4), np.uint8))
    buffer = io.BytesIO()
    np.save(buffer, np.ones((2, 1, 4, 4), np.uint8))
    _tamper(store_uri, "images/part-00000.npy", buffer.getvalue())
    with pytest.raises(ChecksumMismatch, match=r"images/part-00000\.npy is corrupt"):
        store.get_array("images/part-00000.npy")


def ingest_writes_parts_and_reads_back(store_uri, models, data, layout=None):
    gallery = _gallery(store_uri, models, data, layout=layout)
    images, labels = data
    assert gallery.num_items == N and gallery.num_parts == 6 and gallery.model == OLD
    np.testing.assert_array_equal(gallery.ids(), np.arange(N) + 1000)
    np.testing.assert_array_equal(gallery.labels(), labels)
    np.testing.assert_array_equal(gallery.images(5), images[50:])
    np.testing.assert_allclose(gallery.all_features(OLD), embed(models[0], images), rtol=1e-5, atol=1e-6)
    assert gallery.items().column("group").to_pylist()[:4] == ["g0", "g1", "g2", "g0"]
    with pytest.raises(GalleryError, match="already holds a gallery"):
        ingest(gallery.store, images, np.zeros((N, OLD_DIM)), OLD)


def backfill_resumes_without_redoing_chunks_and_finishes(store_uri, models, data, layout=None):
    _, new, h = models
    images, _ = data
    gallery = _gallery(store_uri, models, data, layout=layout)
    plan = _plan(gallery, h)
    assert gallery.manifest(refresh=True)["upgrade"] == plan.upgrade_id and plan.num_chunks == 8
    order = planning.order_of(gallery.store, plan.upgrade_id)
    old_features = gallery.all_features(OLD)
    transformed, sigma = apply_alignment(h, old_features)
    np.testing.assert_array_equal(order, np.argsort(-sigma.astype(np.float64), kind="stable"))

    first = [backfill.backfill_chunk(gallery, plan.upgrade_id, c, new) for c in (0, 1, 4)]
    assert backfill.done_chunks(gallery.store, plan.upgrade_id) == [0, 1, 4]
    again = backfill.backfill_chunk(gallery, plan.upgrade_id, 1, new)
    assert again["skipped"] and again["token"] == first[1]["token"]  # a done chunk is not redone

    mixed, backfilled = backfill.mixed_features(gallery, plan)
    expected_new = embed(new, images)
    rows = np.concatenate([order[slice(*plan.chunk_bounds(c))] for c in (0, 1, 4)])
    assert set(np.flatnonzero(backfilled)) == set(rows)
    np.testing.assert_allclose(mixed[rows], expected_new[rows], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mixed[~backfilled], transformed[~backfilled], rtol=1e-5, atol=1e-6)
    for memory in (1, 2 * 10 * NEW_DIM * 4, 1 << 30):  # a part, two parts, everything per batch
        parts = list(backfill.iter_mixed_parts(gallery, plan, memory_bytes=memory))
        assert [p for p, _, _ in parts] == list(range(gallery.num_parts))
        np.testing.assert_array_equal(np.concatenate([f for _, f, _ in parts]), mixed)
        np.testing.assert_array_equal(np.concatenate([b for _, _, b in parts]), backfilled)
    sample = np.array([order[0], 3, 50, int(rows[-1]), 17])  # the same rows, reading only what they need
    np.testing.assert_array_equal(backfill.mixed_rows(gallery, plan, sample), mixed[sample])
    np.testing.assert_array_equal(backfill.transformed_rows(gallery, plan.upgrade_id, sample),
                                  planning.transformed_all(gallery, plan.upgrade_id)[sample])
    with pytest.raises(GalleryError, match="not complete: 5 chunks left"):
        ending.finish(gallery, plan)
    state = gallery_status(gallery)
    assert state.state == "paused" and state.upgrade.chunks_done == 3
    assert state.upgrade.items_done == 21

    for chunk in range(plan.num_chunks):
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, new)
    ending.finish(gallery, plan)
    assert gallery.model == NEW and gallery.manifest()["upgrade"] is None
    np.testing.assert_allclose(gallery.all_features(NEW), expected_new, rtol=1e-5, atol=1e-6)
    assert gallery_status(gallery).state == "idle"
    # old features stay until collected explicitly (6 parts' objects, or the table's one column)
    assert gallery.missing_features(OLD) == []
    deleted = garbage.collect_garbage(gallery)
    assert deleted["features"] == (6 if layout == "parts" else 1) and deleted["upgrade_objects"] > 0
    assert gallery.missing_features(OLD) != []
    assert gallery.store.list(f"features/{OLD.key}/") == []
    assert gallery.store.exists(f"upgrades/{plan.upgrade_id}/plan.json")
    np.testing.assert_allclose(gallery.all_features(NEW), expected_new, rtol=1e-5, atol=1e-6)


def _table_data_files(store_uri: str) -> list[str]:
    """The keys (in the store) of the Lance table's data files."""
    return sorted(_raw_keys(store_uri, "gallery.lance/data/"))


def _raw_keys(store_uri: str, prefix: str) -> list[str]:
    if store_uri.startswith("s3://"):
        import boto3

        bucket, _, root = store_uri[5:].partition("/")
        pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{root}/{prefix}")
        return [o["Key"][len(root) + 1:] for page in pages for o in page.get("Contents", [])]
    folder = os.path.join(store_uri, prefix)
    return [f"{prefix}{name}" for name in os.listdir(folder)]


def _read_raw(store_uri: str, key: str) -> bytes:
    if store_uri.startswith("s3://"):
        import boto3

        bucket, _, root = store_uri[5:].partition("/")
        return boto3.client("s3").get_object(Bucket=bucket, Key=f"{root}/{key}")["Body"].read()
    with open(os.path.join(store_uri, key), "rb") as handle:
        return handle.read()


def _rewrite_raw(store_uri: str, key: str, change) -> None:
    """Replace a file of the Lance table behind everyone's back with ``change(its bytes)``."""
    if store_uri.startswith("s3://"):
        import boto3

        bucket, _, root = store_uri[5:].partition("/")
        client = boto3.client("s3")
        body = client.get_object(Bucket=bucket, Key=f"{root}/{key}")["Body"].read()
        client.put_object(Bucket=bucket, Key=f"{root}/{key}", Body=change(body))
    else:
        path = os.path.join(store_uri, key)
        with open(path, "rb") as handle:
            body = handle.read()
        with open(path, "wb") as handle:
            handle.write(change(body))


def a_corrupt_image_part_fails_its_chunk_without_a_marker(store_uri, models, data, layout=None):
    """A damaged image part (parts: an object whose bytes do not match its checksum, then a
    missing one; the table: a truncated data file) fails the chunk that reads it, naming it,
    and writes no marker."""
    from fastfill.components.gallery.store import DamagedObject

    _, new, h = models
    gallery = _gallery(store_uri, models, data, layout=layout)
    plan = _plan(gallery, h, chunk_size=N)  # one chunk touches every part
    IMAGE_CACHE._parts.clear()
    if layout == "lance":
        (data_file,) = _table_data_files(store_uri)
        _rewrite_raw(store_uri, data_file, lambda body: body[:len(body) // 2])
        with pytest.raises(DamagedObject, match=rf"data file .*{os.path.basename(data_file)}.* cannot be read"):
            backfill.backfill_chunk(gallery, plan.upgrade_id, 0, new)
        assert backfill.done_chunks(gallery.store, plan.upgrade_id) == []
        return
    buffer = io.BytesIO()
    np.save(buffer, np.zeros((10, 1, 8, 8), np.uint8))
    _tamper(store_uri, "images/part-00002.npy", buffer.getvalue())
    with pytest.raises(ChecksumMismatch, match="images/part-00002.npy"):
        backfill.backfill_chunk(gallery, plan.upgrade_id, 0, new)
    assert backfill.done_chunks(gallery.store, plan.upgrade_id) == []
    gallery.store.delete("images/part-00002.npy")
    with pytest.raises(ObjectMissing, match="images/part-00002.npy does not exist"):
        backfill.backfill_chunk(gallery, plan.upgrade_id, 0, new)
    assert backfill.done_chunks(gallery.store, plan.upgrade_id) == []


def features_altered_in_the_table_are_refused_naming_the_item_and_file(store_uri, models, data, layout=None):
    """The table keeps no checksum of its own: a float changed inside a data file reads back as
    another number. The digest per row finds it, naming the position and the data file, on
    every read of those features (a part, scattered rows, all of them)."""
    from fastfill.components.gallery.store import DamagedObject

    _, new, h = models
    gallery = _gallery(store_uri, models, data, layout=layout)
    plan = _plan(gallery, h)
    for chunk in range(plan.num_chunks):
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, new)
    ending.finish(gallery, plan)  # the new model's column: a data file of its own
    row = gallery.features(NEW, 1)[0].astype("<f4").tobytes()  # position 10's floats, as stored
    untouched = gallery.features(OLD, 1)  # the old model's column: another data file
    newest = next(key for key in _table_data_files(store_uri) if row in _read_raw(store_uri, key))
    at = _read_raw(store_uri, newest).index(row) + 1
    _rewrite_raw(store_uri, newest, lambda body: body[:at] + bytes([body[at] ^ 0x10]) + body[at + 1:])
    gallery = gallery_at(open_store(store_uri))
    for read in (lambda: gallery.features(NEW, 1), lambda: gallery.features_at(NEW, np.array([40, 10])),
                 lambda: gallery.all_features(NEW)):
        with pytest.raises(DamagedObject, match=rf"do not match their digest \(first: position 10, in data files "
                                                rf".*{os.path.basename(newest)}"):
            read()
    np.testing.assert_array_equal(gallery.features(OLD, 1), untouched)  # the rest reads, as it was


def a_features_part_short_of_rows_is_refused_naming_it_and_not_retried(store_uri, models, data, layout=None):
    """A features part written whole (its checksum matching) with fewer rows than its part's
    items: every reader refuses it in one error naming the object, the map sample's reader of
    scattered rows included, and the tasks' retry policy does not read it again."""
    from fastfill.components.gallery.layouts.catalog import features_key, rows_at
    from fastfill.components.gallery.store import DamagedObject
    from fastfill.tasks._policy import _worth_retrying

    gallery = _gallery(store_uri, models, data, layout=layout)
    key = features_key(OLD, 3)
    gallery.store.put_array(key, gallery.features(OLD, 3)[:7])  # 7 rows for the part's 10 items
    for read in (lambda: gallery.features(OLD, 3),
                 lambda: rows_at(gallery, np.array([2, 38, 35]), lambda part: features_key(OLD, part))):
        with pytest.raises(DamagedObject, match=rf"{key}: 7 rows, but part 3 has 10 items"):
            read()

    class Failed:
        def result(self):
            raise DamagedObject("damaged")

    assert _worth_retrying(None, None, Failed()) is False


def a_transformed_part_short_of_rows_is_refused_naming_it(store_uri, models, data, layout=None):
    """An upgrade's transformed part (an object beside the gallery on both layouts) short of
    rows: the search, the backfill's mixed features and the advisor refuse it naming it."""
    from fastfill.components.gallery.store import DamagedObject

    gallery = _gallery(store_uri, models, data, layout=layout)
    plan = _plan(gallery, models[2])
    short = planning.transformed_key(plan.upgrade_id, 2)
    gallery.store.put_array(short, gallery.part_rows(short, 2)[:4])
    for read in (lambda: planning.transformed_all(gallery, plan.upgrade_id), lambda: backfill.mixed_features(gallery, plan),
                 lambda: GallerySearch(gallery)):
        with pytest.raises(DamagedObject, match=rf"{short}: 4 rows, but part 2 has 10 items"):
            read()


def lock_refuses_a_second_upgrade_and_takes_over_a_dead_one(store_uri, models, data, layout=None):
    store = open_store(store_uri)
    lock = locking.acquire_lock(store, "u1", log=lambda m: None)
    with pytest.raises(locking.UpgradeLocked, match=r"being upgraded: upgrade u1 by process \d+ .*fastfill upgrade unlock"):
        locking.acquire_lock(store, "u2", log=lambda m: None)
    lock.release()
    assert not store.exists(locking.LOCK)

    # a lock left by a process that is gone (killed) on this host is taken over
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    store.put_json(locking.LOCK, {"upgrade": "u1", "host": socket.gethostname(), "pid": dead.pid, "since": "t",
                             "token": "x"}, create_only=True)
    messages = []
    lock = locking.acquire_lock(store, "u1", log=messages.append)
    assert lock.holder["pid"] == os.getpid() and "that process is gone" in messages[0]
    lock.release()

    # a lock held on another machine is refused, and can be broken explicitly
    store.put_json(locking.LOCK, {"upgrade": "u1", "host": "elsewhere", "pid": 1, "since": "t", "token": "y"},
                   create_only=True)
    with pytest.raises(locking.UpgradeLocked, match="on elsewhere"):
        locking.acquire_lock(store, "u2", log=lambda m: None)
    assert locking.break_lock(store).host == "elsewhere"
    locking.acquire_lock(store, "u2", log=lambda m: None).release()


def _brute_force(gallery_features, ids, queries, k):
    distances = ((queries[:, None, :] - gallery_features[None]) ** 2).sum(-1)
    return ids[np.argsort(distances, axis=1, kind="stable")[:, :k]]


def search_updates_vectors_by_id_as_chunks_land(store_uri, models, data, layout=None):
    _, new, h = models
    gallery = _gallery(store_uri, models, data, layout=layout)
    searcher = GallerySearch(gallery)
    assert searcher.query_model == OLD
    queries_old = gallery.all_features(OLD)[:5]
    ids, _ = searcher.search(queries_old, k=4)
    np.testing.assert_array_equal(ids, _brute_force(gallery.all_features(OLD), gallery.ids(), queries_old, 4))
    assert searcher.sources(ids) == [[OLD.uri] * 4] * 5

    plan = _plan(gallery, h)
    assert searcher.refresh() == 0 and searcher.query_model == NEW and searcher.rebuilds == 1
    for chunk in (0, 1, 2):
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, new)
    assert searcher.refresh() == 3 and searcher.rebuilds == 1 and searcher.index.ntotal == N
    assert searcher.backfilled == 21
    mixed, _ = backfill.mixed_features(gallery, plan)
    queries = embed(new, data[0][:6])
    ids, distances = searcher.search(queries, k=5)
    np.testing.assert_array_equal(ids, _brute_force(mixed, gallery.ids(), queries, 5))
    first = int(planning.order_of(gallery.store, plan.upgrade_id)[0])  # the index's ids are the items' positions
    np.testing.assert_allclose(searcher.index.reconstruct(first), mixed[first])
    _, backfilled = backfill.mixed_features(gallery, plan)
    position = {int(i): p for p, i in enumerate(gallery.ids())}
    mapped = f"{OLD.uri} mapped by {plan.map_uri}"
    assert searcher.sources(ids) == [[NEW.uri if backfilled[position[int(i)]] else mapped for i in row] for row in ids]
    assert {src for row in searcher.sources(ids) for src in row} <= {NEW.uri, mapped}

    for chunk in range(plan.num_chunks):
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, new)
    ending.finish(gallery, plan)
    assert searcher.refresh() == 5 and searcher.rebuilds == 1 and searcher.query_model == NEW
    with pytest.raises(GalleryError, match="dimension 8, but the model's is 12"):
        searcher.search(queries_old)
    bad = queries.copy()
    bad[1, 0] = np.nan
    with pytest.raises(GalleryError, match="NaN or infinite"):
        searcher.search(bad)


def _originals(store_uri: str) -> str:
    """Where an adopted gallery's images live: beside the store (a folder, or the same bucket)."""
    if store_uri.startswith("s3://"):
        return f"s3://{store_uri[5:].split('/')[0]}/originals"
    return str(os.path.join(os.path.dirname(store_uri.rstrip("/")), "originals"))


def _put_original(root: str, name: str, data: bytes) -> None:
    if root.startswith("s3://"):
        import boto3

        bucket, _, prefix = root[5:].partition("/")
        boto3.client("s3").put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=data)
    else:
        os.makedirs(root, exist_ok=True)
        with open(os.path.join(root, name), "wb") as out:
            out.write(data)


def _remove_original(root: str, name: str) -> None:
    if root.startswith("s3://"):
        import boto3

        bucket, _, prefix = root[5:].partition("/")
        boto3.client("s3").delete_object(Bucket=bucket, Key=f"{prefix}/{name}")
    else:
        os.remove(os.path.join(root, name))


def _png(image: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image[0], mode="L").save(buffer, format="PNG")
    return buffer.getvalue()


def adopted_gallery_reads_images_by_uri_and_keeps_failed_items(store_uri, models, data, layout=None):
    import pyarrow as pa

    old, new, h = models
    images, labels = data
    root = _originals(store_uri)
    for i in range(N):
        _put_original(root, f"img-{i:05d}.png", _png(images[i]))
    table = pa.table({"id": np.arange(N) + 500, "uri": [f"img-{i:05d}.png" for i in range(N)], "label": labels})
    features = embed(old, images)
    adopt(open_store(store_uri), table, OLD, (1, 8, 8), root=root, features=iter([features[:20], features[20:]]),
          part_size=10, layout=writing(layout, store_uri))
    gallery = gallery_at(open_store(store_uri))
    assert gallery.adopted and gallery.image_root == root and gallery.store.list("images/") == []
    np.testing.assert_array_equal(gallery.all_features(OLD), features)
    got, failures = fetch_images(gallery, np.array([3, 40, 0]))
    assert failures == [] and np.array_equal(got, images[[3, 40, 0]])

    _remove_original(root, "img-00005.png")
    _put_original(root, "img-00006.png", b"not a png")
    plan = _plan(gallery, h)
    for chunk in range(plan.num_chunks):
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, new)
    failed = backfill.failed_images(gallery.store, plan.upgrade_id)
    assert sorted((f["id"], f["position"], f["reason"].split(":")[0]) for f in failed) == [
        (505, 5, "missing"), (506, 6, "undecodable")]
    mixed, backfilled = backfill.mixed_features(gallery, plan)
    transformed, _ = apply_alignment(h, features)
    np.testing.assert_allclose(mixed[[5, 6]], transformed[[5, 6]], rtol=1e-5, atol=1e-6)  # kept, not a gap
    others = np.setdiff1d(np.arange(N), [5, 6])
    np.testing.assert_allclose(mixed[others], embed(new, images)[others], rtol=1e-5, atol=1e-6)
    state = gallery_status(gallery)  # the same when read back from the JSON `upgrade status --json` prints
    assert GalleryStatus.from_dict(json.loads(json.dumps(state.to_dict()))).to_dict() == state.to_dict()
    assert state.upgrade.failed_images.count == 2 and {f["id"] for f in state.upgrade.failed_images.items} == {505, 506}
    searcher = GallerySearch(gallery)
    assert searcher.sources(np.array([505, 507])) == [f"{OLD.uri} mapped by {plan.map_uri}", NEW.uri]
    record = ending.finish(gallery, plan)
    assert record["failed_images"]["count"] == 2 and gallery.model == NEW
    assert searcher.refresh() >= 0 and searcher.sources(np.array([506, 500])) == [
        f"{OLD.uri} mapped by {plan.map_uri}", NEW.uri]  # after the finish, the kept item still says so
    assert GallerySearch(gallery).sources(np.array([506, 500])) == [f"{OLD.uri} mapped by {plan.map_uri}", NEW.uri]


def _index_answers(gallery, queries, k=5, model=None):
    """The index's own answers (ids) and the model each answer was computed in."""
    ids, _, models, sources = gallery.index.search(queries, k, model)
    return ids, models, sources


def the_index_serves_one_space_at_a_time_as_chunks_land(store_uri, models, data, layout=None):
    """A reader thread queries the index throughout an upgrade with the model the index says
    serves: no answer mixes spaces or models, it moves to the new model at the switch, and at
    each landed chunk the index answers exactly as a search over the product's mixed gallery."""
    import threading
    import time

    old, new, h = models
    images, _ = data
    gallery = _gallery(store_uri, models, data, layout=layout)
    queries = {OLD.uri: embed(old, images[:8]), NEW.uri: embed(new, images[:8])}
    seen, moved, stop, errors = [], [], threading.Event(), []

    def reader() -> None:
        reading = gallery_at(open_store(store_uri))  # a reader of its own, with its own connection
        try:
            while not stop.is_set():
                served = reading.index.serving().model
                ids, answer_models, sources = _index_answers(reading, queries[served][:2], k=6, model=served)
                if not ids[0]:  # the view moved on since the serving row was read: read it again
                    moved.append(served)
                    continue
                seen.append((served, [sorted(m) for m in answer_models], sources))
                time.sleep(0.002)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)
        finally:
            reading.index.close()

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        time.sleep(0.1)
        plan = _plan(gallery, h)
        time.sleep(0.1)
        order = planning.order_of(gallery.store, plan.upgrade_id)
        for chunk in range(plan.num_chunks):
            backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, new)
            mixed, backfilled = backfill.mixed_features(gallery, plan)
            ids, answer_models, sources = _index_answers(gallery, queries[NEW.uri])
            np.testing.assert_array_equal(np.array(ids), _brute_force(mixed, gallery.ids(), queries[NEW.uri], 5))
            assert all(m == {NEW.uri} for m in answer_models)
            position = {int(i): p for p, i in enumerate(gallery.ids())}
            assert sources == [["embedded" if backfilled[position[int(i)]] else "mapped" for i in row] for row in ids]
            if layout in ("pgvector", "lance"):  # the chunk records commit with the rows (Milvus: the store's markers)
                assert gallery.index.chunk_done(plan.upgrade_id) == set(range(chunk + 1))
            assert set(order[:plan.chunk_bounds(chunk)[1]]) == set(np.flatnonzero(backfilled))
            time.sleep(0.02)
        state = gallery_status(gallery).index
        assert state.serving == NEW.uri and state.as_manifest_says and state.view == gallery.index.view
        ending.finish(gallery, plan)
        time.sleep(0.1)
    finally:
        stop.set()
        thread.join(30)
    assert not errors, errors
    assert len(seen) > 10 and set(moved) <= {OLD.uri}
    for served, answer_models, _ in seen:  # one space per answer: the one the reader asked for
        assert all(m == [served] for m in answer_models), (served, answer_models)
    switched = [i for i, (served, _, _) in enumerate(seen) if served == NEW.uri]
    assert switched and seen[0][0] == OLD.uri and switched == list(range(switched[0], len(seen)))
    assert any({s for row in sources for s in row} == {"mapped"} for served, _, sources in seen if served == NEW.uri)
    assert gallery.index.serving().upgrade is None and gallery.model == NEW


def the_index_follows_reject_abort_and_rollback(store_uri, models, data, layout=None):
    """The view serves what the manifest says after every ending: a rejected or aborted upgrade's
    readers are back on the old model's rows, a rollback's too (until gc drops the column)."""
    from fastfill.components.gallery.upgrade import reversal

    old, new, h = models
    images, _ = data
    gallery = _gallery(store_uri, models, data, layout=layout)
    plan = _plan(gallery, h)
    backfill.backfill_chunk(gallery, plan.upgrade_id, 0, new)
    assert gallery.index.serving().model == NEW.uri
    reversal.abort(gallery, plan.upgrade_id)
    assert gallery.index.serving().model == OLD.uri and gallery.index.serving().upgrade is None
    ids, models_, _ = _index_answers(gallery, embed(old, images[:3]))
    np.testing.assert_array_equal(np.array(ids), _brute_force(embed(old, images), gallery.ids(), embed(old, images[:3]), 5))
    assert all(m == {OLD.uri} for m in models_)

    reversal.start_over(gallery, plan.upgrade_id)
    plan = _plan(gallery, h)  # planned again: the switch writes the new model's vectors again
    if layout in ("pgvector", "lance"):
        assert gallery.index.chunk_done(plan.upgrade_id) == set()
    for chunk in range(plan.num_chunks):
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, new)
    ending.reject(gallery, plan, Decision(plan.upgrade_id, False, ["a test"], None))
    assert gallery.index.serving().model == OLD.uri

    reversal.start_over(gallery, plan.upgrade_id)
    plan = _plan(gallery, h)
    for chunk in range(plan.num_chunks):
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, new)
    ending.finish(gallery, plan)
    assert gallery.index.serving().model == NEW.uri
    # a reader that embedded for the old space gets no rows (not an error, not another space's answer)
    assert gallery.index.search(embed(old, images[:2]), 5, OLD.uri)[0] == [[], []]
    reversal.rollback(gallery)
    assert gallery.index.serving().model == OLD.uri
    assert all(m == {OLD.uri} for m in _index_answers(gallery, embed(old, images[:3]))[1])


def a_row_deleted_or_emptied_in_the_table_is_named(store_uri, models, data, layout=None):
    from psycopg import sql

    gallery = _gallery(store_uri, models, data, layout=layout)
    index = gallery.index
    vectors = sql.Identifier(f"{index.table}_emb_embedder_v1")
    index.execute(sql.SQL("DELETE FROM {} WHERE id = 1012").format(vectors))
    with pytest.raises(DamagedObject, match=r"vectors \w+_emb_embedder_v1.embedding: item 1012 has no row or no vector"):
        gallery.features(OLD, 1)
    gallery.features(OLD, 0)  # the other parts still read
    with pytest.raises(GalleryError, match="1 rows without a vector"):
        gallery.check_sources()
    index.execute(sql.SQL("DELETE FROM {} WHERE id = 1030").format(sql.Identifier(index.table)))
    with pytest.raises(GalleryError, match="has 52 rows, but the manifest says 53 items"):
        gallery.check_sources()


def a_row_deleted_from_the_collection_is_named(store_uri, models, data, layout=None):
    gallery = _gallery(store_uri, models, data, layout=layout)
    index = gallery.index
    collection = index.collection(OLD)
    if layout == "qdrant":
        from fastfill.components.gallery.layouts.qdrant_collection import point_id

        with index.calling(collection) as client:
            client.delete(collection, points_selector=[point_id(1012)], wait=True)
    else:
        index.client().delete(collection, ids=[1012])
    with pytest.raises(DamagedObject, match=rf"collection {collection}: item 1012 has no row"):
        gallery.features(OLD, 1)
    gallery.features(OLD, 0)  # the other parts still read
    with pytest.raises(GalleryError, match="1 rows missing"):
        gallery.check_sources()


def a_teams_table_is_adopted_where_it_is_and_upgraded_in_place(store_uri, models, data, layout=None):
    """A team's own table (text ids, URIs, its vector column, an index of its own or none) is
    adopted without copying a vector: the store gets the items; the view serves the team's column,
    and an upgrade adds the new model's column beside it."""
    from psycopg import sql

    from fastfill.components.gallery.layouts.pg_adopt import adopt_table
    from fastfill.components.gallery.layouts.pg_table import Index, index_settings
    from tests.pg import pg_gallery_config

    old, new, h = models
    images, labels = data
    root = _originals(store_uri)
    for i in range(N):
        _put_original(root, f"img-{i:05d}.png", _png(images[i]))
    config = pg_gallery_config(store_uri, table="products_" + os.path.basename(store_uri.rstrip("/"))[-6:],
                               id_column="sku", image_column="photo")
    settings = index_settings(config.pgvector, "l2")
    index = Index(settings)
    table = sql.Identifier(index.table)
    index.execute(sql.SQL("DROP TABLE IF EXISTS {} CASCADE").format(table))
    index.execute(sql.SQL("CREATE TABLE {} (sku text PRIMARY KEY, photo text, vec vector(8), price numeric, "
                          "class bigint)").format(table))
    features = embed(old, images)
    skus = [f"sku-{(i * 7) % N:03d}" for i in range(N)]  # not in the images' order
    with index.transaction() as connection, connection.cursor().copy(sql.SQL(
            "COPY {} (sku, photo, vec, price, class) FROM STDIN").format(table)) as copy:
        for i in range(N):
            copy.write_row((skus[i], f"img-{i:05d}.png", features[i], 9.5, int(labels[i])))
    store = open_store(store_uri)
    with pytest.raises(GalleryError, match="holds 8-d vectors, but models:/embedder/2 embeds into 12"):
        adopt_table(store, settings, NEW, (1, 8, 8), vector_column="vec")
    with pytest.raises(GalleryError, match="has no vector column 'embedding'"):
        adopt_table(store, settings, OLD, (1, 8, 8), vector_column="embedding")
    adopt_table(store, settings, OLD, (1, 8, 8), vector_column="vec", label_column="class", root=root, part_size=10)
    gallery = gallery_at(open_store(store_uri))
    assert gallery.layout == "pgvector" and gallery.adopted and gallery.store.list("features/") == []
    assert list(gallery.ids()) == sorted(skus)
    by_sku = {s: i for i, s in enumerate(skus)}
    rows = [by_sku[s] for s in gallery.ids()]
    np.testing.assert_array_equal(gallery.all_features(OLD), features[rows])
    np.testing.assert_array_equal(gallery.labels(), labels[rows])
    assert gallery.index.serving().vectors == f"{index.table}.vec"
    assert _index_answers(gallery, features[:1], k=1)[0] == [[skus[0]]]

    plan = _plan(gallery, h)
    assert gallery.index.serving().model == NEW.uri and "vec" in gallery.index.columns()
    assert gallery.index.serving().vectors == f"{index.table}_emb_embedder_v2.embedding"
    for chunk in range(plan.num_chunks):
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, new)
    ending.finish(gallery, plan)
    np.testing.assert_allclose(gallery.all_features(NEW), embed(new, images)[rows], rtol=1e-5, atol=1e-6)
    assert _index_answers(gallery, embed(new, images[:1]), k=1)[0] == [[skus[0]]]
    index.execute(sql.SQL("SELECT price FROM {}").format(table))  # the team's other columns are left alone
    # gc drops nothing of the team's: its column of the old model's vectors stays, named as unused
    assert garbage.collect_garbage(gallery)["features"] == 0 and "vec" in gallery.index.columns()
    assert gallery.kept_columns() == [f"{index.table}.vec"] and "price" in gallery.index.columns()


def the_serving_table_is_searched_by_lancedb_and_a_chunk_writes_only_its_rows(store_uri, models, data, layout=None):
    """A LanceDB reader of ``serving`` in the store sees the old space, then from the switch the
    new one, its answers those of an exact search of the product's mixed gallery; each chunk is
    one commit that appends exactly its rows (nothing of gallery.lance, no other row) and a chunk
    served again writes nothing."""
    import lancedb

    from fastfill.components.gallery.layouts.lance_serving import SERVING_TABLE
    from fastfill.components.gallery.layouts.table import storage_options

    old, new, h = models
    images, _ = data
    gallery = _gallery(store_uri, models, data, layout=layout)
    index = gallery.index
    base = index.uri.rsplit("/", 1)[0]
    db = lancedb.connect(base, storage_options=storage_options(store_uri))

    def reader_answers(queries, k=5):
        table = db.open_table(SERVING_TABLE)
        model = json.loads(table.schema.metadata[b"fastfill.model"])
        hits = [table.search(q).distance_type("l2").limit(k).to_arrow() for q in queries]
        return model, [h.column("id").to_pylist() for h in hits], [set(h.column("model").to_pylist()) for h in hits]

    model, ids, answer_models = reader_answers(embed(old, images[:3]))
    assert model["version"] == "1" and all(m == {OLD.uri} for m in answer_models)
    np.testing.assert_array_equal(np.array(ids), _brute_force(embed(old, images), gallery.ids(), embed(old, images[:3]), 5))
    before = db.open_table(SERVING_TABLE)  # a reader that keeps its version keeps its space

    plan = _plan(gallery, h)
    queries = embed(new, images[:4])
    table_version = gallery.dataset(refresh=True).version
    for chunk in range(plan.num_chunks):
        fragments = {f.fragment_id for f in index.dataset().get_fragments()}
        version = index.dataset().version
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, new)
        after = index.dataset()
        assert after.version == version + 1  # one commit
        added = [f for f in after.get_fragments() if f.fragment_id not in fragments]
        start, stop = plan.chunk_bounds(chunk)
        assert len(added) == 1 and added[0].count_rows() == stop - start
        mixed, _ = backfill.mixed_features(gallery, plan)
        model, ids, answer_models = reader_answers(queries)
        assert model["version"] == "2" and all(m == {NEW.uri} for m in answer_models)
        np.testing.assert_array_equal(np.array(ids), _brute_force(mixed, gallery.ids(), queries, 5))
    positions = planning.order_of(gallery.store, plan.upgrade_id)[:plan.chunk_bounds(0)[1]]
    version = index.dataset().version
    gallery.serve_chunk(plan, 0, positions, np.zeros((len(positions), NEW.dim), np.float32), np.ones(len(positions), bool))
    assert index.dataset().version == version  # once: the chunk's rows are there
    assert gallery.dataset(refresh=True).version == table_version  # gallery.lance untouched by the backfill
    assert json.loads(before.schema.metadata[b"fastfill.model"])["version"] == "1"
    assert len(before.search(embed(old, images[:1])[0]).limit(3).to_arrow()) == 3
    ending.finish(gallery, plan)
    assert index.serving().upgrade is None and len(index.dataset().get_fragments()) == 1  # compacted
    model, ids, _ = reader_answers(queries)
    np.testing.assert_array_equal(np.array(ids), _brute_force(gallery.all_features(NEW), gallery.ids(), queries, 5))


def the_layout_names_what_it_cannot_serve_before_any_work(store_uri, models, data, layout=None):
    """What a layout cannot serve is refused by the decider with the layout's reason: pgvector's
    index dimensions, Milvus's and Qdrant's vector sizes, and a Milvus Lite file or a Qdrant local-mode folder under Dask
    workers."""
    from fastfill.components.gallery.upgrade.decider import UpgradeDecider

    gallery = _gallery(store_uri, models, data, layout=layout)
    wide, wider, widest = (ModelRef("embedder", "2", dim) for dim in (2001, 16001, 40000))
    refusal = UpgradeDecider.layout_refusal
    assert refusal(gallery, NEW, "threads") is None
    if layout in ("parts", "lance"):
        assert refusal(gallery, widest, "dask") is None
    elif layout == "pgvector":
        assert refusal(gallery, ModelRef("embedder", "2", 2000), "threads") is None
        assert re.search(r"\(pgvector layout\) cannot serve models:/embedder/2: .* 2,001 dimensions; pgvector's "
                         r"ivfflat index takes at most 2,000.*Nothing was written\.$", refusal(gallery, wide, "dask"))
        assert "vector type holds at most 16,000" in refusal(gallery, wider, "threads")
    elif layout == "qdrant":
        assert refusal(gallery, widest, "threads") is None
        assert "a Qdrant vector holds at most 65,536" in refusal(gallery, ModelRef("embedder", "2", 70000), "threads")
        assert re.search(r"task_runner is dask, but .* local-mode folder ", refusal(gallery, NEW, "dask"))
    else:
        assert refusal(gallery, wider, "threads") is None
        assert "a Milvus float vector holds at most 32,768" in refusal(gallery, widest, "threads")
        assert re.search(r"task_runner is dask, but .* Milvus Lite file .*\.db", refusal(gallery, NEW, "dask"))
    assert gallery.manifest(refresh=True)["upgrade"] is None and gallery.store.list("upgrades/") == []


STORE_CASES = [  # the store alone
    store_roundtrip_listing_and_create_only,
    checksum_mismatch_is_an_error_naming_the_object,
    lock_refuses_a_second_upgrade_and_takes_over_a_dead_one,
]
GALLERY_CASES = [  # every layout
    ingest_writes_parts_and_reads_back,
    backfill_resumes_without_redoing_chunks_and_finishes,
    a_corrupt_image_part_fails_its_chunk_without_a_marker,
    a_transformed_part_short_of_rows_is_refused_naming_it,
    search_updates_vectors_by_id_as_chunks_land,
    adopted_gallery_reads_images_by_uri_and_keeps_failed_items,
    the_layout_names_what_it_cannot_serve_before_any_work,
]
INDEX_CASES = [  # the layouts whose index serves the team's queries
    the_index_serves_one_space_at_a_time_as_chunks_land,
    the_index_follows_reject_abort_and_rollback,
]
PGVECTOR_CASES = [
    a_row_deleted_or_emptied_in_the_table_is_named,
    a_teams_table_is_adopted_where_it_is_and_upgraded_in_place,
]
CASES = ([(case, None) for case in STORE_CASES] + [(case, layout) for case in GALLERY_CASES for layout in LAYOUTS]
         + [(a_features_part_short_of_rows_is_refused_naming_it_and_not_retried, "parts"),
            (features_altered_in_the_table_are_refused_naming_the_item_and_file, "lance")]
         + [(case, layout) for case in INDEX_CASES for layout in ("lance", "pgvector", "milvus", "qdrant")]
         + [(case, "pgvector") for case in PGVECTOR_CASES]
         + [(the_serving_table_is_searched_by_lancedb_and_a_chunk_writes_only_its_rows, "lance")]
         + [(a_row_deleted_from_the_collection_is_named, layout) for layout in ("milvus", "qdrant")])


def case_id(pair) -> str:
    case, layout = pair
    return case.__name__ + (f"-{layout}" if layout else "")
