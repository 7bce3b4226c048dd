"""The rules an upgrade's steps apply, without Prefect: the registry map to use and its order,
whether a map fits, which source a map's check counts for, what the gate measures against, the
backfill budget and the exact stop, and the chunk scheduler's bookkeeping (``Backfill``: what to
start, what has landed, whether it is complete). Which step comes next is
``components.gallery.upgrade.decider``'s (its docstring draws the states).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from fastfill.components.gallery.layouts.catalog import GalleryError
from fastfill.components.gallery.upgrade.outcome import BackfillSummary
from fastfill.components.gallery.upgrade.planning import Plan


def failure_limit(max_failed: float | int, num_items: int) -> int:
    """Images that may fail before the upgrade stops: a fraction of the items (float) or a count."""
    return int(max_failed * num_items) if isinstance(max_failed, float) else int(max_failed)


def budget_items(budget: float | int | None, num_items: int) -> int:
    """Items a run may backfill: all (None), a fraction (float in (0, 1]) or a count (int)."""
    if budget is None:
        return num_items
    if isinstance(budget, float):
        return min(num_items, max(1, math.ceil(budget * num_items)))
    return min(num_items, int(budget))


def cut_for_limit(plan: Plan, done: set[int], limit: int) -> tuple[Plan, int | None]:
    """The plan with a chunk boundary at ``limit`` items of the backfill, so that a budget or a
    recommended stop ends exactly there; (plan, None) when ``limit`` already is a boundary, or
    when chunks past it are done (cutting would renumber them; the backfill then stops at the
    last whole chunk within the limit)."""
    if limit >= plan.num_items:
        return plan, None
    cut, split = plan.cut_at(limit)
    if split is None or any(c >= split for c in done):
        return plan, None
    return cut, split


def done_prefix(done: set[int], num_chunks: int) -> int:
    """How many chunks from the start of the order are done (retrieval is measured at the
    prefix, where the gallery is exactly the first items of the order)."""
    count = 0
    while count < num_chunks and count in done:
        count += 1
    return count


CHECK_SOURCE_TAG = "check.source"  # the pairs a map's check was measured on: "splits", or "gallery <store>"
SPLITS_SOURCE = "splits"  # the pipeline's new-train split (what a map without the tag was checked on)


def check_source(tags: dict) -> str:
    return tags.get(CHECK_SOURCE_TAG, SPLITS_SOURCE)


def failed_on(tags: dict, source: str) -> bool:
    """An upgrade's check on ``source`` failed this version and replaced it (the pipeline's own
    versions carry no source tag: a pipeline version tagged ``fallback`` is the map it fell back to)."""
    return CHECK_SOURCE_TAG in tags and tags[CHECK_SOURCE_TAG] == source and tags.get("check") == "fallback"


def checked_on(tags: dict, source: str) -> bool:
    """The version came out of a check on ``source`` fit to use: it passed, was kept under warn,
    or is the map a failed check chose in its place."""
    outcome = tags.get("check")
    pipeline_fallback = outcome == "fallback" and CHECK_SOURCE_TAG not in tags  # the align stage's chosen map
    return check_source(tags) == source and (outcome in ("passed", "warned", "fallback map") or pipeline_fallback)


def needs_check(tags: dict, source: str, recheck: bool = False) -> bool:
    """Whether a registered map must be checked on this upgrade's pairs before it is used: not an
    l2-only map (it is the check's own reference), nor one already checked on the same source,
    unless ``recheck``."""
    if recheck:
        return True
    return tags.get("method") != "fct" and not checked_on(tags, source)


def choose_map(found: list, order: str, source: str | None = None):
    """Of the registry's map versions for this pair of models (newest first), the one to use:
    none that a check on ``source`` replaced; of the rest, one already checked on ``source``
    first; for the sigma order, a map with an uncertainty head (not FCT's) before an FCT map;
    else the newest. None if none."""
    if source is not None:
        found = [v for v in found if not failed_on(v.tags, source)]
    if not found:
        return None
    if source is not None:
        found = sorted(found, key=lambda v: not checked_on(v.tags, source))  # stable: newest first within each
    if order == "sigma":
        with_sigma = [v for v in found if v.tags.get("method") != "fct"]
        return (with_sigma or found)[0]
    return found[0]


def registered_map_order(tags: dict, order: str) -> tuple[str, str | None]:
    """The backfill order of a map taken from the registry, and why it differs from the
    configured ``order`` (None if it does not). The map check decided it when it registered a
    fallback map (``map_check.fallback_map``): its tag ``fallback_order: random`` means the
    fallback's sigma order was not shown to help. An l2-only map (tag ``method: fct``, what the
    upgrade of a gallery too small for a checked map registers) has no sigma at all: random too,
    rather than a refusal of the sigma order the configuration asks by default."""
    if order == "sigma" and tags.get("fallback_order") == "random":
        return "random", ("a fallback map whose sigma order was not shown to help (tag fallback_order: random): "
                          "the backfill goes in random order")
    if order == "sigma" and tags.get("method") == "fct":  # e.g. what a small gallery's upgrade registered
        return "random", "an l2-only map (method fct), with no uncertainty head: the backfill goes in random order"
    return order, None


def check_map_fits(alignment_map, map_uri: str, order: str, old_dim: int | None, new_dim: int | None,
                   new_uri: str) -> None:
    """Raise GalleryError if the map cannot serve this upgrade: an order that needs sigma (sigma,
    usage_sigma) without an uncertainty head, or dimensions other than the gallery's and the new
    model's."""
    if order in ("sigma", "usage_sigma") and getattr(alignment_map, "uncertainty", None) is None:
        raise GalleryError(f"{map_uri} has no uncertainty head, so there is no sigma order; set "
                           "gallery.upgrade.order: random" + (" or usage" if order == "usage_sigma" else "")
                           + " or register a FastFill map")
    if alignment_map.old_dim != old_dim or alignment_map.new_dim != new_dim:
        raise GalleryError(f"{map_uri} maps {alignment_map.old_dim} -> {alignment_map.new_dim} dimensions, but the "
                           f"gallery's features are {old_dim}-d and {new_uri} makes {new_dim}-d ones")


TRUTH_JUDGMENTS, TRUTH_LABELS, TRUTH_NONE = "judgments", "labels", "none"


def truth_of(has_labels: bool, judgments: str | None) -> str:
    """What the promotion gate and the budget advisor measure against: a judgments file first,
    then the gallery's labels, else nothing."""
    return TRUTH_JUDGMENTS if judgments else TRUTH_LABELS if has_labels else TRUTH_NONE


def no_truth_refusal(store_uri: str) -> str:
    """Why an upgrade of a gallery with no labels and no judgments is refused under the gate."""
    return (f"the gallery at {store_uri} has no labels and no judged queries are configured, so the promotion gate "
            "has nothing to measure the upgrade against; nothing was planned or embedded. Give a judgments file "
            "(--judgments FILE or gallery.upgrade.judgments: CSV/Parquet with columns query, relevant), adopt the "
            "gallery with a label column, or run it ungated (--no-gate or promotion.gate: false)")


def plan_fields(config, upgrade_id: str, old_uri: str, new_uri: str, base: str | None) -> dict:
    """What the upgrade's MLflow run records as params: the models and ``gallery.upgrade``."""
    return {"id": upgrade_id, "old": old_uri, "new": new_uri, "order": config.order, "chunk_size": config.chunk_size,
            "max_concurrency": config.max_concurrency, "task_runner": config.task_runner,
            "eval_queries": config.eval_queries, "base": base}


@dataclass
class Backfill:
    """The scheduler's bookkeeping for one run of the backfill: which chunks to start (in order,
    at most ``max_concurrency`` in flight, none past the budget, none after a failure), and what
    has landed. The flow submits and waits; this decides."""

    plan: Plan
    done: set[int]
    limit: int
    max_concurrency: int
    max_failed_images: int | None = None  # None: no limit
    max_items_per_second: float | None = None  # None: as fast as the chunks go
    started: float = 0.0  # the clock (seconds) when this run began; the throttle counts from it
    failed_images: list[dict] = field(default_factory=list)  # items whose image could not be read
    pending: list[int] = field(init=False)
    in_flight: set[int] = field(default_factory=set)
    items_done: int = field(init=False)
    submitted_items: int = field(init=False)
    failure: BaseException | None = None

    def __post_init__(self) -> None:
        self.pending = [c for c in range(self.plan.num_chunks) if c not in self.done]
        self.items_done = self.submitted_items = self.plan.items_in(self.done)
        self.run_items = 0  # items submitted by this run (what the throttle paces)

    @property
    def can_start_more(self) -> bool:
        """Chunks remain that this run may start, now or once the throttle allows: the next one
        fits within the budget whole (a stop is never rounded up; ``cut_for_limit`` makes the
        budget a chunk boundary where it can)."""
        return (bool(self.pending) and self.failure is None
                and self.submitted_items + self.plan.items_in([self.pending[0]]) <= self.limit)

    def wait_time(self, now: float) -> float:
        """Seconds until the throttle lets the next chunk start: the items this run has started,
        at ``max_items_per_second``, must have had their time."""
        if not self.max_items_per_second:
            return 0.0
        return max(0.0, self.run_items / self.max_items_per_second - (now - self.started))

    def to_start(self, now: float | None = None) -> list[int]:
        """The chunks to submit now (``now``: the clock, for the throttle); they count as in
        flight from here."""
        chosen = []
        while (self.can_start_more and len(self.in_flight) < self.max_concurrency
               and (now is None or self.wait_time(now) <= 0)):
            chunk = self.pending.pop(0)
            self.run_items += self.plan.items_in([chunk])
            self.in_flight.add(chunk)
            self.submitted_items += self.plan.items_in([chunk])
            chosen.append(chunk)
        return chosen

    def landed(self, chunk: int, count: int, failed: Sequence[dict] = ()) -> None:
        """A chunk is done; ``failed`` lists its items whose image could not be read. Past
        ``max_failed_images`` of them, nothing new starts and the failure says why."""
        self.in_flight.discard(chunk)
        self.done.add(chunk)
        self.items_done += count
        self.failed_images += list(failed)
        if self.max_failed_images is not None and len(self.failed_images) > self.max_failed_images:
            first = self.failed_images[0]
            self.failure = self.failure or GalleryError(
                f"{len(self.failed_images)} image{'s' if len(self.failed_images) > 1 else ''} could not be read or "
                "decoded, more than the "
                f"{self.max_failed_images} that gallery.upgrade.max_failed_images allows (first: item {first['id']} at "
                f"{first['uri']}: {first['reason']}); `fastfill upgrade status` lists them. Raise the limit and "
                "run the same command to go on: done chunks are kept, and their failed items keep their transformed "
                "features")

    def failed(self, chunk: int, error: BaseException) -> None:
        """The first failure stops new submissions; what is in flight still finishes."""
        self.in_flight.discard(chunk)
        self.failure = self.failure or error

    @property
    def complete(self) -> bool:
        return len(self.done) == self.plan.num_chunks

    def summary(self) -> BackfillSummary:
        return BackfillSummary(self.plan.upgrade_id, len(self.done), self.plan.num_chunks, self.items_done,
                               self.plan.num_items, self.items_done / self.plan.num_items, self.complete,
                               len(self.failed_images))
