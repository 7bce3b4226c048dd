"""Datasets and the deterministic splits every later stage reads.

A split is a pair of arrays: images ``uint8 (N, C, H, W)`` and labels ``int64 (N,)``, stored as
.npy files under ``<data>/splits/`` (DVC outputs). Three splits:

- ``old_train``: the training images of the classes the old model knows;
- ``new_train``: all training images (the new model and the alignment maps train on it);
- ``test``: the evaluation images, used both as queries and as the gallery.
"""

from __future__ import annotations

import gzip
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fastfill.components.platform.config import PrepareConfig

SPLITS = ("old_train", "new_train", "test")
_FASHION_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


class DataError(ValueError):
    """The configured dataset is missing or malformed; the message says what to do."""


@dataclass(frozen=True)
class Split:
    images: np.ndarray  # uint8 (N, C, H, W)
    labels: np.ndarray  # int64 (N,)

    def __post_init__(self) -> None:
        if self.images.ndim != 4 or self.images.dtype != np.uint8:
            raise DataError(f"split images must be uint8 (N, C, H, W), got {self.images.dtype} {self.images.shape}")
        if len(self.images) != len(self.labels):
            raise DataError(f"{len(self.images)} images but {len(self.labels)} labels")

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, index: np.ndarray) -> Split:
        return Split(self.images[index], self.labels[index])


@dataclass(frozen=True)
class RawDataset:
    train: Split
    test: Split
    class_names: list[str]


def _fashion_mnist(source: Path, cache: Path) -> RawDataset:
    """Fashion-MNIST through torchvision's dataset class, offline.

    The Debian package ships the four IDX files gzipped; torchvision rejects them (their gz
    checksums differ from the ones it expects) and would then try the network, so they are
    unpacked once into ``<cache>/FashionMNIST/raw/`` where ``download=False`` finds them.
    """
    from fastfill.components.experiment.vision import torchvision  # late: torch loads when a command needs it

    raw = cache / "FashionMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for name in _FASHION_FILES:
        target = raw / name
        if target.exists():
            continue
        packed = source / f"{name}.gz"
        if not packed.is_file():
            raise DataError(
                f"Fashion-MNIST file {packed} not found. Install it with "
                "`apt-get install dataset-fashion-mnist` (scripts/setup.sh does), or set "
                "prepare.source to a folder holding the four IDX .gz files"
            )
        with gzip.open(packed, "rb") as src, open(target.with_suffix(".part"), "wb") as dst:
            shutil.copyfileobj(src, dst)
        target.with_suffix(".part").rename(target)

    def load(train: bool) -> Split:
        ds = torchvision.datasets.FashionMNIST(str(cache), train=train, download=False)
        images = ds.data.numpy().astype(np.uint8)[:, None, :, :]
        return Split(images, ds.targets.numpy().astype(np.int64))

    classes = list(torchvision.datasets.FashionMNIST.classes)
    return RawDataset(load(True), load(False), classes)


def _image_folder_split(root: Path, config: PrepareConfig, classes: list[str] | None) -> tuple[Split, list[str]]:
    from fastfill.components.experiment.vision import torchvision  # late: torch loads when a command needs it

    mode = "L" if config.channels == 1 else "RGB"
    size = (config.image_size, config.image_size)

    def loader(path: str) -> np.ndarray:
        from PIL import Image

        with Image.open(path) as opened:
            array = np.asarray(opened.convert(mode).resize(size), dtype=np.uint8)
        return array[None] if array.ndim == 2 else array.transpose(2, 0, 1)

    try:
        ds = torchvision.datasets.ImageFolder(str(root), loader=loader)
    except (FileNotFoundError, OSError) as error:
        raise DataError(f"cannot read image folder {root}: {error}") from None
    if classes is not None and ds.classes != classes:
        raise DataError(f"{root} has classes {ds.classes}, but the training folder has {classes}")
    images = np.stack([ds[i][0] for i in range(len(ds))]).astype(np.uint8)
    labels = np.asarray(ds.targets, dtype=np.int64)
    return Split(images, labels), list(ds.classes)


