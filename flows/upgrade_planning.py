"""The upgrade's planning step, as the flow runs it: the alignment map (the registry's, checked
once per source, or trained on this upgrade's pairs), the gallery's features through it part by
part, the backfill order, the samples embedded while planning (backfilled first), and the plan
written last. A planning refused half way removes what it wrote."""

from __future__ import annotations

import time

import numpy as np
from prefect.futures import as_completed, wait

from fastfill.components.gallery.layouts.catalog import Gallery, GalleryError
from fastfill.components.gallery.store import StoreError
from fastfill.components.gallery.upgrade import backfill, planning, samples, usage
from fastfill.components.gallery.upgrade.decider import Course
from fastfill.components.gallery.upgrade.lifecycle import check_map_fits, plan_fields
from fastfill.components.platform.config import Params
from fastfill.components.platform.layout import Layout
from fastfill.components.platform.progress import progress
from fastfill.components.platform.registry import ModelRef
from fastfill.tasks._policy import log
from fastfill.tasks.embedding import embed_images, embed_split_pairs, gallery_pairs, load_model
from fastfill.tasks.gallery_store import commit_plan, discard_unplanned, transform_part, write_reverse, write_sources
from fastfill.tasks.upgrade_map import choose_upgrade_map, fit_reverse_transformation
from fastfill.tasks.upgrade_tracking import close_upgrade_run, open_upgrade_run, tag_run


def plan_upgrade(params: Params, client, experiment: str, gallery: Gallery, course: Course, new: ModelRef,
                 new_model, judged=None) -> planning.Plan:
    """Plan ``course``'s upgrade to ``new``. With a base (an unfinished upgrade to ``course.old``),
    a sequential upgrade: the map applies to the gallery as that upgrade left it, so items still
    on the gallery's model go through both maps. A gallery whose parts are missing or foreign is
    refused before anything is written; one whose content fails while planning (a NaN, a torn
    part) is refused and what planning wrote is removed. ``judged``: the judged queries
    (``judgments.load_judgments``, read once by the flow), or None without them. The usage
    orders' weights (``gallery.upgrade.usage_log``, else the items table's column) are read
    here, before anything is written."""
    config, uid = params.gallery.upgrade, course.upgrade
    assert uid is not None and course.old is not None  # a course that plans names its upgrade and its start
    base = planning.load_plan(gallery.store, course.base) if course.base else None
    gallery.check_sources(sequential=base is not None)  # before anything is written
    weights = None
    if config.order in usage.USAGE_ORDERS:  # read and checked against the gallery before any work
        found = usage.usage_weights(gallery, config.usage_log)
        log(found.describe())
        weights = found.weights
    leftover = discard_unplanned(gallery.store.uri, uid)  # a killed planning's objects (its prefilled chunks too)
    if leftover:
        log(f"removed {leftover} object(s) that a planning of {uid} killed before its plan was written had left")
    run_id = open_upgrade_run(client, experiment, plan_fields(config, uid, course.old.uri, new.uri, course.base),
                              gallery.store.uri)
    try:
        return _make_plan(params, client, gallery, uid, course.old, new, new_model, base, run_id, judged, weights)
    except (GalleryError, StoreError) as error:
        discarded = discard_unplanned(gallery.store.uri, uid)
        close_upgrade_run(client, run_id, "FAILED", f"planning refused: {error}")
        log(f"planning refused; {discarded} object(s) it had written under upgrades/{uid}/ were removed, so the store "
            "is as it was")
        raise


def _make_plan(params: Params, client, gallery: Gallery, uid: str, old: ModelRef, new: ModelRef, new_model,
               base: planning.Plan | None, run_id: str, judged, weights=None) -> planning.Plan:
    """The map, the gallery through it, the order, the samples embedded now, then the plan written."""
    config, store_uri = params.gallery.upgrade, gallery.store.uri
    if base is not None:  # first: the map's pairs and transform start from the gallery as base left it
        write_sources(store_uri, uid, base)
        log(f"sequential upgrade: starting from {base.id} as it stands "
            f"({len(backfill.done_chunks(gallery.store, base.id))}/{base.num_chunks} chunks on {base.new.uri}, the "
            "rest through its map)")
    alignment_map, map_uri, order_kind, pairs = choose_upgrade_map(
        params, client, gallery.store.uri, old, new, new_model, run_id,
        lambda: _map_pairs(params, gallery, uid, old, new_model, base is not None))
    # an order that needs sigma without the map's uncertainty head is refused here, before the transform
    check_map_fits(alignment_map, map_uri, order_kind, old.dim, new.dim, new.uri)
    if config.online:
        pairs = _online_reverse(params, client, gallery, uid, old, new_model, base is not None, run_id, pairs)
    _transform_parts(gallery, uid, alignment_map, base is not None)
    order = planning.make_order(gallery, uid, order_kind, config.seed, weights)
    embedded = dict(zip(pairs.positions.tolist(), pairs.new)) if pairs is not None and pairs.positions is not None else {}
    judged, positions, queries = _embed_samples(config, gallery, new_model, judged, embedded)
    # the items embedded while planning are backfilled from the start: the first chunks of the order
    prefilled = np.fromiter(sorted(embedded), dtype=np.int64, count=len(embedded))
    ranks = (planning.stand_in_ranks(order, prefilled, positions, config.seed)
             if len(prefilled) and queries is not None else None)
    if len(prefilled):
        order = planning.front_loaded(order, prefilled)
    plan = planning.Plan(uid, old, new, map_uri, order_kind, config.chunk_size, gallery.num_items,
                         len(positions) if queries is not None else 0, params.gallery.distance, run_id,
                         base=base.id if base else None,
                         bounds=planning.chunk_grid(gallery.num_items, config.chunk_size, [len(prefilled)]),
                         prefilled=len(prefilled), online=config.online)
    chunks = commit_plan(store_uri, plan, order, embedded, judged, positions, queries, ranks)
    if chunks:
        log(f"{len(prefilled)} items embedded while planning (map sample and evaluation sample) are backfilled "
            f"first: chunks 0-{chunks - 1} written")
    log(f"planned {uid}: {plan.num_chunks} chunks of {plan.chunk_size}, {plan.order_kind} order"
        + (f", {plan.prefilled} items already backfilled" if plan.prefilled else "")
        + f"; queries now use {new.uri} against the mixed gallery")
    return plan


