"""The gallery's state for `fastfill upgrade status`: its model, the lock, the upgrade in progress
with its progress, prediction and failed images, and any step a killed run left to complete. Each
is a typed record whose ``to_dict`` is its part of the JSON (docs/json.md) and ``from_dict`` reads
it back."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from fastfill.components.gallery.advice.advisor import stored_advice
from fastfill.components.gallery.layouts.catalog import Gallery, GalleryError
from fastfill.components.gallery.store import StoreError, StoreUnreachable
from fastfill.components.gallery.store.lock import LockRecord, read_lock
from fastfill.components.gallery.upgrade.backfill import FailedImages, done_chunks, failed_images
from fastfill.components.gallery.upgrade.ending import decision, interrupted_decision
from fastfill.components.gallery.upgrade.outcome import Decision, Recommendation
from fastfill.components.gallery.upgrade.planning import load_plan
from fastfill.components.gallery.upgrade.reversal import aborted, interrupted_rollback

FAILED_SHOWN = 20  # failed images listed by status (finished.json keeps them all)


@dataclass(frozen=True)
class PredictedCurve:
    """The budget advisor's prediction as status shows it, every 10% of the gallery in points
    (``{"0%": 41.2, "10%": ...}``), from its ``sample`` of items: top-1 and mAP, with top-1's
    largest standard error (labels or judged queries), or, label-free, the ``agreement`` with the
    finished upgrade's top-k (``metric`` names it); and the stop it recommends (None: none)."""

    sample: int
    recommendation: Recommendation | None
    top1: dict[str, float] | None = None
    map: dict[str, float] | None = None
    top1_standard_error: float | None = None
    metric: str | None = None  # the label-free prediction's: "agreement with the finished upgrade's top-k"
    agreement: dict[str, float] | None = None

    @property
    def label_free(self) -> bool:
        return self.agreement is not None

    def to_dict(self) -> dict:
        recommendation = self.recommendation.to_dict() if self.recommendation is not None else None
        if self.label_free:
            return {"sample": self.sample, "metric": self.metric, "agreement": self.agreement,
                    "recommendation": recommendation}
        return {"sample": self.sample, "top1": self.top1, "map": self.map,
                "top1_standard_error": self.top1_standard_error, "recommendation": recommendation}

    @classmethod
    def from_dict(cls, record: dict) -> PredictedCurve:
        stop = record.get("recommendation")
        return cls(sample=record["sample"], recommendation=Recommendation.from_dict(stop) if stop else None,
                   top1=record.get("top1"), map=record.get("map"),
                   top1_standard_error=record.get("top1_standard_error"), metric=record.get("metric"),
                   agreement=record.get("agreement"))


@dataclass(frozen=True)
class ServedIndex:
    """What the team's index serves (a layout that serves queries): ``where`` it is, the ``view``
    readers query, the model it serves (``serving``) and where its ``vectors`` are, ``since``
    when, whether that is the model the manifest says, and ``problem``, why it cannot serve (None:
    it can)."""

    where: str
    view: str
    serving: str | None
    vectors: str | None
    since: str | None
    as_manifest_says: bool
    problem: str | None = None

    def to_dict(self) -> dict:
        fields = {"where": self.where, "view": self.view, "serving": self.serving, "vectors": self.vectors,
                  "since": self.since, "as_manifest_says": self.as_manifest_says}
        if self.problem is not None:
            fields["problem"] = self.problem
        return fields

    @classmethod
    def from_dict(cls, record: dict) -> ServedIndex:
        return cls(where=record["where"], view=record["view"], serving=record.get("serving"),
                   vectors=record.get("vectors"), since=record.get("since"),
                   as_manifest_says=bool(record["as_manifest_says"]), problem=record.get("problem"))


def _decision_fields(decided: Decision) -> dict:
    """What status shows of a recorded decision (decision.json has the rest)."""
    return {"passed": decided.passed, "decided": decided.decided}


