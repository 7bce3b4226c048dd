"""The upgrade of a gallery kept as a Lance table (gallery.layout lance), as Prefect runs it.

The same course as ``flows/upgrade.py`` on the parts layout, in fewer steps:

1. the target (the challenger, or ``to_uri``) and the upgrade lock, a lease object beside the table;
2. planning, unless the table already holds this upgrade's columns: the registry's map for the two
   versions (checked on a sample of the gallery unless it passed on it before), or one trained
   on that sample; h(old), sigma and the order into the table (the record last);
3. the backfill: every chunk not yet committed, ``max_concurrency`` at a time on the task runner,
   then the chunks folded into the gallery table;
4. the gate: judged queries (gallery.upgrade.judgments, kept beside the plan) against the whole
   table, else a labelled sample of the gallery (``--no-gate``: none); the decision is recorded
   beside the table before anything changes, so a re-run completes it and never measures again;
5. finish (the new features serve) or, rejected, the upgrade's columns dropped; then the
   registry: the decision's tags, and champion moved when it passed; the lock released last.

A re-run of the same command resumes a killed upgrade from its landed chunks. What this flow
does not do yet on the table (the parts layout does): dry runs, sequential upgrades, the budget
advisor, a budget's stop inside a chunk, and progress measured as chunks land.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from prefect import flow, task

from components.gallery.upgrade import ending, planning, samples, table_upgrade, usage

from components.gallery.inputs import judgments
from components.gallery.layouts.catalog import GalleryError
from components.gallery.upgrade.decider import UpgradeDecider
from components.gallery.layouts.lance_table import LanceGallery
from components.gallery.upgrade.lifecycle import check_map_fits, plan_fields
from components.gallery.store.lock import acquire_lock
from components.gallery.store import open_store
from components.platform import registry
from components.platform.config import Params
from components.platform.registry import ModelRef
from flows.parameters import resolve_params
from tasks._policy import IO_RETRIES, NO_CACHING, log
from tasks.embedding import embed_images, load_model
from tasks.upgrade_map import choose_upgrade_map
from tasks.upgrade_tracking import follow_decision, open_upgrade_run, tag_run


@task(name="table-backfill-chunk", **IO_RETRIES, **NO_CACHING)
def backfill_chunk(store_uri: str, upgrade: str, token: str, chunk: int, positions: np.ndarray, model,
                   batch_size: int, read_workers: int, precision: str) -> dict:
    return table_upgrade.backfill_chunk(LanceGallery(store_uri), upgrade, token, chunk, positions, model,
                                        batch_size=batch_size, read_workers=read_workers, precision=precision)


@flow(name="gallery-table-upgrade", log_prints=True)
def table_upgrade_flow(params: Params | None = None, store_uri: str | None = None, to_uri: str = "",
                       gate: bool | None = None, break_lock: bool = False, params_path: str | None = None,
                       overrides: dict[str, Any] | None = None, budget: float | int | None = None) -> dict:
    """Upgrade the Lance table at ``store_uri`` (default gallery.store) to ``to_uri`` (default:
    the challenger); see the module's docstring. ``budget`` (default gallery.upgrade.budget): the
    items this run may backfill, a fraction or a count, in whole chunks; short of the end the
    upgrade pauses (state ``paused``) and the same command goes on."""
    params = resolve_params(params, params_path, overrides)
    config, name = params.gallery.upgrade, params.mlflow.registered_model
    uri = store_uri or params.gallery.store
    table = LanceGallery(uri)
    client, experiment = registry.setup(params.mlflow)
    gated = params.promotion.gate if gate is None else gate
    store = open_store(uri)  # the upgrade's records and its lock, as objects beside the table
    target = _target(table, store, client, name, to_uri)
    if isinstance(target, dict):  # nothing to do
        log(target["message"])
        return target
    old, wanted, uid = target
    with acquire_lock(store, uid, break_lock=break_lock, log=log, lease_seconds=config.lease_seconds):
        decided = ending.decision(store, uid)
        now = table.model()  # read again under the lock: another run may have upgraded the table meanwhile
        if not now.same_version(old):
            if not wanted.same_version(now):
                raise GalleryError(f"{table.uri} changed from {old.uri} to {now.uri} while this upgrade started; run "
                                   "it again")
            if decided is None or decided.get("registry_recorded"):
                said = f"{table.uri} already serves {now.uri}: another run upgraded it meanwhile"
                log(said)
                return {"state": "up-to-date", "message": said, "model": now.uri}
        plan = planning.load_plan(store, uid)
        current = table.upgrade()
        if current is not None and current.id != uid:
            raise GalleryError(f"{table.uri}: upgrade {current.id} is in progress; finish it or abort it "
                               "(`fastfill upgrade abort`) first")
        if decided is None or plan is None:
            new_model = load_model(wanted)
            new = ModelRef(wanted.name, wanted.version, new_model.embedding_dim)
            judged = sample = None
            if gated and config.judgments:  # read and resolved before any work: a bad file is refused first
                judged = judgments.load_judgments(config.judgments, table.items(["id"]).column("id"))
                log(f"the gate measures against {judged.describe()}")
            elif gated and judgments.stored_judged(store, uid) is None:
                sample = table_upgrade.gate_sample(table, config.eval_queries, config.seed)  # refused before any work
            if current is None:  # (plan.json without the table's record: a planning killed half way)
                weights = None
                if config.order in usage.USAGE_ORDERS:  # read and checked before any work
                    found = table_upgrade.usage_weights(table, config.usage_log)
                    log(found.describe())
                    weights = found.weights
                plan = _plan(params, client, experiment, table, store, uid, old, new, new_model, judged, weights)
            elif plan is None:
                raise GalleryError(f"{table.uri} holds upgrade {uid} but its plan.json is gone from {store.uri}; abort "
                                   "it (`fastfill upgrade abort`) and run the upgrade again")
            token, order = table.upgrade().token, table_upgrade.order_of(table)
            done = _backfill(table, plan, token, order, new_model, config,
                             config.budget if budget is None else budget)
            if not done.complete:  # the budget ends this run: the upgrade pauses, queries use the mixed table
                log(f"paused: {done.items_done} of {plan.num_items} items backfilled; the same command goes on")
                return {"state": "paused", "upgrade": uid, "items": plan.num_items, "items_done": done.items_done,
                        "fraction": done.items_done / plan.num_items, "model": table.model().uri,
                        "mlflow_run_id": plan.mlflow_run_id}
            numbers = _gate(params, table, store, plan, order, new_model, old, judged, sample) if gated else None
            decider = UpgradeDecider(uri, name, gated, None, None)
            fields, said = decider.decide(numbers, params.promotion, uid, new, old)
            for line in said:
                log(line)
            decided = ending.write_decision(store, plan, champion=old, **fields)
        else:
            log(f"completing the end of {uid}: decided {decided['decided']}, {'passed' if decided['passed'] else 'rejected'}")
        if decided["passed"]:
            table.finish(uid)
        else:
            table.abort(uid)
        if not decided.get("registry_recorded"):
            follow_decision(client, plan, decided["tags"], promote=decided["passed"])
            ending.mark_registry_recorded(store, uid)
        result = {**UpgradeDecider.ended(decided), "upgrade": uid, "items": plan.num_items, "model": table.model().uri,
                  "mlflow_run_id": plan.mlflow_run_id}
        log(UpgradeDecider.ended_line(result, uid, plan.new, old))
        return result


def _target(table: LanceGallery, store, client, name: str, to_uri: str) -> tuple[ModelRef, ModelRef, str] | dict:
    """(the serving model, the version to upgrade to, the upgrade's id), or the result when there
    is nothing to do. An ending whose finish landed but whose registry step was not recorded
    comes first: the same command completes it."""
    finished = table.finished_upgrade()
    decided = ending.decision(store, finished) if finished else None
    if decided is not None and not decided.get("registry_recorded"):
        plan = planning.load_plan(store, finished)
        if plan is not None:
            return plan.old, plan.new, finished
    old = table.model()
    wanted = registry.asked_version(client, name, to_uri)
    if wanted is None:
        champion = registry.alias_version(client, name, registry.CHAMPION)
        current = champion is not None and ModelRef(name, champion).same_version(old)
        said = (f"{table.uri} serves the champion {old.uri}, and {name} has no challenger" if current else
                f"no version to upgrade to: {name} has no challenger and no --to was given")
        return {"state": "up-to-date" if current else "no target", "message": said, "model": old.uri}
    if wanted.same_version(old):
        return {"state": "up-to-date", "message": f"{table.uri} already serves {old.uri}", "model": old.uri}
    return old, wanted, planning.upgrade_id(old, wanted)


def _plan(params: Params, client, experiment: str, table: LanceGallery, store, uid: str, old: ModelRef, new: ModelRef,
          new_model, judged=None, weights=None) -> planning.Plan:
    """The map (the registry's, checked on the gallery's sample unless it passed there before; or
    trained on that sample), then plan.json and the judged queries' features beside the table,
    then the table's upgrade columns (the table's record last)."""
    config = params.gallery.upgrade
    run_id = open_upgrade_run(client, experiment, plan_fields(config, uid, old.uri, new.uri, None), store.uri)
    alignment_map, map_uri, order, _ = choose_upgrade_map(params, client, store.uri, old, new, new_model, run_id,
                                                          lambda: _pairs(table, params, old, new_model, store.uri))
    check_map_fits(alignment_map, map_uri, order, old.dim, new.dim, new.uri)
    tag_run(client, run_id, {"layout": "lance"})
    plan = planning.Plan(uid, old, new, map_uri, order, config.chunk_size, table.num_items(), 0,
                         params.gallery.distance, run_id)
    planning.write_plan(store, plan)  # before the table's record: a planning killed in between plans again
    if judged is not None:
        judgments.store_judged(store, uid, *_judged_features(table, judged, new_model, old, config))
    started = time.perf_counter()
    table_upgrade.plan(table, uid, new, alignment_map, order, config.seed, weights=weights)
    log(f"planned {uid} on {table.uri}: the stored features through {map_uri}, {order} order "
        f"({time.perf_counter() - started:.1f} s); queries now use {new.uri} against the mixed gallery")
    return plan


def _pairs(table: LanceGallery, params: Params, old: ModelRef, new_model, store_uri: str):
    """The map's pairs (gallery.upgrade.map_pairs): this host's prepared split, or a seeded
    sample of the gallery: the stored features, and the new model's of the items' images
    (unreadable ones left out)."""
    from components.gallery.upgrade.pairs import from_gallery

    config = params.gallery.upgrade
    if config.map_pairs == "splits":
        from components.platform.layout import Layout
        from tasks.embedding import embed_split_pairs

        pairs = embed_split_pairs(Layout(params.paths).splits, load_model(old), new_model)
        if pairs is None:
            raise GalleryError(f"gallery.upgrade.map_pairs is splits, but there is no prepared split at "
                               f"{Layout(params.paths).splits}; use map_pairs: gallery (--pairs gallery)")
        return pairs

    samples.check_map_sample(config, params.align[config.method].validation_fraction, table.num_items())
    positions = samples.map_sample(config, table.num_items())
    images, failures = table_upgrade.images_at(table, positions, config.read_workers,
                                               getattr(new_model, "preprocessing", None))
    keep = ~np.isin(positions, [f.position for f in failures])
    log(f"map pairs: embedding {int(keep.sum())} gallery items with the new model")
    new = embed_images(new_model, images[keep], config.batch_size, config.precision)
    old = table.features_at(positions[keep])
    labels = None
    if "label" in table.dataset().schema.names:
        labels = np.asarray(table.items(["label"]).column("label").to_pylist(), dtype=np.int64)[positions[keep]]
    return from_gallery(new_model, positions[keep], old, new, labels, store_uri, config.pseudo_classes, config.seed)


def _judged_features(table: LanceGallery, judged, new_model, old: ModelRef, config) -> tuple:
    """(judged, new-model query features, champion query features): items' images embedded by the
    new model against their stored features; image queries embedded by both models."""
    def embed_new(images):
        return embed_images(new_model, images, config.batch_size, config.precision, label="embedding the judged queries")

    champion = load_model(old)

    def embed_champion(images):
        return embed_images(champion, images, config.batch_size, config.precision)

    return table_upgrade.judged_queries(table, judged, embed_new, embed_champion, workers=config.read_workers,
                                        source=config.judgments,
                                        preprocessing=getattr(new_model, "preprocessing", None),
                                        champion_preprocessing=getattr(champion, "preprocessing", None))


def _gate(params: Params, table: LanceGallery, store, plan: planning.Plan, order: np.ndarray, new_model,
          old: ModelRef, judged, sample) -> dict:
    """The promotion gate's numbers: the judged queries stored with the plan (or given now)
    against the whole table along the backfill's order, else the labelled sample."""
    config, promotion = params.gallery.upgrade, params.promotion
    stored = judgments.stored_judged(store, plan.id)
    if stored is None and judged is not None:  # planned before the judgments were given
        stored = _judged_features(table, judged, new_model, old, config)
    if stored is not None:
        judged, new_queries, champion_queries = stored
        log(f"promotion gate: {len(judged)} judged queries against all {plan.num_items} items")
        return table_upgrade.judged_gate_numbers(table, judged, new_queries, champion_queries, order,
                                                 distance=plan.distance, curve_points=promotion.curve_points)
    positions, labels = sample if sample is not None else table_upgrade.gate_sample(table, config.eval_queries,
                                                                                    config.seed)
    images, failures = table_upgrade.images_at(table, positions, config.read_workers,
                                               getattr(new_model, "preprocessing", None))
    keep = ~np.isin(positions, [f.position for f in failures])
    queries = embed_images(new_model, images[keep], config.batch_size, config.precision)
    return table_upgrade.gate_numbers(table, positions[keep], labels[keep], queries, order, distance=plan.distance,
                                      curve_points=promotion.curve_points)


