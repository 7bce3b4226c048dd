"""Tasks of a compatible new model (BCT, RACT): train it against the frozen old model, then
store what the evaluation needs on the test images."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from prefect import task

from components.experiment.compatibility import BCTInfluence, RACTCompatibility, old_class_means
from components.platform.config import CompatibleConfig, TrainConfig
from components.experiment.data import load_meta, load_split
from components.platform.layout import Layout, load_array, save_array
from components.experiment.losses import match_dimension
from components.experiment.models import load_embedder
from components.experiment.inference import embed, pick_device
from components.experiment.training import TrainingRun, train_embedder
from tasks._policy import GPU_TAGS, IO_RETRIES, NO_CACHING, epoch_progress, log
from tasks.model_training import store_trained


def compatibility_term(config: CompatibleConfig, old_model, split):
    if config.loss == "bct":
        means = old_class_means(old_model, split.images, split.labels)
        return BCTInfluence(old_model, means, lam=config.lam, label_smoothing=config.label_smoothing)
    return RACTCompatibility(old_model, tau=config.tau, new_to_new=config.new_to_new, lam=config.lam)


@task(name="train-compatible", tags=GPU_TAGS, **NO_CACHING)
def train_compatible(config: CompatibleConfig, train_config: TrainConfig, method: str, layout: Layout):
    meta = load_meta(layout.splits)
    split = load_split(layout.splits, "new_train")
    old_model = load_embedder(layout.model_dir("old") / "model.pt")
    term = compatibility_term(config, old_model, split)
    device = pick_device()
    log(f"training the {method} new model ({train_config.backbone}, {train_config.epochs} epochs, "
        f"{config.loss} compatibility, lambda {config.lam}) on {len(split)} images, device {device}")
    run = TrainingRun(device, layout.checkpoint(f"compatible-{method}"), log,
                      epoch_progress(f"compatible-{method}", f"training the {method} new model"))
    return train_embedder(train_config, split, meta.get("new_classes", list(range(meta["num_classes"]))),
                          (meta["pixel_mean"], meta["pixel_std"]), run=run, compatibility=term)


@task(name="embed-compatible", tags=GPU_TAGS, **NO_CACHING)
def embed_compatible(model, method: str, layout: Layout) -> dict[str, Path]:
    """On the test images: the model's features (queries, backfilled items), the old features
    as the gallery holds them (truncated or zero-padded to the new dimension), and the new
    classifier's logits on those old features (RACT's uncertainty orders)."""
    directory = layout.compatible_dir(method)
    features = embed(model, load_split(layout.splits, "test").images)
    if not np.isfinite(features).all():
        raise FloatingPointError(f"the {method} model produced NaN/inf features; lower train.new.lr")
    old = match_dimension(torch.from_numpy(load_array(layout.features("old", "test"))), features.shape[1])
    with torch.no_grad():
        logits = model.cpu().classify(old).numpy().astype(np.float32)
    outputs = {"query": directory / "query.npy", "gallery_old": directory / "gallery_old.npy",
               "logits": directory / "logits.npy"}
    save_array(outputs["query"], features)
    save_array(outputs["gallery_old"], old.numpy().astype(np.float32))
    save_array(outputs["logits"], logits)
    return outputs


@task(name="save-compatible", **IO_RETRIES, **NO_CACHING)
def save_compatible(model, train_config: TrainConfig, history: list[dict], method: str, layout: Layout) -> Path:
    return store_trained(model, train_config, history, layout.compatible_dir(method),
                         layout.checkpoint(f"compatible-{method}"))
