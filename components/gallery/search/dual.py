"""Search during an upgrade the way a shadow index does: two indexes, two queries, one merged list.

The map's way (``components.gallery.search.index``) asks one index of the new model's features and the
transformed old ones. This is the other way, the common playbook without a map: the old model's
own features of the items not yet re-embedded in one index, the new model's features of those
that are in another; each query is embedded by both models, searched in both, and the two ranked
lists are merged (reciprocal rank fusion by default, or scores normalised per list). As chunks
land, their items leave the old index and join the new one, by id: never a rebuild. Both indexes
are exact (flat); each hit carries its source, the model whose features it was found by.

Outside an upgrade there is one model and one index: the merge has nothing to merge, and the
search is the gallery's own.
"""

from __future__ import annotations

import threading

import numpy as np

from components.gallery.upgrade.backfill import landed_since
from components.gallery.layouts.catalog import Gallery, GalleryError, check_features
from components.gallery.layouts.item_ids import ids_at
from components.gallery.upgrade.planning import load_plan, order_of
from components.platform.registry import ModelRef
from components.platform.vocabulary import DISTANCES, MERGES
from components.evaluation.fusion import merge_lists
from components.experiment.inference import embed
from components.gallery.search.index import query_images


class DualSearch:
    """Top-k item ids of query pairs (old model's, new model's features) over the two parts of a
    gallery mid-upgrade, merged by ``merge`` (one of MERGES)."""

    def __init__(self, gallery: Gallery, distance: str = "l2", merge: str = "rrf", rrf_k: int = 60):
        if distance not in DISTANCES:
            raise GalleryError(f"distance must be one of {', '.join(DISTANCES)}, got {distance!r}")
        if merge not in MERGES:
            raise GalleryError(f"merge must be one of {', '.join(MERGES)}, got {merge!r}")
        self.gallery, self.distance, self.merge, self.rrf_k = gallery, distance, merge, rrf_k
        self._lock = threading.RLock()
        self._build()

    def _build(self) -> None:
        import faiss

        manifest = self.gallery.manifest(refresh=True)
        self.upgrade = manifest.get("upgrade")
        self.ids = self.gallery.ids()
        self.plan = load_plan(self.gallery.store, self.upgrade) if self.upgrade else None
        self.old_model = self.plan.old if self.plan else ModelRef.from_dict(manifest["model"])
        self.new_model = self.plan.new if self.plan else None
        self.dim = self.gallery.features(self.old_model, 0).shape[1]
        flat = faiss.IndexFlatIP if self.distance == "cosine" else faiss.IndexFlatL2
        self.old_index = faiss.IndexIDMap2(flat(self.dim))
        for part in range(self.gallery.num_parts):  # part by part: never the whole gallery at once
            start, stop = self.gallery.part_bounds(part)
            self.old_index.add_with_ids(self._prepare(self.gallery.features(self.old_model, part)),
                                        np.arange(start, stop, dtype=np.int64))  # the index's ids: positions
        self.new_dim = self.new_model.dim if self.new_model is not None and self.new_model.dim else self.dim
        self.new_index = faiss.IndexIDMap2(flat(self.new_dim))
        self.on_new = np.zeros(len(self.ids), dtype=bool)
        self.applied: set[int] = set()
        if self.plan is not None:
            self.order = order_of(self.gallery.store, self.plan.id)
            self.refresh()

    def _prepare(self, features: np.ndarray) -> np.ndarray:
        features = np.ascontiguousarray(features, dtype=np.float32)
        if self.distance == "cosine":
            features = features / np.maximum(np.linalg.norm(features, axis=1, keepdims=True), 1e-12)
        return features

    @property
    def mid_upgrade(self) -> bool:
        return self.plan is not None

    @property
    def backfilled(self) -> int:
        return int(self.on_new.sum()) if self.plan is not None else self.gallery.num_items

    def refresh(self) -> int:
        """Move the items of chunks that landed since the last refresh from the old index to the
        new one; returns how many chunks. A gallery whose upgrade started, ended or was undone
        since is reloaded."""
        with self._lock:
            if self.gallery.manifest(refresh=True).get("upgrade") != self.upgrade:
                self._build()
                return 0
            if self.plan is None:
                return 0
            count = 0
            for chunk, positions, features, read in landed_since(self.gallery.store, self.plan, self.order,
                                                                 self.applied):
                moved = np.asarray(positions[read], dtype=np.int64)  # an image that could not be read stays old
                self.old_index.remove_ids(moved)
                self.new_index.add_with_ids(self._prepare(features[read]), moved)
                self.on_new[positions[read]] = True
                self.applied.add(chunk)
                count += 1
            return count

    def _one(self, index, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        k = min(k, index.ntotal)
        if k == 0:
            return np.empty((len(queries), 0), dtype=np.int64), np.empty((len(queries), 0), dtype=np.float32)
        scores, ids = index.search(self._prepare(queries), k)
        return ids, (1.0 - scores if self.distance == "cosine" else scores)

    def search(self, old_queries: np.ndarray, new_queries: np.ndarray | None, k: int = 10
               ) -> tuple[np.ndarray, np.ndarray, list[list[str]]]:
        """(ids, merge scores, sources), each (queries, k'), k' = min(k, items). ``old_queries``:
        the old model's features of the queries; ``new_queries``: the new model's (needed while
        an upgrade is on). Each part gives its k nearest; the merge (``fusion.merge_lists``: rrf's
        fused scores descending, or the normalised distances ascending) keeps the best k'.
        Outside an upgrade the scores are distances of the one index."""

        if k < 1:
            raise GalleryError(f"k must be >= 1, got {k}")
        old_queries = check_features(np.atleast_2d(np.asarray(old_queries)), self.dim,
                                     f"old query features (for {self.old_model.uri})")
        with self._lock:
            old_ids, old_dist = self._one(self.old_index, old_queries, k)
            if self.plan is None:
                return ids_at(self.ids, old_ids), old_dist, [[self.old_model.uri] * old_ids.shape[1] for _ in old_ids]
            if new_queries is None:
                raise GalleryError(f"an upgrade to {self.new_model.uri} is on: the merged search needs each "
                                   "query's features from both models (the new model's too)")
            new_queries = check_features(np.atleast_2d(np.asarray(new_queries)), self.new_dim,
                                         f"new query features (for {self.new_model.uri})")
            if len(new_queries) != len(old_queries):
                raise GalleryError(f"{len(old_queries)} old query features but {len(new_queries)} new ones; "
                                   "give both models' features of the same queries, in the same order")
            new_ids, new_dist = self._one(self.new_index, new_queries, k)
        limit = min(k, self.gallery.num_items)
        names = [self.old_model.uri, self.new_model.uri]
        rows, scores, sources = [], [], []
        for q in range(len(old_queries)):
            ids, score, source = merge_lists(self.merge, [old_ids[q], new_ids[q]], [old_dist[q], new_dist[q]],
                                             rrf_k=self.rrf_k, distance=self.distance, limit=limit)
            rows.append(ids)
            scores.append(score)
            sources.append([names[s] for s in source])
        return ids_at(self.ids, np.stack(rows)), np.stack(scores), sources

    def search_images(self, images: np.ndarray, old_model, new_model, k: int = 10):
        """Embed query images (uint8, (N, C, H, W) or (N, H, W)) with both models, and search."""

        images = query_images(self.gallery, images)
        new = embed(new_model, images) if new_model is not None else None
        return self.search(embed(old_model, images), new, k)
