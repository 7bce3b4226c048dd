"""Search the gallery as it is now, during an upgrade too, with a faiss index kept up to date.

Before an upgrade the index holds the gallery model's features and queries use that model.
From the moment an upgrade's plan exists, queries use the new model and the index holds the
transformed old features, with each finished chunk's new features replacing its items'
vectors by id (``IndexIDMap2.remove_ids`` + ``add_with_ids``) as chunks land: never a rebuild.
The index's ids are the items' positions; answers carry the team's own ids (integers or text).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from fastfill.components.experiment.inference import embed, pick_device
from fastfill.components.gallery.layouts.catalog import Gallery, GalleryError, check_features
from fastfill.components.gallery.layouts.item_ids import ids_at, is_text, positions_of
from fastfill.components.gallery.store import ObjectMissing
from fastfill.components.gallery.upgrade.backfill import landed_since
from fastfill.components.gallery.upgrade.planning import FINISHED, load_plan, order_of, transformed_key, upgrade_key
from fastfill.components.platform.config import IndexConfig
from fastfill.components.platform.registry import ModelRef
from fastfill.components.platform.vocabulary import DISTANCES


def check_queries(features, dim: int | None, model_uri: str, k: int, num_items: int) -> tuple[np.ndarray, int]:
    """Query features as a 2-D float32 array of the query model's dimension (one query may be
    1-D), and k capped at the gallery's size; a GalleryError naming what is wrong otherwise."""
    if k < 1:
        raise GalleryError(f"k must be >= 1, got {k}")
    features = np.asarray(features)
    if features.ndim == 1:
        features = features[None]
    return check_features(features, dim, f"query features (for {model_uri})"), min(k, num_items)


