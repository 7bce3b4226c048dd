"""Search during an upgrade the way a shadow index does: two indexes, two queries, one merged list.

The map's way (``components.gallery.search.index``) asks one index of the new model's features and the
transformed old ones. This is the other way, the common playbook without a map: the old model's
own features of the items not yet re-embedded in one index, the new model's features of those
that are in another; each query is embedded by both models, searched in both, and the two ranked
lists are merged (reciprocal rank fusion by default, or scores normalised per list). As chunks
land, their items leave the old index and join the new one, by id: never a rebuild. Both indexes
are exact (flat); each hit carries its source, the model whose features it was found by.

Online backfilling (``merge="online"``) searches the same two indexes with one model: the new
model's query in the new part, and its twin in the old space, the upgrade's stored reverse
transformation of it (``gallery.upgrade.online``), in the old part; the two lists are merged by
their raw distances, the new list's scaled by the transformation's gain (squared l2; a cosine
distance is scale-free). Only the new model embeds a query.

Candidate reranking (``merge="rerank"``, ``components.evaluation.rerank``: the way EmbedFlow
migrates an index without a map) keeps the old index whole: every item's old features stay in it
while chunks land, and the re-embedded items' new features are kept beside it (the new index,
looked up by id, never searched). The old query finds its ``depth`` (K) nearest items in the old
index, the candidates; those with new features are ranked by their new distance to the new
query (ties: the old order), the candidates without follow in their old order, and the old
index's order continues beyond the K candidates. Both models embed a query, as for rrf; its cost
is two query embeddings, one search of the old index for K candidates, and K lookups of new
features.

Outside an upgrade there is one model and one index: the merge has nothing to merge, and the
search is the gallery's own.
"""

from __future__ import annotations

import threading

import numpy as np

from fastfill.components.evaluation.fusion import distance_merge, merge_lists
from fastfill.components.experiment.inference import embed
from fastfill.components.gallery.layouts.catalog import Gallery, GalleryError, check_features
from fastfill.components.gallery.layouts.item_ids import ids_at
from fastfill.components.gallery.search.index import query_images
from fastfill.components.gallery.upgrade.backfill import landed_since
from fastfill.components.gallery.upgrade.planning import REPLAN_REVERSE, load_plan, load_reverse, order_of, reverse_key
from fastfill.components.platform.registry import ModelRef
from fastfill.components.platform.vocabulary import DISTANCES, RERANK_DEPTH, SEARCH_MERGES


