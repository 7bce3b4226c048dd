"""The gallery components on a local folder: every store case of tests/gallery_cases.py (the
integration tier runs them on S3), bad input, gc, and the measurement."""


import numpy as np
import pytest

from fastfill.components.evaluation import curve_at_counts
from fastfill.components.gallery.layouts.catalog import GalleryError, PartsGallery, ingest
from fastfill.components.gallery.store import open_store
from fastfill.components.gallery.upgrade import garbage
from fastfill.components.gallery.upgrade.measure import BackfillMeter
from tests.gallery_cases import CASES, OLD, OLD_DIM, N, _gallery, _plan, case_id


@pytest.mark.parametrize("pair", CASES, ids=case_id)
def test_on_a_local_folder(pair, tmp_path, models, data):
    case, layout = pair
    case(str(tmp_path / "store"), models, data, layout)


@pytest.mark.parametrize("case, message", [
    ("nan", "rows contain NaN or infinite values"),
    ("inf", "rows contain NaN or infinite values"),
    ("dim", "dimension 9, but the model's is 8"),
    ("labels", "labels: 3 values for 53 images"),
    ("images", "images must be uint8"),
    ("ids", "item ids must be unique"),
])
def test_ingest_refuses_bad_input_and_writes_nothing(tmp_path, data, case, message):
    images, labels = data
    features = np.random.default_rng(0).normal(size=(N, OLD_DIM)).astype(np.float32)
    kwargs = {"labels": labels}
    if case == "nan":
        features[7, 2] = np.nan
    elif case == "inf":
        features[3, 0] = np.inf
    elif case == "dim":
        features = np.zeros((N, 9), np.float32)
    elif case == "labels":
        kwargs["labels"] = labels[:3]
    elif case == "images":
        images = images.astype(np.float32)
    elif case == "ids":
        kwargs["ids"] = np.zeros(N)
    store = open_store(tmp_path / "store")
    with pytest.raises(GalleryError, match=message):
        ingest(store, images, features, OLD, **kwargs)
    assert store.list("") == []


def test_a_missing_gallery_says_how_to_make_one(tmp_path):
    with pytest.raises(GalleryError, match="no gallery at .*run `fastfill gallery ingest"):
        PartsGallery(open_store(tmp_path / "empty")).manifest()


def test_collect_garbage_refuses_during_an_upgrade(tmp_path, models, data):
    gallery = _gallery(str(tmp_path / "g"), models, data)
    _plan(gallery, models[2])
    with pytest.raises(GalleryError, match="in progress"):
        garbage.collect_garbage(gallery)


def test_meter_equals_the_simulated_curve_at_the_same_counts():
    rng = np.random.default_rng(3)
    n = 80
    new = rng.normal(size=(n, 6)).astype(np.float32)
    transformed = (new + rng.normal(scale=0.8, size=(n, 6))).astype(np.float32)
    labels = rng.integers(0, 4, size=n)
    order = rng.permutation(n)
    positions = np.sort(rng.choice(n, size=50, replace=False))
    meter = BackfillMeter(positions, labels, new[positions], transformed[positions], order)
    measured, chunk = {}, 16
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        meter.land(start, stop, new[order[start:stop]])
        measured[stop] = meter.measure(stop)
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    local = np.argsort(rank[positions], kind="stable")  # the sample's order within the full order
    counts = [int(np.isin(order[:p], positions).sum()) for p in measured]
    curve = curve_at_counts(new[positions], new[positions], transformed[positions], labels[positions], local, counts)
    for i, p in enumerate(measured):
        assert measured[p]["top1"] == pytest.approx(curve.top1[i], abs=1e-9)
        assert measured[p]["map"] == pytest.approx(curve.map[i], abs=1e-9)
    # at 100% the gallery is all new: new-vs-new on the sample
    full = curve_at_counts(new[positions], new[positions], new[positions], labels[positions], local, [0])
    assert measured[n]["map"] == pytest.approx(full.map[0], abs=1e-9)


def test_a_dry_run_measures_and_writes_nothing(tmp_path, models, data):
    from fastfill.components.gallery.advice.estimate import dry_run
    from fastfill.components.platform.config import UpgradeConfig

    _, new, _ = models
    gallery = _gallery(str(tmp_path / "store"), models, data)
    before = {key: gallery.store.get(key) for key in gallery.store.list("")}
    plan = dry_run(gallery, UpgradeConfig(chunk_size=7, max_concurrency=2), new, sample=16)
    assert {key: gallery.store.get(key) for key in gallery.store.list("")} == before
    assert plan.items == N and plan.chunks == 8 and plan.parts == 6 and plan.sample.items == 16
    assert plan.bytes_to_read.images == N * 64 and plan.bytes_to_read.features == N * OLD_DIM * 4
    assert plan.sample.embed_seconds_per_item > 0 and plan.estimated_backfill_seconds > 0
    throttled = dry_run(gallery, UpgradeConfig(chunk_size=7, max_items_per_second=0.5), new, sample=4)
    assert throttled.estimated_backfill_seconds >= N / 0.5


