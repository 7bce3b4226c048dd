"""Bring-your-own-features evaluation: the backfill curve of features a user computed.

The folder holds ``query.npy`` (n x d, new-model features of the evaluation images),
``gallery_new.npy`` (n x d, the same images, new side), ``gallery_old.npy`` (n x d, old side,
already transformed where the method transforms), ``labels.npy`` (n integers) and optionally
``order.npy`` (a permutation of 0..n-1, the backfill order; default 0..n-1).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from components.evaluation import backfill_curve

REQUIRED = ("query", "gallery_new", "gallery_old", "labels")


class EvaluationInputError(ValueError):
    """A file is missing or does not fit the others; the message names it."""


def _load(path: Path) -> np.ndarray:
    from components.platform.layout import load_array

    try:
        return load_array(path, missing="pass a folder that holds it")
    except (FileNotFoundError, ValueError) as error:
        raise EvaluationInputError(str(error)) from None


def evaluate_feature_folder(folder: Path, *, distance: str = "l2", num_intermediate: int = 20) -> dict:
    folder = Path(folder)
    if not folder.is_dir():
        raise EvaluationInputError(f"{folder} is not a folder; pass --features DIR with {', '.join(f + '.npy' for f in REQUIRED)}")
    missing = [f"{name}.npy" for name in REQUIRED if not (folder / f"{name}.npy").is_file()]
    if missing:
        raise EvaluationInputError(f"{folder} lacks {', '.join(missing)}")
    arrays = {name: _load(folder / f"{name}.npy") for name in REQUIRED}
    for name in ("query", "gallery_new", "gallery_old"):
        if arrays[name].ndim != 2 or not np.issubdtype(arrays[name].dtype, np.floating):
            raise EvaluationInputError(f"{name}.npy must be a 2-D float array (n x d), got {arrays[name].dtype} {arrays[name].shape}")
        arrays[name] = arrays[name].astype(np.float32, copy=False)
    labels = arrays["labels"]
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise EvaluationInputError(f"labels.npy must be a 1-D integer array, got {labels.dtype} {labels.shape}")
    order_path = folder / "order.npy"
    order = _load(order_path) if order_path.is_file() else None
    try:
        curve = backfill_curve(arrays["query"], arrays["gallery_new"], arrays["gallery_old"], labels, order,
                               distance=distance, num_intermediate=num_intermediate)
    except ValueError as error:
        raise EvaluationInputError(str(error)) from None
    return curve.to_dict()