def _backfill(table: LanceGallery, plan: planning.Plan, token: str, order: np.ndarray, new_model, config,
              budget: float | int | None = None):
    """The chunks not yet committed that ``budget`` (whole chunks; None: all) allows,
    ``max_concurrency`` at a time, no faster than ``max_items_per_second``, stopping (what is in
    flight finishes) past ``max_failed_images`` unreadable images; then the chunks folded in.
    The bookkeeping (returned) is ``lifecycle.Backfill``'s."""
    from components.gallery.upgrade.lifecycle import Backfill, budget_items, failure_limit
    from components.platform.progress import progress, resolve_mode
    from flows.upgrade import run_chunks

    state = Backfill(plan, set(table.landed_chunks()), budget_items(budget, plan.num_items), config.max_concurrency,
                     failure_limit(config.max_failed_images, plan.num_items), config.max_items_per_second,
                     time.monotonic())
    log(f"backfill of {plan.id}: {len(state.done)}/{plan.num_chunks} chunks already committed; {len(state.pending)} "
        "to go" + (f", budget {state.limit} items (whole chunks)" if state.limit < plan.num_items else "")
        + (f", at most {config.max_items_per_second:g} items/s" if config.max_items_per_second else ""))
    shown = progress(f"backfill {plan.id}", total=plan.num_items, log=log, initial=state.items_done,
                     mode="off" if resolve_mode() == "bar" else "log")
    ok = False

    def submit(chunk: int):
        lo, hi = plan.chunk_bounds(chunk)
        return backfill_chunk.submit(table.store_uri, plan.id, token, chunk, order[lo:hi], new_model,
                                     config.batch_size, config.read_workers, config.precision)

    try:
        run_chunks(state, submit, lambda chunk, record: shown.update_to(state.items_done))
        ok = True
    finally:
        shown.close(failed=not ok)
    folded = table.fold(plan.id)
    log(f"{folded} chunks folded into {table.uri}")
    return state
