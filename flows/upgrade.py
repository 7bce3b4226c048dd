"""The upgrade of a stored gallery, as Prefect runs it. ``upgrade_flow`` is the list of its
steps; what happens next at each one is decided by ``components.gallery.upgrade.decider``
(``UpgradeDecider``), the steps' work is in tasks (tasks/gallery_store.py, tasks/embedding.py,
tasks/upgrade_map.py, tasks/upgrade_tracking.py, with retries) and components. Planning is
``flows/upgrade_planning.py``; abort and rollback are ``flows/undo.py``. Queries are served from
the mixed gallery throughout."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prefect import flow
from prefect.futures import as_completed

from fastfill.components.gallery.advice import advisor

from fastfill.components.gallery.upgrade import backfill, ending, planning, reversal, samples

from fastfill.components.gallery.inputs import judgments
from fastfill.components.gallery.layouts.catalog import Gallery, GalleryError
from fastfill.components.gallery.upgrade.outcome import Advice, UpgradeResult, backfilled
from fastfill.components.gallery.upgrade.decider import ENDED, REFUSE, RESUME, UP_TO_DATE, Course, GalleryView, UpgradeDecider, up_to_date
from fastfill.components.gallery.upgrade.lifecycle import TRUTH_JUDGMENTS, Backfill, budget_items, cut_for_limit, failure_limit
from fastfill.components.gallery.store.lock import acquire_lock
from fastfill.components.gallery.upgrade.measure import meter_for
from fastfill.components.platform import registry
from fastfill.components.platform.config import Params
from fastfill.components.platform.progress import progress, resolve_mode
from fastfill.components.platform.registry import CHAMPION, ModelRef
from fastfill.components.platform.vocabulary import UPGRADE_FLOW
from fastfill.flows.parameters import resolve_params, run_parameters, store_of
from fastfill.flows.upgrade_planning import plan_upgrade
from fastfill.tasks._policy import log
from fastfill.tasks.embedding import load_model
from fastfill.tasks.gallery_store import backfill_chunk, evaluate_gate, finish_upgrade, open_gallery, reject_upgrade
from fastfill.tasks.upgrade_tracking import UpgradeProgress, follow_decision, log_gate, log_prediction


def _upgrade_run_name() -> str:
    parameters = run_parameters()
    return f"upgrade {store_of(parameters)} to {parameters.get('to_uri') or 'challenger'}"


# persist_result: a run that ends in a named state ("Paused", "Rejected") hands its result back
# through that state's data; were the API to answer the final state's proposal with its own copy
# (a proposal retried after a slow answer is rejected as already final), only a persisted result
# could still be read from it. The result is a small dict in Prefect's result storage.
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
    view = GalleryView(gallery)
    wanted = decider.target(registry.asked_version(client, name, to_uri), view)
    if wanted is None:
        return _said(decider.no_target(view, registry.alias_version(client, name, CHAMPION)))
    with acquire_lock(gallery.store, planning.upgrade_id(gallery.model, wanted), break_lock=break_lock, log=log,
                      lease_seconds=config.lease_seconds):  # released last, after every ending
        course = decider.course(GalleryView(gallery), wanted)  # again under the lock: another run may have moved it
        ended = _complete_first(client, gallery, course)
        if course.action == ENDED:
            return _outcome(ended, gallery.store.uri, wanted.uri)
        if course.action == UP_TO_DATE:
            return up_to_date(wanted, gallery.num_items)
        if course.action == REFUSE:
            raise GalleryError(course.reason)
        new_model = load_model(wanted)
        new = ModelRef(wanted.name, wanted.version, new_model.embedding_dim)
        refusal = decider.layout_refusal(gallery, new, config.task_runner)
        if refusal is not None:
            raise GalleryError(refusal)
        judged = None
        if course.truth == TRUTH_JUDGMENTS:  # read and checked against the gallery now, before any work
            judged = judgments.load_judgments(config.judgments, gallery.ids())
            log(f"the gate measures against {judged.describe()}")
        plan = (_resume(gallery, course) if course.action == RESUME else
                plan_upgrade(params, client, experiment, gallery, course, new, new_model, judged))
        if gallery.serves_queries:  # the index serves the upgrade's mixed gallery (a killed switch completed)
            serving = gallery.sync_serving()
            log(f"{gallery.index.where}: the view {gallery.index.view} serves {serving['model']}")
        advice = _advice(client, gallery, plan, config.stop_when_gain_below)
        budget = config.budget if budget is None else budget
        stop = decider.advised_stop(advice, budget)
        ran = backfilled(_backfill(client, gallery, plan, new_model, config, stop["items"] if stop else budget),
                         plan.mlflow_run_id, _advice_result(advice, config.stop_when_gain_below))
        if not ran["complete"]:
            return named_state(_said(*decider.paused(ran, stop)))
        ended = _end(decider, client, gallery, planning.load_plan(gallery.store, plan.id), params.promotion)
        champion = ModelRef.from_dict(ended.pop("champion"))
        result: UpgradeResult = {**ran, **ended}
        log(decider.ended_line(result, plan.id, new, champion))
        return _outcome(result, gallery.store.uri, new.uri)


def run_upgrade(params: Params, store_uri: str, to_uri: str = "", budget: float | int | None = None,
                break_lock: bool = False, gate: bool | None = None) -> dict:
    """``upgrade_flow`` on the task runner its settings name (the Python API)."""
    flow_with_runner = upgrade_flow.with_options(task_runner=runner_for(params.gallery.upgrade))
    return flow_with_runner(params, store_uri, to_uri, budget=budget, break_lock=break_lock, gate=gate)


def run_upgrade_file(params: Params, params_path: str, store_uri: str | None = None, to_uri: str = "",
                     budget: float | int | None = None, break_lock: bool = False, gate: bool | None = None,
                     overrides: dict[str, Any] | None = None) -> dict:
    """``upgrade_flow`` configured by the file ``params_path`` and ``overrides`` (what the CLI and
    the upgrade deployment call): the flow run reads the file itself, so its Prefect parameters are
    these few values, not the whole configuration. ``params`` is what they give, read by the
    caller: it names the task runner."""
    flow_with_runner = upgrade_flow.with_options(task_runner=runner_for(params.gallery.upgrade))
    return flow_with_runner(store_uri=store_uri, to_uri=to_uri, budget=budget, break_lock=break_lock, gate=gate,
                            params_path=params_path, overrides=overrides or None)


def _said(result: dict, line: str | None = None) -> dict:
    log(line or result["message"])
    return {**result, "message": line or result["message"]}


def _complete_first(client, gallery: Gallery, course: Course) -> dict | None:
    """What a killed run left half done, before anything else: an abort, an ending (whose
    result it returns), an undone upgrade's objects (it is planned from scratch)."""
    for line in course.say:
        log(line)
    if course.complete_abort:
        reversal.abort(gallery, course.complete_abort)
    ended = None
    if course.complete_ending:
        decided = course.complete_ending
        _follow_in_registry(client, gallery, decided)
        plan = planning.load_plan(gallery.store, decided["upgrade"])
        n = gallery.num_items
        ended = {**UpgradeDecider.ended(decided), "items": n, "items_done": n, "fraction": 1.0, "complete": True,
                 "resumed_ending": True, "decided": decided, "mlflow_run_id": plan.mlflow_run_id}
    if course.start_over:
        reversal.start_over(gallery, course.uid)
    return ended


