"""What the layouts whose index serves the team's queries (pgvector, Milvus) share: the features
of items read by id from the index (``_rows``, each layout's), and the manifest written only after
the index serves what it says (``sync_serving``, each layout's)."""

from __future__ import annotations

from typing import Any

import numpy as np

from fastfill.components.gallery.layouts.catalog import Gallery, StoredItems
from fastfill.components.gallery.layouts.item_ids import id_array
from fastfill.components.gallery.store import Store
from fastfill.components.platform.registry import ModelRef


class ServedGallery(StoredItems, Gallery):
    """A gallery whose vectors live in the index queries are served from; the manifest, items,
    images and upgrade objects are in its store (``StoredItems``)."""

    serves_queries = True

    def __init__(self, store: Store, manifest: dict | None = None):
        super().__init__(store, manifest)
        self._index: Any = None  # the layout's own: pgvector's Index, Milvus's Collections

    def _rows(self, model: ModelRef, ids: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def features(self, model: ModelRef, part: int) -> np.ndarray:
        return self._rows(model, id_array(self.items_part(part).column("id")))

    def all_features(self, model: ModelRef) -> np.ndarray:
        return self._rows(model, self.ids())

    def features_at(self, model: ModelRef, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        return self._rows(model, self.ids()[positions]) if len(positions) else np.zeros((0, model.dim or 0), np.float32)

    def write_manifest(self, manifest: dict) -> None:
        """Readers of the index follow the manifest: what it says serves (the upgrade's mixed
        gallery while one is under way, else its model) is switched to first, then the manifest
        is written; a run killed between them is completed by the next one (the switch is
        idempotent)."""
        self._manifest = manifest
        self.sync_serving(manifest)
        super().write_manifest(manifest)
