"""Undoing an upgrade: abort an unfinished one, roll back a finished one, and start over an
upgrade that was undone and is asked for again.

Besides ``plan``'s layout, an upgrade's folder may hold::

    aborted.json      the upgrade was aborted before its end: who, when, how far it had got
    rolled-back.json  the finished upgrade was rolled back: who, when, from which model to which

Either makes the upgrade's working data garbage, and an upgrade to the same version asked for
later is planned again from scratch (``start_over``), never resumed.

Both run under the gallery's lock (taken by the caller), write the record of what they did
first, then change the manifest. An abort recorded but cut short before the manifest changed
is completed by the next abort (or by the next upgrade of the same version, which plans it
again); a rollback whose registry step did not happen is completed by the next rollback.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastfill.components.gallery.layouts.catalog import Gallery, GalleryError, ModelRef, now
from fastfill.components.gallery.store import Store
from fastfill.components.gallery.upgrade.backfill import done_chunks
from fastfill.components.gallery.upgrade.ending import decision, interrupted_decision, rejection
from fastfill.components.gallery.upgrade.planning import (
    FINISHED,
    REJECTED,
    Plan,
    load_plan,
    plan_key,
    upgrade_key,
    upgrade_record,
)

ABORTED, ROLLED_BACK = "aborted.json", "rolled-back.json"
ROLLBACK = "rollback"  # the ``by`` of a manifest history entry written by a rollback


def who() -> dict:
    """Who is doing something to the gallery: user, host and process."""
    import getpass
    import os
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container)
        user = str(os.getuid())
    return {"user": user, "host": socket.gethostname(), "pid": os.getpid()}


@dataclass(frozen=True)
class Aborted:
    """An upgrade's abort as ``aborted.json`` keeps it (``to_dict``/``from_dict``, whose keys are
    that file's: ``upgrade`` is ``upgrade_id``, ``from`` is ``source``): who aborted it and when,
    the versions, the upgrade it started from (a sequential one), how far it had got
    (``how_far``), its MLflow run and when its plan was made."""

    upgrade_id: str  # ``upgrade`` in the record
    aborted: str
    by: dict  # user, host, pid (``who``)
    source: str  # the gallery's model, whose features it serves again
    to: str  # the version the upgrade went to
    base: str | None
    stage: str  # planned, backfilling or backfill complete
    chunks_done: int
    chunks: int
    items_done: int
    items: int
    fraction: float
    mlflow_run_id: str | None
    plan_created: str | None

    def to_dict(self) -> dict:
        """aborted.json's record, its keys in their stored order."""
        return {"upgrade": self.upgrade_id, "aborted": self.aborted, "by": dict(self.by), "from": self.source,
                "to": self.to, "base": self.base, "stage": self.stage, "chunks_done": self.chunks_done,
                "chunks": self.chunks, "items_done": self.items_done, "items": self.items,
                "fraction": self.fraction, "mlflow_run_id": self.mlflow_run_id, "plan_created": self.plan_created}

    @classmethod
    def from_dict(cls, record: dict) -> Aborted:
        """A stored aborted.json."""
        return cls(upgrade_id=record["upgrade"], aborted=record["aborted"], by=dict(record.get("by") or {}),
                   source=record["from"], to=record["to"], base=record.get("base"), stage=record["stage"],
                   chunks_done=record["chunks_done"], chunks=record["chunks"], items_done=record["items_done"],
                   items=record["items"], fraction=record["fraction"], mlflow_run_id=record.get("mlflow_run_id"),
                   plan_created=record.get("plan_created"))


@dataclass(frozen=True)
class AbortAnswer:
    """What ``abort_flow`` answers: the abort's record and the model whose features the gallery
    serves again (``to_dict``: the record's fields, ``state`` "aborted" and ``model``)."""

    record: Aborted
    model: str

    def to_dict(self) -> dict:
        return {**self.record.to_dict(), "state": "aborted", "model": self.model}


def aborted(store: Store, upgrade_id: str) -> dict | None:
    """The record of ``upgrade_id``'s abort, or None."""
    return upgrade_record(store, upgrade_id, ABORTED)


