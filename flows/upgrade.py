"""The upgrade of a stored gallery, as Prefect runs it. The course of an upgrade is decided by
``UpgradeDecider`` and carried out by ``UpgradeRun`` (components/gallery/upgrade/decider.py and
run.py); this flow opens the gallery and the registry, binds Prefect tasks to the run's ports
(every store write a retried task, chunks on the task runner, MLflow's records), and turns the
result into the flow run's state. Planning is ``flows/upgrade_planning.py``; abort and rollback
are ``flows/undo.py``. Queries are served from the mixed gallery throughout."""

from __future__ import annotations

import hashlib
from typing import Any

from prefect import flow
from prefect.events import emit_event
from prefect.futures import as_completed
from prefect.states import Completed

from fastfill.components.gallery.inputs import judgments
from fastfill.components.gallery.layouts.catalog import Gallery
from fastfill.components.gallery.store.lock import acquire_lock
from fastfill.components.gallery.upgrade import backfill, samples
from fastfill.components.gallery.upgrade.decider import Course, GalleryView, UpgradeDecider
from fastfill.components.gallery.upgrade.measure import meter_for
from fastfill.components.gallery.upgrade.outcome import GateDecision, UpgradeResult
from fastfill.components.gallery.upgrade.planning import Plan
from fastfill.components.gallery.upgrade.run import RunSettings, UpgradePorts, UpgradeRun
from fastfill.components.platform import registry
from fastfill.components.platform.config import Params
from fastfill.components.platform.progress import progress, resolve_mode
from fastfill.components.platform.registry import CHAMPION, ModelRef
from fastfill.components.platform.vocabulary import UPGRADE_FLOW
from fastfill.flows.parameters import resolve_params, run_parameters, store_of
from fastfill.flows.upgrade_planning import plan_upgrade
from fastfill.tasks import gallery_store as store_tasks
from fastfill.tasks._policy import log
from fastfill.tasks.embedding import load_model
from fastfill.tasks.gallery_store import backfill_chunk, evaluate_gate, open_gallery
from fastfill.tasks.upgrade_tracking import UpgradeProgress, follow_decision, log_gate, log_prediction


def _upgrade_run_name() -> str:
    parameters = run_parameters()
    return f"upgrade {store_of(parameters)} to {parameters.get('to_uri') or 'challenger'}"


# persist_result: a run that ends in a named state ("Paused", "Rejected") hands its result back
# through that state's data; were the API to answer the final state's proposal with its own copy
# (a proposal retried after a slow answer is rejected as already final), only a persisted result
# could still be read from it. The result is a small record in Prefect's result storage.
@flow(name=UPGRADE_FLOW, flow_run_name=_upgrade_run_name, log_prints=True, persist_result=True)
def upgrade_flow(params: Params | None = None, store_uri: str | None = None, to_uri: str = "",
                 budget: float | int | None = None, break_lock: bool = False, gate: bool | None = None,
                 params_path: str | None = None, overrides: dict[str, Any] | None = None) -> UpgradeResult:
    """Upgrade the stored gallery to ``to_uri`` (default: the challenger): plan, backfill in
    chunks (sigma order by default, measured as they land), then the promotion gate (``gate``,
    default promotion.gate) switches the gallery and moves champion, or rejects and the gallery
    keeps serving the champion's features. Re-run the same command to resume a stopped or killed
    upgrade; an aborted or rolled-back upgrade asked for again is planned from scratch.

    The configuration is ``params`` (the Python API), or, for runs that the CLI and the
    deployments start, the file ``params_path`` with ``overrides`` by dotted key
    (``{"gallery.upgrade.chunk_size": 4}``): small parameters, readable in the Prefect UI.
    ``store_uri`` defaults to gallery.store."""
    params = resolve_params(params, params_path, overrides)
    gallery = open_gallery(store_uri or params.gallery.store, params.gallery.s3,
                           registry.identity(params.mlflow))
    params, fitted = samples.fit_to_gallery(params, gallery.num_items)
    if fitted:
        log(fitted)
    config, name = params.gallery.upgrade, params.mlflow.registered_model
    client, experiment = registry.setup(params.mlflow)  # the run's one registry client
    decider = UpgradeDecider(gallery.store.uri, name, params.promotion.gate if gate is None else gate,
                             config.judgments, config.stop_when_gain_below)
    run = UpgradeRun(decider, GalleryView(gallery), RunSettings.of(params, budget),
                     _ports(params, gallery, client, experiment, break_lock))
    result = run.run(registry.asked_version(client, name, to_uri))
    return _outcome(result, gallery.store.uri, run.target.uri if run.target else to_uri)


def backfill_plan(params: Params, gallery: Gallery, plan: Plan, model, budget: float | int | None = None):
    """The chunk loop alone, over an upgrade already planned, with the flow's ports (what the
    backfill benchmarks time); called inside a flow, whose task runner runs the chunks."""
    client, _ = registry.setup(params.mlflow)
    decider = UpgradeDecider(gallery.store.uri, params.mlflow.registered_model, False)
    ports = _ports(params, gallery, client, "", break_lock=False)
    return UpgradeRun(decider, GalleryView(gallery), RunSettings.of(params, budget), ports).backfill(plan, model, budget)


