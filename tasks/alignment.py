"""Tasks of the alignment stage: train h (and psi) on stored features, transform the gallery."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
from prefect import task

from fastfill.components.experiment.data import load_split
from fastfill.components.experiment.inference import apply_alignment, apply_unified, pick_device
from fastfill.components.experiment.map_check import decide_map, is_reference, reference_config, skip_reason
from fastfill.components.experiment.map_training import train_alignment, train_unified, true_alignment_loss
from fastfill.components.experiment.models import (
    AlignmentMap,
    UnifiedMaps,
    load_alignment,
    load_embedder,
    save_alignment,
)
from fastfill.components.experiment.training import discard_checkpoint, run_key
from fastfill.components.platform.config import AlignConfig
from fastfill.components.platform.layout import Layout, load_array, save_array, write_json
from fastfill.tasks._policy import GPU_TAGS, IO_RETRIES, NO_CACHING, epoch_progress, log


def _class_rows(new_model, labels: np.ndarray, *, unseen_ok: bool = False) -> np.ndarray:
    """kappa_new's row of each label; -1 for a class the new model never saw (open-class test
    images, where ``unseen_ok``)."""
    import torch

    rows = new_model.class_index(torch.from_numpy(labels)).numpy()
    if (rows < 0).any() and not unseen_ok:
        raise ValueError("some labels are classes the new model does not know; its head must cover all classes")
    return rows


def _training_pairs(layout: Layout):
    new_model = load_embedder(layout.model_dir("new") / "model.pt")
    labels = load_split(layout.splits, "new_train").labels
    old = load_array(layout.features("old", "new_train"))
    new = load_array(layout.features("new", "new_train"))
    return old, new, _class_rows(new_model, labels), new_model


def _reference_path(config: AlignConfig, old: np.ndarray, new: np.ndarray, rows: np.ndarray, layout: Layout) -> Path:
    """Where the l2-only reference of ``config`` trained on these pairs is kept: FCT's stage
    leaves its map there and every other map's check reuses it (training is seeded, so it is
    the same map either way). Not a stage output."""
    key = hashlib.md5(run_key(reference_config(config), old, new, rows).encode()).hexdigest()[:16]
    return layout.paths.artifacts / "reference-maps" / f"{key}.pt"


@task(name="train-alignment", tags=GPU_TAGS, **NO_CACHING)
def train_map(config: AlignConfig, method: str, layout: Layout) -> tuple[AlignmentMap | UnifiedMaps, list[dict]]:
    old, new, rows, new_model = _training_pairs(layout)
    options = dict(device=pick_device(), checkpoint=layout.checkpoint(f"align-{method}"), log=log,
                   on_epoch=epoch_progress(f"align-{method}", f"training the {method} alignment map"), method=method)
    if config.architecture == "unified":
        log(f"training {method}: a unified space ({config.rbt_blocks} RBT blocks per side), on {len(old)} "
            f"stored feature pairs, {old.shape[1]} and {new.shape[1]} -> {new.shape[1]}")
        return train_unified(config, old, new, rows, len(new_model.classes), **options)
    terms = "+".join(t for t in ("l2", "disc", "uncertainty") if getattr(config, t))
    log(f"training the {method} map ({config.architecture}, {terms}) on {len(old)} stored feature pairs, "
        f"{old.shape[1]} -> {new.shape[1]}")
    h, history = train_alignment(config, old, new, rows, new_model.classifier, **options)
    if is_reference(config) and config.validation_fraction > 0:
        save_alignment(h, reference_config(config), _reference_path(config, old, new, rows, layout))
    return h, history


def _cached_reference(method: str, path: Path):
    """The l2-only reference kept at ``path`` (FCT's stage, or an earlier check, left it), or None."""
    def cached():
        if not path.is_file():
            return None
        log(f"{method} check: the l2-only map trained on the same pairs is at {path}")
        return load_alignment(path)

    return cached


@task(name="check-alignment", tags=GPU_TAGS, **NO_CACHING)
def check_trained_map(h, config: AlignConfig, method: str, layout: Layout,
                      distance: str = "l2") -> tuple[Any, AlignConfig, dict | None]:
    """The map check (components.experiment.map_check.decide_map) on the held-out pairs: returns
    the map to use, its configuration and the check's record (None when the map is l2-only, its
    own reference, or nothing is held out). Raises MapCheckError under ``check: fail``."""
    directory = layout.align_dir(method)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "check.json").unlink(missing_ok=True)
    reason = skip_reason(method, config)
    if reason is None:
        old, new, rows, new_model = _training_pairs(layout)
        path = _reference_path(config, old, new, rows, layout)
        checkpoint = layout.checkpoint(f"align-{method}-reference")

        def keep(reference) -> None:
            save_alignment(reference, reference_config(config), path)
            discard_checkpoint(checkpoint)

        decision = decide_map(method, config, h, (old, new, rows), _cached_reference(method, path),
                              new_model.classifier, distance=distance, device=pick_device(), log=log,
                              keep_reference=keep, checkpoint=checkpoint)
        reason = decision.skipped
    if reason is not None:
        log(f"{method}: {reason}, so the map is used unchecked")
        return h, config, None
    write_json(directory / "check.json", decision.record)
    return decision.map, decision.config, decision.record


@task(name="transform-gallery", **NO_CACHING)
def transform_gallery(h, config: AlignConfig, method: str, layout: Layout) -> dict[str, Path]:
    """h(old) for the evaluation images, sigma per item, and the true per-item loss (oracle).
    A unified map also writes query.npy: T_q(new), which queries and backfilled items use."""
    old, new = load_array(layout.features("old", "test")), load_array(layout.features("new", "test"))
    directory = layout.align_dir(method)
    outputs = {"gallery_old": directory / "gallery_old.npy", "true_loss": directory / "true_loss.npy"}
    if config.architecture == "unified":
        transformed, query = apply_unified(h, old, new)
        outputs["query"] = directory / "query.npy"
        save_array(outputs["query"], query)
        save_array(outputs["gallery_old"], transformed)
        save_array(outputs["true_loss"], ((query - transformed) ** 2).sum(axis=1).astype(np.float32))
        return outputs
    new_model = load_embedder(layout.model_dir("new") / "model.pt")
    labels = load_split(layout.splits, "test").labels
    transformed, log_sigma2 = apply_alignment(h, old)
    true_loss = true_alignment_loss(config, transformed, new, _class_rows(new_model, labels, unseen_ok=True),
                                    new_model.classifier)
    save_array(outputs["gallery_old"], transformed)
    save_array(outputs["true_loss"], true_loss)
    if log_sigma2 is not None:
        outputs["log_sigma2"] = directory / "log_sigma2.npy"
        save_array(outputs["log_sigma2"], log_sigma2)
    return outputs


@task(name="save-alignment", **IO_RETRIES, **NO_CACHING)
def save_map(h, config: AlignConfig, history: list[dict], method: str, layout: Layout) -> Path:
    directory = layout.align_dir(method)
    save_alignment(h, config, directory / "map.pt")
    write_json(directory / "history.json", history)
    discard_checkpoint(layout.checkpoint(f"align-{method}"))
    return directory / "map.pt"
