"""Tasks that load registered models and embed images (the GPU's work): a model from the
registry, images embedded, and the pairs a map trains on."""

from __future__ import annotations

import numpy as np
from prefect import task
from torch import nn

from fastfill.components.experiment.data import DataError, load_split
from fastfill.components.experiment.inference import embed
from fastfill.components.gallery.layouts.catalog import GalleryError, check_features, rows_at
from fastfill.components.gallery.layouts.opening import gallery_at
from fastfill.components.gallery.upgrade.lifecycle import SPLITS_SOURCE
from fastfill.components.gallery.upgrade.pairs import TARGETS_LABELS, MapPairs, from_gallery
from fastfill.components.gallery.upgrade.planning import source_key
from fastfill.components.gallery.upgrade.samples import readable_images
from fastfill.components.model_store import registered
from fastfill.components.platform.progress import progress
from fastfill.components.platform.registry import ModelRef
from fastfill.tasks._policy import GPU_TAGS, IO_RETRIES, NO_CACHING, log
from fastfill.tasks.gallery_store import store_at


@task(name="load-model", **IO_RETRIES, **NO_CACHING)
def load_model(ref: ModelRef) -> nn.Module:
    """A registered model, ready to embed (the registry is the one this process set up)."""
    return registered.load_model(ref.uri).eval()


@task(name="embed-images", tags=GPU_TAGS, **NO_CACHING)
def embed_images(model, images: np.ndarray, batch_size: int = 512, precision: str = "auto",
                 label: str | None = None) -> np.ndarray:
    """``images`` embedded by ``model``; with ``label``, its progress shown (a bar, or log lines)."""

    if label is None:
        return embed(model, images, batch_size=batch_size, precision=precision)
    with progress(label, total=len(images), unit="image", log=log) as bar:
        return embed(model, images, batch_size=batch_size, precision=precision, on_batch=bar.advance)


@task(name="embed-split-pairs", tags=GPU_TAGS, **NO_CACHING)
def embed_split_pairs(splits_folder, old_model, new_model) -> MapPairs | None:
    """Both models' features of this host's prepared new-train split (``map_pairs: splits``)
    with kappa_new's row of each label, or None when no split is prepared here."""
    import torch

    try:
        split = load_split(splits_folder, "new_train")
    except (DataError, FileNotFoundError):
        return None
    rows = new_model.class_index(torch.from_numpy(split.labels)).numpy()
    keep = rows >= 0
    images = split.images[keep]
    log(f"map pairs: embedding {len(images)} images of the new-train split with both models")
    with progress("embedding the split's pairs", total=2 * len(images), unit="image", log=log) as bar:
        old, new = embed(old_model, images, on_batch=bar.advance), embed(new_model, images, on_batch=bar.advance)
    return MapPairs(old, new, rows[keep], rows[keep], SPLITS_SOURCE, TARGETS_LABELS)


@task(name="embed-gallery-pairs", tags=GPU_TAGS, **IO_RETRIES, **NO_CACHING)
def gallery_pairs(store_uri: str, positions: np.ndarray, new_model, config, sequential: str | None = None) -> MapPairs:
    """The map sample's pairs (``map_pairs: gallery``): old features from the store (the
    gallery's model's, or for a ``sequential`` upgrade the source parts it starts from), new ones
    by embedding the items' images; unreadable images are left out of the sample."""

    gallery = gallery_at(store_at(store_uri))
    positions, images = readable_images(gallery, positions, config.read_workers, "map sample", log,
                                        getattr(new_model, "preprocessing", None))
    if images is None:  # readable_images answers None for no positions at all
        raise GalleryError("map sample: no gallery items to embed (gallery.upgrade.map_sample chose none); "
                           "the map's pairs need at least one")
    log(f"map pairs: embedding {len(positions)} gallery items with the new model (a seeded sample; their features "
        "are kept as backfilled)")
    with progress("embedding the map sample", total=len(images), unit="image", log=log) as bar:
        new = check_features(embed(new_model, images, batch_size=config.batch_size, precision=config.precision,
                                   on_batch=bar.advance), None, "new-model features of the map sample")
    labels = gallery.labels()
    old = (rows_at(gallery, positions, lambda part: source_key(sequential, part)) if sequential else
           gallery.features_at(gallery.model, positions))
    return from_gallery(new_model, positions, old, new, None if labels is None else labels[positions],
                        gallery.store.uri, config.pseudo_classes, config.seed, config.pseudo_disc)
