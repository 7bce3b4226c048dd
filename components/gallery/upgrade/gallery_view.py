"""The store's side of an upgrade's reads: ``GalleryView`` reads a real gallery for the
decider (its ``decider.StoreView``) and for the executor (``run.RunView``): the manifest read
once (``refresh`` reads it again, under the lock), the plans, chunks, decisions and advice from
the store when asked. The decider and the executor see only those protocols; the flows build
this view."""

from __future__ import annotations

from fastfill.components.gallery.advice.advisor import stored_advice
from fastfill.components.gallery.layouts.catalog import GalleryError
from fastfill.components.gallery.upgrade import backfill
from fastfill.components.gallery.upgrade.decider import UpgradeDecider
from fastfill.components.gallery.upgrade.ending import decision, interrupted_decision, rejection
from fastfill.components.gallery.upgrade.outcome import Decision
from fastfill.components.gallery.upgrade.planning import Plan, load_plan
from fastfill.components.gallery.upgrade.reversal import aborted, undone
from fastfill.components.platform.registry import ModelRef


class GalleryView:
    """The ``StoreView`` of a real gallery, and the ``RunView`` an ``UpgradeRun`` reads it
    through: its manifest read once (``refresh`` reads it again, under the lock), the upgrades'
    records read from the store when asked."""

    def __init__(self, gallery):
        self.gallery = gallery
        self.num_items = gallery.num_items
        self.serves_queries = gallery.serves_queries
        self.refresh()

    def refresh(self) -> None:
        manifest = self.gallery.manifest(refresh=True)
        self.model = ModelRef.from_dict(manifest["model"])
        self.current = manifest.get("upgrade")
        self.has_labels = bool(manifest.get("has_labels"))  # the manifest says; no label is read

    def planned_new(self, upgrade_id: str) -> ModelRef | None:
        plan = load_plan(self.gallery.store, upgrade_id)
        return plan.new if plan is not None else None

    def aborted(self, upgrade_id: str) -> bool:
        return aborted(self.gallery.store, upgrade_id) is not None

    def undone(self, upgrade_id: str) -> dict | None:
        return undone(self.gallery.store, upgrade_id)

    def rejected(self, upgrade_id: str) -> dict | None:
        return rejection(self.gallery.store, upgrade_id)

    def interrupted_decision(self) -> Decision | None:
        return interrupted_decision(self.gallery)

    # ---- what a run reads besides

    def plan(self, upgrade_id: str) -> Plan:
        plan = load_plan(self.gallery.store, upgrade_id)
        if plan is None:
            raise GalleryError(f"upgrade {upgrade_id} has no plan.json in {self.gallery.store.uri}")
        return plan

    def done_chunks(self, upgrade_id: str) -> set[int]:
        return set(backfill.done_chunks(self.gallery.store, upgrade_id))

    def failed_images(self, upgrade_id: str) -> list[dict]:
        """Items whose image could not be read, recorded by earlier runs (adopted galleries' images)."""
        return backfill.failed_images(self.gallery.store, upgrade_id) if self.gallery.adopted else []

    def decision(self, upgrade_id: str) -> Decision | None:
        return decision(self.gallery.store, upgrade_id)

    def stored_advice(self, upgrade_id: str) -> dict | None:
        return stored_advice(self.gallery.store, upgrade_id)

    def layout_refusal(self, new: ModelRef, task_runner: str) -> str | None:
        return UpgradeDecider.layout_refusal(self.gallery, new, task_runner)
