"""What the layouts whose index serves the team's queries (Lance, pgvector, Milvus) share: their
index (a ``ServingIndex``, opened from the manifest's ``index`` settings), the manifest written
only after the index serves what it says (``write_manifest``), and making it serve that
(``sync_serving``, written once here). A layout keeps only what is its own:

- ``_open_index(settings)``: its index;
- ``_target(model)``: where ``model``'s vectors serve from (a table, a collection, a space);
- ``_prepare_switch(plan, target)``: the upgrade's mixed gallery written there, before any reader
  moves to it;
- ``_point(target, model, upgrade)``: readers moved to it, in one step;
- ``_holds(serving, target, upgrade)``, where ``Serving.vectors`` does not name the target alone.

``FeaturesById``: the features of items read by id from the index (pgvector, Milvus: ``_rows``)."""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Generic, TypeVar

import numpy as np

from fastfill.components.gallery.layouts.catalog import Gallery, Serving, ServingIndex
from fastfill.components.gallery.layouts.item_ids import id_array
from fastfill.components.gallery.store import Store
from fastfill.components.gallery.upgrade.stored import Plan, load_plan
from fastfill.components.platform.registry import ModelRef

IndexT = TypeVar("IndexT", bound=ServingIndex)
TargetT = TypeVar("TargetT")


class ServedGallery(Gallery, Generic[IndexT, TargetT]):
    """A gallery whose vectors live in the index queries are served from (see the module's
    docstring); the manifest and the upgrade objects are in its store."""

    serves_queries = True
    records_upgrade = True  # the index's Serving names the upgrade it serves (Milvus's does not: the manifest does)

    def __init__(self, store: Store, manifest: dict | None = None):
        super().__init__(store, manifest)
        self._index: IndexT | None = None
        self._index_settings: dict | None = None  # the manifest's, that self._index was opened with

    @property
    def index(self) -> IndexT:
        """The index, opened with the manifest's ``index`` settings (reopened when they change)."""
        settings = self.manifest().get("index") or {}
        if self._index is None or self._index_settings != settings:
            if self._index is not None:
                self._index.close()
            self._index, self._index_settings = self._open_index(settings), settings
        return self._index

    @abstractmethod
    def _open_index(self, settings: dict) -> IndexT:
        """The layout's index with the manifest's ``settings``."""

    def write_manifest(self, manifest: dict) -> None:
        """Readers of the index follow the manifest: what it says serves (the upgrade's mixed
        gallery while one is under way, else its model) is switched to first, then the manifest
        is written; a run killed between them is completed by the next one (the switch is
        idempotent)."""
        self._manifest = manifest
        self.sync_serving(manifest)
        super().write_manifest(manifest)

    # ---- serving what the manifest says

    def sync_serving(self, manifest: dict | None = None) -> Serving | None:
        """Make the index serve what ``manifest`` (default: the stored one) says: an upgrade's
        mixed gallery from its switch on, else the gallery's model's features; returns what it
        serves. Nothing is written when it already does."""
        manifest = manifest or self.manifest(refresh=True)
        upgrade_id = manifest.get("upgrade")
        plan = load_plan(self.store, upgrade_id) if upgrade_id else None
        model = plan.new if plan is not None else ModelRef.from_dict(manifest["model"])
        wanted = plan.upgrade_id if plan is not None else None
        target = self._target(model)
        serving = self.index.serving()
        held = serving is not None and self._holds(serving, target, wanted)
        if held and serving is not None and serving.model == model.uri \
                and (serving.upgrade == wanted or not self.records_upgrade):
            return serving
        if plan is not None and not held:
            self._prepare_switch(plan, target)
        self._point(target, model, wanted)
        return self.index.serving()

    @abstractmethod
    def _target(self, model: ModelRef) -> TargetT:
        """Where ``model``'s vectors serve from."""

    def _vectors_name(self, target: TargetT) -> str:
        """``target`` as the index's ``Serving.vectors`` names it."""
        return str(target)

    def _holds(self, serving: Serving, target: TargetT, upgrade_id: str | None) -> bool:
        """The index serves from ``target`` already (a switch's rows are there: by default where
        ``Serving.vectors`` names it; a layout whose every space has the one place says more)."""
        return serving.vectors == self._vectors_name(target)

    @abstractmethod
    def _prepare_switch(self, plan: Plan, target: TargetT) -> None:
        """The mixed gallery of ``plan`` as it is now (h(old); the new features of the chunks
        done) written at ``target``, before any reader moves to it."""

    @abstractmethod
    def _point(self, target: TargetT, model: ModelRef, upgrade_id: str | None) -> None:
        """Readers moved to ``model``'s vectors at ``target`` (serving ``upgrade_id``), in one step."""


class FeaturesById:
    """The features of items read by id from the index (``_rows``, each layout's)."""

    if TYPE_CHECKING:  # what the gallery it is mixed into gives (``Gallery``'s)
        def items_part(self, part: int): ...

        def ids(self) -> np.ndarray: ...

    def _rows(self, model: ModelRef, ids: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def features(self, model: ModelRef, part: int) -> np.ndarray:
        return self._rows(model, id_array(self.items_part(part).column("id")))

    def all_features(self, model: ModelRef) -> np.ndarray:
        return self._rows(model, self.ids())

    def features_at(self, model: ModelRef, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        return self._rows(model, self.ids()[positions]) if len(positions) else np.zeros((0, model.dim or 0), np.float32)