class GallerySearch:
    """Top-k item ids for query features against the current (possibly mixed) gallery."""

    def __init__(self, gallery: Gallery, distance: str = "l2", index=None):
        """``index``: an ``IndexConfig`` (flat by default)."""

        if distance not in DISTANCES:
            raise GalleryError(f"distance must be l2 or cosine, got {distance!r}")
        self.gallery, self.distance = gallery, distance
        self.index_config = index or IndexConfig()
        self._lock = threading.RLock()  # refresh() may rebuild, and a rebuild refreshes
        self._build()

    # ---- state

    def _build(self) -> None:
        manifest = self.gallery.manifest(refresh=True)
        self.ids = self.gallery.ids()
        self.upgrade_id = manifest.get("upgrade")
        self.fresh = np.zeros(len(self.ids), dtype=bool)  # during an upgrade: items on the new model
        self.plan = load_plan(self.gallery.store, self.upgrade_id) if self.upgrade_id else None
        if self.plan is not None:
            plan = self.plan
            self.query_model = plan.new
            self.order = order_of(self.gallery.store, plan.upgrade_id)

            def part_features(part: int) -> np.ndarray:
                return self.gallery.part_rows(transformed_key(plan.upgrade_id, part), part)
        else:
            self.upgrade_id = None
            self.query_model = self.gallery.model
            self.fresh[:] = True
            self._mark_kept_from(manifest)

            def part_features(part: int) -> np.ndarray:
                return self.gallery.features(self.gallery.model, part)
        self.index = self._new_index(part_features)
        for part in range(self.gallery.num_parts):  # part by part: never the whole gallery at once
            start, stop = self.gallery.part_bounds(part)
            self.index.add_with_ids(self._prepare(part_features(part)), np.arange(start, stop, dtype=np.int64))
        self.applied: set[int] = set()
        self.rebuilds = getattr(self, "rebuilds", -1) + 1
        self.gpu = GpuCopy.choose(self.index_config, self.distance)
        self.searched_on = self.gpu.name if self.gpu else "cpu (faiss)"
        if self.plan is not None:
            self.refresh()

    def _new_index(self, part_features):
        """An empty index of the configured kind; inverted lists are trained on a sample of
        ``train_size`` items drawn from a few random parts."""
        self.dim = part_features(0).shape[1]

        def training_sample() -> np.ndarray:
            rng = np.random.default_rng(0)
            sample, have = [], 0
            for part in rng.permutation(self.gallery.num_parts):
                sample.append(self._prepare(part_features(int(part))))
                have += len(sample[-1])
                if have >= self.index_config.train_size:
                    break
            return np.concatenate(sample)[:self.index_config.train_size]

        return new_index(self.index_config, self.dim, self.distance, self.gallery.num_items, training_sample)

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
            if manifest.get("upgrade") != self.upgrade_id:
                if self.upgrade_id is not None and self.plan is not None and manifest.get("upgrade") is None \
                        and ModelRef.from_dict(manifest["model"]) == self.plan.new:
                    applied = self._apply_new_chunks()
                    self.upgrade_id, self.plan, self.query_model = None, None, ModelRef.from_dict(manifest["model"])
                    self.fresh[:] = True
                    self._mark_kept_from(manifest)
                    return applied
                self._build()
                return 0
            if self.plan is None and ModelRef.from_dict(manifest["model"]) != self.query_model:
                self._build()  # the model changed without an upgrade: a rollback
                return 0
            return self._apply_new_chunks() if self.plan is not None else 0

    def _apply_new_chunks(self) -> int:
        count = 0
        for chunk, positions, features, read in landed_since(self.gallery.store, self.plan, self.order, self.applied):
            positions = np.asarray(positions, dtype=np.int64)
            self.index.remove_ids(positions)
            self.index.add_with_ids(self._prepare(features), positions)
            if self.gpu is not None:
                self.gpu.stale = True
            self.applied.add(chunk)
            self.fresh[positions] = read  # an image that could not be read: still h(old)
            count += 1
        return count

    def _mark_kept_from(self, manifest: dict) -> None:
        """Items the last finished upgrade could not re-embed keep their transformed features."""
        self._mapped = None  # how sources() names the kept items' features, when there are any
        last = (manifest.get("history") or [{}])[-1].get("by")
        if last and last not in ("ingest", "adopt"):
            try:
                record = self.gallery.store.get_json(upgrade_key(last, FINISHED))
            except ObjectMissing:
                return
            failed = record.get("failed_images", {}).get("items", [])
            plan = load_plan(self.gallery.store, last) if failed else None
            for entry in failed:
                self.fresh[entry["position"]] = False
            self._mapped = f"{plan.old.uri} mapped by {plan.map_uri}" if plan else None

    def sources(self, ids: np.ndarray) -> list:
        """Where each hit's features come from: the model URI that embedded its image, or
        ``<old model> mapped by <map>`` for transformed features (items not yet backfilled, or
        whose image could not be read)."""
        ids = np.asarray(ids, dtype=object if is_text(self.ids) else np.int64)
        flat = ids.ravel()
        found = np.array([i is not None and not (isinstance(i, (int, np.integer)) and i < 0) for i in flat], dtype=bool)
        positions = np.full(len(flat), -1, dtype=np.int64)
        if found.any():
            positions[found] = positions_of(self.ids, [flat[i] for i in np.flatnonzero(found)])
        mapped: str | None
        if self.plan is not None:
            new, mapped = self.plan.new.uri, f"{self.plan.old.uri} mapped by {self.plan.map_uri}"
        else:
            new, mapped = self.query_model.uri, self._mapped
        out = [None if p < 0 else new if self.fresh[p] else mapped for p in positions]
        return np.array(out, dtype=object).reshape(ids.shape).tolist()

    @property
    def backfilled(self) -> int:
        if self.plan is None:
            return self.gallery.num_items
        return self.plan.items_in(self.applied)

    # ---- queries

    def search(self, features: np.ndarray, k: int = 10) -> tuple[np.ndarray, np.ndarray]:
        """(ids, distances), each (queries, k); distances are squared L2, or 1 - cosine."""
        features, k = check_queries(features, self.dim, self.query_model.uri, k, self.gallery.num_items)
        with self._lock:
            if self.gpu is not None:
                scores, positions = self.gpu.search(self.index, self._prepare(features), k)
            else:
                scores, positions = self.index.search(self._prepare(features), k)
        return ids_at(self.ids, positions), (1.0 - scores if self.distance == "cosine" else scores)

    def search_images(self, images: np.ndarray, model, k: int = 10) -> tuple[np.ndarray, np.ndarray]:
        """Embed query images (uint8, (N, C, H, W) or (N, H, W)) with ``model``, the query model
        (``self.query_model``), and search."""

        return self.search(embed(model, query_images(self.gallery, images)), k)