@dataclass(frozen=True)
class UpgradeInProgress:
    """The upgrade a gallery is in the middle of: how far its backfill is (None where it has no
    plan), the advisor's prediction, the images a backfill could not read, a decision a killed
    run left; ``registry_recorded`` False for an ending whose registry step is missing. The JSON
    shows of the decision whether it passed and when it was decided: one read back
    (``from_dict``) has no reasons or numbers (decision.json keeps them)."""

    upgrade_id: str
    to: str | None
    source: str | None = None  # the model it upgrades from ("from" in the JSON)
    order: str | None = None
    chunks_done: int | None = None
    chunks: int | None = None
    items_done: int | None = None
    fraction: float | None = None
    mlflow_run_id: str | None = None
    predicted: PredictedCurve | None = None
    failed_images: FailedImages | None = None
    decision: Decision | None = None
    registry_recorded: bool | None = None

    def to_dict(self) -> dict:
        decided = _decision_fields(self.decision) if self.decision is not None else None
        if self.registry_recorded is False:  # an ending: what its record says, nothing of a backfill
            return {"id": self.upgrade_id, "to": self.to, "decision": decided, "registry_recorded": False}
        fields: dict = {"id": self.upgrade_id, "from": self.source, "to": self.to, "order": self.order,
                  "chunks_done": self.chunks_done, "chunks": self.chunks, "items_done": self.items_done,
                  "fraction": self.fraction, "mlflow_run_id": self.mlflow_run_id}
        if self.predicted is not None:
            fields["predicted"] = self.predicted.to_dict()
        if self.failed_images is not None:
            fields["failed_images"] = self.failed_images.to_dict()
        if decided is not None:
            fields["decision"] = decided
        return fields

    @classmethod
    def from_dict(cls, record: dict) -> UpgradeInProgress:
        shown = record.get("decision")
        decided = (Decision(upgrade_id=record["id"], passed=bool(shown["passed"]), reasons=[], numbers=None,
                            decided=shown.get("decided")) if shown is not None else None)
        if record.get("registry_recorded") is False:
            return cls(record["id"], record.get("to"), decision=decided, registry_recorded=False)
        predicted, failed = record.get("predicted"), record.get("failed_images")
        return cls(record["id"], record.get("to"), source=record.get("from"), order=record.get("order"),
                   chunks_done=record.get("chunks_done"), chunks=record.get("chunks"),
                   items_done=record.get("items_done"), fraction=record.get("fraction"),
                   mlflow_run_id=record.get("mlflow_run_id"),
                   predicted=PredictedCurve.from_dict(predicted) if predicted is not None else None,
                   failed_images=FailedImages.from_dict(failed) if failed is not None else None, decision=decided)


@dataclass(frozen=True)
class GalleryStatus:
    """The gallery's state (`fastfill upgrade status`, `gallery info`, doctor): its model, the
    lock, the upgrade in progress, what to run next after an interrupted run, and the index it
    serves from (a layout that serves queries)."""

    store: str
    items: int
    model: str
    state: str = "idle"  # idle, running, paused, abort interrupted, ending interrupted, rollback interrupted
    lock: LockRecord | None = None
    upgrade: UpgradeInProgress | None = None
    next: str | None = None
    index: ServedIndex | None = None

    @property
    def lock_live(self) -> bool:
        return self.lock is not None and not self.lock.expired

    def to_dict(self) -> dict:
        """The JSON document's fields (docs/json.md, fastfill.upgrade.status/1)."""
        fields = {"store": self.store, "items": self.items, "model": self.model, "state": self.state,
                  "upgrade": self.upgrade.to_dict() if self.upgrade else None,
                  "lock": self.lock.to_dict() if self.lock else None}
        if self.next is not None:
            fields["next"] = self.next
        if self.index is not None:
            fields["index"] = self.index.to_dict()
        return fields

    @classmethod
    def from_dict(cls, record: dict) -> GalleryStatus:
        """A status document's fields (its ``schema`` key, if any, left out)."""
        upgrade, lock, index = record.get("upgrade"), record.get("lock"), record.get("index")
        return cls(record["store"], record["items"], record["model"], record["state"],
                   lock=LockRecord.from_dict(lock) if lock is not None else None,
                   upgrade=UpgradeInProgress.from_dict(upgrade) if upgrade is not None else None,
                   next=record.get("next"), index=ServedIndex.from_dict(index) if index is not None else None)


def gallery_status(gallery: Gallery, *, failures: bool = True, probe: bool = True) -> GalleryStatus:
    """The gallery's model, lock and upgrade in progress; ``failures``: with the adopted images a
    backfill could not read (one read per done chunk); ``probe``: with one query of a served
    index, as a reader's (``served_index``)."""
    manifest = gallery.manifest(refresh=True)
    status = GalleryStatus(gallery.store.uri, manifest["num_items"], manifest["model"]["uri"],
                           lock=read_lock(gallery.store))
    if status.lock is not None and status.lock.expired:
        # its holder stopped renewing (killed, or cut off from the store): nobody is working
        status = replace(status, next="the lock's lease has expired: the next `fastfill upgrade` takes it over and "
                                      "resumes")
    upgrade_id = manifest.get("upgrade")
    if gallery.serves_queries:
        status = replace(status, index=served_index(gallery, upgrade_id, probe=probe))
    if upgrade_id:
        return _in_progress(gallery, status, upgrade_id, manifest["num_items"], failures)
    return _interrupted_ending(gallery, status)