def _resume(gallery: Gallery, course: Course) -> planning.Plan:
    """The upgrade's plan, made before; the gallery pointed at it again if a crash came between
    the plan and that switch."""
    if course.point_manifest:
        gallery.write_manifest({**gallery.manifest(refresh=True), "upgrade": course.uid})
    return planning.load_plan(gallery.store, course.uid)


def _advice(client, gallery: Gallery, plan: planning.Plan, gain_below: float | None) -> dict | None:
    """The budget advisor's prediction for the planned upgrade (stored beside the plan, made
    once), logged as lines and, the first time, to the upgrade's MLflow run as series (step:
    items backfilled)."""
    advice = advisor.stored_advice(gallery.store, plan.id)
    if advice is None:
        started = time.perf_counter()
        advice = advisor.advise_upgrade(gallery, plan, gain_below)
        if advice is None:
            if gain_below is not None:
                log("stop_when_gain_below is set, but this upgrade has no evaluation sample to predict the curve from "
                    "(eval_queries 0): the backfill goes to its budget")
            return None
        log(f"budget advisor: predicted the backfill curve in {time.perf_counter() - started:.1f} s")
        log_prediction(client, plan, advice)
    for line in advisor.describe(advice, gain_below=gain_below):
        log(line)
    return advice


def _advice_result(advice: dict | None, gain_below: float | None) -> Advice | None:
    if advice is None:
        return None
    curves = ("agreement",) if advice.get("metric") == "agreement" else ("top1", "map")
    return {"recommendation": advisor.at_stop(advice, gain_below), "fractions": advice["fractions"],
            **{key: advice[key] for key in curves}}


