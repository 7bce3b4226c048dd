"""The upgrade flow's ports (``components.gallery.upgrade.run.UpgradePorts``), bound to Prefect:
every store write a retried task of ``tasks/gallery_store.py``, the chunks ``backfill-chunk``
tasks on the flow's task runner, the gate's measurement the ``evaluate-gate`` task, MLflow's
records the retried tasks of ``tasks/upgrade_tracking.py``. What they decide or compute is the
components' (``measure.BackfillMeasure``, ``judgments.gate_judgments``); ``flows/upgrade.py``
asks ``upgrade_ports`` for the set."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from prefect.futures import as_completed

from fastfill.components.gallery.inputs import judgments
from fastfill.components.gallery.layouts.catalog import Gallery
from fastfill.components.gallery.upgrade.decider import Course
from fastfill.components.gallery.upgrade.measure import BackfillMeasure
from fastfill.components.gallery.upgrade.outcome import Decision
from fastfill.components.gallery.upgrade.planning import Plan
from fastfill.components.gallery.upgrade.run import UpgradePorts
from fastfill.components.platform import registry
from fastfill.components.platform.config import Params
from fastfill.components.platform.progress import progress, resolve_mode
from fastfill.components.platform.registry import CHAMPION, ModelRef
from fastfill.flows.upgrade_planning import plan_upgrade
from fastfill.tasks import gallery_store as store_tasks
from fastfill.tasks._policy import log
from fastfill.tasks.embedding import load_model
from fastfill.tasks.gallery_store import backfill_chunk, evaluate_gate
from fastfill.tasks.upgrade_tracking import UpgradeProgress, log_gate, log_prediction


def upgrade_ports(params: Params, gallery: Gallery, client, experiment: str, break_lock: bool,
                  acquire_lock: Callable[..., Any], follow_decision: Callable[..., Any]) -> UpgradePorts:
    """The ports of an upgrade of ``gallery`` with ``params``, through the run's one registry
    ``client`` (``experiment``: where its MLflow run goes); the flow names the lock's
    ``acquire_lock`` (``store.lock.acquire_lock``) and the registry step's task
    (``upgrade_tracking.follow_decision``)."""
    config = params.gallery.upgrade
    return UpgradePorts(writes=_StoreWrites(gallery, break_lock, config.lease_seconds, acquire_lock),
                        chunks=_Chunks(gallery.store.uri, config),
                        measure_gate=lambda plan: evaluate_gate(gallery.store.uri, plan, params.promotion.curve_points),
                        records=_Records(client, gallery, params.mlflow.registered_model, follow_decision),
                        work=_Work(params, client, experiment, gallery), log=log)


def progress_key(store_uri: str, upgrade_id: str) -> str:
    """The Prefect progress artifact of one gallery's upgrade (lowercase, digits and dashes)."""
    slug = "".join(c if c.isalnum() else "-" for c in upgrade_id.lower())[:80]
    return f"backfill-{slug}-{hashlib.sha1(store_uri.encode()).hexdigest()[:8]}"


class _StoreWrites:
    """Every write of the run to the gallery's store, each a retried task (the lock renews itself)."""

    def __init__(self, gallery: Gallery, break_lock: bool, lease_seconds: float, acquire_lock: Callable[..., Any]):
        self.gallery, self.uri = gallery, gallery.store.uri
        self.break_lock, self.lease_seconds, self.acquire_lock = break_lock, lease_seconds, acquire_lock

    def lock(self, upgrade_id: str):
        return self.acquire_lock(self.gallery.store, upgrade_id, break_lock=self.break_lock, log=log,
                                 lease_seconds=self.lease_seconds)

    def complete_abort(self, upgrade_id: str) -> None:
        store_tasks.complete_abort(self.uri, upgrade_id)

    def start_over(self, upgrade_id: str) -> None:
        store_tasks.start_over(self.uri, upgrade_id)

    def point_manifest(self, upgrade_id: str) -> None:
        store_tasks.point_manifest(self.uri, upgrade_id)

    def write_plan(self, plan: Plan) -> None:
        store_tasks.write_plan(self.uri, plan)

    def sync_serving(self) -> str:
        return store_tasks.sync_serving(self.uri)

    def write_decision(self, decided: Decision) -> Decision:
        return store_tasks.write_decision(self.uri, decided)

    def finish(self, plan: Plan) -> None:
        store_tasks.finish_upgrade(self.uri, plan)

    def reject(self, plan: Plan, decision: Decision) -> None:
        store_tasks.reject_upgrade(self.uri, plan, decision)

    def mark_registry_recorded(self, upgrade_id: str) -> None:
        store_tasks.mark_registry_recorded(self.uri, upgrade_id)


