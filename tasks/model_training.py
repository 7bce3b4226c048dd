"""Tasks of the model-training stages: train, embed the splits, save."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from prefect import task

from fastfill.components.experiment.data import load_meta, load_split
from fastfill.components.experiment.inference import embed, pick_device
from fastfill.components.experiment.models import Embedder, save_embedder
from fastfill.components.experiment.training import TrainingRun, discard_checkpoint, train_embedder
from fastfill.components.platform.config import TrainConfig
from fastfill.components.platform.layout import FEATURE_SPLITS, Layout, save_array, write_json
from fastfill.tasks._policy import GPU_TAGS, IO_RETRIES, NO_CACHING, epoch_progress, log


@task(name="train-embedder", tags=GPU_TAGS, **NO_CACHING)
def train_model(config: TrainConfig, role: str, layout: Layout) -> tuple[Embedder, list[dict]]:
    meta = load_meta(layout.splits)
    split = load_split(layout.splits, "old_train" if role == "old" else "new_train")
    classes = meta["old_classes"] if role == "old" else meta.get("new_classes", list(range(meta["num_classes"])))
    device = pick_device()
    log(f"training the {role} model ({config.backbone}, {config.epochs} epochs) on {len(split)} images, "
        f"classes {classes}, device {device}")
    run = TrainingRun(device, layout.checkpoint(f"model-{role}"), log,
                      epoch_progress(f"train-{role}", f"training the {role} embedding model"))
    model, history = train_embedder(config, split, classes, (meta["pixel_mean"], meta["pixel_std"]), run=run)
    return model, history


@task(name="embed-splits", tags=GPU_TAGS, **NO_CACHING)
def embed_splits(model, role: str, layout: Layout) -> dict[str, Path]:
    """Features of every split the later stages need, computed once and stored."""
    written = {}
    for name in FEATURE_SPLITS:
        features = embed(model, load_split(layout.splits, name).images)
        if not np.isfinite(features).all():
            raise FloatingPointError(f"the {role} model produced NaN/inf features on {name}; lower its lr")
        save_array(layout.features(role, name), features)
        written[name] = layout.features(role, name)
        log(f"{role} features of {name}: {features.shape}")
    return written


def store_trained(model, config: TrainConfig, history: list[dict], directory: Path, checkpoint: Path) -> Path:
    """model.pt and history.json in ``directory``; then the training's checkpoint goes."""
    directory.mkdir(parents=True, exist_ok=True)
    save_embedder(model, config, directory / "model.pt")
    write_json(directory / "history.json", history)
    discard_checkpoint(checkpoint)
    return directory / "model.pt"


@task(name="save-model", **IO_RETRIES, **NO_CACHING)
def save_model(model, config: TrainConfig, history: list[dict], role: str, layout: Layout) -> Path:
    return store_trained(model, config, history, layout.model_dir(role), layout.checkpoint(f"model-{role}"))
