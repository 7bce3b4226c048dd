"""Search the gallery as it is now, during an upgrade too, with a faiss index kept up to date.

Before an upgrade the index holds the gallery model's features and queries use that model.
From the moment an upgrade's plan exists, queries use the new model and the index holds the
transformed old features, with each finished chunk's new features replacing its items'
vectors by id (``IndexIDMap2.remove_ids`` + ``add_with_ids``) as chunks land: never a rebuild.
"""

from __future__ import annotations

import threading

import numpy as np

from components.gallery.catalog import Gallery, GalleryError, check_features
from components.platform.registry import ModelRef
from components.platform.vocabulary import DISTANCES
from components.gallery.backfill import chunk_features, done_chunks
from components.gallery.plan import load_plan, order_of, transformed_all


class GallerySearch:
    """Top-k item ids for query features against the current (possibly mixed) gallery."""

    def __init__(self, gallery: Gallery, distance: str = "l2"):
        if distance not in DISTANCES:
            raise GalleryError(f"distance must be l2 or cosine, got {distance!r}")
        self.gallery, self.distance = gallery, distance
        self._lock = threading.RLock()  # refresh() may rebuild, and a rebuild refreshes
        self._build()

    # ---- state

    def _build(self) -> None:
        import faiss

        manifest = self.gallery.manifest(refresh=True)
        self.ids = self.gallery.ids()
        self.upgrade = manifest.get("upgrade")
        self.plan = load_plan(self.gallery.store, self.upgrade) if self.upgrade else None
        if self.plan is not None:
            base, self.query_model = transformed_all(self.gallery, self.plan.id), self.plan.new
            self.order = order_of(self.gallery.store, self.plan.id)
        else:
            self.upgrade = None
            base, self.query_model = self.gallery.all_features(self.gallery.model), self.gallery.model
        self.dim = base.shape[1]
        inner = faiss.IndexFlatIP(self.dim) if self.distance == "cosine" else faiss.IndexFlatL2(self.dim)
        self.index = faiss.IndexIDMap2(inner)
        self.index.add_with_ids(self._prepare(base), self.ids)
        self.applied: set[int] = set()
        self.rebuilds = getattr(self, "rebuilds", -1) + 1
        if self.plan is not None:
            self.refresh()

    def _prepare(self, features: np.ndarray) -> np.ndarray:
        features = np.ascontiguousarray(features, dtype=np.float32)
        if self.distance == "cosine":
            features = features / np.maximum(np.linalg.norm(features, axis=1, keepdims=True), 1e-12)
        return features

    def refresh(self) -> int:
        """Apply chunks that landed since the last refresh; returns how many. A gallery that
        started an upgrade since is reloaded; one that finished its upgrade keeps its index (it
        already holds the new features) and its query model becomes the gallery's."""
        with self._lock:
            manifest = self.gallery.manifest(refresh=True)
            if manifest.get("upgrade") != self.upgrade:
                if self.upgrade is not None and manifest.get("upgrade") is None \
                        and ModelRef.from_dict(manifest["model"]) == self.plan.new:
                    applied = self._apply_new_chunks()
                    self.upgrade, self.plan, self.query_model = None, None, ModelRef.from_dict(manifest["model"])
                    return applied
                self._build()
                return 0
            return self._apply_new_chunks() if self.plan is not None else 0

    def _apply_new_chunks(self) -> int:
        new = [c for c in done_chunks(self.gallery.store, self.plan.id) if c not in self.applied]
        for chunk in new:
            start, stop = self.plan.chunk_bounds(chunk)
            ids = self.ids[self.order[start:stop]]
            features = self._prepare(chunk_features(self.gallery.store, self.plan.id, chunk))
            self.index.remove_ids(ids)
            self.index.add_with_ids(features, ids)
            self.applied.add(chunk)
        return len(new)

    @property
    def backfilled(self) -> int:
        if self.plan is None:
            return self.gallery.num_items
        return self.plan.items_in(self.applied)

    # ---- queries

    def search(self, features: np.ndarray, k: int = 10) -> tuple[np.ndarray, np.ndarray]:
        """(ids, distances), each (queries, k); distances are squared L2, or 1 - cosine."""
        if k < 1:
            raise GalleryError(f"k must be >= 1, got {k}")
        features = np.asarray(features)
        if features.ndim == 1:
            features = features[None]
        features = check_features(features, self.dim, f"query features (for {self.query_model.uri})")
        k = min(k, self.gallery.num_items)
        with self._lock:
            scores, ids = self.index.search(self._prepare(features), k)
        return ids, (1.0 - scores if self.distance == "cosine" else scores)

    def search_images(self, images: np.ndarray, model, k: int = 10) -> tuple[np.ndarray, np.ndarray]:
        """Embed query images (uint8, (N, C, H, W) or (N, H, W)) with ``model``, the query model
        (``self.query_model``), and search."""
        from components.experiment.inference import embed

        images = np.asarray(images)
        if images.ndim == 3:
            images = images[:, None]
        expected = tuple(self.gallery.manifest()["image_shape"])
        if images.ndim != 4 or images.shape[1:] != expected or images.dtype != np.uint8:
            raise GalleryError(f"query images must be uint8 of shape (N, {', '.join(map(str, expected))}), "
                               f"got {images.dtype} {images.shape}")
        return self.search(embed(model, images), k)