class DualSearch:
    """Top-k item ids of query pairs (old model's, new model's features) over the two parts of a
    gallery mid-upgrade, merged by ``merge`` (one of SEARCH_MERGES; ``online``: see
    ``search_online``; ``rerank``: the old index's top ``depth`` ranked by the new model)."""

    def __init__(self, gallery: Gallery, distance: str = "l2", merge: str = "rrf", rrf_k: int = 60,
                 depth: int = RERANK_DEPTH):
        if distance not in DISTANCES:
            raise GalleryError(f"distance must be one of {', '.join(DISTANCES)}, got {distance!r}")
        if merge not in SEARCH_MERGES:
            raise GalleryError(f"merge must be one of {', '.join(SEARCH_MERGES)}, got {merge!r}")
        if isinstance(depth, bool) or not isinstance(depth, (int, np.integer)) or depth < 1:
            raise GalleryError(f"the candidate depth (rerank's K) must be an integer >= 1, got {depth!r}")
        self.gallery, self.distance, self.merge, self.rrf_k = gallery, distance, merge, rrf_k
        self.depth = int(depth)
        self._lock = threading.RLock()
        self._build()

    def _build(self) -> None:
        import faiss

        manifest = self.gallery.manifest(refresh=True)
        self.upgrade_id = manifest.get("upgrade")
        self.ids = self.gallery.ids()
        self.plan = load_plan(self.gallery.store, self.upgrade_id) if self.upgrade_id else None
        self.old_model = self.plan.old if self.plan else ModelRef.from_dict(manifest["model"])
        self.new_model = self.plan.new if self.plan else None
        self.reverse = None
        if self.merge == "online" and self.plan is not None:
            self.reverse = load_reverse(self.gallery.store, self.plan.upgrade_id, self.plan.online)
            if self.reverse is None and self.plan.online is False:
                raise GalleryError(
                    f"the upgrade {self.plan.upgrade_id} was planned without online backfilling's reverse transformation "
                    "(gallery.upgrade.online was false), so --merge online has no old-space query; search with "
                    "--merge rrf (or no --merge), or set gallery.upgrade.online: true before the next upgrade")
            if self.reverse is None:  # a plan that does not say whether it kept one
                raise GalleryError(
                    f"the upgrade {self.plan.upgrade_id} has no reverse transformation for online backfilling "
                    f"({self.gallery.store.describe(reverse_key(self.plan.upgrade_id))} does not exist: it was planned with "
                    "gallery.upgrade.online false, or the object was deleted), so --merge online has no old-space "
                    f"query; {REPLAN_REVERSE}")
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
            self.order = order_of(self.gallery.store, self.plan.upgrade_id)
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
        new one (``rerank``: add them to the new one, the old index keeping every item); returns
        how many chunks. A gallery whose upgrade started, ended or was undone since is reloaded."""
        with self._lock:
            if self.gallery.manifest(refresh=True).get("upgrade") != self.upgrade_id:
                self._build()
                return 0
            if self.plan is None:
                return 0
            import faiss

            count = 0
            for chunk, positions, features, read in landed_since(self.gallery.store, self.plan, self.order,
                                                                 self.applied):
                moved = np.asarray(positions[read], dtype=np.int64)  # an image that could not be read stays old
                if self.merge != "rerank":  # reranking's candidates come from every item's old features
                    self.old_index.remove_ids(faiss.IDSelectorBatch(moved))  # what an id array becomes
                self.new_index.add_with_ids(self._prepare(features[read]), moved)
                self.on_new[positions[read]] = True
                self.applied.add(chunk)
                count += 1
            return count

    def _upgrade_model(self) -> ModelRef:
        """The new model of the upgrade that is on; asked only mid-upgrade (a plan names it)."""
        if self.new_model is None:
            raise GalleryError("no upgrade is on: the gallery has one model, and no new model's part to search")
        return self.new_model

    def _one(self, index, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        k = min(k, index.ntotal)
        if k == 0:
            return np.empty((len(queries), 0), dtype=np.int64), np.empty((len(queries), 0), dtype=np.float32)
        scores, ids = index.search(self._prepare(queries), k)
        # faiss's squared l2 can round just below 0 for a near-identical pair
        return ids, (1.0 - scores if self.distance == "cosine" else np.maximum(scores, 0.0))

    def search(self, old_queries: np.ndarray, new_queries: np.ndarray | None, k: int = 10
               ) -> tuple[np.ndarray, np.ndarray, list[list[str]]]:
        """(ids, merge scores, sources), each (queries, k'), k' = min(k, items). ``old_queries``:
        the old model's features of the queries; ``new_queries``: the new model's (needed while
        an upgrade is on). Each part gives its k nearest; the merge (``fusion.merge_lists``: rrf's
        fused scores descending, or the normalised distances ascending) keeps the best k'.
        ``rerank``: see ``_reranked``; its scores are distances, each in the space its item was
        ranked in. Outside an upgrade the scores are distances of the one index."""

        if k < 1:
            raise GalleryError(f"k must be >= 1, got {k}")
        if self.merge == "online" and self.plan is not None:
            raise GalleryError("online backfilling searches with the new model's query alone: call search_online")
        old_queries = check_features(np.atleast_2d(np.asarray(old_queries)), self.dim,
                                     f"old query features (for {self.old_model.uri})")
        with self._lock:
            reranking = self.merge == "rerank" and self.plan is not None
            old_ids, old_dist = self._one(self.old_index, old_queries, max(k, self.depth) if reranking else k)
            if self.plan is None:
                return ids_at(self.ids, old_ids), old_dist, [[self.old_model.uri] * old_ids.shape[1] for _ in old_ids]
            if new_queries is None:
                raise GalleryError(f"an upgrade to {self._upgrade_model().uri} is on: the merged search needs each "
                                   "query's features from both models (the new model's too)")
            new_queries = check_features(np.atleast_2d(np.asarray(new_queries)), self.new_dim,
                                         f"new query features (for {self._upgrade_model().uri})")
            if len(new_queries) != len(old_queries):
                raise GalleryError(f"{len(old_queries)} old query features but {len(new_queries)} new ones; "
                                   "give both models' features of the same queries, in the same order")
            if reranking:
                return self._reranked(old_ids, old_dist, new_queries, k)
            new_ids, new_dist = self._one(self.new_index, new_queries, k)
        return self._merged(old_ids, old_dist, new_ids, new_dist, k)

    def _reranked(self, old_ids: np.ndarray, old_dist: np.ndarray, new_queries: np.ndarray, k: int
                  ) -> tuple[np.ndarray, np.ndarray, list[list[str]]]:
        """Candidate reranking of each query: ``old_ids``/``old_dist`` are its old list over every
        item (``max(k, depth)`` long, nearest first), whose first ``depth`` are the candidates.
        The candidates with new features come first, by their new distance to the new query
        (stable: the old order at a tie), then the other candidates in old order, then the old
        list beyond the candidates; the first k' are kept. Scores: each hit's distance in the
        space it was ranked in, the new one (new model's source) for a re-embedded candidate,
        the old one (old model's source) otherwise: the positions ascend, the scores need not.
        Called under the lock."""
        limit = min(k, old_ids.shape[1])
        depth = min(self.depth, old_ids.shape[1])
        queries = self._prepare(new_queries)
        names = [self.old_model.uri, self._upgrade_model().uri]
        rows, scores, sources = [], [], []
        for q in range(len(old_ids)):
            candidates = old_ids[q, :depth]
            scored = self.on_new[candidates]
            new_dist = np.empty(int(scored.sum()), dtype=np.float32)
            if len(new_dist):  # the K lookups of new features
                features = self.new_index.reconstruct_batch(candidates[scored])
                if self.distance == "cosine":
                    new_dist = 1.0 - features @ queries[q]
                else:
                    new_dist = ((features - queries[q]) ** 2).sum(axis=1)
            by_new = np.argsort(new_dist, kind="stable")
            ids = np.concatenate([candidates[scored][by_new], candidates[~scored], old_ids[q, depth:]])
            score = np.concatenate([new_dist[by_new], old_dist[q, :depth][~scored], old_dist[q, depth:]])
            source = np.concatenate([np.ones(len(new_dist), dtype=np.int64), np.zeros(len(ids) - len(new_dist),
                                                                                     dtype=np.int64)])
            rows.append(ids[:limit])
            scores.append(score[:limit].astype(np.float32))
            sources.append([names[s] for s in source[:limit]])
        return ids_at(self.ids, np.stack(rows)), np.stack(scores), sources

    def search_online(self, queries: np.ndarray, k: int = 10) -> tuple[np.ndarray, np.ndarray, list[list[str]]]:
        """Online backfilling's answer (``merge="online"``): ``queries`` are the new model's
        features mid-upgrade (the serving model's outside one). The new part is searched with
        them, the old part with their reverse transformation; (ids, merged distances, sources),
        the distances ascending, the new part's scaled by the transformation's gain."""
        if self.merge != "online":
            raise GalleryError(f"search_online needs a searcher made with merge='online', not {self.merge!r}")
        if k < 1:
            raise GalleryError(f"k must be >= 1, got {k}")
        with self._lock:
            if self.plan is None:
                return self.search(queries, None, k)
            queries = check_features(np.atleast_2d(np.asarray(queries)), self.new_dim,
                                     f"query features (for {self._upgrade_model().uri})")
            if self.reverse is None:  # _build refuses an online search of an upgrade without one
                raise GalleryError(f"the upgrade {self.plan.upgrade_id} has no reverse transformation for online "
                                   f"backfilling; {REPLAN_REVERSE}")
            twins = self.reverse(np.asarray(queries, dtype=np.float32))
            old_ids, old_dist = self._one(self.old_index, twins, k)
            new_ids, new_dist = self._one(self.new_index, queries, k)
        return self._merged(old_ids, old_dist, new_ids, new_dist, k)

    def _merged(self, old_ids, old_dist, new_ids, new_dist, k: int):
        limit = min(k, self.gallery.num_items)
        names = [self.old_model.uri, self._upgrade_model().uri]
        # the reverse transformation's gain multiplies the new features, so squared l2 distances by its square
        gain = float(getattr(self.reverse, "new_scale", 1.0)) ** 2 if self.distance == "l2" else 1.0
        rows, scores, sources = [], [], []
        for q in range(len(old_ids)):
            if self.merge == "online":
                ids, score, source = distance_merge([old_ids[q], new_ids[q]], [old_dist[q], new_dist[q]],
                                                    scales=[1.0, gain], limit=limit)
            else:
                ids, score, source = merge_lists(self.merge, [old_ids[q], new_ids[q]], [old_dist[q], new_dist[q]],
                                                 rrf_k=self.rrf_k, distance=self.distance, limit=limit)
            rows.append(ids)
            scores.append(score)
            sources.append([names[s] for s in source])
        return ids_at(self.ids, np.stack(rows)), np.stack(scores), sources

    def search_images(self, images: np.ndarray, old_model, new_model, k: int = 10):
        """Embed query images (uint8, (N, C, H, W) or (N, H, W)) with both models, and search."""

        images = query_images(self.gallery, images)
        if self.merge == "online":  # one model embeds: the new one mid-upgrade, the gallery's own outside
            return self.search_online(embed(new_model if self.plan is not None else old_model, images), k)
        new = embed(new_model, images) if new_model is not None else None
        return self.search(embed(old_model, images), new, k)
