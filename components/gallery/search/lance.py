"""`fastfill search` on the Lance table (gallery.layout: lance): the gallery as queries see it,
mid-upgrade too, with each hit's source.

Before and after an upgrade the table's ``features`` column is the whole gallery; during one, the
new model's features where a chunk landed (folded into the table or still in the backfill table)
and h(old) elsewhere (``LanceGallery.mixed``). The vectors are searched exactly with faiss, as
``components.gallery.search.index`` does for the parts layout: at the sizes measured here faiss's flat
index answers faster than a scan through LanceDB (docs/lance.md). A team's own service can query
the same table with LanceDB; docs/lance.md has the lines.
"""

from __future__ import annotations

import numpy as np

from components.gallery.layouts.catalog import GalleryError
from components.gallery.search.index import check_queries
from components.gallery.layouts.lance_table import LanceGallery


class LanceSearch:
    def __init__(self, table: LanceGallery, distance: str = "l2", index=None):
        """``index``: an ``IndexConfig`` (gallery.index; flat, exact, by default): inverted lists
        (ivf, ivfpq) for a large gallery, as the parts layout's search."""
        from components.gallery.search.index import new_index
        from components.platform.config import IndexConfig

        if distance not in ("l2", "cosine"):
            raise GalleryError(f"distance must be l2 or cosine, got {distance!r}")
        self.table, self.distance = table, distance
        dataset = table.dataset()
        self.upgrade = table.upgrade(dataset)
        self.old_model = table.model(dataset)
        vectors, self.fresh, self.query_model = table.mixed()
        self.ids = np.asarray(table.items(["id"]).column("id").to_pylist(), dtype=object)
        self.dim = vectors.shape[1]
        config = index or IndexConfig()
        prepared = self._prepare(vectors)

        def training_sample() -> np.ndarray:
            rng = np.random.default_rng(0)
            return prepared[np.sort(rng.permutation(len(prepared))[:config.train_size])]

        self.index = new_index(config, self.dim, distance, len(prepared), training_sample)
        self.index.add_with_ids(prepared, np.arange(len(prepared), dtype=np.int64))  # ids: positions

    @property
    def num_items(self) -> int:
        return len(self.ids)

    @property
    def backfilled(self) -> int:
        return int(self.fresh.sum())

    def _prepare(self, features: np.ndarray) -> np.ndarray:
        features = np.ascontiguousarray(features, dtype=np.float32)
        if self.distance == "cosine":
            features = features / np.maximum(np.linalg.norm(features, axis=1, keepdims=True), 1e-12)
        return features

    def search(self, features: np.ndarray, k: int = 10) -> tuple[list, np.ndarray, list]:
        """(item ids, distances, sources), each (queries, k). Distances are squared L2 or
        1 - cosine; a source is the model URI that embedded the item, or ``<old model> mapped``."""
        features, k = check_queries(features, self.dim, self.query_model.uri, k, self.num_items)
        scores, rows = self.index.search(self._prepare(features), k)
        mapped = f"{self.old_model.uri} mapped"
        # inverted lists can find fewer than k items (row -1): those places are None, at +inf
        ids = [[self.ids[r] if r >= 0 else None for r in row] for row in rows]
        sources = [[(self.query_model.uri if self.fresh[r] else mapped) if r >= 0 else None for r in row]
                   for row in rows]
        distances = 1.0 - scores if self.distance == "cosine" else scores
        return ids, np.where(rows >= 0, distances, np.inf), sources


