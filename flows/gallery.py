"""Flows of the stored gallery: ingest, and the upgrade (plan, sigma-ordered chunked backfill,
measurement, finish) with queries served from the mixed gallery throughout."""

from __future__ import annotations

import math
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
from tasks.gallery import (
    backfill_chunk, check_upgrade_map, embed_images, evaluate_gate, finish_upgrade, load_model, record_decision,
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


def _budget_items(budget: float | int | None, num_items: int) -> int:
    if budget is None:
        return num_items
    if isinstance(budget, float):
        return min(num_items, max(1, math.ceil(budget * num_items)))
    return min(num_items, int(budget))


def _open_run(params: Params, plan_fields: dict, store_uri: str) -> str:
    client, experiment = registry.setup(params.mlflow)
    run = client.create_run(experiment, run_name=f"upgrade {plan_fields['id']}", tags={
        registry.STAGE_TAG: "upgrade", "store": store_uri, "from": plan_fields["old"], "to": plan_fields["new"],
        "git_commit": registry.git_commit()})
    registry.log_params(client, run.info.run_id, plan_fields)
    return run.info.run_id


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
    run_id = _open_run(params, fields, store_uri)
    found = registry.find_alignment(client, params.mlflow.alignment_model, old.version, new.version)
    if config.order == "sigma":
        found = [v for v in found if v.tags.get("method") != "fct"] or found
    pairs = training_pairs(params, old_model, new_model)
    if found:
        map_uri = f"models:/{params.mlflow.alignment_model}/{found[0].version}"
        alignment_map = registry.load_model(map_uri).eval()
        log(f"alignment map from the registry: {map_uri} ({found[0].tags.get('method')})")
    else:
        alignment_map, map_uri = train_upgrade_map(params, pairs, new_model, old, new, run_id)
    alignment_map, map_uri = check_upgrade_map(params, alignment_map, map_uri, pairs, new_model, old, new, run_id)
    if config.order == "sigma" and getattr(alignment_map, "uncertainty", None) is None:
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
    order = up.make_order(gallery, uid, config.order, config.seed)
    size = None if config.eval_queries == "all" else int(config.eval_queries)
    positions = up.eval_sample(gallery.labels(), size, config.seed)
    queries = None
    if len(positions) >= 2:
        queries = embed_images(new_model, gather_images(gallery, positions), config.batch_size)
    plan = up.Plan(uid, old, new, map_uri, config.order, config.chunk_size, gallery.num_items,
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


def _prefix(done: set[int], num_chunks: int) -> int:
    count = 0
    while count < num_chunks and count in done:
        count += 1
    return count


def progress_key(store_uri: str, upgrade_id: str) -> str:
    """The Prefect progress artifact of one gallery's upgrade (lowercase, digits and dashes)."""
    import hashlib

    slug = "".join(c if c.isalnum() else "-" for c in upgrade_id.lower())[:80]
    return f"backfill-{slug}-{hashlib.sha1(store_uri.encode()).hexdigest()[:8]}"


class _Tracker:
    """Progress to MLflow (fraction, items, and retrieval when the done chunks form a longer
    prefix of the order) and to a Prefect progress artifact."""

    def __init__(self, params: Params, store_uri: str, plan: up.Plan, meter: BackfillMeter | None):
        from prefect.artifacts import create_progress_artifact

        self.client, _ = registry.setup(params.mlflow)
        self.plan, self.meter = plan, meter
        self.run_id = plan.mlflow_run_id
        self.client.update_run(self.run_id, status="RUNNING")
        history = self.client.get_metric_history(self.run_id, "top1")
        self.measured = {int(m.step) for m in history}
        self.artifact = create_progress_artifact(0.0, key=progress_key(store_uri, plan.id),
                                                 description=f"backfill of {plan.id} in {store_uri}")

    def chunk_done(self, done: set[int], items_done: int) -> None:
        from prefect.artifacts import update_progress_artifact

        fraction = items_done / self.plan.num_items
        update_progress_artifact(self.artifact, 100.0 * fraction)
        registry.log_metrics(self.client, self.run_id, {"backfill_fraction": fraction, "items_backfilled": items_done},
                             step=len(done))
        self.measure(done)

    def measure(self, done: set[int]) -> None:
        if self.meter is None:
            return
        prefix = _prefix(done, self.plan.num_chunks)
        items = self.plan.chunk_bounds(prefix - 1)[1] if prefix else 0
        if items in self.measured:
            return
        metrics = self.meter.measure(items)
        registry.log_metrics(self.client, self.run_id, metrics, step=items)
        self.measured.add(items)
        log(f"at {items}/{self.plan.num_items} backfilled: top-1 {metrics['top1']:.4f}, mAP {metrics['map']:.4f}")

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


def _backfill(params: Params, gallery: Gallery, store_uri: str, plan: up.Plan, new_model, budget) -> dict:
    config = params.gallery.upgrade
    done = set(up.done_chunks(gallery.store, plan.id))
    items_done = plan.items_in(done)
    limit = _budget_items(budget, plan.num_items)
    pending = [c for c in range(plan.num_chunks) if c not in done]
    log(f"backfill of {plan.id}: {len(done)}/{plan.num_chunks} chunks already done; {len(pending)} to go"
        + (f", budget {limit} items" if limit < plan.num_items else ""))
    tracker = _Tracker(params, store_uri, plan, _meter(gallery, plan, sorted(done)))
    tracker.measure(done)
    in_flight: dict = {}
    submitted_items = items_done
    failure: BaseException | None = None
    ok = False

    def refill() -> None:
        nonlocal submitted_items
        while pending and failure is None and len(in_flight) < config.max_concurrency and submitted_items < limit:
            chunk = pending.pop(0)
            in_flight[backfill_chunk.submit(store_uri, plan.id, chunk, new_model, config.batch_size)] = chunk
            submitted_items += plan.items_in([chunk])

    try:
        refill()
        while in_flight:
            future = next(as_completed(list(in_flight)))
            chunk = in_flight.pop(future)
            try:
                record = future.result()
            except BaseException as error:  # noqa: BLE001 - finish what is in flight, then raise
                failure = failure or error
                continue
            refill()  # the next chunk starts before this one's bookkeeping
            done.add(chunk)
            items_done += record["count"]
            if tracker.meter is not None:
                tracker.meter.land(record["start"], record["stop"], up.chunk_features(gallery.store, plan.id, chunk))
            tracker.chunk_done(done, items_done)
        if failure is not None:
            raise failure
        ok = True
    finally:
        tracker.close(ok)
    complete = len(done) == plan.num_chunks
    return {"upgrade": plan.id, "chunks_done": len(done), "chunks": plan.num_chunks, "items_done": items_done,
            "items": plan.num_items,
            "fraction": items_done / plan.num_items, "complete": complete}


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


@flow(name="gallery-upgrade", log_prints=True)
def upgrade_flow(params: Params, store_uri: str, to_uri: str = "", budget: float | int | None = None,
                 break_lock: bool = False, gate: bool | None = None) -> dict:
    """Upgrade the stored gallery to ``to_uri`` (default: the challenger): plan, backfill in
    chunks in sigma order, measure along the way; when complete, the promotion gate decides
    (``gate``, default promotion.gate): switch the gallery and move champion, or reject and
    keep serving the champion's features. Re-run the same command to resume a stopped or killed
    upgrade. A new model that arrives while an upgrade is unfinished starts a sequential
    upgrade from the gallery as it stands."""
    gate = params.promotion.gate if gate is None else gate
    store = store_at(store_uri)
    store.check()
    gallery = Gallery(store)
    manifest = gallery.manifest(refresh=True)
    champion = gallery.model
    new = _resolve(params, to_uri or f"models:/{params.mlflow.registered_model}@{registry.CHALLENGER}")
    if (new.name, new.version) == (champion.name, champion.version):
        raise GalleryError(f"the gallery at {store.uri} is already built with {new.uri}; nothing to upgrade")
    base = None
    current = manifest.get("upgrade")
    if current:
        plan = up.load_plan(store, current)
        if plan is not None and (plan.new.name, plan.new.version) != (new.name, new.version):
            base = plan
            log(f"{store.uri} is in the middle of upgrade {current} to {plan.new.uri}: {new.uri} starts a sequential "
                "upgrade from the gallery as it stands")
    old = base.new if base is not None else champion
    new_model = load_model(params.mlflow, new)
    new = ModelRef(new.name, new.version, new_model.embedding_dim)
    uid = up.upgrade_id(old, new)
    rejected = up.rejection(store, uid)
    if rejected is not None:
        raise GalleryError(f"upgrade {uid} was rejected by the promotion gate on {rejected['rejected']} "
                           f"({'; '.join(rejected.get('reasons', []))}); register a better version")
    lock = up.acquire_lock(store, uid, break_lock=break_lock, log=log)
    try:
        plan = up.load_plan(store, uid)
        if plan is None:
            old_model = load_model(params.mlflow, old)
            plan = _plan(params, gallery, store_uri, uid, old, new, old_model, new_model, base)
        else:
            log(f"resuming upgrade {uid}")
            if gallery.manifest(refresh=True).get("upgrade") != uid:  # killed between plan and switch
                gallery.write_manifest({**gallery.manifest(), "upgrade": uid})
        result = _backfill(params, gallery, store_uri, plan, new_model,
                           budget if budget is not None else params.gallery.upgrade.budget)
        result["mlflow_run_id"] = plan.mlflow_run_id
        if not result["complete"]:
            log(f"stopped at {result['items_done']}/{plan.num_items} items (budget); run the same command to go on")
            result["state"] = "paused"
            return result
        if gate:
            result["promotion"] = _gate(params, store_uri, plan, champion)
            result["state"] = "complete" if result["promotion"]["passed"] else "rejected"
        else:
            finish_upgrade(store_uri, plan)
            record_decision(params.mlflow, plan, {"promotion": "ungated", "promotion.upgrade": plan.id}, promote=True)
            result["state"] = "complete"
        if result["state"] == "complete":
            log(f"upgrade {uid} complete: the gallery's model is now {new.uri}")
        else:
            log(f"upgrade {uid} rejected: the gallery serves {champion.uri}'s features again")
        return result
    finally:
        lock.release()