def rolled_back(store: Store, upgrade_id: str) -> dict | None:
    """The record of ``upgrade_id``'s rollback, or None."""
    return upgrade_record(store, upgrade_id, ROLLED_BACK)


def _finished(store: Store, upgrade_id: str) -> dict | None:
    return upgrade_record(store, upgrade_id, FINISHED)


def _last_ended(gallery: Gallery, manifest: dict) -> tuple[str, str, dict] | None:
    """The newest upgrade that ended by finishing or by the gate's rejection: (id, "finished" or
    "rejected", its record), or None."""
    found = []
    history = manifest.get("history") or []
    if history and history[-1].get("by") not in (None, "ingest", "adopt", ROLLBACK):
        record = _finished(gallery.store, history[-1]["by"])
        if record is not None:
            found.append((record["finished"], history[-1]["by"], "finished", record))
    for key in gallery.store.list("upgrades/"):
        if key.endswith("/" + REJECTED):
            upgrade_id = key.split("/")[1]
            rejected = rejection(gallery.store, upgrade_id)
            if rejected is not None:
                found.append((rejected.get("rejected", ""), upgrade_id, "rejected", rejected))
    if not found:
        return None
    _, upgrade_id, how, record = max(found, key=lambda entry: entry[0])
    return upgrade_id, how, record


def _rollback_hint(manifest: dict) -> str:
    history = manifest.get("history") or []
    if len(history) < 2:
        return ""
    return (f"; `fastfill gallery rollback` returns the gallery to {ModelRef.from_dict(history[-2]['model']).uri} "
            "while that model's features are still stored")


def abortable(gallery: Gallery) -> str:
    """The id of the gallery's unfinished upgrade (planned, or part of the way through its
    backfill, its end not begun), or a GalleryError that says why there is none to abort."""
    store = gallery.store
    manifest = gallery.manifest(refresh=True)
    upgrade_id = manifest.get("upgrade")
    if upgrade_id:
        decided = decision(store, upgrade_id)
        if decided is not None:
            raise GalleryError(
                f"upgrade {upgrade_id} of {store.uri} is ending: its promotion decision "
                f"({'passed' if decided.passed else 'rejected'}) was recorded on {decided.decided}, so it is no "
                "longer unfinished and cannot be aborted; run `fastfill upgrade` to complete its end"
                + (", then `fastfill gallery rollback` to undo it" if decided.passed else ""))
        return upgrade_id
    ending = interrupted_decision(gallery)
    if ending is not None:
        raise GalleryError(
            f"upgrade {ending.upgrade_id} of {store.uri} has ended ({'passed' if ending.passed else 'rejected'} on "
            f"{ending.decided}); only its registry step is left, so it cannot be aborted: run `fastfill upgrade` to "
            "complete it" + (", then `fastfill gallery rollback` to undo it" if ending.passed else ""))
    serving = ModelRef.from_dict(manifest["model"]).uri
    message = f"no upgrade of {store.uri} is in progress (the gallery serves {serving}); nothing to abort"
    last = _last_ended(gallery, manifest)
    if last is not None:
        upgrade_id, how, record = last
        if how == "finished":
            message += (f". The last upgrade, {upgrade_id}, finished on {record['finished']}: a finished upgrade cannot "
                        "be aborted" + _rollback_hint(manifest))
        else:
            message += (f". The last upgrade, {upgrade_id}, was rejected by the promotion gate on {record['rejected']}: "
                        "it is over, and the gallery already serves the champion's features")
    raise GalleryError(message)


def how_far(gallery: Gallery, plan: Plan) -> dict:
    """How far ``plan``'s upgrade has got: its stage, chunks and items done."""
    done = done_chunks(gallery.store, plan.upgrade_id)
    items = plan.items_in(done)
    stage = ("planned" if not done else "backfill complete" if len(done) == plan.num_chunks else "backfilling")
    return {"stage": stage, "chunks_done": len(done), "chunks": plan.num_chunks, "items_done": items,
            "items": plan.num_items, "fraction": items / plan.num_items if plan.num_items else 1.0}