def _image_folder(config: PrepareConfig) -> RawDataset:
    root = config.source
    if not root.is_dir():
        raise DataError(f"prepare.source {root} is not a folder of class sub-folders")
    if (root / "train").is_dir() and (root / "test").is_dir():
        train, classes = _image_folder_split(root / "train", config, None)
        test, _ = _image_folder_split(root / "test", config, classes)
        return RawDataset(train, test, classes)
    full, classes = _image_folder_split(root, config, None)
    rng = np.random.default_rng(config.seed)
    test_index = []
    for label in np.unique(full.labels):
        members = np.flatnonzero(full.labels == label)
        count = max(1, int(round(config.test_fraction * len(members))))
        test_index.extend(rng.choice(members, size=count, replace=False).tolist())
    is_test = np.zeros(len(full), dtype=bool)
    is_test[test_index] = True
    return RawDataset(full.subset(~is_test), full.subset(is_test), classes)


def load_raw_dataset(config: PrepareConfig, cache: Path) -> RawDataset:
    if config.dataset == "fashion-mnist":
        return _fashion_mnist(config.source, cache)
    return _image_folder(config)


def _per_class_sample(split: Split, per_class: int | None, rng: np.random.Generator) -> Split:
    """At most ``per_class`` items of each class, chosen by ``rng``, in their original order."""
    if per_class is None:
        return split
    keep = []
    for label in np.unique(split.labels):
        members = np.flatnonzero(split.labels == label)
        if len(members) > per_class:
            members = rng.choice(members, size=per_class, replace=False)
        keep.append(members)
    return split.subset(np.sort(np.concatenate(keep)))


def make_splits(raw: RawDataset, config: PrepareConfig) -> tuple[dict[str, Split], dict]:
    """The three splits and a description of them; the same config always gives the same bytes."""
    num_classes = len(raw.class_names)
    unseen = sorted(config.unseen_classes or [])
    bad = [c for c in unseen if not 0 <= c < num_classes]
    if bad:
        raise DataError(f"prepare.unseen_classes {config.unseen_classes}: {bad} are not class ids in 0..{num_classes - 1}")
    seen = [c for c in range(num_classes) if c not in unseen]
    if not seen:
        raise DataError(f"prepare.unseen_classes {config.unseen_classes} holds out every class; leave some to train on")
    old_classes = config.old_classes
    if old_classes is None:
        old_classes = seen[: max(1, len(seen) // 2)]
    bad = [c for c in old_classes if not 0 <= c < num_classes]
    if bad or not old_classes:
        raise DataError(
            f"prepare.old_classes {config.old_classes} must be a non-empty list of class ids in "
            f"0..{num_classes - 1}; bad: {bad}"
        )
    rng = np.random.default_rng(config.seed)
    new_train = _per_class_sample(raw.train, config.train_per_class, rng)
    test = _per_class_sample(raw.test, config.test_per_class, rng)
    if unseen:  # open-class evaluation: train on the seen classes, evaluate on the held-out ones only
        new_train = new_train.subset(np.flatnonzero(~np.isin(new_train.labels, unseen)))
        test = test.subset(np.flatnonzero(np.isin(test.labels, unseen)))
    old_train = new_train.subset(np.flatnonzero(np.isin(new_train.labels, old_classes)))
    splits = {"old_train": old_train, "new_train": new_train, "test": test}
    meta = {
        "dataset": config.dataset,
        "class_names": raw.class_names,
        "num_classes": num_classes,
        "old_classes": sorted(old_classes),
        "new_classes": seen,
        "unseen_classes": unseen,
        "image_shape": list(test.images.shape[1:]),
        "sizes": {name: len(split) for name, split in splits.items()},
        # Mean and std of the training pixels: the models normalise their input with them.
        "pixel_mean": float(new_train.images.mean() / 255.0),
        "pixel_std": float(new_train.images.std() / 255.0),
    }
    return splits, meta


def save_splits(splits: dict[str, Split], meta: dict, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, split in splits.items():
        np.save(directory / f"{name}_images.npy", split.images)
        np.save(directory / f"{name}_labels.npy", split.labels)
    (directory / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def load_split(directory: Path, name: str) -> Split:
    if name not in SPLITS:
        raise DataError(f"unknown split {name!r}; expected one of {SPLITS}")
    images_path = directory / f"{name}_images.npy"
    if not images_path.is_file():
        raise DataError(f"{images_path} not found; run the prepare stage first (`fastfill stage prepare`)")
    return Split(np.load(images_path), np.load(directory / f"{name}_labels.npy"))


def load_meta(directory: Path) -> dict:
    path = directory / "meta.json"
    if not path.is_file():
        raise DataError(f"{path} not found; run the prepare stage first (`fastfill stage prepare`)")
    return json.loads(path.read_text())