def _ports(params: Params, gallery: Gallery, client, experiment: str, break_lock: bool) -> UpgradePorts:
    config = params.gallery.upgrade
    return UpgradePorts(writes=_StoreWrites(gallery, break_lock, config.lease_seconds),
                        chunks=_Chunks(gallery.store.uri, config),
                        measure_gate=lambda plan: evaluate_gate(gallery.store.uri, plan, params.promotion.curve_points),
                        records=_Records(client, gallery, params.mlflow.registered_model),
                        work=_Work(params, client, experiment, gallery), log=log)


# ---- the run's ports, bound to Prefect tasks

class _StoreWrites:
    """Every write of the run to the gallery's store, each a retried task (the lock renews itself)."""

    def __init__(self, gallery: Gallery, break_lock: bool, lease_seconds: float):
        self.gallery, self.uri = gallery, gallery.store.uri
        self.break_lock, self.lease_seconds = break_lock, lease_seconds

    def lock(self, upgrade: str):
        return acquire_lock(self.gallery.store, upgrade, break_lock=self.break_lock, log=log,
                            lease_seconds=self.lease_seconds)

    def complete_abort(self, upgrade: str) -> None:
        store_tasks.complete_abort(self.uri, upgrade)

    def start_over(self, upgrade: str) -> None:
        store_tasks.start_over(self.uri, upgrade)

    def point_manifest(self, upgrade: str) -> None:
        store_tasks.point_manifest(self.uri, upgrade)

    def write_plan(self, plan: Plan) -> None:
        store_tasks.write_plan(self.uri, plan)

    def sync_serving(self) -> str:
        return store_tasks.sync_serving(self.uri)

    def write_decision(self, plan: Plan, champion: ModelRef, decided: GateDecision) -> dict:
        return store_tasks.write_decision(self.uri, plan, champion, decided)

    def finish(self, plan: Plan) -> None:
        store_tasks.finish_upgrade(self.uri, plan)

    def reject(self, plan: Plan, decision: dict) -> None:
        store_tasks.reject_upgrade(self.uri, plan, decision)

    def mark_registry_recorded(self, upgrade: str) -> None:
        store_tasks.mark_registry_recorded(self.uri, upgrade)


class _Chunks:
    """Chunks as ``backfill-chunk`` tasks on the flow's task runner (threads or Dask)."""

    def __init__(self, store_uri: str, config):
        self.store_uri, self.config = store_uri, config

    def submit(self, plan: Plan, chunk: int, model):
        config = self.config
        return backfill_chunk.submit(self.store_uri, plan.id, chunk, model, config.batch_size,
                                     config.read_workers, config.precision)

    def first_done(self, handles: list):
        return next(as_completed(handles))

    def result(self, handle) -> dict:
        return handle.result()


class _Records:
    """The upgrade's MLflow records through the run's one registry client."""

    def __init__(self, client, gallery: Gallery, registered_model: str):
        self.client, self.gallery, self.registered_model = client, gallery, registered_model

    def champion_version(self) -> str | None:
        return registry.alias_version(self.client, self.registered_model, CHAMPION)

    def prediction(self, plan: Plan, advice: dict) -> None:
        log_prediction(self.client, plan, advice)

    def gate(self, plan: Plan, numbers: dict) -> None:
        assert plan.mlflow_run_id is not None  # the run records the gate only where the upgrade has its run
        log_gate(self.client, plan.mlflow_run_id, numbers)

    def follow_decision(self, plan: Plan, tags: dict, promote: bool) -> None:
        follow_decision(self.client, plan, tags, promote=promote)

    def progress(self, plan: Plan, done: set[int], total: int, items_done: int) -> _BackfillRecords:
        return _BackfillRecords(self.client, self.gallery, plan, done, total, items_done)


class _BackfillRecords:
    """As chunks land: retrieval measured on the done prefix and progress in MLflow and a Prefect
    artifact; log lines with rate and time left (a terminal's bar is the CLI's: it polls the
    store, wherever chunks run)."""

    def __init__(self, client, gallery: Gallery, plan: Plan, done: set[int], total: int, items_done: int):
        store_uri = gallery.store.uri
        self.gallery, self.plan = gallery, plan
        self.tracker = UpgradeProgress(client, store_uri, plan, meter_for(gallery, plan, sorted(done)),
                                       progress_key(store_uri, plan.id))
        self.tracker.measure(done)
        self.shown = progress(f"backfill {plan.id}", total=total, log=log, initial=items_done,
                              mode="off" if resolve_mode() == "bar" else "log")

    def landed(self, chunk: int, record: dict, done: set[int], items_done: int) -> None:
        if self.tracker.meter is not None:
            features = backfill.chunk_features(self.gallery.store, self.plan.id, chunk)
            self.tracker.meter.land(record["start"], record["stop"], features)
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
        judged = judgments.load_judgments(source, self.gallery.ids())
        log(f"the gate measures against {judged.describe()}")
        return judged

    def plan(self, course: Course, new: ModelRef, new_model, judged) -> Plan:
        return plan_upgrade(self.params, self.client, self.experiment, self.gallery, course, new, new_model, judged)

    def advise(self, plan: Plan) -> dict | None:
        return store_tasks.advise_upgrade(self.gallery.store.uri, plan, self.params.gallery.upgrade.stop_when_gain_below)


