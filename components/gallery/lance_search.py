"""`fastfill search` on the Lance table (gallery.layout: lance): the gallery as queries see it,
mid-upgrade too, with each hit's source.

Before and after an upgrade the table's ``features`` column is the whole gallery; during one, the
new model's features where a chunk landed (folded into the table or still in the backfill table)
and h(old) elsewhere (``LanceGallery.mixed``). The vectors are searched exactly with faiss, as
``components.gallery.search`` does for the parts layout: at the sizes measured here faiss's flat
index answers faster than a scan through LanceDB (docs/lance.md). A team's own service can query
the same table with LanceDB; docs/lance.md has the lines.
"""

from __future__ import annotations

import numpy as np

from components.gallery.catalog import GalleryError, check_queries
from components.gallery.lance_table import LanceGallery


class LanceSearch:
    def __init__(self, table: LanceGallery, distance: str = "l2"):
        import faiss

        if distance not in ("l2", "cosine"):
            raise GalleryError(f"distance must be l2 or cosine, got {distance!r}")
        self.table, self.distance = table, distance
        dataset = table.dataset()
        self.upgrade = table.upgrade(dataset)
        self.old_model = table.model(dataset)
        vectors, self.fresh, self.query_model = table.mixed()
        self.ids = np.asarray(table.items(["id"]).column("id").to_pylist(), dtype=object)
        self.dim = vectors.shape[1]
        self.index = faiss.IndexFlatIP(self.dim) if distance == "cosine" else faiss.IndexFlatL2(self.dim)
        self.index.add(self._prepare(vectors))

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
        ids = [[self.ids[r] for r in row] for row in rows]
        sources = [[self.query_model.uri if self.fresh[r] else mapped for r in row] for row in rows]
        return ids, (1.0 - scores if self.distance == "cosine" else scores), sources
