import numpy as np
import pytest

from fastfill.components.experiment.data import (
    DataError,
    RawDataset,
    Split,
    load_meta,
    load_raw_dataset,
    load_split,
    make_splits,
    save_splits,
)
from fastfill.components.platform.config import PrepareConfig
from testkit.tiny_demo import make_image_folder


def _raw(n_train=200, n_test=50, classes=4, seed=0) -> RawDataset:
    rng = np.random.default_rng(seed)
    train = Split(rng.integers(0, 255, (n_train, 1, 8, 8), dtype=np.uint8), np.arange(n_train) % classes)
    test = Split(rng.integers(0, 255, (n_test, 1, 8, 8), dtype=np.uint8), np.arange(n_test) % classes)
    return RawDataset(train, test, [f"c{i}" for i in range(classes)])


def test_splits_follow_the_config():
    splits, meta = make_splits(_raw(), PrepareConfig(old_classes=[0, 2]))
    assert set(np.unique(splits["old_train"].labels)) == {0, 2}
    assert len(splits["new_train"]) == 200 and len(splits["test"]) == 50
    assert meta["old_classes"] == [0, 2] and meta["num_classes"] == 4


def test_default_old_classes_are_the_first_half():
    splits, meta = make_splits(_raw(classes=6), PrepareConfig())
    assert meta["old_classes"] == [0, 1, 2]
    assert set(np.unique(splits["old_train"].labels)) == {0, 1, 2}


def test_subsampling_is_seeded_and_per_class(tmp_path):
    config = PrepareConfig(train_per_class=10, test_per_class=3, seed=5)
    a, _ = make_splits(_raw(), config)
    b, _ = make_splits(_raw(), config)
    assert np.array_equal(a["new_train"].images, b["new_train"].images)
    assert np.bincount(a["new_train"].labels).tolist() == [10] * 4
    assert np.bincount(a["test"].labels).tolist() == [3] * 4
    c, _ = make_splits(_raw(), PrepareConfig(train_per_class=10, test_per_class=3, seed=6))
    assert not np.array_equal(a["new_train"].images, c["new_train"].images)


def test_saved_splits_are_byte_identical_across_runs(tmp_path):
    for name in ("a", "b"):
        save_splits(*make_splits(_raw(), PrepareConfig(train_per_class=20)), tmp_path / name)
    for f in (tmp_path / "a").iterdir():
        assert f.read_bytes() == (tmp_path / "b" / f.name).read_bytes()
    split = load_split(tmp_path / "a", "test")
    assert split.images.dtype == np.uint8 and len(split) == 50
    assert load_meta(tmp_path / "a")["sizes"]["new_train"] == 80


def test_bad_old_classes_are_reported():
    with pytest.raises(DataError, match="old_classes"):
        make_splits(_raw(classes=4), PrepareConfig(old_classes=[0, 9]))


def test_image_folder_with_train_and_test(tmp_path):
    root = make_image_folder(tmp_path / "images", num_classes=4, train_per_class=5, test_per_class=2)
    raw = load_raw_dataset(PrepareConfig(dataset="imagefolder", source=root, image_size=12), tmp_path / "cache")
    assert raw.train.images.shape == (20, 1, 12, 12) and raw.test.images.shape == (8, 1, 12, 12)
    assert raw.class_names == [f"class_{i:02d}" for i in range(4)]


def test_image_folder_without_test_folder_is_split_by_fraction(tmp_path):
    root = make_image_folder(tmp_path / "images", num_classes=3, train_per_class=10, test_per_class=1)
    raw = load_raw_dataset(PrepareConfig(dataset="imagefolder", source=root / "train", test_fraction=0.2,
                                         channels=3), tmp_path / "cache")
    assert len(raw.test) == 6 and len(raw.train) == 24
    assert raw.train.images.shape[1] == 3


def test_missing_fashion_mnist_says_how_to_install(tmp_path):
    with pytest.raises(DataError, match="apt-get install dataset-fashion-mnist"):
        load_raw_dataset(PrepareConfig(source=tmp_path / "nowhere"), tmp_path / "cache")


def test_missing_image_folder(tmp_path):
    with pytest.raises(DataError, match="not a folder"):
        load_raw_dataset(PrepareConfig(dataset="imagefolder", source=tmp_path / "nope"), tmp_path / "cache")
