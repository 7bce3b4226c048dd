"""An upgrade's plan: where its objects live, the plan record, and the planning steps
(transform each part through the map, the backfill order, the evaluation sample, commit).

Under ``upgrades/<upgrade-id>/`` (the id joins the two model versions, so re-running the same
command finds the same upgrade)::

    source/part-NNNNN.npy       a sequential upgrade only: each part's features as the unfinished
                                upgrade it starts from left them (its new features or its map's)
    order.npy                   item positions in backfill order (gallery.upgrade.order: sigma,
                                random, usage or usage_sigma; see components.gallery.upgrade.usage)
    transformed/part-NNNNN.npy  h(old features) of each part, in the new model's space
    sigma/part-NNNNN.npy        predicted log sigma^2 per item (maps with an uncertainty head)
    eval/positions.npy, eval/queries.npy   the evaluation sample and its new-model features
    plan.json                   models, map, order, chunking; written last: the plan exists once it does
    chunks/chunk-NNNNN.npy      new features of a chunk's items, in order; deterministic key
    done/chunk-NNNNN.json       the chunk's completion marker, written after its features
    finished.json               written when the backfill is complete and the gallery switched
    rejected.json               written when the promotion gate rejects it (reasons and numbers); the
                                same upgrade is then refused until a better version is registered
    superseded.json             written when a sequential upgrade starts from this unfinished one

Chunk c holds the items ``order[bounds[c] : bounds[c + 1]]``: chunk_size items each, except where
the plan is cut (``Plan.bounds``): after the items embedded while planning (the map sample and
the evaluation sample, written as done chunks at the front of the order) and where a budget or
the recommended stop ends a run, so a stop is exact, never rounded up to a whole chunk. A chunk
is done when its marker exists; a killed backfill resumes by listing markers, and a chunk redone
after a crash before its marker rewrites the same key with the same features.
"""

from __future__ import annotations

import io
import math
import zipfile
import zlib

import numpy as np

from fastfill.components.experiment.adapters import adapter_arrays, adapter_from_arrays
from fastfill.components.gallery.layouts.catalog import Gallery, GalleryError, ModelRef, check_features, now
from fastfill.components.gallery.store import DamagedObject, ObjectMissing, Store

# the read side of the upgrade's objects (keys, plan, order), named from here too by the upgrade's steps
from fastfill.components.gallery.upgrade.stored import ORDER as ORDER
from fastfill.components.gallery.upgrade.stored import Plan as Plan
from fastfill.components.gallery.upgrade.stored import chunk_key as chunk_key
from fastfill.components.gallery.upgrade.stored import load_plan as load_plan
from fastfill.components.gallery.upgrade.stored import marker_key as marker_key
from fastfill.components.gallery.upgrade.stored import order_of as order_of
from fastfill.components.gallery.upgrade.stored import plan_key as plan_key
from fastfill.components.gallery.upgrade.stored import source_key as source_key
from fastfill.components.gallery.upgrade.stored import transformed_all as transformed_all
from fastfill.components.gallery.upgrade.stored import transformed_key as transformed_key
from fastfill.components.gallery.upgrade.stored import upgrade_key as upgrade_key

FINISHED, REJECTED, SUPERSEDED = "finished.json", "rejected.json", "superseded.json"
ENDINGS = (FINISHED, REJECTED, SUPERSEDED)  # an upgrade with one of these is over
DECISION = "decision.json"  # the promotion decision, written before the gallery switches (kept by gc)


def upgrade_id(old: ModelRef, new: ModelRef) -> str:
    return f"{old.key}-to-{new.key}"


def upgrade_record(store: Store, upgrade_id: str, name: str) -> dict | None:
    """The upgrade's JSON record ``name`` (its decision, how it ended, ...), or None when there is none."""
    try:
        return store.get_json(upgrade_key(upgrade_id, name))
    except ObjectMissing:
        return None


def eval_positions_key(upgrade_id: str) -> str:
    return upgrade_key(upgrade_id, "eval/positions.npy")


