"""Tasks of the alignment stage: train h (and psi) on stored features, transform the gallery."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from prefect import task

from components.config import AlignConfig
from components.data import load_split
from components.layout import Layout, load_array, save_array, write_json
from components.models import load_alignment, load_embedder, save_alignment
from components.training import (
    apply_alignment, apply_unified, discard_checkpoint, pick_device, train_alignment, train_unified,
    true_alignment_loss,
)
from tasks._policy import GPU_TAGS, IO_RETRIES, NO_CACHING, epoch_progress, log


def _class_rows(new_model, labels: np.ndarray) -> np.ndarray:
    import torch

    rows = new_model.class_index(torch.from_numpy(labels)).numpy()
    if (rows < 0).any():
        raise ValueError("some labels are classes the new model does not know; its head must cover all classes")
    return rows


@task(name="train-alignment", tags=GPU_TAGS, **NO_CACHING)
def train_map(config: AlignConfig, method: str, layout: Layout):
    new_model = load_embedder(layout.model_dir("new") / "model.pt")
    labels = load_split(layout.splits, "new_train").labels
    old = load_array(layout.features("old", "new_train"))
    new = load_array(layout.features("new", "new_train"))
    options = dict(device=pick_device(), checkpoint=layout.checkpoint(f"align-{method}"), log=log,
                   on_epoch=epoch_progress(f"align-{method}", f"training the {method} alignment map"))
    if config.architecture == "unified":
        log(f"training {method}: a unified space ({config.rbt_blocks} RBT blocks per side), on {len(old)} "
            f"stored feature pairs, {old.shape[1]} and {new.shape[1]} -> {new.shape[1]}")
        return train_unified(config, old, new, _class_rows(new_model, labels), len(new_model.classes), **options)
    terms = "+".join(t for t in ("l2", "disc", "uncertainty") if getattr(config, t))
    log(f"training the {method} map ({config.architecture}, {terms}) on {len(old)} stored feature pairs, "
        f"{old.shape[1]} -> {new.shape[1]}")
    return train_alignment(config, old, new, _class_rows(new_model, labels), new_model.classifier, **options)


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
    true_loss = true_alignment_loss(config, transformed, new, _class_rows(new_model, labels), new_model.classifier)
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


def load_map(method: str, layout: Layout):
    return load_alignment(layout.align_dir(method) / "map.pt")
