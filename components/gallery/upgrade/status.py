"""The gallery's state for `fastfill upgrade status`: its model, the lock, the upgrade in progress
with its progress, prediction and failed images, and any step a killed run left to complete."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastfill.components.gallery.advice.advisor import stored_advice
from fastfill.components.gallery.layouts.catalog import Gallery, GalleryError
from fastfill.components.gallery.store import ObjectMissing, StoreError, StoreUnreachable
from fastfill.components.gallery.store.lock import LOCK, lease_expired
from fastfill.components.gallery.upgrade.backfill import done_chunks, failed_images
from fastfill.components.gallery.upgrade.ending import decision, interrupted_decision
from fastfill.components.gallery.upgrade.planning import load_plan
from fastfill.components.gallery.upgrade.reversal import aborted, interrupted_rollback

FAILED_SHOWN = 20  # failed images listed by status (finished.json keeps them all)


@dataclass
class UpgradeInProgress:
    """The upgrade a gallery is in the middle of: how far its backfill is (None where it has no
    plan), the advisor's prediction, the images a backfill could not read, a decision a killed
    run left; ``registry_recorded`` False for an ending whose registry step is missing."""

    id: str
    to: str | None
    source: str | None = None  # the model it upgrades from ("from" in the JSON)
    order: str | None = None
    chunks_done: int | None = None
    chunks: int | None = None
    items_done: int | None = None
    fraction: float | None = None
    mlflow_run_id: str | None = None
    predicted: dict | None = None
    failed_images: dict | None = None
    decision: dict | None = None
    registry_recorded: bool | None = None

    def as_dict(self) -> dict:
        if self.registry_recorded is False:  # an ending: what its record says, nothing of a backfill
            return {"id": self.id, "to": self.to, "decision": self.decision, "registry_recorded": False}
        fields = {"id": self.id, "from": self.source, "to": self.to, "order": self.order,
                  "chunks_done": self.chunks_done, "chunks": self.chunks, "items_done": self.items_done,
                  "fraction": self.fraction, "mlflow_run_id": self.mlflow_run_id}
        for key in ("predicted", "failed_images", "decision"):
            if getattr(self, key) is not None:
                fields[key] = getattr(self, key)
        return fields


@dataclass
class GalleryStatus:
    """The gallery's state (`fastfill upgrade status`, `gallery info`, doctor): its model, the
    lock, the upgrade in progress, what to run next after an interrupted run, and the index it
    serves from (a layout that serves queries)."""

    store: str
    items: int
    model: str
    state: str = "idle"  # idle, running, paused, abort interrupted, ending interrupted, rollback interrupted
    lock: dict | None = None
    upgrade: UpgradeInProgress | None = None
    next: str | None = None
    index: dict | None = None

    @property
    def lock_live(self) -> bool:
        return self.lock is not None and not self.lock.get("expired")

    def as_dict(self) -> dict:
        """The JSON document's fields (docs/json.md, fastfill.upgrade.status/1)."""
        fields = {"store": self.store, "items": self.items, "model": self.model, "state": self.state,
                  "upgrade": self.upgrade.as_dict() if self.upgrade else None, "lock": self.lock}
        if self.next is not None:
            fields["next"] = self.next
        if self.index is not None:
            fields["index"] = self.index
        return fields


def gallery_status(gallery: Gallery, *, failures: bool = True, probe: bool = True) -> GalleryStatus:
    """The gallery's model, lock and upgrade in progress; ``failures``: with the adopted images a
    backfill could not read (one read per done chunk); ``probe``: with one query of a served
    index, as a reader's (``served_index``)."""
    manifest = gallery.manifest(refresh=True)
    status = GalleryStatus(gallery.store.uri, manifest["num_items"], manifest["model"]["uri"], lock=_lock(gallery))
    if status.lock is not None and status.lock.get("expired"):
        # its holder stopped renewing (killed, or cut off from the store): nobody is working
        status.next = "the lock's lease has expired: the next `fastfill upgrade` takes it over and resumes"
    upgrade_id = manifest.get("upgrade")
    if gallery.serves_queries:
        status.index = served_index(gallery, upgrade_id, probe=probe)
    if upgrade_id:
        _in_progress(gallery, status, upgrade_id, manifest["num_items"], failures)
    else:
        _interrupted_ending(gallery, status)
    return status


def _lock(gallery: Gallery) -> dict | None:
    """The lock's holder (without its token), marked ``expired`` when its lease ran out; None unlocked."""
    try:
        lock = gallery.store.get_json(LOCK)
    except ObjectMissing:
        return None
    lock.pop("token", None)
    if lease_expired(lock):
        lock["expired"] = True
    return lock