@pytest.mark.parametrize("kind", ["ivf", "ivfpq"])
def test_an_ivf_index_is_built_part_by_part_and_follows_the_backfill(tmp_path, models, kind):
    from fastfill.components.experiment.inference import embed
    from fastfill.components.gallery.search.index import GallerySearch
    from fastfill.components.gallery.upgrade import backfill, planning
    from fastfill.components.platform.config import IndexConfig
    from tests.gallery_cases import NEW

    old, new, h = models
    rng = np.random.default_rng(3)
    images = rng.integers(0, 256, size=(1200, 1, 8, 8), dtype=np.uint8)
    ingest(open_store(tmp_path / "g"), images, embed(old, images), OLD, part_size=100)
    gallery = PartsGallery(open_store(tmp_path / "g"))
    exact_config = IndexConfig(kind=kind, nlist=8, nprobe=8, pq_m=4, train_size=500)  # every list searched
    flat, approximate = GallerySearch(gallery), GallerySearch(gallery, index=exact_config)
    assert approximate.index.ntotal == 1200 and approximate.index.nlist == 8
    queries = embed(old, images[:20])
    if kind == "ivf":  # all lists probed: the same neighbours as the exact index
        np.testing.assert_array_equal(approximate.search(queries, 5)[0], flat.search(queries, 5)[0])
    else:  # codes of 4 bytes: most nearest neighbours still found
        hits = np.mean([a in f for a, f in zip(approximate.search(queries, 1)[0][:, 0], flat.search(queries, 10)[0])])
        assert hits >= 0.5, hits

    uid = planning.upgrade_id(OLD, NEW)
    for part in range(gallery.num_parts):
        planning.transform_part(gallery, uid, h, part)
    plan = planning.Plan(uid, OLD, NEW, "models:/embedder-alignment/1", "sigma", 100, 1200, 0, "l2")
    planning.commit_plan(gallery, plan, planning.make_order(gallery, uid, "sigma", 0))
    for chunk in (0, 1, 2):
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, new)
    assert flat.refresh() == 0 and approximate.refresh() == 0  # the plan: rebuilt on h(old), done chunks applied
    for chunk in (3, 4):
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, new)
    assert approximate.refresh() == 2 and approximate.backfilled == 500 and approximate.index.ntotal == 1200
    assert approximate.query_model == NEW and approximate.rebuilds == 1
    flat.refresh()
    if kind == "ivf":
        new_queries = embed(new, images[:20])
        np.testing.assert_array_equal(approximate.search(new_queries, 5)[0], flat.search(new_queries, 5)[0])
    with pytest.raises(GalleryError, match="needs at least 39000 items"):
        GallerySearch(gallery, index=IndexConfig(kind=kind, nlist=1000))


def test_precision_rules_name_the_setting_and_keep_the_cpu_in_float32():
    import torch

    from fastfill.components.experiment.inference import autocast_dtype

    cpu = torch.device("cpu")
    assert autocast_dtype(cpu, "auto") is None and autocast_dtype(cpu, "fp32") is None
    with pytest.raises(ValueError, match="precision bf16 needs a CUDA device; on cpu use auto or fp32"):
        autocast_dtype(cpu, "bf16")
    with pytest.raises(ValueError, match="precision must be one of auto, fp32, bf16, fp16, got 'half'"):
        autocast_dtype(cpu, "half")


def test_search_on_the_cpu_by_default_and_a_gpu_that_is_not_there_is_an_error(tmp_path, models, data):
    import torch

    from fastfill.components.gallery.search.index import GallerySearch
    from fastfill.components.platform.config import IndexConfig

    gallery = _gallery(str(tmp_path / "store"), models, data)
    assert GallerySearch(gallery).searched_on == "cpu (faiss)"  # auto follows FASTFILL_DEVICE=cpu (conftest)
    if not torch.cuda.is_available():
        with pytest.raises(GalleryError, match="gallery.index.device is cuda, but this machine has no CUDA"):
            GallerySearch(gallery, index=IndexConfig(device="cuda"))
    assert GallerySearch(gallery, index=IndexConfig(device="cpu")).searched_on == "cpu (faiss)"


def test_a_store_outage_is_never_a_missing_measurement_or_a_failed_image(tmp_path, monkeypatch):
    import socket

    from fastfill.components.gallery.inputs.images import ImageStoreError, read_images
    from fastfill.components.gallery.store import LocalStore, StoreUnreachable
    from fastfill.components.gallery.upgrade import planning

    class Down(LocalStore):  # the store answers nothing: what an outage looks like to a reader
        def _get(self, key):
            raise StoreUnreachable(f"cannot reach {self.uri}")

    with pytest.raises(GalleryError, match="has no evaluation sample"):  # absent: a configuration problem
        planning.stored_eval_sample(LocalStore(tmp_path / "empty"), "u1")
    with pytest.raises(StoreUnreachable, match="cannot reach"):  # unreachable: said as it is
        planning.stored_eval_sample(Down(tmp_path / "down"), "u1")

    with socket.socket() as probe:  # a port where nothing listens: the image store is down
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with pytest.raises(ImageStoreError, match="the image store failed, not the image"):
        read_images(["s3://bucket/a.png", "s3://bucket/b.png"], (1, 8, 8), workers=2)
    missing = read_images([str(tmp_path / "nowhere.png")], (1, 8, 8))[1]  # one file's problem: recorded
    assert [f.reason.split(":")[0] for f in missing] == ["missing"]