def progress_key(store_uri: str, upgrade_id: str) -> str:
    """The Prefect progress artifact of one gallery's upgrade (lowercase, digits and dashes)."""
    import hashlib

    slug = "".join(c if c.isalnum() else "-" for c in upgrade_id.lower())[:80]
    return f"backfill-{slug}-{hashlib.sha1(store_uri.encode()).hexdigest()[:8]}"


def _backfill(client, gallery: Gallery, plan: planning.Plan, new_model, config, budget) -> dict:
    """Run the chunks the budget allows, ``max_concurrency`` at a time, measuring as they land;
    the bookkeeping is ``lifecycle.Backfill``'s."""
    store_uri = gallery.store.uri
    done = set(backfill.done_chunks(gallery.store, plan.id))
    limit = budget_items(budget, plan.num_items)
    cut, split = cut_for_limit(plan, done, limit)
    if split is not None:  # the stop falls inside a chunk: that chunk becomes two, so the stop is exact
        planning.write_plan(gallery.store, cut)
        log(f"chunk {split} of {plan.id} cut in two at item {limit}, where this run stops")
        plan = cut
    state = Backfill(plan, done, limit,
                     config.max_concurrency, failure_limit(config.max_failed_images, plan.num_items),
                     config.max_items_per_second, time.monotonic())
    if gallery.adopted:
        state.failed_images = backfill.failed_images(gallery.store, plan.id)
    log(f"backfill of {plan.id}: {len(state.done)}/{plan.num_chunks} chunks already done; {len(state.pending)} to go"
        + (f", budget {state.limit} items" if state.limit < plan.num_items else "")
        + (f", at most {config.max_items_per_second:g} items/s" if config.max_items_per_second else ""))
    tracker = UpgradeProgress(client, store_uri, plan, meter_for(gallery, plan, sorted(state.done)),
                              progress_key(store_uri, plan.id))
    tracker.measure(state.done)
    # log lines with rate and time left; a terminal's bar is the CLI's (it polls the store, wherever chunks run)
    shown = progress(f"backfill {plan.id}", total=min(state.limit, plan.num_items), log=log, initial=state.items_done,
                     mode="off" if resolve_mode() == "bar" else "log")
    ok = False

    def submit(chunk: int):
        return backfill_chunk.submit(store_uri, plan.id, chunk, new_model, config.batch_size, config.read_workers,
                                     config.precision)

    def landed(chunk: int, record: dict) -> None:
        if tracker.meter is not None:
            tracker.meter.land(record["start"], record["stop"], backfill.chunk_features(gallery.store, plan.id, chunk))
        tracker.chunk_done(state.done, state.items_done)
        shown.update_to(state.items_done)

    try:
        run_chunks(state, submit, landed)
        ok = True
    finally:
        shown.close(failed=not ok)
        tracker.close(ok)
    return state.summary()


def run_chunks(state: Backfill, submit: Callable[[int], Any], landed: Callable[[int, dict], None]) -> None:
    """Drive a backfill on the task runner (both layouts): the chunks ``state`` lets start
    (``submit(chunk)`` returns the chunk task's future), the next one started as soon as one
    lands, then ``landed(chunk, record)``; held back by the throttle, it waits its turn. The first
    failure stops new starts; what is in flight finishes, then it is raised."""
    in_flight: dict = {}

    def start() -> None:
        for chunk in state.to_start(time.monotonic()):
            in_flight[submit(chunk)] = chunk

    start()
    while in_flight or state.can_start_more:
        if not in_flight:  # held back by the throttle: wait for its turn
            time.sleep(max(state.wait_time(time.monotonic()), 0.01))
            start()
            continue
        future = next(as_completed(list(in_flight)))
        chunk = in_flight.pop(future)
        try:
            record = future.result()
        except BaseException as error:  # noqa: BLE001 - finish what is in flight, then raise
            state.failed(chunk, error)
            continue
        state.landed(chunk, record["count"], record.get("failed", []))
        for entry in record.get("failed", []):
            log(f"chunk {chunk}: item {entry['id']} keeps its transformed features: {entry['uri']}: {entry['reason']}")
        start()  # the next chunk starts before this one's bookkeeping
        landed(chunk, record)
    if state.failure is not None:
        raise state.failure


