"""Flows of the stored gallery: ingest, and the upgrade (plan, sigma-ordered chunked backfill,
measurement, finish) with queries served from the mixed gallery throughout."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from prefect import flow
from prefect.futures import as_completed

from components.platform import registry
from components.platform.config import Params
from components.gallery import upgrade as up
from components.gallery.catalog import Gallery, GalleryError, check_features, gather_images
from components.platform.registry import ModelRef
from components.gallery.measure import BackfillMeter
from tasks._policy import log
from components.gallery.lock import acquire_lock
from components.gallery.lifecycle import Backfill, budget_items, choose_map
from tasks.gallery import (
    UpgradeProgress, backfill_chunk, open_upgrade_run, check_upgrade_map, embed_images, evaluate_gate, finish_upgrade, load_model, record_decision,
    reject_upgrade, store_at, train_upgrade_map, training_pairs, transform_part, write_gallery, write_sources,
)


def _resolve(params: Params, uri: str) -> ModelRef:
    client, _ = registry.setup(params.mlflow)
    return registry.resolve_model(client, uri)


def _load_array(path: Path | None, what: str) -> np.ndarray | None:
    if path is None:
        return None
    from components.platform.layout import load_array

    try:
        return load_array(path, what, missing="check the path")
    except (FileNotFoundError, ValueError) as error:
        raise GalleryError(str(error)) from None


@flow(name="gallery-ingest", log_prints=True)
def ingest_flow(params: Params, store_uri: str, model_uri: str = "", images: Path | None = None,
                labels: Path | None = None, groups: Path | None = None, ids: Path | None = None,
                features: Path | None = None) -> dict:
    """Put images (default: the prepared test split) into the store with the features of the
    ``model_uri`` model (default: the registry's champion), or with given features."""
    store = store_at(store_uri)
    store.check()
    if store.exists("gallery.json"):
        raise GalleryError(f"{store.uri} already holds a gallery; ingest into a new prefix or folder")
    model_uri = model_uri or f"models:/{params.mlflow.registered_model}@{registry.CHAMPION}"
    ref = _resolve(params, model_uri)
    if images is None:
        from components.experiment.data import load_split
        from components.platform.layout import Layout

        split = load_split(Layout(params.paths).splits, "test")
        image_array, label_array = split.images, split.labels
        log(f"ingesting the prepared test split: {len(image_array)} images")
    else:
        image_array, label_array = _load_array(images, "--images"), _load_array(labels, "--labels")
    group_array, id_array = _load_array(groups, "--groups"), _load_array(ids, "--ids")
    feature_array = _load_array(features, "--features")
    if image_array.ndim == 3:
        image_array = image_array[:, None]
    model = load_model(params.mlflow, ref)
    ref = ModelRef(ref.name, ref.version, model.embedding_dim)
    if image_array.ndim != 4 or image_array.dtype != np.uint8 or image_array.shape[1] != model.in_channels:
        raise GalleryError(f"images must be uint8 (N, {model.in_channels}, H, W) for {ref.uri}, got "
                           f"{image_array.dtype} {image_array.shape}")
    if feature_array is None:
        log(f"embedding {len(image_array)} images with {ref.uri}")
        feature_array = embed_images(model, image_array)
    else:
        feature_array = check_features(feature_array, ref.dim, f"--features {features}")
    manifest = write_gallery(store_uri, image_array, feature_array, ref, label_array, group_array, id_array,
                             params.gallery.part_size)
    log(f"gallery at {store.uri}: {manifest['num_items']} items in {manifest['num_parts']} parts, model {ref.uri}")
    return manifest


# ------------------------------------------------------------------------------------------------


def _plan(params: Params, gallery: Gallery, store_uri: str, uid: str, old: ModelRef, new: ModelRef,
          old_model, new_model, base: up.Plan | None = None) -> up.Plan:
    """Map, transformed features and sigma, order, evaluation sample; plan.json last. With
    ``base`` (an unfinished upgrade to ``old``), a sequential upgrade: the map applies to the
    gallery as that upgrade left it, so items still on the gallery's model go through both maps."""
    config = params.gallery.upgrade
    client, _ = registry.setup(params.mlflow)
    fields = {"id": uid, "old": old.uri, "new": new.uri, "order": config.order, "chunk_size": config.chunk_size,
              "max_concurrency": config.max_concurrency, "task_runner": config.task_runner,
              "eval_queries": config.eval_queries, "base": base.id if base else None}
    run_id = open_upgrade_run(params, fields, store_uri)
    chosen = choose_map(registry.find_alignment(client, params.mlflow.alignment_model, old.version, new.version),
                        config.order)
    pairs = training_pairs(params, old_model, new_model)
    order_kind = config.order
    if chosen is not None:
        map_uri = f"models:/{params.mlflow.alignment_model}/{chosen.version}"
        alignment_map = registry.load_model(map_uri).eval()
        log(f"alignment map from the registry: {map_uri} ({chosen.tags.get('method')})")
        if order_kind == "sigma" and chosen.tags.get("fallback_order") == "random":
            order_kind = "random"
            log(f"{map_uri} is a fallback map whose sigma order was not shown to help (tag fallback_order: random): "
                "the backfill goes in random order")
    else:
        alignment_map, map_uri = train_upgrade_map(params, pairs, new_model, old, new, run_id)
    alignment_map, map_uri, order_kind = check_upgrade_map(params, alignment_map, map_uri, pairs, new_model, old, new,
                                                           run_id, order_kind)
    if order_kind == "sigma" and getattr(alignment_map, "uncertainty", None) is None:
        raise GalleryError(f"{map_uri} has no uncertainty head, so there is no sigma order; set "
                           "gallery.upgrade.order: random or register a FastFill map")
    if alignment_map.old_dim != old.dim or alignment_map.new_dim != new.dim:
        raise GalleryError(f"{map_uri} maps {alignment_map.old_dim} -> {alignment_map.new_dim} dimensions, but the "
                           f"gallery's features are {old.dim}-d and {new.uri} makes {new.dim}-d ones")
    if base is not None:
        write_sources(store_uri, uid, base)
        log(f"sequential upgrade: starting from {base.id} as it stands ({len(up.done_chunks(gallery.store, base.id))}"
            f"/{base.num_chunks} chunks on {base.new.uri}, the rest through its map), then {map_uri}")
    futures = [transform_part.submit(store_uri, uid, alignment_map, p, base is not None) for p in range(gallery.num_parts)]
    for future in futures:
        future.result()
    order = up.make_order(gallery, uid, order_kind, config.seed)
    size = None if config.eval_queries == "all" else int(config.eval_queries)
    positions = up.eval_sample(gallery.labels(), size, config.seed)
    queries = None
    if len(positions) >= 2:
        queries = embed_images(new_model, gather_images(gallery, positions), config.batch_size)
    plan = up.Plan(uid, old, new, map_uri, order_kind, config.chunk_size, gallery.num_items,
                   len(positions) if len(positions) >= 2 else 0, params.gallery.distance, run_id,
                   base=base.id if base else None)
    up.commit_plan(gallery, plan, order, positions, queries)
    log(f"planned {uid}: {plan.num_chunks} chunks of {plan.chunk_size}, {plan.order_kind} order; queries now use "
        f"{new.uri} against the mixed gallery")
    return plan


def _meter(gallery: Gallery, plan: up.Plan, done: list[int]) -> BackfillMeter | None:
    if plan.eval_queries < 2:
        return None
    store = gallery.store
    order = up.order_of(store, plan.id)
    meter = BackfillMeter(store.get_array(up.eval_positions_key(plan.id)), gallery.labels(),
                          store.get_array(up.eval_queries_key(plan.id)), up.transformed_all(gallery, plan.id),
                          order, plan.distance)
    for chunk in done:
        meter.land(*plan.chunk_bounds(chunk), up.chunk_features(store, plan.id, chunk))
    return meter


def progress_key(store_uri: str, upgrade_id: str) -> str:
    """The Prefect progress artifact of one gallery's upgrade (lowercase, digits and dashes)."""
    import hashlib

    slug = "".join(c if c.isalnum() else "-" for c in upgrade_id.lower())[:80]
    return f"backfill-{slug}-{hashlib.sha1(store_uri.encode()).hexdigest()[:8]}"


def _backfill(params: Params, gallery: Gallery, store_uri: str, plan: up.Plan, new_model, budget) -> dict:
    """Run the chunks the budget allows, ``max_concurrency`` at a time, measuring as they land;
    the bookkeeping is ``lifecycle.Backfill``'s."""
    config = params.gallery.upgrade
    state = Backfill(plan, set(up.done_chunks(gallery.store, plan.id)), budget_items(budget, plan.num_items),
                     config.max_concurrency)
    log(f"backfill of {plan.id}: {len(state.done)}/{plan.num_chunks} chunks already done; {len(state.pending)} to go"
        + (f", budget {state.limit} items" if state.limit < plan.num_items else ""))
    tracker = UpgradeProgress(params, store_uri, plan, _meter(gallery, plan, sorted(state.done)), progress_key(store_uri, plan.id))
    tracker.measure(state.done)
    in_flight: dict = {}
    ok = False

    def start() -> None:
        for chunk in state.to_start():
            in_flight[backfill_chunk.submit(store_uri, plan.id, chunk, new_model, config.batch_size)] = chunk

    try:
        start()
        while in_flight:
            future = next(as_completed(list(in_flight)))
            chunk = in_flight.pop(future)
            try:
                record = future.result()
            except BaseException as error:  # noqa: BLE001 - finish what is in flight, then raise
                state.failed(chunk, error)
                continue
            state.landed(chunk, record["count"])
            start()  # the next chunk starts before this one's bookkeeping
            if tracker.meter is not None:
                tracker.meter.land(record["start"], record["stop"], up.chunk_features(gallery.store, plan.id, chunk))
            tracker.chunk_done(state.done, state.items_done)
        if state.failure is not None:
            raise state.failure
        ok = True
    finally:
        tracker.close(ok)
    return state.summary()


def _gate(params: Params, store_uri: str, plan: up.Plan, champion: ModelRef) -> dict:
    """Measure the gates, record the decision in MLflow, and either switch the gallery and move
    champion, or reject: the gallery keeps serving the champion's features."""
    from components.gallery.promotion import decide, decision_tags

    numbers = evaluate_gate(store_uri, plan, params.promotion)
    passed, reasons = decide(numbers, params.promotion)
    tags = decision_tags(passed, reasons, numbers, champion.version, plan.id)
    reached = numbers["fraction_to_gain"]
    log(f"promotion gate for {plan.new.uri} against {champion.uri}: top-1 {100 * numbers['champion_top1']:.2f} -> "
        f"mean {100 * numbers['top1_auc']:.2f} along the backfill ({100 * numbers['top1_auc_gain']:+.2f}), NFR@1 "
        f"{100 * numbers['nfr1_mean']:.2f}%, gain reached at "
        f"{'never' if reached is None else f'{100 * reached:.0f}%'}: {'PASSED' if passed else 'REJECTED'}"
        + ("" if passed else f" ({'; '.join(reasons)})"))
    if passed:
        finish_upgrade(store_uri, plan)
        record_decision(params.mlflow, plan, tags, promote=True)
    else:
        reject_upgrade(store_uri, plan, {"reasons": reasons, "numbers": numbers})
        record_decision(params.mlflow, plan, tags, promote=False)
    if plan.mlflow_run_id:
        client, _ = registry.setup(params.mlflow)
        registry.log_series(client, plan.mlflow_run_id, {"gate.top1": numbers["top1"], "gate.nfr1": numbers["nfr1"]})
        registry.log_metrics(client, plan.mlflow_run_id, {f"gate.{k}": numbers[k] for k in
                             ("champion_top1", "top1_auc", "top1_auc_gain", "nfr1_mean")})
    return {"passed": passed, "reasons": reasons, "numbers": numbers}


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


def run_upgrade(params: Params, store_uri: str, to_uri: str = "", budget: float | int | None = None,
                break_lock: bool = False, gate: bool | None = None) -> dict:
    """``upgrade_flow`` on the task runner its settings name (what the CLI, the deployments and
    the triggers call)."""
    flow_with_runner = upgrade_flow.with_options(task_runner=runner_for(params.gallery.upgrade))
    return flow_with_runner(params, store_uri, to_uri, budget=budget, break_lock=break_lock, gate=gate)


def _target(params: Params, gallery: Gallery, to_uri: str):
    """(champion, the new model's ref and loaded model, the unfinished upgrade to start from or
    None). A new model that arrives while an upgrade is unfinished starts a sequential upgrade."""
    champion = gallery.model
    new = _resolve(params, to_uri or f"models:/{params.mlflow.registered_model}@{registry.CHALLENGER}")
    if (new.name, new.version) == (champion.name, champion.version):
        raise GalleryError(f"the gallery at {gallery.store.uri} is already built with {new.uri}; nothing to upgrade")
    base = None
    current = gallery.manifest().get("upgrade")
    if current:
        plan = up.load_plan(gallery.store, current)
        if plan is not None and (plan.new.name, plan.new.version) != (new.name, new.version):
            base = plan
            log(f"{gallery.store.uri} is in the middle of upgrade {current} to {plan.new.uri}: {new.uri} starts a "
                "sequential upgrade from the gallery as it stands")
    new_model = load_model(params.mlflow, new)
    return champion, ModelRef(new.name, new.version, new_model.embedding_dim), new_model, base


@flow(name="gallery-upgrade", log_prints=True)
def upgrade_flow(params: Params, store_uri: str, to_uri: str = "", budget: float | int | None = None,
                 break_lock: bool = False, gate: bool | None = None) -> dict:
    """Upgrade the stored gallery to ``to_uri`` (default: the challenger), one step of the
    lifecycle after another: plan, backfill in chunks (sigma order by default,
    measured as they land), then the promotion gate (``gate``, default promotion.gate) switches
    the gallery and moves champion, or rejects and the gallery keeps serving the champion's
    features. Re-run the same command to resume a stopped or killed upgrade."""
    gate = params.promotion.gate if gate is None else gate
    store = store_at(store_uri)
    store.check()
    gallery = Gallery(store)
    gallery.manifest(refresh=True)
    champion, new, new_model, base = _target(params, gallery, to_uri)
    old = base.new if base is not None else champion
    uid = up.upgrade_id(old, new)
    rejected = up.rejection(store, uid)
    if rejected is not None:
        raise GalleryError(f"upgrade {uid} was rejected by the promotion gate on {rejected['rejected']} "
                           f"({'; '.join(rejected.get('reasons', []))}); register a better version")
    lock = acquire_lock(store, uid, break_lock=break_lock, log=log)
    try:
        plan = up.load_plan(store, uid)
        if plan is None:
            plan = _plan(params, gallery, store_uri, uid, old, new, load_model(params.mlflow, old), new_model, base)
        else:
            log(f"resuming upgrade {uid}")
            if gallery.manifest(refresh=True).get("upgrade") != uid:  # killed between plan and switch
                gallery.write_manifest({**gallery.manifest(), "upgrade": uid})
        result = _backfill(params, gallery, store_uri, plan, new_model,
                           budget if budget is not None else params.gallery.upgrade.budget)
        result["mlflow_run_id"] = plan.mlflow_run_id
        if not result["complete"]:
            log(f"stopped at {result['items_done']}/{plan.num_items} items (budget); run the same command to go on")
            return {**result, "state": "paused"}
        if gate:
            result["promotion"] = _gate(params, store_uri, plan, champion)
            result["state"] = "complete" if result["promotion"]["passed"] else "rejected"
        else:
            finish_upgrade(store_uri, plan)
            record_decision(params.mlflow, plan, {"promotion": "ungated", "promotion.upgrade": plan.id}, promote=True)
            result["state"] = "complete"
        log(f"upgrade {uid} complete: the gallery's model is now {new.uri}" if result["state"] == "complete" else
            f"upgrade {uid} rejected: the gallery serves {champion.uri}'s features again")
        return result
    finally:
        lock.release()
