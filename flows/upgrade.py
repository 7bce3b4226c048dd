"""The upgrade of a stored gallery, as Prefect runs it. The course of an upgrade is decided by
``UpgradeDecider`` and carried out by ``UpgradeRun`` (components/gallery/upgrade/decider.py and
run.py); this flow opens the gallery and the registry, gives the run its ports bound to Prefect
tasks (``flows/upgrade_ports.py``: every store write and every MLflow record but the backfill's
progress a retried task, chunks on the task runner), and turns the result into the flow run's state. Planning is
``flows/upgrade_planning.py``; abort and rollback are ``flows/undo.py``. Queries are served from
the mixed gallery throughout."""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.events import emit_event
from prefect.states import Completed

from fastfill.components.gallery.layouts.catalog import Gallery
from fastfill.components.gallery.store.lock import acquire_lock
from fastfill.components.gallery.upgrade import samples
from fastfill.components.gallery.upgrade.decider import UpgradeDecider
from fastfill.components.gallery.upgrade.gallery_view import GalleryView
from fastfill.components.gallery.upgrade.outcome import UpgradeResult, rejection_event
from fastfill.components.gallery.upgrade.planning import Plan
from fastfill.components.gallery.upgrade.run import RunSettings, UpgradeRun
from fastfill.components.platform import registry
from fastfill.components.platform.config import Params
from fastfill.components.platform.vocabulary import UPGRADE_FLOW
from fastfill.flows.parameters import resolve_params, run_parameters, store_of
from fastfill.flows.upgrade_ports import progress_key, upgrade_ports
from fastfill.tasks._policy import log
from fastfill.tasks.gallery_store import open_gallery
from fastfill.tasks.upgrade_tracking import follow_decision

__all__ = ["backfill_plan", "named_state", "progress_key", "run_upgrade", "run_upgrade_file", "runner_for",
           "upgrade_flow"]


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


def _ports(params: Params, gallery: Gallery, client, experiment: str, break_lock: bool):
    """The run's ports (flows/upgrade_ports.py). The gallery's lock and the registry's step are
    bound by this module's names (``acquire_lock``, ``follow_decision``): one place to wrap them."""
    return upgrade_ports(params, gallery, client, experiment, break_lock, acquire_lock, follow_decision)


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
        emit_event(**rejection_event(result, store_uri, model_uri))
    return named_state(result, model_uri)
