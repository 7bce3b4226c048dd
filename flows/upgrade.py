"""The upgrade of a stored gallery, as Prefect runs it. ``upgrade_flow`` reads like the states
of ``components.gallery.lifecycle``: plan -> backfill (paused when the budget is reached) ->
promotion gate -> finish or reject. The steps below call tasks (tasks/gallery.py, with retries)
and decide with components (plan, backfill, lifecycle, promotion); queries are served from the
mixed gallery throughout. ``abort_flow`` drops an unfinished upgrade and ``rollback_flow`` undoes
a finished one (components.gallery.upgrade)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from prefect import flow
from prefect.futures import as_completed

from components.gallery import advisor, backfill as bf, judgments, plan as pl, upgrade as up
from components.gallery.upgrade import rejection as upgrade_rejection
from components.gallery.catalog import Gallery, GalleryError, check_registry, features_key, fetch_images, rows_at
from components.gallery.images import readable
from components.gallery.lifecycle import (
    SPLITS_SOURCE, Backfill, budget_items, check_map_fits, cut_for_limit, choose_map, failure_limit, needs_check,
    plan_fields, registered_map_order, TRUTH_JUDGMENTS, TRUTH_NONE, no_truth_refusal, truth_of,
)
from components.gallery.lock import acquire_lock
from components.gallery.store import configure_s3
from components.gallery.measure import meter_for
from components.gallery.store import StoreError
from components.gallery.promotion import decide, decision_tags, gate_message
from components.platform import registry
from components.experiment import registered
from components.platform.config import Params
from components.platform.registry import ModelRef
from components.platform.progress import progress, resolve_mode
from components.platform.vocabulary import UPGRADE_FLOW
from flows.parameters import resolve_params, run_parameters, store_of
from tasks._policy import log
from tasks.gallery import (
    UpgradeProgress, backfill_chunk, check_upgrade_map, close_upgrade_run, embed_images, evaluate_gate,
    finish_upgrade, gallery_pairs, load_model, open_upgrade_run, record_decision, reject_upgrade, split_pairs, store_at,
    train_upgrade_map, transform_part,
    write_sources,
)


def _upgrade_run_name() -> str:
    parameters = run_parameters()
    return f"upgrade {store_of(parameters)} to {parameters.get('to_uri') or 'challenger'}"


@flow(name=UPGRADE_FLOW, flow_run_name=_upgrade_run_name, log_prints=True)
def upgrade_flow(params: Params | None = None, store_uri: str | None = None, to_uri: str = "",
                 budget: float | int | None = None, break_lock: bool = False, gate: bool | None = None,
                 params_path: str | None = None, overrides: dict[str, Any] | None = None) -> dict:
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
    store_uri = store_uri or params.gallery.store
    gate = params.promotion.gate if gate is None else gate
    configure_s3(params.gallery.s3)  # S3 retries and timeouts of this process's clients
    store = store_at(store_uri)
    store.check()
    gallery = Gallery(store)
    check_registry(gallery.manifest(refresh=True), store.uri, registry.identity(params.mlflow))
    client, _ = registry.setup(params.mlflow)
    wanted = _wanted(params, client, gallery, to_uri)
    if wanted is None:
        result = _no_challenger(params, client, gallery)
        log(result["message"])
        return result
    lock = acquire_lock(store, pl.upgrade_id(gallery.model, wanted), break_lock=break_lock, log=log,
                        lease_seconds=params.gallery.upgrade.lease_seconds)
    try:
        # Under the lock, the gallery as it is now: another upgrade may have finished (or been
        # interrupted at its end) while this one started.
        gallery.manifest(refresh=True)
        _complete_interrupted_abort(gallery)
        ended = _complete_interrupted_ending(params, gallery)
        if ended is not None and _same(ModelRef.from_dict(ended["decided"]["new"]), wanted):
            return _outcome(ended, store.uri, wanted.uri)
        if _same(gallery.model, wanted):
            current = gallery.manifest().get("upgrade")
            if current:
                moving = pl.load_plan(store, current)
                raise GalleryError(f"the gallery at {store.uri} is already built with {wanted.uri}, and upgrade {current}"
                                   f" is half done; run `fastfill upgrade --to {moving.new.uri if moving else '...'}` "
                                   "to finish it")
            log(f"the gallery at {store.uri} is already built with {wanted.uri}; nothing to upgrade")
            return _nothing_to_do(gallery, wanted)
        champion, new, new_model, base = _target(params, gallery, wanted)
        old = base.new if base is not None else champion
        uid = pl.upgrade_id(old, new)
        _start_over_if_undone(gallery, uid)
        _refuse_rejected(store, uid)
        _decide_truth(params, gallery, gate)  # before any embedding
        plan = _resume(gallery, uid) or _plan(params, gallery, store_uri, uid, old, new, new_model, base)
        advice = _advice(params, gallery, plan)
        budget = budget if budget is not None else params.gallery.upgrade.budget
        stop = _advised_stop(params, advice, budget)
        result = _backfill(params, gallery, store_uri, plan, new_model, stop["items"] if stop else budget)
        plan = pl.load_plan(store, plan.id)  # as the backfill left it (a stop inside a chunk cuts it)
        result["mlflow_run_id"] = plan.mlflow_run_id
        if advice is not None:
            curves = ("agreement",) if advice.get("metric") == "agreement" else ("top1", "map")
            result["advice"] = {"recommendation": advisor.at_stop(advice, params.gallery.upgrade.stop_when_gain_below),
                                "fractions": advice["fractions"], **{key: advice[key] for key in curves}}
        if not result["complete"]:
            if stop:
                metric = "top-1" if stop.get("metric", "top1") == "top1" else "agreement"
                log(f"stopped at {result['items_done']}/{plan.num_items} items: the recommended stop for a gain below "
                    f"{stop['gain_below']:g} {metric} points per 5% ({100 * stop['fraction']:.0f}%); queries are served "
                    "by the mixed gallery. To go on, run again with a --budget, or without stop_when_gain_below")
                return {**result, "state": "paused", "stopped": "recommended"}
            log(f"stopped at {result['items_done']}/{plan.num_items} items (budget); run the same command to go on")
            return {**result, "state": "paused", "stopped": "budget"}
        result.update(_end(params, store_uri, gallery, plan, champion, gate))
        log(f"upgrade {uid} complete: the gallery's model is now {new.uri}" if result["state"] == "complete" else
            f"upgrade {uid} rejected: the gallery serves {champion.uri}'s features again")
        return _outcome(result, store.uri, new.uri)
    finally:
        lock.release()  # the last step of every ending


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


def dry_run_upgrade(params: Params, store_uri: str, to_uri: str = "") -> dict:
    """What ``upgrade_flow`` would do (components.gallery.estimate), writing nothing: no plan,
    no lock, no MLflow run."""
    from components.gallery.estimate import dry_run

    configure_s3(params.gallery.s3)
    store = store_at(store_uri)
    store.check()
    gallery = Gallery(store)
    gallery.manifest(refresh=True)
    client, _ = registry.setup(params.mlflow)
    new = _wanted(params, client, gallery, to_uri)
    if new is None:
        return {"from": gallery.model.uri, "to": None, **_no_challenger(params, client, gallery)}
    config = params.gallery.upgrade
    truth = truth_of(gallery.labels() is not None, config.judgments)
    truth_line = {TRUTH_NONE: "none: the gallery has no labels and no judged queries are configured; "
                  + ("the upgrade would be refused before planning (promotion.gate true)" if params.promotion.gate
                     else "the upgrade runs ungated"),
                  TRUTH_JUDGMENTS: f"the judged queries of {config.judgments}",
                  }.get(truth, "the gallery's labels")
    model = registered.load_model(new.uri).eval()
    result = dry_run(gallery, config, model, seed=config.seed)
    current = gallery.manifest().get("upgrade")
    resumes = current == pl.upgrade_id(gallery.model, ModelRef(new.name, new.version, model.embedding_dim))
    return {"from": gallery.model.uri, "to": new.uri, "in_progress": current, "resumes": resumes, **result,
            "truth": truth_line, "map_pairs": _pairs_description(params, gallery), "advice": _dry_run_advice(params, gallery, new, model, current if resumes else None,
                                      sequential=bool(current) and not resumes)}


def _dry_run_advice(params: Params, gallery: Gallery, new: ModelRef, model, resumes: str | None,
                    sequential: bool) -> dict:
    """The budget advisor's prediction without writing anything: the stored one of the upgrade
    this would resume; else, when the registry holds a map joining the two versions, computed
    here (the evaluation sample embedded with the new model, the gallery's features sent
    through the map part by part, twice: its sigma order first, then the search). Otherwise a
    note saying when the prediction appears."""
    from components.evaluation.ordering import random_order, sigma_order
    from components.experiment.inference import apply_alignment

    config = params.gallery.upgrade
    gain_below = config.stop_when_gain_below
    if resumes:
        stored = advisor.stored_advice(gallery.store, resumes)
        if stored is not None:
            return {**stored, "recommendation": advisor.at_stop(stored, gain_below)}
    labels = gallery.labels()
    if truth_of(labels is not None, config.judgments) == TRUTH_NONE and params.promotion.gate:
        return {"note": "no prediction: the upgrade would be refused before planning: "
                        + no_truth_refusal(gallery.store.uri)}
    if config.eval_queries == 0:
        return {"note": "no prediction: gallery.upgrade.eval_queries is 0, so there is no evaluation sample"}
    if sequential:
        return {"note": "no prediction before a sequential upgrade is planned; `fastfill upgrade status` shows it then"}
    source = _pairs_source(params, gallery.store.uri)
    chosen = _registry_map(params, gallery.model, new, source)
    if chosen is None:
        return {"note": f"no prediction yet: the registry has no map from {gallery.model.uri} to {new.uri}; the upgrade "
                        f"trains one when it plans (on {_pairs_description(params, gallery)}), and `fastfill upgrade "
                        "status` then shows the predicted curve"}
    if params.align[config.method].check != "off" and needs_check(chosen.tags, source, config.recheck):
        return {"note": f"no prediction yet: the registry's map (version {chosen.version}) has not passed its check on "
                        f"{source}; the upgrade checks it first (on {_pairs_description(params, gallery)}) and may "
                        "replace it, and `fastfill upgrade status` then shows the predicted curve"}
    order_kind, _ = registered_map_order(chosen.tags, config.order)
    alignment_map = registered.load_model(f"models:/{params.mlflow.alignment_model}/{chosen.version}").eval()
    positions = pl.eval_sample(labels, None if config.eval_queries == "all" else int(config.eval_queries), config.seed,
                               gallery.num_items)
    images, failures = fetch_images(gallery, positions, workers=config.read_workers)
    keep = readable(len(positions), failures)
    positions = positions[keep]
    from components.experiment.inference import embed

    queries = embed(model, images[keep], batch_size=config.batch_size, precision=config.precision)
    judged = _judged_queries(params, gallery, model, {})[:2] if config.judgments else None
    prefilled = positions  # what planning embeds and backfills first: the sample, and the judged query items
    if judged is not None:
        prefilled = np.union1d(positions, judged[0].query_positions[judged[0].query_positions >= 0])

    def transformed(part: int):
        return apply_alignment(alignment_map, gallery.features(gallery.model, part))

    if order_kind == "sigma":
        sigma = [transformed(p)[1] for p in range(gallery.num_parts)]
        if any(s is None for s in sigma):
            return {"note": f"no prediction: the registry's map (version {chosen.version}) has no uncertainty head "
                            "for the sigma order; use --order random"}
        order = sigma_order(np.concatenate(sigma))
    else:
        order = random_order(gallery.num_items, config.seed)
    # the evaluation sample is embedded while planning and backfilled first: its stand-in places
    ranks = pl.stand_in_ranks(order, prefilled, positions, config.seed)
    old_side = rows_at(gallery, positions, lambda part: features_key(gallery.model, part))
    prediction = advisor.predict_upgrade(
        positions, queries, apply_alignment(alignment_map, old_side)[0], ranks, gallery.num_items,
        lambda: ((gallery.part_bounds(p)[0], transformed(p)[0]) for p in range(gallery.num_parts)), order,
        labels=labels, judged=judged, distance=params.gallery.distance, gain_below=gain_below)
    return {**prediction, "map_version": str(chosen.version)}


def _pairs_description(params: Params, gallery: Gallery) -> str:
    config = params.gallery.upgrade
    if config.map_pairs == "splits":
        return "this host's new-train split"
    from components.gallery.pairs import map_sample_size

    return (f"a sample of {map_sample_size(config.map_sample, config.map_sample_min, gallery.num_items):,} gallery "
            "items, embedded once and kept as backfilled")


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


# ------------------------------------------------------------------------------------------------
# The steps


def _same(a: ModelRef, b: ModelRef) -> bool:
    return (a.name, str(a.version)) == (b.name, str(b.version))


def _wanted(params: Params, client, gallery: Gallery, to_uri: str) -> ModelRef | None:
    """The model to upgrade to: ``to_uri``, else the registry's challenger. Without a challenger
    (the convention clears it once its version is promoted) the upgrade this gallery is in the
    middle of, if any, so that the same command resumes or completes it; None when there is
    nothing to upgrade to. An unknown model, or a registry without the registered model, is
    refused as such."""
    name = params.mlflow.registered_model
    if to_uri:
        return registry.resolve_model(client, to_uri)
    version = registry.alias_version(client, name, registry.CHALLENGER)
    if version is not None:
        return ModelRef(name, version)
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException:  # no such registered model: refused with what the registry holds
        registry.resolve_model(client, f"models:/{name}@{registry.CHALLENGER}")
        raise
    ending = up.interrupted_ending(gallery)
    if ending is not None:
        return ModelRef.from_dict(ending["new"])
    current = gallery.manifest().get("upgrade")
    plan = pl.load_plan(gallery.store, current) if current else None
    return plan.new if plan is not None else None


def _no_challenger(params: Params, client, gallery: Gallery) -> dict:
    """Nothing to upgrade because no version is the challenger: a success that says so."""
    name = params.mlflow.registered_model
    champion = registry.alias_version(client, name, registry.CHAMPION)
    serving = gallery.model
    where = ("which the gallery serves" if champion == str(serving.version) and name == serving.name else
             f"while the gallery serves {serving.uri}")
    held = f"champion is version {champion}" if champion else f"no `{registry.CHAMPION}` either"
    message = (f"{name} has no `{registry.CHALLENGER}` ({held}, {where}); nothing to "
               f"upgrade. Set the alias `{registry.CHALLENGER}` on a new version, or pass --to models:/{name}/VERSION")
    return {**_nothing_to_do(gallery, serving), "message": message}


def _nothing_to_do(gallery: Gallery, model: ModelRef) -> dict:
    n = gallery.num_items
    return {"state": "up-to-date", "model": model.uri, "items": n, "items_done": n, "fraction": 1.0,
            "complete": True, "mlflow_run_id": None}


REJECTED_EVENT = "fastfill.upgrade.rejected"


def _outcome(result: dict, store_uri: str, model_uri: str):
    """What the flow returns. A rejection by the gate ends the flow run in a state of its own, a
    Completed state named "Rejected" (the run did its work; its answer is no), and emits the
    Prefect event ``fastfill.upgrade.rejected`` (resource: the gallery) for an Automation to act
    on. Called as a function the flow returns the result dict either way."""
    if result.get("state") != "rejected":
        return result
    from prefect.events import emit_event
    from prefect.states import Completed

    decided = result.get("decided") or {}
    promotion = result.get("promotion") or {}
    upgrade = result.get("upgrade") or decided.get("upgrade")
    reasons = promotion.get("reasons") or decided.get("reasons") or []
    numbers = {k: v for k, v in (promotion.get("numbers") or {}).items() if isinstance(v, int | float | None)}
    emit_event(event=REJECTED_EVENT,
               resource={"prefect.resource.id": f"fastfill.gallery.{store_uri}", "prefect.resource.name": store_uri},
               payload={"upgrade": upgrade, "store": store_uri, "model": model_uri, "reasons": reasons,
                        "numbers": numbers, "mlflow_run_id": result.get("mlflow_run_id")})
    message = f"{model_uri} rejected by the promotion gate: " + ("; ".join(reasons) or "see its decision.json")
    return Completed(name="Rejected", message=message, data=result)


def _target(params: Params, gallery: Gallery, new: ModelRef):
    """(champion, the new model's ref and loaded model, the unfinished upgrade to start from or
    None). A new model that arrives while an upgrade is unfinished starts a sequential upgrade."""
    champion = gallery.model
    base = None
    current = gallery.manifest().get("upgrade")
    if current:
        plan = pl.load_plan(gallery.store, current)
        if plan is not None and (plan.new.name, plan.new.version) != (new.name, new.version):
            base = plan
            log(f"{gallery.store.uri} is in the middle of upgrade {current} to {plan.new.uri}: {new.uri} starts a "
                "sequential upgrade from the gallery as it stands")
    new_model = load_model(params.mlflow, new)
    return champion, ModelRef(new.name, new.version, new_model.embedding_dim), new_model, base


def _end(params: Params, store_uri: str, gallery: Gallery, plan: pl.Plan, champion: ModelRef, gate: bool) -> dict:
    """The end of a complete backfill, as a recoverable sequence (components.gallery.upgrade):
    the decision recorded first, then the gallery switched (or back on the champion's features),
    then the registry; the caller releases the lock last. A decision already recorded (a re-run
    after a kill) is completed, never measured again."""
    decided = up.decision(gallery.store, plan.id)
    if decided is None:
        if gate:
            numbers = evaluate_gate(store_uri, plan, params.promotion)
            passed, reasons = decide(numbers, params.promotion)
            log(gate_message(numbers, passed, reasons, plan.new.uri, champion.uri))
            tags = decision_tags(passed, reasons, numbers, champion.version, plan.id)
        else:
            numbers, passed, reasons = None, True, []
            tags = {"promotion": "ungated", "promotion.upgrade": plan.id}
        decided = up.record_decision(gallery.store, plan, passed=passed, reasons=reasons, numbers=numbers, tags=tags,
                                     champion=champion)
        if numbers is not None and plan.mlflow_run_id:
            client, _ = registry.setup(params.mlflow)
            registry.log_series(client, plan.mlflow_run_id, {"gate.top1": numbers["top1"], "gate.nfr1": numbers["nfr1"]})
            registry.log_metrics(client, plan.mlflow_run_id, {f"gate.{k}": numbers[k] for k in
                                 ("champion_top1", "top1_auc", "top1_auc_gain", "nfr1_mean")})
    else:
        log(f"completing the end of upgrade {plan.id}: its decision ({'passed' if decided['passed'] else 'rejected'}, "
            f"{decided['decided']}) was recorded before the last run stopped")
    if decided["passed"]:
        finish_upgrade(store_uri, plan)
    else:
        reject_upgrade(store_uri, plan, {"reasons": decided["reasons"], "numbers": decided["numbers"]})
    _follow_in_registry(params, gallery, decided)
    return _ending_result(decided)


def _ending_result(decided: dict) -> dict:
    result = {"state": "complete" if decided["passed"] else "rejected"}
    if decided["numbers"] is not None:
        result["promotion"] = {"passed": decided["passed"], "reasons": decided["reasons"], "numbers": decided["numbers"]}
    return result


def _follow_in_registry(params: Params, gallery: Gallery, decided: dict) -> None:
    """Step 3 of the ending: the decision's tags on the version and the upgrade's run, and
    champion moved when it passed; then the decision says so."""
    plan = pl.load_plan(gallery.store, decided["upgrade"])
    record_decision(params.mlflow, plan, decided["tags"], promote=decided["passed"])
    up.mark_registry_recorded(gallery.store, decided["upgrade"])


def _complete_interrupted_ending(params: Params, gallery: Gallery) -> dict | None:
    """An upgrade killed after its gallery switched (or went back) but before the registry
    followed is completed now; returns its result, or None when there is none."""
    decided = up.interrupted_ending(gallery)
    if decided is None:
        return None
    log(f"upgrade {decided['upgrade']} was interrupted at its end, after the gallery "
        f"{'switched' if decided['passed'] else 'went back'}: recording its decision in the registry now")
    _follow_in_registry(params, gallery, decided)
    n = gallery.num_items
    return {**_ending_result(decided), "items": n, "items_done": n, "fraction": 1.0, "complete": True,
            "resumed_ending": True, "decided": decided, "mlflow_run_id": pl.load_plan(gallery.store, decided["upgrade"]).mlflow_run_id}


def _complete_interrupted_abort(gallery: Gallery) -> None:
    """An abort that recorded itself but stopped before the gallery went back is completed
    first: the upgrade it dropped is never resumed, nor started from."""
    current = gallery.manifest().get("upgrade")
    if current and up.aborted(gallery.store, current) is not None:
        log(f"upgrade {current} was aborted, but the abort stopped before the gallery went back to its own model's "
            "features; completing the abort first")
        up.abort(gallery, current)


def _start_over_if_undone(gallery: Gallery, uid: str) -> None:
    """An upgrade that was aborted or rolled back and is asked for again is planned from
    scratch, never resumed: the user ended it, so its old plan and chunks count for nothing."""
    undone = up.start_over(gallery, uid)
    if undone is not None:
        when = undone.get("aborted") or undone.get("rolled_back")
        by = undone.get("by") or {}
        log(f"upgrade {uid} was {undone['ended']} on {when} by {by.get('user')}@{by.get('host')}; planning it again "
            "from scratch (its earlier objects were removed)")


def _refuse_rejected(store, uid: str) -> None:
    rejected = upgrade_rejection(store, uid)
    if rejected is not None:
        raise GalleryError(f"upgrade {uid} was rejected by the promotion gate on {rejected['rejected']} "
                           f"({'; '.join(rejected.get('reasons', []))}); register a better version")


def _decide_truth(params: Params, gallery: Gallery, gate: bool) -> str:
    """What the gate and the advisor measure against (``lifecycle.truth_of``), decided before any
    work: with nothing, the gate's policy decides up front (refused, or run ungated)."""
    truth = truth_of(gallery.labels() is not None, params.gallery.upgrade.judgments)
    if truth == TRUTH_NONE and gate:
        raise GalleryError(no_truth_refusal(gallery.store.uri))
    if truth == TRUTH_NONE:
        log(f"{gallery.store.uri} has no labels and no judged queries: the upgrade runs ungated (promotion.gate false), "
            "and no retrieval is measured along the backfill")
    elif truth == TRUTH_JUDGMENTS:  # read and checked against the gallery now, before any work
        judged = judgments.load_judgments(params.gallery.upgrade.judgments, gallery.ids())
        log(f"the gate measures against {judged.describe()}")
    return truth


def _resume(gallery: Gallery, uid: str) -> pl.Plan | None:
    """The upgrade's plan if it was made before (the gallery pointed at it again if a crash came
    between the plan and that switch), else None."""
    plan = pl.load_plan(gallery.store, uid)
    if plan is not None:
        log(f"resuming upgrade {uid}")
        if gallery.manifest(refresh=True).get("upgrade") != uid:
            gallery.write_manifest({**gallery.manifest(), "upgrade": uid})
    return plan


def _pairs_source(params: Params, store_uri: str) -> str:
    from components.gallery.pairs import gallery_source

    return SPLITS_SOURCE if params.gallery.upgrade.map_pairs == "splits" else gallery_source(store_uri)


def _registry_map(params: Params, old: ModelRef, new: ModelRef, source: str):
    """The registry's map version for this pair of versions that the upgrade would use (see
    ``lifecycle.choose_map``), or None."""
    client, _ = registry.setup(params.mlflow)
    return choose_map(registry.find_alignment(client, params.mlflow.alignment_model, old.version, new.version),
                      params.gallery.upgrade.order, source)


def _map_sample(params: Params, gallery: Gallery) -> np.ndarray:
    from components.gallery.pairs import map_sample_size, sample_positions

    config = params.gallery.upgrade
    size = map_sample_size(config.map_sample, config.map_sample_min, gallery.num_items)
    return sample_positions(gallery.num_items, size, config.seed)


def _map_pairs(params: Params, gallery: Gallery, store_uri: str, uid: str, old_model_ref: ModelRef, new_model,
               sequential: bool):
    """The pairs that train and check the map, from ``gallery.upgrade.map_pairs``."""
    config = params.gallery.upgrade
    if config.map_pairs == "splits":
        return split_pairs(params, load_model(params.mlflow, old_model_ref), new_model)
    positions = _map_sample(params, gallery)
    log(f"map sample: {len(positions)} of {gallery.num_items} gallery items (gallery.upgrade.map_sample "
        f"{config.map_sample}, at least {config.map_sample_min})")
    return gallery_pairs(store_uri, positions, new_model, config, uid if sequential else None)


def _alignment_map(params: Params, gallery: Gallery, store_uri: str, uid: str, old: ModelRef, new: ModelRef,
                   new_model, run_id: str, sequential: bool):
    """(map, its URI, the backfill order, the pairs embedded for it or None): the registry's map
    for this pair of versions, checked first on this upgrade's pairs unless it already passed on
    the same source (``recheck`` forces it); or a map trained now on those pairs and checked."""
    config = params.gallery.upgrade
    source = _pairs_source(params, gallery.store.uri)
    chosen = _registry_map(params, old, new, source)
    policy = params.align[config.method].check
    if chosen is not None:
        map_uri = f"models:/{params.mlflow.alignment_model}/{chosen.version}"
        order, why = registered_map_order(chosen.tags, config.order)
        log(f"alignment map from the registry: {map_uri} ({chosen.tags.get('method')})" + (f"; it is {why}" if why else ""))
        alignment_map = registered.load_model(map_uri).eval()
        if policy == "off" or not needs_check(chosen.tags, source, config.recheck):
            said = (f"align.{config.method}.check is off" if policy == "off" else
                    "an l2-only map needs no check" if chosen.tags.get("method") == "fct" else
                    f"it passed its check on {source} (check: {chosen.tags.get('check')}); --recheck checks it again")
            log(f"{map_uri} is used as it is: {said}")
            _tag_run(params, run_id, {"check": f"not repeated ({said})", "map_version": str(chosen.version)})
            return alignment_map, map_uri, order, None
        pairs = _map_pairs(params, gallery, store_uri, uid, old, new_model, sequential)
    else:
        pairs = _map_pairs(params, gallery, store_uri, uid, old, new_model, sequential)
        alignment_map, map_uri = train_upgrade_map(params, pairs, new_model, old, new, run_id)
        order = config.order
    alignment_map, map_uri, order = check_upgrade_map(params, alignment_map, map_uri, pairs, new_model, old, new,
                                                      run_id, order)
    _tag_run(params, run_id, {"map_version": map_uri.rsplit("/", 1)[1]})
    return alignment_map, map_uri, order, pairs


def _tag_run(params: Params, run_id: str, tags: dict) -> None:
    client, _ = registry.setup(params.mlflow)
    for key, value in tags.items():
        client.set_tag(run_id, key, value)


def _plan(params: Params, gallery: Gallery, store_uri: str, uid: str, old: ModelRef, new: ModelRef,
          new_model, base: pl.Plan | None = None) -> pl.Plan:
    """Map (checked), transformed features and sigma, order, evaluation sample; plan.json last.
    With ``base`` (an unfinished upgrade to ``old``), a sequential upgrade: the map applies to the
    gallery as that upgrade left it, so items still on the gallery's model go through both maps.
    A gallery whose parts are missing or foreign is refused before anything is written; one whose
    content fails while planning (a NaN, a torn part) is refused and what planning wrote is removed."""
    config = params.gallery.upgrade
    pl.check_sources(gallery, sequential=base is not None)  # before anything is written
    leftover = pl.discard_unplanned(gallery, uid)  # a killed planning's objects (its prefilled chunks too)
    if leftover:
        log(f"removed {leftover} object(s) that a planning of {uid} killed before its plan was written had left")
    run_id = open_upgrade_run(params, plan_fields(config, uid, old.uri, new.uri, base.id if base else None), store_uri)
    try:
        return _make_plan(params, gallery, store_uri, uid, old, new, new_model, base, run_id)
    except (GalleryError, StoreError) as error:
        discarded = pl.discard_unplanned(gallery, uid)
        close_upgrade_run(params, run_id, "FAILED", f"planning refused: {error}")
        log(f"planning refused; {discarded} object(s) it had written under upgrades/{uid}/ were removed, so the store "
            "is as it was")
        raise


def _make_plan(params: Params, gallery: Gallery, store_uri: str, uid: str, old: ModelRef, new: ModelRef,
               new_model, base: pl.Plan | None, run_id: str) -> pl.Plan:
    config = params.gallery.upgrade
    if base is not None:  # first: the map's pairs and transform start from the gallery as base left it
        write_sources(store_uri, uid, base)
        log(f"sequential upgrade: starting from {base.id} as it stands ({len(bf.done_chunks(gallery.store, base.id))}"
            f"/{base.num_chunks} chunks on {base.new.uri}, the rest through its map)")
    alignment_map, map_uri, order_kind, pairs = _alignment_map(params, gallery, store_uri, uid, old, new, new_model,
                                                               run_id, base is not None)
    check_map_fits(alignment_map, map_uri, order_kind, old.dim, new.dim, new.uri)
    futures = [transform_part.submit(store_uri, uid, alignment_map, p, base is not None) for p in range(gallery.num_parts)]
    with progress("planning: the gallery's features through the map", total=gallery.num_items, log=log) as bar:
        for future in as_completed(futures):
            bar.advance(future.result())
    order = pl.make_order(gallery, uid, order_kind, config.seed)
    embedded = dict(zip(pairs.positions.tolist(), pairs.new)) if pairs is not None and pairs.positions is not None else {}
    judged = _judged_queries(params, gallery, new_model, embedded) if config.judgments else None
    positions, queries = _evaluation_sample(params, gallery, new_model, embedded)
    embedded.update(zip(positions.tolist(), queries) if queries is not None else ())
    # the items embedded while planning are backfilled from the start: the first chunks of the order
    prefilled = np.fromiter(sorted(embedded), dtype=np.int64, count=len(embedded))
    ranks = pl.stand_in_ranks(order, prefilled, positions, config.seed) if len(prefilled) and queries is not None else None
    if len(prefilled):
        order = pl.front_loaded(order, prefilled)
    plan = pl.Plan(uid, old, new, map_uri, order_kind, config.chunk_size, gallery.num_items,
                   len(positions) if queries is not None else 0, params.gallery.distance, run_id,
                   base=base.id if base else None, bounds=pl.chunk_grid(gallery.num_items, config.chunk_size,
                                                                       [len(prefilled)]),
                   prefilled=len(prefilled))
    if len(prefilled):
        chunks = bf.write_prefilled(gallery.store, plan, order, embedded)
        log(f"{len(prefilled)} items embedded while planning (map sample and evaluation sample) are backfilled "
            f"first: chunks 0-{chunks - 1} written")
    if judged is not None:
        judgments.store_judged(gallery.store, uid, *judged)
    pl.commit_plan(gallery, plan, order, positions, queries, ranks)
    log(f"planned {uid}: {plan.num_chunks} chunks of {plan.chunk_size}, {plan.order_kind} order"
        + (f", {plan.prefilled} items already backfilled" if plan.prefilled else "")
        + f"; queries now use {new.uri} against the mixed gallery")
    return plan


def _judged_queries(params: Params, gallery: Gallery, new_model, embedded: dict) -> tuple:
    """The judged queries (``gallery.upgrade.judgments``) resolved against the gallery, with
    their features on both sides of the gate: a gallery item's new features are embedded here
    (and join ``embedded``, so they are backfilled from the start) and its champion features are
    the stored ones; an image query is embedded by both models."""
    from components.gallery.catalog import features_key, rows_at
    from components.gallery.images import read_images

    config = params.gallery.upgrade
    judged = judgments.load_judgments(config.judgments, gallery.ids())
    log(judged.describe())
    items = judged.query_positions[judged.query_positions >= 0]
    missing = np.array([p for p in items.tolist() if p not in embedded], dtype=np.int64)
    if len(missing):
        images, failures = fetch_images(gallery, missing, workers=config.read_workers)
        if failures:
            raise GalleryError(f"{len(failures)} judged query images could not be read (first: {failures[0].uri}: "
                               f"{failures[0].reason}); fix them or leave those queries out of {config.judgments}")
        embedded.update(zip(missing.tolist(), embed_images(new_model, images, config.batch_size, config.precision)))
    inside, outside = np.flatnonzero(judged.query_positions >= 0), judged.image_queries
    new_rows, old_rows = {}, {}
    if len(inside):
        new_rows.update(zip(inside.tolist(), (embedded[int(p)] for p in judged.query_positions[inside])))
        old_rows.update(zip(inside.tolist(), rows_at(gallery, judged.query_positions[inside],
                                                     lambda part: features_key(gallery.model, part))))
    if len(outside):
        images, failures = read_images([judged.query_uris[i] for i in outside], gallery.manifest()["image_shape"],
                                       root=gallery.image_root, workers=config.read_workers)
        if failures:
            raise GalleryError(f"{len(failures)} judged query images could not be read (first: {failures[0].uri}: "
                               f"{failures[0].reason}); fix them or leave those queries out of {config.judgments}")
        champion = load_model(params.mlflow, gallery.model)
        new_rows.update(zip(outside.tolist(), embed_images(new_model, images, config.batch_size, config.precision)))
        old_rows.update(zip(outside.tolist(), embed_images(champion, images, config.batch_size, config.precision)))
    new = np.stack([new_rows[i] for i in range(len(judged))]).astype(np.float32)
    old = np.stack([old_rows[i] for i in range(len(judged))]).astype(np.float32)
    return judged, new, old


def _evaluation_sample(params: Params, gallery: Gallery, new_model, embedded: dict) -> tuple:
    """(positions, new-model features) of the evaluation sample, or (empty, None) without one;
    items already embedded while planning (the map sample) are not embedded again."""
    config = params.gallery.upgrade
    positions = pl.eval_sample(gallery.labels(), None if config.eval_queries == "all" else int(config.eval_queries),
                               config.seed, gallery.num_items)
    missing = np.array([p for p in positions.tolist() if p not in embedded], dtype=np.int64)
    images, failures = fetch_images(gallery, missing, workers=config.read_workers) if len(missing) else (None, [])
    if failures:
        log(f"evaluation sample: {len(failures)} of {len(positions)} images could not be read and are left out "
            f"(first: {failures[0].uri}: {failures[0].reason})")
        keep = readable(len(missing), failures)
        unreadable = set(missing[~keep].tolist())
        missing, images = missing[keep], images[keep]
        positions = np.array([p for p in positions.tolist() if p not in unreadable], dtype=np.int64)
    if len(positions) < 2:
        return positions, None
    fresh = embed_images(new_model, images, config.batch_size, config.precision,
                         label="embedding the evaluation sample") if len(missing) else None
    new_of = {**embedded, **(dict(zip(missing.tolist(), fresh)) if fresh is not None else {})}
    return positions, np.stack([new_of[int(p)] for p in positions]).astype(np.float32)


def _advice(params: Params, gallery: Gallery, plan: pl.Plan) -> dict | None:
    """The budget advisor's prediction for the planned upgrade (stored beside the plan, made
    once), logged as lines and, the first time, to the upgrade's MLflow run as the series
    predicted_top1 and predicted_map (step: items backfilled)."""
    gain_below = params.gallery.upgrade.stop_when_gain_below
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
        client, _ = registry.setup(params.mlflow)
        steps = [int(f * plan.num_items) for f in advice["fractions"]]
        series = ({"predicted_agreement": advice["agreement"]} if advice.get("metric") == "agreement" else
                  {"predicted_top1": advice["top1"], "predicted_map": advice["map"]})
        registry.log_series(client, plan.mlflow_run_id, series, steps=steps)
    for line in advisor.describe(advice, gain_below=gain_below):
        log(line)
    return advice


def _advised_stop(params: Params, advice: dict | None, budget) -> dict | None:
    """The recommended stop when stop_when_gain_below asks for one and no explicit budget is
    given (a budget is the user's own limit and wins); None when it is 100%."""
    gain_below = params.gallery.upgrade.stop_when_gain_below
    if gain_below is None or advice is None or budget is not None:
        return None
    stop = advisor.at_stop(advice, gain_below)
    return stop if stop["fraction"] < 1 else None


def progress_key(store_uri: str, upgrade_id: str) -> str:
    """The Prefect progress artifact of one gallery's upgrade (lowercase, digits and dashes)."""
    import hashlib

    slug = "".join(c if c.isalnum() else "-" for c in upgrade_id.lower())[:80]
    return f"backfill-{slug}-{hashlib.sha1(store_uri.encode()).hexdigest()[:8]}"


def _backfill(params: Params, gallery: Gallery, store_uri: str, plan: pl.Plan, new_model, budget) -> dict:
    """Run the chunks the budget allows, ``max_concurrency`` at a time, measuring as they land;
    the bookkeeping is ``lifecycle.Backfill``'s."""
    config = params.gallery.upgrade
    done = set(bf.done_chunks(gallery.store, plan.id))
    limit = budget_items(budget, plan.num_items)
    cut, split = cut_for_limit(plan, done, limit)
    if split is not None:  # the stop falls inside a chunk: that chunk becomes two, so the stop is exact
        pl.write_plan(gallery.store, cut)
        log(f"chunk {split} of {plan.id} cut in two at item {limit}, where this run stops")
        plan = cut
    state = Backfill(plan, done, limit,
                     config.max_concurrency, failure_limit(config.max_failed_images, plan.num_items),
                     config.max_items_per_second, time.monotonic())
    if gallery.adopted:
        state.failed_images = bf.failed_images(gallery.store, plan.id)
    log(f"backfill of {plan.id}: {len(state.done)}/{plan.num_chunks} chunks already done; {len(state.pending)} to go"
        + (f", budget {state.limit} items" if state.limit < plan.num_items else "")
        + (f", at most {config.max_items_per_second:g} items/s" if config.max_items_per_second else ""))
    tracker = UpgradeProgress(params, store_uri, plan, meter_for(gallery, plan, sorted(state.done)),
                              progress_key(store_uri, plan.id))
    tracker.measure(state.done)
    # log lines with rate and time left; a terminal's bar is the CLI's (it polls the store, wherever chunks run)
    shown = progress(f"backfill {plan.id}", total=min(state.limit, plan.num_items), log=log, initial=state.items_done,
                     mode="off" if resolve_mode() == "bar" else "log")
    in_flight: dict = {}
    ok = False

    def start() -> None:
        for chunk in state.to_start(time.monotonic()):
            in_flight[backfill_chunk.submit(store_uri, plan.id, chunk, new_model, config.batch_size,
                                            config.read_workers, config.precision)] = chunk

    try:
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
            if tracker.meter is not None:
                tracker.meter.land(record["start"], record["stop"], bf.chunk_features(gallery.store, plan.id, chunk))
            tracker.chunk_done(state.done, state.items_done)
            shown.update_to(state.items_done)
        if state.failure is not None:
            raise state.failure
        ok = True
    finally:
        shown.close(failed=not ok)
        tracker.close(ok)
    return state.summary()