def progress_key(store_uri: str, upgrade_id: str) -> str:
    """The Prefect progress artifact of one gallery's upgrade (lowercase, digits and dashes)."""
    slug = "".join(c if c.isalnum() else "-" for c in upgrade_id.lower())[:80]
    return f"backfill-{slug}-{hashlib.sha1(store_uri.encode()).hexdigest()[:8]}"


def run_upgrade(params: Params, store_uri: str, to_uri: str = "", budget: float | int | None = None,
                break_lock: bool = False, gate: bool | None = None) -> UpgradeResult:
    """``upgrade_flow`` on the task runner its settings name (the Python API)."""
    flow_with_runner = upgrade_flow.with_options(task_runner=runner_for(params.gallery.upgrade))
    return flow_with_runner(params, store_uri, to_uri, budget=budget, break_lock=break_lock, gate=gate)


def run_upgrade_file(params: Params, params_path: str, store_uri: str | None = None, to_uri: str = "",
                     budget: float | int | None = None, break_lock: bool = False, gate: bool | None = None,
                     overrides: dict[str, Any] | None = None) -> UpgradeResult:
    """``upgrade_flow`` configured by the file ``params_path`` and ``overrides`` (what the CLI and
    the upgrade deployment call): the flow run reads the file itself, so its Prefect parameters are
    these few values, not the whole configuration. ``params`` is what they give, read by the
    caller: it names the task runner."""
    flow_with_runner = upgrade_flow.with_options(task_runner=runner_for(params.gallery.upgrade))
    return flow_with_runner(store_uri=store_uri, to_uri=to_uri, budget=budget, break_lock=break_lock, gate=gate,
                            params_path=params_path, overrides=overrides or None)


def runner_for(settings):
    """The task runner of an upgrade's chunks, from gallery.upgrade: threads (one more than the
    chunks in flight, for the bookkeeping), or Dask (an existing cluster at ``dask_address``, or
    a local one of ``max_concurrency`` single-threaded workers). Every entry point uses it."""
    if settings.task_runner == "dask":
        from prefect_dask import DaskTaskRunner

        if settings.dask_address:
            return DaskTaskRunner(address=settings.dask_address)
        return DaskTaskRunner(cluster_kwargs={"n_workers": settings.max_concurrency, "threads_per_worker": 1})
    from prefect.task_runners import ThreadPoolTaskRunner

    return ThreadPoolTaskRunner(max_workers=settings.max_concurrency + 1)


REJECTED_EVENT = "fastfill.upgrade.rejected"


def named_state(result: UpgradeResult, model_uri: str = "the new model", data=None):
    """The state an upgrade's flow run ends in, when it is more than Completed: "Paused" (the
    budget or the advised stop ended the backfill; the upgrade is not over) or "Rejected" (the
    gate said no), both Completed states (the run did its work), with the result as data. A
    flow that runs the upgrade as a subflow (the deployment's) returns it too, so its own run
    tells the same. Called as a function, a flow returns the result either way: ``data`` when
    given (the deployment's run returns the result as its JSON dict), else the result itself."""
    data = result if data is None else data
    if result.state == "paused":
        return Completed(name="Paused", message=result.message, data=data)
    if result.state == "rejected":
        return Completed(name="Rejected", message=f"{model_uri} rejected by the promotion gate: "
                         + ("; ".join(result.reasons) or "see its decision.json"), data=data)
    return data


def _outcome(result: UpgradeResult, store_uri: str, model_uri: str):
    """What the flow returns. A rejection by the gate ends the flow run in a state of its own, a
    Completed state named "Rejected" (the run did its work; its answer is no), and emits the
    Prefect event ``fastfill.upgrade.rejected`` (resource: the gallery) for an Automation to act
    on; a paused one ends in a Completed state named "Paused". Called as a function the flow
    returns the result either way."""
    if result.state == "rejected":
        upgrade = result.upgrade or (result.decision or {}).get("upgrade")
        numbers = {k: v for k, v in ((result.promotion.numbers if result.promotion else None) or {}).items()
                   if isinstance(v, int | float | None)}
        emit_event(event=REJECTED_EVENT,
                   resource={"prefect.resource.id": f"fastfill.gallery.{store_uri}",
                             "prefect.resource.name": store_uri},
                   payload={"upgrade": upgrade, "store": store_uri, "model": model_uri, "reasons": result.reasons,
                            "numbers": numbers, "mlflow_run_id": result.mlflow_run_id})
    return named_state(result, model_uri)
