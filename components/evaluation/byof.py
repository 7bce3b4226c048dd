"""Bring-your-own-features evaluation: the backfill curve of features a user computed.

The folder holds ``query.npy`` (n x d, new-model features of the evaluation images),
``gallery_new.npy`` (n x d, the same images, new side), ``gallery_old.npy`` (n x d, old side,
already transformed where the method transforms), ``labels.npy`` (n integers) and optionally
``order.npy`` (a permutation of 0..n-1, the backfill order; default 0..n-1).

With the old model's query features (``old_query``, n x d_old) it adds the shadow index's curves
(``dual``, one per merge): no map, the old query searches the old model's own gallery features of
the items not yet re-embedded. Those are ``gallery_old_raw.npy`` when the folder has it (a map's
folder, whose ``gallery_old.npy`` is transformed), else ``gallery_old.npy``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fastfill.components.evaluation import backfill_curve, dual_curves
from fastfill.components.platform.layout import load_array
from fastfill.components.platform.vocabulary import MERGES

REQUIRED = ("query", "gallery_new", "gallery_old", "labels")
RAW_OLD = "gallery_old_raw"


class EvaluationInputError(ValueError):
    """A file is missing or does not fit the others; the message names it."""


def _load(path: Path, what: str = "") -> np.ndarray:

    try:
        return load_array(path, what, missing="pass a folder that holds it")
    except (FileNotFoundError, ValueError) as error:
        raise EvaluationInputError(str(error)) from None


def _features(array: np.ndarray, name: str) -> np.ndarray:
    if array.ndim != 2 or not np.issubdtype(array.dtype, np.floating):
        raise EvaluationInputError(f"{name} must be a 2-D float array (n x d), got {array.dtype} {array.shape}")
    return array.astype(np.float32, copy=False)


def evaluate_feature_folder(folder: Path, *, distance: str = "l2", num_intermediate: int = 20,
                            old_query: Path | None = None) -> dict:
    """The curve of the folder's features (``backfill_curve``'s JSON); with ``old_query``, also
    ``dual``: the shadow index's curve for each merge, on the same order and points."""
    folder = Path(folder)
    if not folder.is_dir():
        raise EvaluationInputError(f"{folder} is not a folder; pass --features DIR with "
                                   f"{', '.join(f + '.npy' for f in REQUIRED)}")
    missing = [f"{name}.npy" for name in REQUIRED if not (folder / f"{name}.npy").is_file()]
    if missing:
        raise EvaluationInputError(f"{folder} lacks {', '.join(missing)}")
    arrays = {name: _load(folder / f"{name}.npy") for name in REQUIRED}
    for name in ("query", "gallery_new", "gallery_old"):
        arrays[name] = _features(arrays[name], f"{name}.npy")
    labels = arrays["labels"]
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise EvaluationInputError(f"labels.npy must be a 1-D integer array, got {labels.dtype} {labels.shape}")
    order_path = folder / "order.npy"
    order = _load(order_path) if order_path.is_file() else None
    try:
        result = backfill_curve(arrays["query"], arrays["gallery_new"], arrays["gallery_old"], labels, order,
                                distance=distance, num_intermediate=num_intermediate).to_dict()
    except ValueError as error:
        raise EvaluationInputError(str(error)) from None
    if old_query is not None:
        result["dual"] = _dual(folder, arrays, labels, order, Path(old_query), distance, num_intermediate)
    return result


def _dual(folder: Path, arrays: dict, labels, order, old_query: Path, distance: str, num_intermediate: int) -> dict:
    """The shadow index's curves: the old query on the old model's own gallery features."""
    queries = _features(_load(old_query, "--old-query"), f"--old-query {old_query}")
    raw = folder / f"{RAW_OLD}.npy"
    name = raw.name if raw.is_file() else "gallery_old.npy"
    gallery = _features(_load(raw), name) if raw.is_file() else arrays["gallery_old"]
    n = len(labels)
    if queries.shape[0] != n:
        raise EvaluationInputError(f"--old-query {old_query} has {queries.shape[0]} rows but labels.npy has {n}: give "
                                   "the old model's features of the same evaluation images, in the same row order")
    if gallery.shape != queries.shape:
        raise EvaluationInputError(
            f"--old-query {old_query} has shape {queries.shape} but {name} has {gallery.shape}: the shadow index "
            f"compares the old model's query features with its own gallery features; for a map's folder, put the "
            f"old model's untransformed gallery features in {RAW_OLD}.npy")
    try:
        curves = dual_curves(queries, arrays["query"], gallery, arrays["gallery_new"], labels, order, merges=MERGES,
                             distance=distance, num_intermediate=num_intermediate)
    except ValueError as error:
        raise EvaluationInputError(f"the shadow index's curves: {error}") from None
    return {merge: curve.to_dict() for merge, curve in curves.items()}