def new_index(config, dim: int, distance: str, num_items: int, training_sample: Callable[[], np.ndarray]):
    """An empty faiss index of ``config``'s kind (gallery.index) with ids: exact (flat), or
    inverted lists trained on ``training_sample()`` (vectors already normalised for cosine)."""
    import faiss

    metric = faiss.METRIC_INNER_PRODUCT if distance == "cosine" else faiss.METRIC_L2
    if config.kind == "flat":
        return faiss.IndexIDMap2(faiss.IndexFlatIP(dim) if distance == "cosine" else faiss.IndexFlatL2(dim))
    if num_items < 39 * config.nlist:
        raise GalleryError(f"gallery.index.nlist {config.nlist} needs at least {39 * config.nlist} items to train "
                           f"its lists; this gallery has {num_items}: lower nlist (about items / 100) or use kind: flat")
    if config.kind == "ivfpq" and dim % config.pq_m:
        raise GalleryError(f"gallery.index.pq_m {config.pq_m} must divide the features' dimension {dim}")
    spec = f"IVF{config.nlist},Flat" if config.kind == "ivf" else f"IVF{config.nlist},PQ{config.pq_m}"
    index: Any = faiss.index_factory(dim, spec, metric)  # an IndexIVF (faiss's types know only Index)
    index.train(training_sample())
    index.nprobe = config.nprobe
    # remove_ids and reconstruct by id (faiss's types lack DirectMap)
    index.set_direct_map_type(faiss.DirectMap.Hashtable)  # type: ignore[attr-defined]
    return index


def query_images(gallery: Gallery, images) -> np.ndarray:
    """Query images checked: uint8, (N, C, H, W) with 1 or 3 channels, or (N, H, W) for one.
    Any size: the model that embeds them resizes them by its own preprocessing."""
    images = np.asarray(images)
    if images.ndim == 3:
        images = images[:, None]
    expected = tuple(gallery.manifest()["image_shape"])
    if images.ndim != 4 or images.shape[1] not in (1, 3) or min(images.shape[2:], default=0) < 1 \
            or images.dtype != np.uint8:
        raise GalleryError(f"query images must be uint8 of shape (N, C, H, W) with 1 or 3 channels, e.g. "
                           f"(N, {', '.join(map(str, expected))}) as the gallery stores them; got {images.dtype} "
                           f"{images.shape}")
    return images


def faiss_gpus() -> int:
    """GPUs faiss can use: 0 with faiss-cpu (no GPU build) or no CUDA device."""
    import faiss

    return faiss.get_num_gpus() if hasattr(faiss, "StandardGpuResources") else 0