class _Chunks:
    """Chunks as ``backfill-chunk`` tasks on the flow's task runner (threads or Dask)."""

    def __init__(self, store_uri: str, config):
        self.store_uri, self.config = store_uri, config

    def submit(self, plan: Plan, chunk: int, model):
        config = self.config
        return backfill_chunk.submit(self.store_uri, plan.upgrade_id, chunk, model, config.batch_size,
                                     config.read_workers, config.precision)

    def first_done(self, handles: list):
        return next(as_completed(handles))

    def result(self, handle) -> dict:
        return handle.result()


class _Records:
    """The upgrade's MLflow records through the run's one registry client."""

    def __init__(self, client, gallery: Gallery, registered_model: str, follow_decision: Callable[..., Any]):
        self.client, self.gallery, self.registered_model = client, gallery, registered_model
        self.follow = follow_decision

    def champion_version(self) -> str | None:
        return registry.alias_version(self.client, self.registered_model, CHAMPION)

    def prediction(self, plan: Plan, advice: dict) -> None:
        log_prediction(self.client, plan, advice, registry.metric_time())

    def gate(self, plan: Plan, numbers: dict) -> None:
        assert plan.mlflow_run_id is not None  # the run records the gate only where the upgrade has its run
        log_gate(self.client, plan.mlflow_run_id, numbers, registry.metric_time())

    def follow_decision(self, plan: Plan, tags: dict, promote: bool) -> None:
        self.follow(self.client, plan, tags, promote=promote)

    def progress(self, plan: Plan, done: set[int], total: int, items_done: int) -> _BackfillRecords:
        return _BackfillRecords(self.client, self.gallery, plan, done, total, items_done)


class _BackfillRecords:
    """As chunks land: retrieval measured on the done prefix (``BackfillMeasure``), progress in
    MLflow and a Prefect artifact, log lines with rate and time left (a terminal's bar is the
    CLI's: it polls the store, wherever chunks run)."""

    def __init__(self, client, gallery: Gallery, plan: Plan, done: set[int], total: int, items_done: int):
        store_uri = gallery.store.uri
        self.measure = BackfillMeasure(gallery, plan, done)
        self.tracker = UpgradeProgress(client, store_uri, plan, self.measure, progress_key(store_uri, plan.upgrade_id))
        self.tracker.measure(done)
        self.shown = progress(f"backfill {plan.upgrade_id}", total=total, log=log, initial=items_done,
                              mode="off" if resolve_mode() == "bar" else "log")

    def landed(self, chunk: int, record: dict, done: set[int], items_done: int) -> None:
        self.measure.land(chunk, record["start"], record["stop"])
        self.tracker.chunk_done(done, items_done)
        self.shown.update_to(items_done)

    def close(self, ok: bool) -> None:
        self.shown.close(failed=not ok)
        self.tracker.close(ok)


class _Work:
    """The model loaded, the judged queries read, the upgrade planned, the advisor's prediction."""

    def __init__(self, params: Params, client, experiment: str, gallery: Gallery):
        self.params, self.client, self.experiment, self.gallery = params, client, experiment, gallery

    def load_model(self, ref: ModelRef):
        return load_model(ref)

    def judgments(self):
        source = self.params.gallery.upgrade.judgments
        assert source is not None  # asked for only when the gate measures against judged queries
        return judgments.gate_judgments(source, self.gallery.ids(), log)

    def plan(self, course: Course, new: ModelRef, new_model, judged) -> Plan:
        return plan_upgrade(self.params, self.client, self.experiment, self.gallery, course, new, new_model, judged)

    def advise(self, plan: Plan) -> dict | None:
        return store_tasks.advise_upgrade(self.gallery.store.uri, plan, self.params.gallery.upgrade.stop_when_gain_below)