def _transform_parts(gallery: Gallery, uid: str, alignment_map, sequential: bool) -> None:
    """The gallery's features through the map, a ``transform-part`` task per part, shown as they land."""
    futures = [transform_part.submit(gallery.store.uri, uid, alignment_map, p, sequential)
               for p in range(gallery.num_parts)]
    try:
        with progress("planning: the gallery's features through the map", total=gallery.num_items, log=log) as bar:
            for future in as_completed(futures):
                bar.advance(future.result())
    except BaseException:
        wait(futures)  # every part's task has ended before the caller removes what planning wrote
        raise


def _embed_samples(config, gallery: Gallery, new_model, judged, embedded: dict):
    """The samples embedded while planning: the judged queries (both models' features) and the
    evaluation sample; ``embedded`` (position -> new features) gains the sample's items. Returns
    (judged with features, or None; the sample's positions; its new features, or None)."""
    def embed(images, label=None):
        return embed_images(new_model, images, config.batch_size, config.precision, label=label)

    preprocessing = getattr(new_model, "preprocessing", None)
    champion = load_model(gallery.model) if judged is not None else None
    started, before = time.perf_counter(), len(embedded)  # the samples' reading and embedding, timed
    if judged is not None:
        def embed_champion(images, label=None):
            return embed_images(champion, images, config.batch_size, config.precision)

        judged = samples.judged_queries(gallery, config, judged, embed, embed_champion, embedded,
                                        preprocessing=preprocessing,
                                        champion_preprocessing=getattr(champion, "preprocessing", None))
    positions, queries = samples.evaluation_sample(gallery, config, embed, embedded, log, preprocessing)
    embedded.update(zip(positions.tolist(), queries) if queries is not None else ())
    log(f"judged queries and evaluation sample: {len(embedded) - before} more items read and embedded in "
        f"{time.perf_counter() - started:.1f} s")
    return judged, positions, queries


def _online_reverse(params: Params, client, gallery: Gallery, uid: str, old: ModelRef, new_model, sequential: bool,
                    run_id: str, pairs):
    """gallery.upgrade.online: online backfilling's reverse transformation, fitted on the map's
    pairs (embedded now when the registry's map was used without them) and kept with the plan;
    returns the pairs."""
    if pairs is None:
        log("online backfilling: the registry's map was used as it is, so its pairs are embedded now for the "
            "reverse transformation")
        pairs = _map_pairs(params, gallery, uid, old, new_model, sequential)
    if pairs is None:
        raise GalleryError(f"gallery.upgrade.online needs the map's pairs, and there is no training split at "
                           f"{Layout(params.paths).splits} (gallery.upgrade.map_pairs: splits); use map_pairs: "
                           "gallery, or set online: false")
    config = params.gallery.upgrade
    reverse = fit_reverse_transformation(pairs, config.pseudo_classes, config.seed)
    write_reverse(gallery.store.uri, uid, reverse)
    gain = reverse.new_scale ** 2  # type: ignore[attr-defined]  # Prefect types a task's call as maybe awaitable
    tag_run(client, run_id, {"online": "metric_compatible", "online.new_gain": f"{gain:.6g}"})
    return pairs


def _map_pairs(params: Params, gallery: Gallery, uid: str, old: ModelRef, new_model, sequential: bool):
    """The pairs that train and check the map, from ``gallery.upgrade.map_pairs``."""
    config = params.gallery.upgrade
    if config.map_pairs == "splits":
        return embed_split_pairs(Layout(params.paths).splits, load_model(old), new_model)
    settings = params.upgrade_map
    samples.check_map_sample(config, settings.validation_fraction, gallery.num_items,
                             checked=settings.validation_fraction > 0 and settings.check != "off")
    positions = samples.map_sample(config, gallery.num_items)
    minimum = f", at least {config.map_sample_min}" if isinstance(config.map_sample, float) else ""  # a fraction
    log(f"map sample: {len(positions)} of {gallery.num_items} gallery items (gallery.upgrade.map_sample "
        f"{config.map_sample}{minimum})")
    return gallery_pairs(gallery.store.uri, positions, new_model, config, uid if sequential else None)