def eval_queries_key(upgrade_id: str) -> str:
    return upgrade_key(upgrade_id, "eval/queries.npy")


def eval_ranks_key(upgrade_id: str) -> str:
    return upgrade_key(upgrade_id, "eval/ranks.npy")


def sigma_key(upgrade_id: str, part: int) -> str:
    return upgrade_key(upgrade_id, f"sigma/part-{part:05d}.npy")


def reverse_key(upgrade_id: str) -> str:
    """Online backfilling's reverse transformation (gallery.upgrade.online), as named arrays."""
    return upgrade_key(upgrade_id, "reverse.npz")


def write_reverse(store: Store, upgrade_id: str, adapter) -> None:
    """Keep the upgrade's reverse transformation (``adapters.adapter_arrays``: arrays, no pickle)."""
    buffer = io.BytesIO()
    np.savez(buffer, **adapter_arrays(adapter))  # type: ignore[arg-type]  # numpy's stubs: keyword arrays
    store.put(reverse_key(upgrade_id), buffer.getvalue())


REPLAN_REVERSE = ("it is fitted only while an upgrade is planned: run `fastfill upgrade abort`, then the same "
                  "`fastfill upgrade` with gallery.upgrade.online: true to plan it again; until then search with "
                  "--merge rrf (or no --merge)")


def load_reverse(store: Store, upgrade_id: str, online: bool | None = None):
    """The upgrade's reverse transformation, or None when it was planned without one. ``online``:
    what the plan says (``Plan.online``; None for a plan that does not say): where it says the
    upgrade was planned with one, a missing object is ObjectMissing. An object that is not one
    (its checksum matching: it was written so) is DamagedObject. Both name the object and what to do."""
    key = reverse_key(upgrade_id)
    if not store.exists(key):
        if online:
            raise ObjectMissing(f"{store.describe(key)} is missing: upgrade {upgrade_id} was planned with online "
                                f"backfilling (gallery.upgrade.online: true), and its reverse transformation has been "
                                f"deleted; {REPLAN_REVERSE}")
        return None
    data = store.get(key)
    try:
        if not data.startswith(b"PK\x03\x04"):  # what np.savez writes: a zip of .npy files
            raise ValueError("not a file of named arrays (.npz)")
        with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
            return adapter_from_arrays({name: arrays[name] for name in arrays.files})
    except (zipfile.BadZipFile, zlib.error, ValueError, KeyError, OSError, EOFError, RuntimeError) as error:
        why = " ".join(f"{type(error).__name__}: {error}".split())[:200]
        raise DamagedObject(f"{store.describe(key)} is not a reverse transformation ({why}; its checksum matches, so "
                            f"it was stored as it is); {REPLAN_REVERSE}") from None



# ------------------------------------------------------------------------------------------------
# The plan record


def chunk_grid(num_items: int, chunk_size: int, cuts=()) -> tuple[int, ...] | None:
    """Chunk boundaries: ``chunk_size`` items each, restarting at every cut (so the chunks after
    the front's prefilled items are whole again); None when there is no cut (the plain grid)."""
    cuts = sorted({int(c) for c in cuts if 0 < int(c) < num_items})
    if not cuts:
        return None
    edges: list[int] = []
    start = 0
    for stop in [*cuts, num_items]:
        edges.extend(range(start, stop, chunk_size))
        start = stop
    return tuple([*edges, num_items])


def write_plan(store: Store, plan: Plan) -> None:
    store.put_json(plan_key(plan.upgrade_id), plan.to_dict())



# ------------------------------------------------------------------------------------------------
# Planning


def transform_part(gallery: Gallery, upgrade_id: str, alignment_map, part: int, *, device=None,
                   sequential: bool = False) -> int:
    """h(old) and log sigma^2 of one part's stored features (``sequential``: of its source
    features, see write_sources); returns the part's item count."""
    from fastfill.components.experiment.inference import apply_alignment

    old = gallery.part_rows(source_key(upgrade_id, part), part) if sequential else gallery.features(gallery.model, part)
    transformed, log_sigma2 = apply_alignment(alignment_map, old, device=device)
    check_features(transformed, None, f"transformed features of part {part}")
    gallery.store.put_array(transformed_key(upgrade_id, part), transformed)
    if log_sigma2 is not None:
        gallery.store.put_array(sigma_key(upgrade_id, part), log_sigma2)
    return len(old)


