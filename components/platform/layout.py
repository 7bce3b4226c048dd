"""Where each stage's outputs live. dvc.yaml lists the same paths."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fastfill.components.platform.config import PathsConfig

FEATURE_SPLITS = ("new_train", "test")


@dataclass(frozen=True)
class Layout:
    paths: PathsConfig

    @property
    def splits(self) -> Path:
        return self.paths.data / "splits"

    @property
    def raw_cache(self) -> Path:
        return self.paths.data / "raw"

    def model_dir(self, role: str) -> Path:
        return self.paths.artifacts / "models" / role

    def registry_record(self, output: str) -> Path:
        """What the registry answered when a stage registered its output (``models-old``,
        ``align-fastfill``, ``compatible-bct``): version and run. Beside the stage outputs, never
        inside them, so DVC hashes only what the inputs determine and a rerun is byte-identical."""
        return self.paths.artifacts / "registry" / f"{output}.json"

    def features_dir(self, role: str) -> Path:
        return self.paths.artifacts / "features" / role

    def features(self, role: str, split: str) -> Path:
        return self.features_dir(role) / f"{split}.npy"

    def align_dir(self, method: str) -> Path:
        return self.paths.artifacts / "align" / method

    def compatible_dir(self, method: str) -> Path:
        """A compatible new model (BCT, RACT): model, its test features, the old gallery side."""
        return self.paths.artifacts / "compatible" / method

    def checkpoint(self, name: str) -> Path:
        """Resume state of a running training (``model-old``, ``align-fct``); not a stage output."""
        return self.paths.artifacts / "checkpoints" / f"{name}.pt"

    @property
    def metrics(self) -> Path:
        return self.paths.reports / "metrics.json"

    @property
    def curves(self) -> Path:
        return self.paths.reports / "curves.json"

    @property
    def plot_data(self) -> Path:
        return self.paths.reports / "plots"

    @property
    def plot(self) -> Path:
        return self.paths.reports / "backfill.png"


def _write_atomically(path: Path, write) -> None:
    """Write through a side file and rename it, so a crash never leaves half a file where a
    stage output or checkpoint should be."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".part")
    write(partial)
    partial.replace(path)


def write_json(path: Path, data: object) -> None:
    _write_atomically(path, lambda p: p.write_text(json.dumps(data, indent=2) + "\n"))


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; run the stage that writes it first")
    return json.loads(path.read_text())


def save_array(path: Path, array: np.ndarray) -> None:
    def write(partial: Path) -> None:
        with open(partial, "wb") as handle:  # a handle, so numpy adds no .npy suffix
            np.save(handle, array)

    _write_atomically(path, write)


def save_torch(path: Path, obj: object) -> None:
    import torch

    _write_atomically(path, lambda p: torch.save(obj, p))


class ArrayFileError(ValueError):
    """A .npy file that is missing or unreadable; the message names it and what to do."""


def load_array(path: Path, what: str = "", *, missing: str = "run the stage that writes it first") -> np.ndarray:
    """The one .npy reader for files: no pickles; a missing file raises FileNotFoundError
    (``what``: how the caller names the file, ``missing``: what to do), an unreadable one
    ArrayFileError."""
    path = Path(path)
    label = f"{what}: {path}" if what else str(path)
    if not path.is_file():
        raise FileNotFoundError(f"{label} does not exist; {missing}")
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as error:
        raise ArrayFileError(f"{label} is not a readable .npy array ({error})") from None