def _in_progress(gallery: Gallery, status: GalleryStatus, upgrade_id: str, num_items: int,
                 failures: bool) -> GalleryStatus:
    """The upgrade the manifest names: its progress, prediction and failed images, and an abort or a
    decision a killed run left."""
    plan = load_plan(gallery.store, upgrade_id)
    done = done_chunks(gallery.store, upgrade_id)
    items = plan.items_in(done) if plan else 0
    predicted = _predicted(stored_advice(gallery.store, upgrade_id))
    failed = (FailedImages.of(failed_images(gallery.store, upgrade_id), FAILED_SHOWN)
              if failures and gallery.adopted else None)
    upgrade = UpgradeInProgress(
        upgrade_id, plan.new.uri if plan else None, source=plan.old.uri if plan else None,
        order=plan.order_kind if plan else None, chunks_done=len(done), chunks=plan.num_chunks if plan else None,
        items_done=items, fraction=items / num_items, mlflow_run_id=plan.mlflow_run_id if plan else None,
        predicted=predicted, failed_images=failed)
    if aborted(gallery.store, upgrade_id) is not None:  # an abort cut short before the gallery went back
        return replace(status, state="abort interrupted", upgrade=upgrade,
                       next=("run `fastfill upgrade abort` again to complete it, or `fastfill upgrade` to plan this "
                             "upgrade again from scratch"))
    state = "running" if status.lock_live else "paused"
    decided = decision(gallery.store, upgrade_id)
    if decided is None:
        return replace(status, state=state, upgrade=upgrade)
    upgrade = replace(upgrade, decision=decided)  # killed between the decision and the switch
    if status.lock_live:
        return replace(status, state=state, upgrade=upgrade)
    return replace(status, state="ending interrupted", upgrade=upgrade,
                   next="run the same `fastfill upgrade` again: it completes the recorded decision")


def _predicted(advice: dict | None) -> PredictedCurve | None:
    """The budget advisor's prediction every 10%, in points (the label-free one as agreement)."""
    if advice is None:
        return None
    every = range(0, len(advice["fractions"]), 2)

    def points(curve: str) -> dict[str, float]:
        return {f"{100 * advice['fractions'][i]:.0f}%": round(100 * advice[curve][i], 2) for i in every}

    stop = advice.get("recommendation")
    recommendation = Recommendation.from_dict(stop) if stop else None
    if advice.get("metric") == "agreement":
        return PredictedCurve(sample=advice["sample"], recommendation=recommendation,
                              metric=f"agreement with the finished upgrade's top-{advice['k']}",
                              agreement=points("agreement"))
    return PredictedCurve(sample=advice["sample"], recommendation=recommendation, top1=points("top1"),
                          map=points("map"), top1_standard_error=round(100 * max(advice["top1_se"]), 2))


def _interrupted_ending(gallery: Gallery, status: GalleryStatus) -> GalleryStatus:
    """No upgrade in progress: an ending whose registry step is missing, or a rollback's."""
    ending = interrupted_decision(gallery)
    if ending is not None:  # killed after the switch, before the registry followed
        upgrade = UpgradeInProgress(ending.upgrade_id, ending.new.uri if ending.new else None, decision=ending,
                                    registry_recorded=False)
        if status.lock_live:
            return replace(status, state="running", upgrade=upgrade)
        return replace(status, state="ending interrupted", upgrade=upgrade,
                       next=("run `fastfill upgrade` again: it records the decision in the registry (tags"
                             + (", champion" if ending.passed else "") + ") and ends"))
    if interrupted_rollback(gallery) is not None and not status.lock_live:  # the registry did not follow yet
        return replace(status, state="rollback interrupted",
                       next="run `fastfill gallery rollback` again: it moves champion back and tags the version")
    return status


def served_index(gallery: Gallery, upgrade_id: str | None, *, probe: bool = True) -> ServedIndex:
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
    return ServedIndex(where=index.where, view=index.view, serving=model,
                       vectors=serving.vectors if serving is not None else None,
                       since=serving.since if serving is not None and serving.since else None,
                       as_manifest_says=model == expected, problem=problem)