def make_order(gallery: Gallery, upgrade_id: str, kind: str, seed: int, weights: np.ndarray | None = None) -> np.ndarray:
    """The backfill order ``kind`` (``usage.backfill_order``) from the upgrade's stored log sigma^2
    (when its map has an uncertainty head) and, for the usage orders, the items' ``weights``
    (default: ``usage.usage_weights`` of the gallery's items table)."""
    from fastfill.components.gallery.upgrade import usage

    if kind == "random":
        return usage.backfill_order(kind, gallery.num_items, seed)
    try:
        sigma = np.concatenate([gallery.part_rows(sigma_key(upgrade_id, p), p) for p in range(gallery.num_parts)])
    except ObjectMissing:
        sigma = None
    if kind in usage.USAGE_ORDERS and weights is None:
        weights = usage.usage_weights(gallery, None).weights
    return usage.backfill_order(kind, gallery.num_items, seed, sigma, weights)


def commit_plan(gallery: Gallery, plan: Plan, order: np.ndarray, eval_positions: np.ndarray | None = None,
                eval_queries: np.ndarray | None = None, eval_ranks: np.ndarray | None = None) -> None:
    """Write the order (and evaluation sample), then plan.json, then point the gallery at the
    upgrade: from here on queries use the new model against the mixed gallery. Needs the
    transformed parts written first."""
    store = gallery.store
    from fastfill.components.evaluation.ordering import check_permutation

    try:
        order = check_permutation(order, plan.num_items)
    except ValueError as error:
        raise GalleryError(f"the order of {plan.upgrade_id}: {error}") from None
    store.put_array(upgrade_key(plan.upgrade_id, ORDER), order.astype(np.int64))
    if eval_positions is not None and len(eval_positions) >= 2:
        assert eval_queries is not None  # the sample's positions come with their queries
        store.put_array(eval_positions_key(plan.upgrade_id), eval_positions)
        store.put_array(eval_queries_key(plan.upgrade_id), eval_queries)
        if eval_ranks is not None:
            store.put_array(eval_ranks_key(plan.upgrade_id), np.asarray(eval_ranks, dtype=np.float64))
    write_plan(store, plan)
    gallery.write_manifest({**gallery.manifest(refresh=True), "upgrade": plan.upgrade_id})
    if plan.base:
        store.put_json(upgrade_key(plan.base, SUPERSEDED), {"by": plan.upgrade_id, "at": now()})


def eval_size(config) -> int | None:
    """The evaluation sample's size from ``gallery.upgrade`` (``config``): None = all labeled
    items. ``auto``: the queries that give a measured top-1 the standard error
    ``eval_standard_error`` (points) at worst, a top-1 of 50% (binomial: 0.25 / n = (se / 100)^2),
    whatever the gallery's size: a share of a gallery would give a small one's sample the same
    error bars as a large one's only by chance."""
    if config.eval_queries == "all":
        return None
    if config.eval_queries == "auto":
        return worst_case_queries(config.eval_standard_error)
    return int(config.eval_queries)


def worst_case_queries(standard_error: float) -> int:
    """Queries whose top-1 (a share of hits) has at most ``standard_error`` points of standard error."""
    return math.ceil(0.25 * (100.0 / standard_error) ** 2)


def worst_case_standard_error(queries: int) -> float:
    """Points of standard error of a top-1 measured on ``queries`` queries, at worst (50%)."""
    return 100.0 * math.sqrt(0.25 / queries) if queries else math.inf