def _in_progress(gallery: Gallery, status: GalleryStatus, upgrade_id: str, num_items: int, failures: bool) -> None:
    """The upgrade the manifest names: its progress, prediction and failed images, and an abort or a
    decision a killed run left."""
    plan = load_plan(gallery.store, upgrade_id)
    done = done_chunks(gallery.store, upgrade_id)
    items = plan.items_in(done) if plan else 0
    status.state = "running" if status.lock_live else "paused"
    status.upgrade = UpgradeInProgress(
        upgrade_id, plan.new.uri if plan else None, source=plan.old.uri if plan else None,
        order=plan.order_kind if plan else None, chunks_done=len(done), chunks=plan.num_chunks if plan else None,
        items_done=items, fraction=items / num_items, mlflow_run_id=plan.mlflow_run_id if plan else None,
        predicted=_predicted(stored_advice(gallery.store, upgrade_id)))
    if failures and gallery.adopted:
        failed = failed_images(gallery.store, upgrade_id)
        status.upgrade.failed_images = {"count": len(failed), "items": failed[:FAILED_SHOWN]}
    if aborted(gallery.store, upgrade_id) is not None:  # an abort cut short before the gallery went back
        status.state = "abort interrupted"
        status.next = ("run `fastfill upgrade abort` again to complete it, or `fastfill upgrade` to plan this "
                       "upgrade again from scratch")
        return
    decided = decision(gallery.store, upgrade_id)
    if decided is not None:  # killed between the decision and the switch
        status.upgrade.decision = {"passed": decided.passed, "decided": decided.decided}
        if not status.lock_live:
            status.state = "ending interrupted"
            status.next = "run the same `fastfill upgrade` again: it completes the recorded decision"


def _predicted(advice: dict | None) -> dict | None:
    """The budget advisor's prediction every 10%, in points (the label-free one as agreement)."""
    if advice is None:
        return None
    every = range(0, len(advice["fractions"]), 2)

    def points(curve: str) -> dict:
        return {f"{100 * advice['fractions'][i]:.0f}%": round(100 * advice[curve][i], 2) for i in every}

    if advice.get("metric") == "agreement":
        return {"sample": advice["sample"], "metric": f"agreement with the finished upgrade's top-{advice['k']}",
                "agreement": points("agreement"), "recommendation": advice.get("recommendation")}
    return {"sample": advice["sample"], "top1": points("top1"), "map": points("map"),
            "top1_standard_error": round(100 * max(advice["top1_se"]), 2),
            "recommendation": advice.get("recommendation")}


def _interrupted_ending(gallery: Gallery, status: GalleryStatus) -> None:
    """No upgrade in progress: an ending whose registry step is missing, or a rollback's."""
    ending = interrupted_decision(gallery)
    if ending is not None:  # killed after the switch, before the registry followed
        status.state = "running" if status.lock_live else "ending interrupted"
        status.upgrade = UpgradeInProgress(ending.upgrade_id, ending.new.uri if ending.new else None,
                                           decision={"passed": ending.passed, "decided": ending.decided},
                                           registry_recorded=False)
        if not status.lock_live:
            status.next = ("run `fastfill upgrade` again: it records the decision in the registry (tags"
                           + (", champion" if ending.passed else "") + ") and ends")
        return
    if interrupted_rollback(gallery) is not None and not status.lock_live:  # the registry did not follow yet
        status.state = "rollback interrupted"
        status.next = "run `fastfill gallery rollback` again: it moves champion back and tags the version"


def served_index(gallery: Gallery, upgrade_id: str | None, *, probe: bool = True) -> dict:
    """What the team's index serves (a layout that serves queries): where, the view, its model,
    and whether it is what the manifest says (a switch a killed run left is completed by the
    next `fastfill upgrade`); ``problem``, where the index cannot serve: its serving record
    unreadable or gone, or (``probe``) one query of its view, as a reader's, failing (a Lance
    table's damaged files, a dropped view or alias). One line, the layout's own message. A server
    of the index that does not answer raises (StoreUnreachable: the commands exit 5)."""
    index = gallery.index
    serving = None
    problem = None
    try:
        serving = index.serving()
        if serving is None or not serving.model:
            problem = (f"{index.where}: serves no model ({index.view}, or its record of the model it serves, is gone: "
                       "dropped or deleted by another writer); restore it from a copy (docs/serving.md: what each "
                       "layout's index holds)")
        elif probe and serving.dim:
            index.search(np.ones((1, int(serving.dim)), dtype=np.float32), 1, serving.model)
    except StoreUnreachable:  # the index's server does not answer: a service's failure, not the index's
        raise
    except (StoreError, GalleryError) as error:  # a DamagedObject among them: the layout names what is wrong
        problem = " ".join(str(error).split())
    plan = load_plan(gallery.store, upgrade_id) if upgrade_id else None
    expected = plan.new.uri if plan is not None else gallery.model.uri
    model = serving.model if serving is not None else None
    found = {"where": index.where, "view": index.view, "serving": model,
             "vectors": serving.vectors if serving is not None else None,
             "since": serving.since if serving is not None and serving.since else None,
             "as_manifest_says": model == expected}
    if problem is not None:
        found["problem"] = problem
    return found