def abort(gallery: Gallery, upgrade_id: str, *, by: dict | None = None) -> Aborted:
    """Drop the unfinished ``upgrade_id`` (the caller holds the lock): its record
    ``aborted.json`` first (who, when, how far it got), then the gallery back on its own model's
    features (the champion's). Its working data is garbage from then on, and the same upgrade
    asked for again is planned from scratch. Returns the record (an abort already recorded but
    cut short is completed, its record kept)."""
    store = gallery.store
    if abortable(gallery) != upgrade_id:
        raise GalleryError(f"upgrade {upgrade_id} is no longer the one in progress at {store.uri}; nothing was changed")
    stored = aborted(store, upgrade_id)
    if stored is not None:
        record = Aborted.from_dict(stored)
    else:
        plan = load_plan(store, upgrade_id)
        if plan is None:
            raise GalleryError(f"the gallery at {store.uri} points at upgrade {upgrade_id}, which has no plan.json")
        record = Aborted.from_dict({"upgrade": upgrade_id, "aborted": now(), "by": by or who(), "from": plan.old.uri,
                                    "to": plan.new.uri, "base": plan.base, **how_far(gallery, plan),
                                    "mlflow_run_id": plan.mlflow_run_id, "plan_created": plan.created})
        store.put_json(upgrade_key(upgrade_id, ABORTED), record.to_dict())
    manifest = dict(gallery.manifest(refresh=True))
    manifest["upgrade"] = None
    gallery.write_manifest(manifest)
    return record


def completed_abort(gallery: Gallery, upgrade_id: str) -> Aborted | None:
    """The record of ``upgrade_id``'s abort when that abort is complete (recorded, and the gallery no
    longer points at the upgrade), else None: what an abort tried again after its answer was lost
    finds done."""
    record = aborted(gallery.store, upgrade_id)
    if record is None or gallery.manifest(refresh=True).get("upgrade") == upgrade_id:
        return None
    return Aborted.from_dict(record)


def undone(store: Store, upgrade_id: str) -> dict | None:
    """The record of ``upgrade_id``'s abort or rollback, with ``ended`` ("aborted" or "rolled back"),
    or None when it was neither: such an upgrade asked for again is planned from scratch."""
    for ended, read in (("aborted", aborted), ("rolled back", rolled_back)):
        record = read(store, upgrade_id)
        if record is not None:
            return {"ended": ended, **record}
    return None


def start_over(gallery: Gallery, upgrade_id: str) -> dict | None:
    """``upgrade_id`` was aborted or rolled back (or rejected by the gate, and asked for again with
    the gate off) and is asked for again: delete its objects so it is planned from scratch
    (plan.json first, so nothing can resume it; the record of its end last, so a run cut short
    here does this again). Returns that record, with ``ended`` ("aborted", "rolled back" or
    "rejected"), or None when the upgrade was none of these."""
    store = gallery.store
    record = undone(store, upgrade_id)
    if record is None:  # rejected by the gate, asked for again with the gate off
        rejected = rejection(store, upgrade_id)
        record = {"ended": "rejected", **rejected} if rejected is not None else None
    if record is None:
        return None
    manifest = gallery.manifest(refresh=True)
    if manifest.get("upgrade") == upgrade_id:  # an abort cut short before the gallery went back
        gallery.write_manifest({**manifest, "upgrade": None})
    records = {upgrade_key(upgrade_id, ABORTED), upgrade_key(upgrade_id, ROLLED_BACK), upgrade_key(upgrade_id, REJECTED)}
    keys = store.list(f"upgrades/{upgrade_id}/")
    if plan_key(upgrade_id) in keys:
        store.delete(plan_key(upgrade_id))
    for key in keys:
        if key != plan_key(upgrade_id) and key not in records:
            store.delete(key)
    for key in sorted(records & set(keys)):
        store.delete(key)
    return record


