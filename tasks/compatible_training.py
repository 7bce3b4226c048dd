"""Tasks of a compatible new model (BCT, RACT, stationary representations, BT^2): train it
against the frozen old model, then store what the evaluation needs on the test images."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from prefect import task

from fastfill.components.experiment.basis_transformation import fold_basis_transformation
from fastfill.components.experiment.compatibility import (
    BCTInfluence,
    BT2Compatibility,
    RACTCompatibility,
    StationaryCompatibility,
    fix_simplex_classifier,
    old_class_means,
    old_items_beside_new_features,
)
from fastfill.components.experiment.data import load_meta, load_split
from fastfill.components.experiment.inference import embed, pick_device
from fastfill.components.experiment.models import load_embedder
from fastfill.components.experiment.training import TrainingRun, train_embedder
from fastfill.components.platform.config import CompatibleConfig, TrainConfig
from fastfill.components.platform.layout import Layout, load_array, save_array
from fastfill.tasks._policy import GPU_TAGS, IO_RETRIES, NO_CACHING, epoch_progress, log
from fastfill.tasks.model_training import store_trained


def compatibility_term(config: CompatibleConfig, old_model, split, reference_new=None):
    """The term of ``config.loss``; ``reference_new`` is the independently trained new model
    (BT^2 matches its representation to it)."""
    if config.loss == "bct":
        means = old_class_means(old_model, split.images, split.labels)
        return BCTInfluence(old_model, means, lam=config.lam, label_smoothing=config.label_smoothing)
    if config.loss == "stationary":
        return StationaryCompatibility(old_model, lam=config.lam, scale=1.0 / config.tau)
    if config.loss == "bt2":
        if reference_new is None:
            raise ValueError("loss bt2 needs the independently trained new model (train.new's) to match")
        means = old_class_means(old_model, split.images, split.labels)
        return BT2Compatibility(old_model, reference_new, means, lam=config.lam, match_old=config.bt2["match_old"],
                                match_new=config.bt2["match_new"], label_smoothing=config.label_smoothing)
    return RACTCompatibility(old_model, tau=config.tau, new_to_new=config.new_to_new, lam=config.lam)


def own_old_model_dir(layout: Layout, method: str) -> Path:
    """Where a method that trains its own old model (stationary representations) keeps it."""
    return layout.compatible_dir(method) / "old"


def train_own_old_model(train_config: TrainConfig, method: str, layout: Layout):
    """Stationary representations' old model: the pipeline's old model (train.old's settings, the
    old classes, the old_train split) trained against the fixed d-Simplex classifier; stored in
    artifacts/compatible/<method>/old/. It builds this row's gallery, not the shared old model."""
    meta = load_meta(layout.splits)
    split = load_split(layout.splits, "old_train")
    device, checkpoint = pick_device(), layout.checkpoint(f"compatible-{method}-old")
    log(f"training the {method} old model ({train_config.backbone}, {train_config.epochs} epochs, fixed d-Simplex "
        f"classifier) on {len(split)} images, device {device}")
    run = TrainingRun(device, checkpoint, log,
                      epoch_progress(f"compatible-{method}-old", f"training the {method} old model"))
    model, history = train_embedder(train_config, split, meta["old_classes"], (meta["pixel_mean"], meta["pixel_std"]),
                                    run=run, prepare=fix_simplex_classifier)
    store_trained(model, train_config, history, own_old_model_dir(layout, method), checkpoint)
    return model


@task(name="train-compatible", tags=GPU_TAGS, **NO_CACHING)
def train_compatible(config: CompatibleConfig, train_config: TrainConfig, method: str, layout: Layout,
                     old_train_config: TrainConfig | None = None) -> tuple[torch.nn.Module, list[dict]]:
    """The compatible new model, against the pipeline's old model, or (stationary
    representations) against its own, trained first with ``old_train_config`` (train.old)."""
    meta = load_meta(layout.splits)
    split = load_split(layout.splits, "new_train")
    if config.trains_own_old_model:
        if old_train_config is None or old_train_config.embedding_dim != train_config.embedding_dim:
            raise ValueError(f"loss {config.loss} needs train.old with the new model's embedding_dim (one d-Simplex "
                             "for both models)")
        old_model = train_own_old_model(old_train_config, method, layout)
    else:
        old_model = load_embedder(layout.model_dir("old") / "model.pt")
    reference, trained_config = None, train_config
    if config.loss == "bt2":  # the feature grows by extra_dims beyond the independently trained new model's
        reference = load_embedder(layout.model_dir("new") / "model.pt")
        trained_config = train_config.model_copy(
            update={"embedding_dim": reference.embedding_dim + config.bt2["extra_dims"]})
    term = compatibility_term(config, old_model, split, reference)
    device = pick_device()
    log(f"training the {method} new model ({train_config.backbone}, {train_config.epochs} epochs, "
        f"{config.loss} compatibility, lambda {config.lam}) on {len(split)} images, device {device}")
    run = TrainingRun(device, layout.checkpoint(f"compatible-{method}"), log,
                      epoch_progress(f"compatible-{method}", f"training the {method} new model"))
    model, history = train_embedder(trained_config, split, meta.get("new_classes", list(range(meta["num_classes"]))),
                                    (meta["pixel_mean"], meta["pixel_std"]), run=run, compatibility=term)
    return fold_basis_transformation(model), history


@task(name="embed-compatible", tags=GPU_TAGS, **NO_CACHING)
def embed_compatible(model, method: str, layout: Layout, own_old: bool = False) -> dict[str, Path]:
    """On the test images: the model's features (queries, backfilled items), the old features
    as the gallery holds them (in the new feature's first d_old coordinates: see
    ``old_items_beside_new_features``, how BT^2's old items meet its compatible part), and the new
    classifier's logits on those old features (RACT's uncertainty orders). ``own_old``: the
    gallery was built by the method's own old model (stationary representations)."""
    directory = layout.compatible_dir(method)
    images = load_split(layout.splits, "test").images
    features = embed(model, images)
    if not np.isfinite(features).all():
        raise FloatingPointError(f"the {method} model produced NaN/inf features; lower train.new.lr")
    if own_old:
        old_features = embed(load_embedder(own_old_model_dir(layout, method) / "model.pt"), images)
    else:
        old_features = load_array(layout.features("old", "test"))
    old = old_items_beside_new_features(torch.from_numpy(old_features), features.shape[1])
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
    # train.new's settings at the model's own dimension (BT^2's feature has extra dimensions)
    config = train_config.model_copy(update={"embedding_dim": model.embedding_dim})
    return store_trained(model, config, history, layout.compatible_dir(method), layout.checkpoint(f"compatible-{method}"))