def _end(decider: UpgradeDecider, client, gallery: Gallery, plan: planning.Plan, promotion) -> dict:
    """The end of a complete backfill, as a recoverable sequence (``components.gallery.upgrade.ending``):
    the decision recorded first, then the gallery switched (or back on the champion's features),
    then the registry; the caller releases the lock last. A decision already recorded (a re-run
    after a kill) is completed, never measured again."""
    champion = gallery.model
    recorded = ending.decision(gallery.store, plan.id)
    steps = decider.ending(recorded, plan.id)
    for line in steps.say:
        log(line)
    if recorded is None:
        numbers = evaluate_gate(gallery.store.uri, plan, promotion.curve_points) if steps.measure else None
        fields, said = decider.decide(numbers, promotion, plan.id, plan.new, champion)
        for line in said:
            log(line)
        recorded = ending.write_decision(gallery.store, plan, champion=champion, **fields)
        if numbers is not None and plan.mlflow_run_id:
            log_gate(client, plan.mlflow_run_id, numbers)
    if recorded["passed"]:
        finish_upgrade(gallery.store.uri, plan)
    else:
        reject_upgrade(gallery.store.uri, plan, {"reasons": recorded["reasons"], "numbers": recorded["numbers"]})
    _follow_in_registry(client, gallery, recorded)
    return {**UpgradeDecider.ended(recorded), "champion": recorded["champion"]}


def _follow_in_registry(client, gallery: Gallery, decided: dict) -> None:
    """The end's registry step: the decision's tags on the version and the upgrade's run, and
    champion moved when it passed; then the decision says so."""
    plan = planning.load_plan(gallery.store, decided["upgrade"])
    follow_decision(client, plan, decided["tags"], promote=decided["passed"])
    ending.mark_registry_recorded(gallery.store, decided["upgrade"])


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


def named_state(result: dict, model_uri: str = "the new model"):
    """The state an upgrade's flow run ends in, when it is more than Completed: "Paused" (the
    budget or the advised stop ended the backfill; the upgrade is not over) or "Rejected" (the
    gate said no), both Completed states (the run did its work), with the result as data. A
    flow that runs the upgrade as a subflow (the deployment's) returns it too, so its own run
    tells the same. Called as a function, a flow returns the result dict either way."""
    from prefect.states import Completed

    if result.get("state") == "paused":
        return Completed(name="Paused", message=result.get("message"), data=result)
    if result.get("state") == "rejected":
        return Completed(name="Rejected", message=f"{model_uri} rejected by the promotion gate: "
                         + ("; ".join(_reasons(result)) or "see its decision.json"), data=result)
    return result


def _reasons(result: dict) -> list[str]:
    """Why the gate rejected: the gate's reasons of this run, or those of the decision it completed."""
    return (result.get("promotion") or {}).get("reasons") or (result.get("decided") or {}).get("reasons") or []


def _outcome(result: dict, store_uri: str, model_uri: str):
    """What the flow returns. A rejection by the gate ends the flow run in a state of its own, a
    Completed state named "Rejected" (the run did its work; its answer is no), and emits the
    Prefect event ``fastfill.upgrade.rejected`` (resource: the gallery) for an Automation to act
    on. Called as a function the flow returns the result dict either way."""
    if result.get("state") != "rejected":
        return result
    from prefect.events import emit_event

    upgrade = result.get("upgrade") or (result.get("decided") or {}).get("upgrade")
    numbers = {k: v for k, v in ((result.get("promotion") or {}).get("numbers") or {}).items()
               if isinstance(v, int | float | None)}
    emit_event(event=REJECTED_EVENT,
               resource={"prefect.resource.id": f"fastfill.gallery.{store_uri}", "prefect.resource.name": store_uri},
               payload={"upgrade": upgrade, "store": store_uri, "model": model_uri, "reasons": _reasons(result),
                        "numbers": numbers, "mlflow_run_id": result.get("mlflow_run_id")})
    return named_state(result, model_uri)
