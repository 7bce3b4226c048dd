"""Undoing an upgrade, as Prefect runs it: ``abort_flow`` drops an unfinished upgrade and
``rollback_flow`` undoes a finished one. The decisions and records are
``components.gallery.upgrade.reversal``'s; the flows take the lock, call them and follow in the registry."""

from __future__ import annotations

from prefect import flow

from fastfill.components.gallery.layouts.catalog import Gallery, GalleryError, check_registry
from fastfill.components.gallery.store.lock import LeaseLost, UpgradeLocked, acquire_lock
from fastfill.components.gallery.triggers.claims import claim_record
from fastfill.components.gallery.upgrade import planning, reversal
from fastfill.components.platform import registry
from fastfill.components.platform.config import Params
from fastfill.components.platform.registry import ModelRef
from fastfill.flows.parameters import resolve_params, run_parameters, store_of
from fastfill.tasks._policy import log
from fastfill.tasks.gallery_store import abort_upgrade, claim_version, mark_rollback_recorded, open_gallery, roll_back
from fastfill.tasks.upgrade_tracking import end_aborted_run, record_rollback


def take_undo_lock(store, holder: str, doing: str, params: Params):
    """The gallery's lock for ``doing``; held by another live process, a refusal that names it."""

    try:
        return acquire_lock(store, holder, log=log, lease_seconds=params.gallery.upgrade.lease_seconds)
    except LeaseLost:
        raise
    except UpgradeLocked as error:
        raise UpgradeLocked(f"cannot {doing} now: {error}") from None


def _abort_run_name() -> str:
    return f"abort the upgrade of {store_of(run_parameters())}"


@flow(name="gallery-upgrade-abort", flow_run_name=_abort_run_name, log_prints=True)
def abort_flow(params: Params | None = None, store_uri: str | None = None,
               params_path: str | None = None) -> reversal.AbortAnswer:
    """Drop the gallery's unfinished upgrade (planned, or part of the way through its backfill):
    under the lock (refused while another process holds it), ``aborted.json`` records who, when
    and how far it got, and the gallery serves its own model's (the champion's) features again.
    Its working data is garbage for `fastfill gallery gc`; the version is claimed so the watcher
    and the webhook do not start it again, and a later `fastfill upgrade` to it plans from
    scratch. Its MLflow run ends KILLED with the tag ``fastfill.aborted``. A finished or rejected
    upgrade, or one whose end has begun, cannot be aborted (the message says what to do)."""
    params = resolve_params(params, params_path, None)
    gallery = open_gallery(store_uri or params.gallery.store, params.gallery.s3)
    store = gallery.store
    upgrade_id = reversal.abortable(gallery)  # refused with its reason before the lock is touched
    lock = take_undo_lock(store, upgrade_id, f"abort upgrade {upgrade_id}", params)
    try:
        record = abort_upgrade(store.uri, upgrade_id)  # checked again under the lock
        plan = planning.load_plan(store, upgrade_id)
        if plan is not None and claim_version(store.uri, claim_record(plan.new.name, plan.new.version, "abort",
                                                                      upgrade=upgrade_id)):
            log(f"{plan.new.uri} is claimed for {store.uri}: the registry watcher and the webhook will not start it "
                "again (`fastfill upgrade` still can)")
        _record_abort_in_mlflow(params, gallery, record)
        log(f"aborted upgrade {upgrade_id} ({record.stage}: {record.chunks_done}/{record.chunks} chunks, "
            f"{record.items_done}/{record.items} items); {store.uri} serves {gallery.model.uri}'s features again")
        return reversal.AbortAnswer(record, gallery.model.uri)
    finally:
        lock.release()


def _record_abort_in_mlflow(params: Params, gallery: Gallery, record: reversal.Aborted) -> None:
    """The aborted upgrade's MLflow run ends KILLED (``mark_run_aborted``), once the gallery is
    known to belong to this registry."""
    mark_run_aborted(params, record.to_dict(), f"{record.items_done}/{record.items} items ({record.stage})",
                     lambda: check_registry(gallery.manifest(), gallery.store.uri, registry.identity(params.mlflow)))