def eval_sample(labels: np.ndarray | None, size: int | None, seed: int, num_items: int | None = None) -> np.ndarray:
    """Positions of the items that serve as queries (and their own gallery) while the backfill
    is measured and predicted; ``size`` None = all of them, 0 = none. Without labels, a sample
    of the ``num_items`` items (the label-free prediction's), or none when that is not given."""
    if size == 0 or (labels is None and not num_items):
        return np.zeros(0, dtype=np.int64)
    n = len(labels) if labels is not None else int(num_items or 0)
    if size is None or size >= n:
        return np.arange(n, dtype=np.int64)
    return np.sort(np.random.default_rng(seed).choice(n, size=size, replace=False)).astype(np.int64)


def front_loaded(order: np.ndarray, prefilled: np.ndarray) -> np.ndarray:
    """``order`` with the ``prefilled`` positions (embedded while planning) first, in the
    sequence ``order`` gives them, then every other item as ``order`` has it."""
    first = np.zeros(len(order), dtype=bool)
    first[np.asarray(prefilled, dtype=np.int64)] = True
    in_front = first[order]
    return np.concatenate([order[in_front], order[~in_front]]).astype(np.int64)


def stand_in_ranks(order: np.ndarray, prefilled: np.ndarray, positions: np.ndarray, seed: int) -> np.ndarray:
    """Where each evaluation item stands in the backfill when the items embedded while planning
    (``prefilled``, which holds every one of ``positions``) come first: the place a random item
    of the gallery would have. The sample is a uniform sample of the gallery, so a share
    |prefilled| / N of it (seeded) stands for the front and takes places spread over it; each
    other item takes the place it has in ``order`` (sigma's or the random one, before the
    prefilled items were moved to the front) among the items that were not prefilled. The
    measurement along the backfill, the advisor and the gate count an evaluation item as
    backfilled once the backfill passes its place, so the curves they give stand for the whole
    gallery, not for a sample that is all backfilled from the start."""
    order, positions = np.asarray(order, dtype=np.int64), np.asarray(positions, dtype=np.int64)
    n, m, front = len(order), len(positions), len(np.unique(prefilled))
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    rest = np.ones(n, dtype=bool)
    rest[np.asarray(prefilled, dtype=np.int64)] = False
    rest_ranks = np.sort(rank[rest])  # original places of the items that were not prefilled
    places = front + np.searchsorted(rest_ranks, rank[positions]).astype(np.float64)
    rng = np.random.default_rng([seed, 27])
    chosen = rng.choice(m, size=int(round(m * front / max(n, 1))), replace=False)
    places[chosen] = rng.uniform(0, front, size=len(chosen))
    return places


def eval_ranks(store: Store, plan: Plan, positions: np.ndarray) -> np.ndarray:
    """Each evaluation item's place in the backfill (see ``stand_in_ranks`` when items were
    embedded while planning; else its place in the order)."""
    if plan.prefilled:
        try:
            return store.get_array(eval_ranks_key(plan.upgrade_id))
        except ObjectMissing:
            pass
    order = order_of(store, plan.upgrade_id)
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    return rank[np.asarray(positions, dtype=np.int64)].astype(np.float64)






def stored_eval_sample(store, upgrade_id: str) -> tuple[np.ndarray, np.ndarray]:
    """The upgrade's evaluation sample: (positions, new-model query features). Its absence is a
    configuration problem, said so; any other store failure (an outage) propagates as it is, never
    as a missing measurement."""

    try:
        return store.get_array(eval_positions_key(upgrade_id)), store.get_array(eval_queries_key(upgrade_id))
    except ObjectMissing as error:
        raise GalleryError(f"upgrade {upgrade_id} has no evaluation sample, so the promotion gate cannot measure it "
                           "(the gallery needs labels and gallery.upgrade.eval_queries > 0); run with --no-gate "
                           "or set promotion.gate: false") from error


def discard_unplanned(gallery: Gallery, upgrade_id: str) -> int:
    """Delete what a refused or failed planning wrote under the upgrade's prefix, so the store is
    as it was; never once plan.json exists (then the upgrade is resumable and its objects count)."""
    if load_plan(gallery.store, upgrade_id) is not None:
        return 0
    keys = [key for key in gallery.store.list(f"upgrades/{upgrade_id}/") if not key.endswith("/rejected.json")]
    for key in keys:
        gallery.store.delete(key)
    return len(keys)