class GpuCopy:
    """The search index's copy on a CUDA GPU, where searches run. Updates still go to the faiss
    index on the CPU (faiss's GPU indexes cannot remove ids, and the CPU index is what a
    rebuild-free upgrade edits), and the copy is reloaded at the first search after a change:
    one host-to-device copy per refresh that applied chunks, not per search.

    With faiss's GPU build (``FASTFILL_GPU=1 bash scripts/setup.sh``) the copy is faiss's own GPU
    index, of any kind. With faiss-cpu and CUDA torch, a flat index's vectors are copied to the GPU
    and searched exactly by torch (same squared-L2 or inner-product scores as faiss)."""

    QUERY_SCORES = 1 << 28  # query x item scores in flight at once (1 GiB of float32)

    def __init__(self, backend: str, distance: str):
        import torch

        self.backend, self.distance, self.stale = backend, distance, True
        self.device = torch.device("cuda")
        self.name = "cuda (faiss)" if backend == "faiss" else "cuda (torch, exact)"
        # faiss's GPU index, or torch's tensors (both libraries load late)
        self._copy: Any = None
        self._vectors: Any = None
        self._ids: Any = None
        self._norms: Any = None
        if backend == "faiss":
            import faiss

            self._resources = faiss.StandardGpuResources()

    @classmethod
    def choose(cls, config, distance: str) -> GpuCopy | None:
        """The GPU copy ``config`` (gallery.index) asks for and this machine allows, or None (search
        on the CPU). ``device: cuda`` that cannot be honoured is an error, never a silent CPU."""
        import torch

        if config.device == "cpu" or (config.device == "auto" and pick_device().type != "cuda"):
            return None  # auto follows FASTFILL_DEVICE too
        if faiss_gpus() > 0:
            return cls("faiss", distance)
        cuda = torch.cuda.is_available()
        if cuda and config.kind == "flat":
            return cls("torch", distance)
        if config.device == "cuda":
            if not cuda:
                raise GalleryError("gallery.index.device is cuda, but this machine has no CUDA device; set it to "
                                   "auto (the GPU when there is one) or cpu")
            raise GalleryError(f"gallery.index.kind {config.kind} on the GPU needs faiss's GPU build "
                               "(FASTFILL_GPU=1 bash scripts/setup.sh); without it use kind flat, or device "
                               "auto or cpu")
        return None

    def load(self, index) -> None:
        """Copy ``index`` (the CPU faiss index, already filled) to the GPU, replacing the last copy."""
        import faiss
        import torch

        self._copy = self._vectors = self._ids = self._norms = None
        if self.backend == "faiss":
            self._copy = faiss.index_cpu_to_gpu(self._resources, 0, index)
        else:
            flat = faiss.downcast_index(index.index)
            n, block = index.ntotal, 1 << 18
            self._vectors = torch.empty((n, index.d), dtype=torch.float32, device=self.device)
            for start in range(0, n, block):  # block by block: never a second N x d copy on the host
                rows = flat.reconstruct_n(start, min(block, n - start))
                self._vectors[start: start + len(rows)] = torch.from_numpy(rows).to(self.device)
            self._ids = torch.from_numpy(faiss.vector_to_array(index.id_map).astype(np.int64)).to(self.device)
            if self.distance != "cosine":
                self._norms = (self._vectors * self._vectors).sum(dim=1)
        self.stale = False

    def search(self, index, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids) as faiss's ``index.search`` gives them: squared L2 ascending, or inner
        product descending."""
        import torch

        if self.stale:
            self.load(index)
        if self.backend == "faiss":
            return self._copy.search(queries, k)
        n = len(self._ids)
        step = max(1, self.QUERY_SCORES // max(n, 1))
        scores, ids = [], []
        with torch.no_grad():
            for start in range(0, len(queries), step):
                q = torch.from_numpy(queries[start: start + step]).to(self.device)
                products = q @ self._vectors.T
                if self.distance == "cosine":
                    best, at = products.topk(k, dim=1, largest=True)
                else:
                    distances = ((q * q).sum(dim=1, keepdim=True) - 2 * products + self._norms).clamp_min_(0)
                    best, at = distances.topk(k, dim=1, largest=False)
                scores.append(best.cpu().numpy())
                ids.append(self._ids[at].cpu().numpy())
        return np.concatenate(scores).astype(np.float32), np.concatenate(ids)
