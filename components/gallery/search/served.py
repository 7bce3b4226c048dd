"""`fastfill search` on a layout whose index serves the team's queries (``serves_queries``: Lance,
pgvector, Milvus, Qdrant): the index itself answers, through the name the team's readers query
(``index.view``: the LanceDB serving table, the pgvector view, the Milvus or Qdrant alias), with
the model the index says it serves; the answer has ``GallerySearch``'s form (ids, distances on
the product's scale, each hit's source), found by the index's own search, not by
``GallerySearch``'s faiss index over the product's objects."""

from __future__ import annotations

import numpy as np

from fastfill.components.experiment.inference import embed
from fastfill.components.gallery.layouts.catalog import EMBEDDED, MAPPED, Gallery, GalleryError
from fastfill.components.gallery.layouts.item_ids import is_text
from fastfill.components.gallery.search.index import GallerySearch, check_queries, query_images
from fastfill.components.gallery.upgrade.planning import load_plan
from fastfill.components.platform.registry import ModelRef


class IndexSearch:
    """Top-k item ids for query features, asked of the gallery's index (its view)."""

    def __init__(self, gallery: Gallery, distance: str | None = None):
        if not gallery.serves_queries:
            raise GalleryError(f"{gallery.store.uri} ({gallery.layout} layout) has no index of the team's to ask")
        self.gallery = gallery
        self.distance = gallery.manifest()["index"].get("distance", "l2")
        if distance is not None and distance != self.distance:
            raise GalleryError(f"gallery.distance is {distance}, but the index at {gallery.index.where} was built for "
                               f"{self.distance}; search it with {self.distance}")
        self.searched_on = f"{gallery.index.where} ({gallery.index.view})"
        self._sources: dict = {}
        self.refresh()

    def refresh(self) -> int:
        """Read again which model the index serves (the switch, a finish, a rollback)."""
        serving = self.gallery.index.serving()
        if serving is None:
            raise GalleryError(f"{self.gallery.index.where} serves no model yet; run `fastfill gallery adopt` (or "
                               "ingest) again")
        self.serving = serving
        if serving.model_name is None or serving.model_version is None:
            raise GalleryError(f"{self.gallery.index.where} serves rows of no model the product knows ({serving.model}); "
                               "restore it, or adopt the gallery again")
        self.query_model = ModelRef(serving.model_name, serving.model_version, serving.dim or None)
        upgrade_id = serving.upgrade or self.gallery.manifest(refresh=True).get("upgrade")
        plan = load_plan(self.gallery.store, upgrade_id) if upgrade_id else self._last_plan()
        self._mapped = f"{plan.old.uri} mapped by {plan.map_uri}" if plan is not None else None
        return 0

    def _last_plan(self):
        history = self.gallery.manifest(refresh=True).get("history") or [{}]
        last = history[-1].get("by")
        return load_plan(self.gallery.store, last) if last and last not in ("ingest", "adopt", "rollback") else None

    @property
    def backfilled(self) -> int:
        """Items whose vector the serving model embedded (the rest: h(old))."""
        return self.gallery.index.embedded_count()

    def search(self, features: np.ndarray, k: int = 10) -> tuple[np.ndarray, np.ndarray]:
        """(ids, distances), each (queries, k); distances are squared L2, or 1 - cosine, as
        ``GallerySearch``'s. The index answers only while it serves the query model: when it moved
        on (a switch between reading the serving row and the search), the search says so."""
        features, k = check_queries(features, self.query_model.dim, self.query_model.uri, k, self.gallery.num_items)
        ids, distances, _, sources = self.gallery.index.search(features, k, self.query_model.uri)
        if any(len(row) < k for row in ids):
            now = self.gallery.index.serving()
            if now is not None and now.model != self.query_model.uri:
                raise GalleryError(f"the index switched from {self.query_model.uri} to {now.model} during this "
                                   "search; search again (with the new model's query features)")
            raise GalleryError(f"the index answered fewer than {k} rows ({min(len(r) for r in ids)}); "
                               f"{self.gallery.index.where} has lost rows: check it with `fastfill doctor`")
        text = is_text(self.gallery.ids())
        array = np.array(ids, dtype=object if text else np.int64)
        self._sources = {item: source for row_ids, row in zip(ids, sources) for item, source in zip(row_ids, row)}
        return array, self.gallery.index.product_distances(distances)

    def sources(self, ids: np.ndarray) -> list:
        """Where each hit's vector comes from: the serving model's URI (it embedded the image) or
        ``<old model> mapped by <map>`` (h(old)), as the index's ``source`` column says."""
        names = {EMBEDDED: self.query_model.uri, MAPPED: self._mapped}
        return [[names.get(self._sources.get(item, "")) for item in row]
                for row in np.asarray(ids, dtype=object).tolist()]

    def search_images(self, images: np.ndarray, model, k: int = 10) -> tuple[np.ndarray, np.ndarray]:
        return self.search(embed(model, query_images(self.gallery, images)), k)


def searcher_for(gallery: Gallery, distance: str, index_config=None):
    """What answers `fastfill search` for ``gallery``: its index where it serves queries
    (``IndexSearch``), else a faiss index over the product's objects (``GallerySearch``)."""
    if gallery.serves_queries:
        return IndexSearch(gallery)
    return GallerySearch(gallery, distance, index_config)