def mark_run_aborted(params: Params, record: dict, progress: str, check=lambda: None) -> None:
    """The aborted upgrade's MLflow run (``record['mlflow_run_id']``) ends KILLED, tagged with who
    aborted it, when and how far it got (``progress``), after ``check()``. The store's
    ``aborted.json`` is the record that counts: a registry that cannot take this is reported, and
    the abort stands. ``abort_flow`` calls it, on every layout, through ``_record_abort_in_mlflow``
    (whose check is that the gallery belongs to this registry)."""
    from mlflow.exceptions import MlflowException

    run_id = record.get("mlflow_run_id")
    if not run_id:
        return
    by = record.get("by") or {}
    try:
        check()
        client, _ = registry.setup(params.mlflow)
        end_aborted_run(client, run_id, f"{record['aborted']} by {by.get('user')}@{by.get('host')} at {progress}")
    except (GalleryError, MlflowException, OSError) as error:
        log(f"the abort stands, but MLflow run {run_id} could not be marked aborted: {error}")


def _rollback_run_name() -> str:
    return f"roll back {store_of(run_parameters())}"


@flow(name="gallery-rollback", flow_run_name=_rollback_run_name, log_prints=True)
def rollback_flow(params: Params | None = None, store_uri: str | None = None, params_path: str | None = None) -> dict:
    """Return the gallery to the model it had before its last, finished upgrade, while that
    model's features still exist (before `fastfill gallery gc`): under the lock, the record
    ``rolled-back.json``, then the manifest (history entry ``rollback``), then the registry:
    ``champion`` back on the previous version (when it still names the rolled-back one) and that
    version tagged ``promotion=rolled-back``. Refused while an upgrade is in progress, and once gc
    collected the old features. A rollback cut short before the registry followed is completed
    by the next one. The version is claimed so the watcher and the webhook do not start it
    again; a later `fastfill upgrade` to it plans from scratch."""
    params = resolve_params(params, params_path, None)
    gallery = open_gallery(store_uri or params.gallery.store, params.gallery.s3, registry.identity(params.mlflow))
    store = gallery.store
    client, _ = registry.setup(params.mlflow)  # the run's one registry client
    pending = reversal.interrupted_rollback(gallery)
    upgrade_id = pending["upgrade"] if pending is not None else reversal.rollback_target(gallery)[0]  # refusals first
    lock = take_undo_lock(store, f"rollback of {upgrade_id}", "roll back", params)
    try:
        record = reversal.interrupted_rollback(gallery)
        if record is None:
            record = roll_back(store.uri)  # checked again under the lock
            log(f"{store.uri} serves {ModelRef.from_dict(record['to']).uri}'s features again (upgrade {upgrade_id} to "
                f"{ModelRef.from_dict(record['from']).uri} rolled back)")
        else:
            log(f"completing the rollback of upgrade {upgrade_id} (recorded {record['rolled_back']}): the registry step")
        rolled, previous = ModelRef.from_dict(record["from"]), ModelRef.from_dict(record["to"])
        claim_version(store.uri, claim_record(rolled.name, rolled.version, "rollback", upgrade=upgrade_id))
        moved = _record_rollback_in_registry(client, store, record, rolled, previous)
        mark_rollback_recorded(store.uri, upgrade_id)
        return {"state": "rolled back", "upgrade": upgrade_id, "model": previous.uri, "from": rolled.uri,
                "champion_moved": moved, "rolled_back": record["rolled_back"]}
    finally:
        lock.release()


def _record_rollback_in_registry(client, store, record: dict, rolled: ModelRef, previous: ModelRef) -> bool:
    by = record.get("by") or {}
    tags = {"promotion": "rolled-back", "promotion.rolled_back": record["rolled_back"],
            "promotion.rolled_back_to": str(previous.version),
            "promotion.rolled_back_by": f"{by.get('user')}@{by.get('host')}",
            "promotion.rolled_back_upgrade": record["upgrade"]}
    plan = planning.load_plan(store, record["upgrade"])
    if rolled.name != previous.name:  # another registered model: only the tags
        record_rollback(client, rolled.name, rolled.version, rolled.version, plan.mlflow_run_id if plan else None, tags)
        return False
    moved = record_rollback(client, rolled.name, rolled.version, previous.version, plan.mlflow_run_id if plan else None,
                            tags)
    champion = registry.alias_version(client, rolled.name, registry.CHAMPION)
    log(f"champion moved back to {previous.uri}" if moved else
        f"champion names version {champion}, not {rolled.version}: left as it is")
    return moved