class LanceDualSearch:
    """`search --merge` on the Lance table: the shadow index's answer (components.gallery.search.dual
    on the parts layout). The table keeps the serving model's own features in ``features`` until
    the finish, so the old part is those of the items not yet re-embedded, the new part the new
    features of those that are; each query's two lists are merged (one of MERGES)."""

    def __init__(self, table: LanceGallery, distance: str = "l2", merge: str = "rrf", rrf_k: int = 60):
        import faiss

        from components.platform.vocabulary import MERGES

        if distance not in ("l2", "cosine"):
            raise GalleryError(f"distance must be l2 or cosine, got {distance!r}")
        if merge not in MERGES:
            raise GalleryError(f"merge must be one of {', '.join(MERGES)}, got {merge!r}")
        self.distance, self.merge, self.rrf_k = distance, merge, rrf_k
        dataset = table.dataset()
        upgrade = table.upgrade(dataset)
        self.old_model = table.model(dataset)
        self.ids = np.asarray(table.items(["id"]).column("id").to_pylist(), dtype=object)
        old = table.features("features", dataset)
        self.new_model = None
        on_new = np.zeros(len(old), dtype=bool)
        if upgrade is not None and not self.old_model.same_version(upgrade.new):
            vectors, on_new, self.new_model = table.mixed()
        self.on_new = on_new
        flat = faiss.IndexFlatIP if distance == "cosine" else faiss.IndexFlatL2
        self.dim = old.shape[1]
        self.old_index = faiss.IndexIDMap2(flat(self.dim))
        self.old_index.add_with_ids(self._prepare(old[~on_new]), np.flatnonzero(~on_new).astype(np.int64))
        self.new_dim = self.new_model.dim if self.new_model is not None else self.dim
        self.new_index = faiss.IndexIDMap2(flat(self.new_dim))
        if self.new_model is not None:
            self.new_index.add_with_ids(self._prepare(vectors[on_new]), np.flatnonzero(on_new).astype(np.int64))

    _prepare = LanceSearch._prepare

    @property
    def mid_upgrade(self) -> bool:
        return self.new_model is not None

    @property
    def backfilled(self) -> int:
        return int(self.on_new.sum()) if self.mid_upgrade else len(self.ids)

    def _one(self, index, queries: np.ndarray, k: int):
        k = min(k, index.ntotal)
        if k == 0:
            return np.empty((len(queries), 0), dtype=np.int64), np.empty((len(queries), 0), dtype=np.float32)
        scores, rows = index.search(self._prepare(queries), k)
        return rows, (1.0 - scores if self.distance == "cosine" else scores)

    def search(self, old_queries: np.ndarray, new_queries: np.ndarray | None, k: int = 10) -> tuple[list, np.ndarray, list]:
        """(item ids, merge scores, sources), each (queries, k'): as ``DualSearch.search``."""
        from components.evaluation.fusion import merge_lists

        old_queries, k = check_queries(old_queries, self.dim, self.old_model.uri, k, len(self.ids))
        old_rows, old_dist = self._one(self.old_index, old_queries, k)
        if not self.mid_upgrade:
            return ([[self.ids[r] for r in row] for row in old_rows], old_dist,
                    [[self.old_model.uri] * old_rows.shape[1] for _ in old_rows])
        if new_queries is None:
            raise GalleryError(f"an upgrade to {self.new_model.uri} is on: the merged search needs each query's "
                               "features from both models (the new model's too)")
        new_queries, _ = check_queries(new_queries, self.new_dim, self.new_model.uri, k, len(self.ids))
        if len(new_queries) != len(old_queries):
            raise GalleryError(f"{len(old_queries)} old query features but {len(new_queries)} new ones; give both "
                               "models' features of the same queries, in the same order")
        new_rows, new_dist = self._one(self.new_index, new_queries, k)
        names = [self.old_model.uri, self.new_model.uri]
        ids, scores, sources = [], [], []
        for q in range(len(old_queries)):
            rows, score, source = merge_lists(self.merge, [old_rows[q], new_rows[q]], [old_dist[q], new_dist[q]],
                                              rrf_k=self.rrf_k, distance=self.distance, limit=k)
            ids.append([self.ids[r] for r in rows])
            scores.append(score)
            sources.append([names[s] for s in source])
        return ids, np.stack(scores), sources