def rollback_target(gallery: Gallery) -> tuple[str, ModelRef, ModelRef]:
    """(the upgrade to roll back, the gallery's model now, the model it had before) when the
    gallery's last change is a finished upgrade whose previous model's features all still exist;
    else a GalleryError that says why not."""
    store = gallery.store
    manifest = gallery.manifest(refresh=True)
    if manifest.get("upgrade"):
        raise GalleryError(f"upgrade {manifest['upgrade']} of {store.uri} is in progress; drop it with `fastfill "
                           "upgrade abort` (or let it finish) before rolling back")
    ending = interrupted_decision(gallery)
    if ending is not None:
        raise GalleryError(f"the end of upgrade {ending.upgrade_id} of {store.uri} was interrupted before the registry "
                           "followed; run `fastfill upgrade` to complete it, then roll back")
    history = manifest.get("history") or []
    current = ModelRef.from_dict(manifest["model"])
    last = history[-1] if history else {}
    if last.get("by") == ROLLBACK:
        raise GalleryError(f"the last change to {store.uri} was already a rollback (to {current.uri} on "
                           f"{last.get('since')}); only the newest finished upgrade can be rolled back")
    upgrade_id = last.get("by")
    if len(history) < 2 or upgrade_id in (None, "ingest", "adopt") or _finished(store, upgrade_id) is None:
        raise GalleryError(f"nothing to roll back: {store.uri} has served {current.uri} since it was created "
                           f"({last.get('by', 'ingest')}, {last.get('since')}), not since a finished upgrade")
    previous = ModelRef.from_dict(history[-2]["model"])
    missing = gallery.missing_features(previous)
    if missing:
        raise GalleryError(
            f"cannot roll {store.uri} back to {previous.uri}: the old features were collected ({len(missing)} "
            f"of {previous.key}'s features are gone, first {missing[0]}; `fastfill gallery gc` "
            f"deletes a previous model's features). Re-ingest the gallery with the previous model (`fastfill gallery "
            f"ingest --model {previous.uri} --store <a new store>`, or `adopt`) to serve it again")
    return upgrade_id, current, previous


def rollback(gallery: Gallery, *, by: dict | None = None) -> dict:
    """Return the gallery to the model it had before its last, finished upgrade (the caller holds
    the lock): the record ``rolled-back.json`` first, then the manifest's model switched back
    with a history entry ``rollback``. The registry's part (champion back, the version tagged) is
    the caller's; ``mark_rollback_recorded`` notes it done."""
    upgrade_id, current, previous = rollback_target(gallery)
    record = {"upgrade": upgrade_id, "rolled_back": now(), "by": by or who(), "from": current.to_dict(),
              "to": previous.to_dict(), "registry_recorded": None}
    gallery.store.put_json(upgrade_key(upgrade_id, ROLLED_BACK), record)
    manifest = dict(gallery.manifest(refresh=True))
    manifest["model"] = previous.to_dict()
    shape_before = (manifest.get("history") or [{}])[-1].get("image_shape_before")
    if shape_before is not None:  # the finish moved an adopted gallery's image shape to the new model's
        manifest["image_shape"] = shape_before
    manifest["history"] = [*manifest.get("history", []),
                           {"model": previous.to_dict(), "since": now(), "by": ROLLBACK, "upgrade": upgrade_id,
                            "from": current.to_dict()}]
    gallery.write_manifest(manifest)
    return record


def interrupted_rollback(gallery: Gallery) -> dict | None:
    """The record of the gallery's last change when it is a rollback whose registry step was not
    recorded, else None."""
    history = gallery.manifest(refresh=True).get("history") or []
    if not history or history[-1].get("by") != ROLLBACK:
        return None
    record = rolled_back(gallery.store, history[-1].get("upgrade", ""))
    return record if record is not None and not record.get("registry_recorded") else None


def mark_rollback_recorded(store: Store, upgrade_id: str) -> dict:
    recorded = rolled_back(store, upgrade_id)
    if recorded is None:
        raise GalleryError(f"upgrade {upgrade_id} has no rollback record in {store.uri}: nothing to mark recorded")
    record = {**recorded, "registry_recorded": now()}
    store.put_json(upgrade_key(upgrade_id, ROLLED_BACK), record)
    return record
