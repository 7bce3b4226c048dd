"""The gallery components on a local folder: every store case of tests/gallery_cases.py (the
integration tier runs them on S3), bad input, gc, and the measurement."""


import numpy as np
import pytest

from components.evaluation import curve_at_counts
from components.gallery import upgrade as up
from components.gallery.catalog import Gallery, GalleryError, ingest
from components.gallery.measure import BackfillMeter, restricted_order
from components.gallery.store import (
    open_store,
)

from tests.gallery_cases import N, OLD, OLD_DIM, STORE_CASES, _gallery, _plan, make_data, make_models


@pytest.fixture
def models():
    return make_models()


@pytest.fixture
def data():
    return make_data()


@pytest.mark.parametrize("case", STORE_CASES, ids=lambda case: case.__name__)
def test_on_a_local_folder(case, tmp_path, models, data):
    case(str(tmp_path / "store"), models, data)


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
        Gallery(open_store(tmp_path / "empty")).manifest()


def test_collect_garbage_refuses_during_an_upgrade(tmp_path, models, data):
    gallery = _gallery(str(tmp_path / "g"), models, data)
    _plan(gallery, models[2])
    with pytest.raises(GalleryError, match="in progress"):
        up.collect_garbage(gallery)


def test_meter_equals_the_simulated_curve_at_the_same_counts():
    rng = np.random.default_rng(3)
    n = 80
    new = rng.normal(size=(n, 6)).astype(np.float32)
    transformed = (new + rng.normal(scale=0.8, size=(n, 6))).astype(np.float32)
    labels = rng.integers(0, 4, size=n)
    order = rng.permutation(n)
    positions = np.sort(rng.choice(n, size=50, replace=False))
    meter = BackfillMeter(positions, labels, new[positions], transformed, order)
    measured, chunk = {}, 16
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        meter.land(start, stop, new[order[start:stop]])
        measured[stop] = meter.measure(stop)
    local = restricted_order(order, positions)
    counts = [int(np.isin(order[:p], positions).sum()) for p in measured]
    curve = curve_at_counts(new[positions], new[positions], transformed[positions], labels[positions], local, counts)
    for i, p in enumerate(measured):
        assert measured[p]["top1"] == pytest.approx(curve.top1[i], abs=1e-9)
        assert measured[p]["map"] == pytest.approx(curve.map[i], abs=1e-9)
    # at 100% the gallery is all new: new-vs-new on the sample
    full = curve_at_counts(new[positions], new[positions], new[positions], labels[positions], local, [0])
    assert measured[n]["map"] == pytest.approx(full.map[0], abs=1e-9)


def test_a_dry_run_measures_and_writes_nothing(tmp_path, models, data):
    from components.gallery.estimate import dry_run
    from components.platform.config import UpgradeConfig

    _, new, _ = models
    gallery = _gallery(str(tmp_path / "store"), models, data)
    before = {key: gallery.store.get(key) for key in gallery.store.list("")}
    plan = dry_run(gallery, UpgradeConfig(chunk_size=7, max_concurrency=2), new, sample=16)
    assert {key: gallery.store.get(key) for key in gallery.store.list("")} == before
    assert plan["items"] == N and plan["chunks"] == 8 and plan["parts"] == 6 and plan["sample"]["items"] == 16
    assert plan["bytes_to_read"]["images"] == N * 64 and plan["bytes_to_read"]["features"] == N * OLD_DIM * 4
    assert plan["sample"]["embed_seconds_per_item"] > 0 and plan["estimated_backfill_seconds"] > 0
    throttled = dry_run(gallery, UpgradeConfig(chunk_size=7, max_items_per_second=0.5), new, sample=4)
    assert throttled["estimated_backfill_seconds"] >= N / 0.5
