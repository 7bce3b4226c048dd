"""An upgrade's planning, as one course: ``PlanningCourse`` decides the sequence and what a
refusal cleans up; every step that reads or writes the store, MLflow or a model is a port it is
given (``PlanningSteps``). ``flows/upgrade_planning.py`` binds Prefect tasks to the ports,
``tests/unit/test_planning_course.py`` binds fakes and makes each port fail in turn.

The course, in order::

    reads, before anything is written: the base's plan (a sequential upgrade), the gallery's
        sources checked, the usage weights (the usage orders)
    discard a killed planning's leftovers ─> open the upgrade's MLflow run
    ─> (sequential) the base's sources written
    ─> map (the registry's, or trained on the map's pairs) ─> checked against the order and dims
    ─> (online) the reverse map fitted on the pairs, written, tagged on the run
    ─> the gallery's features through the map ─> the backfill order ─> the samples embedded
    ─> prefill (the items embedded while planning first, their stand-in ranks) ─> commit the plan

A GalleryError or StoreError after the run is opened is a refusal: what planning wrote under
``upgrades/<id>/`` is discarded, the run is closed FAILED, and the error is raised. Any other
failure (a killed process) leaves both for the next planning, whose first step discards them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from fastfill.components.gallery.layouts.catalog import GalleryError
from fastfill.components.gallery.store import StoreError
from fastfill.components.gallery.upgrade import planning, samples, usage
from fastfill.components.gallery.upgrade.decider import Course
from fastfill.components.gallery.upgrade.lifecycle import check_map_fits, plan_fields
from fastfill.components.gallery.upgrade.planning import Plan
from fastfill.components.platform.layout import Layout
from fastfill.components.platform.registry import ModelRef


class PlanningSteps(Protocol):
    """The steps of a planning that touch the store, MLflow or a model (the flow binds Prefect
    tasks, each store write and MLflow record a retried one)."""

    num_items: int  # the gallery's items

    # ---- reads, before anything is written

    def base_plan(self, upgrade_id: str) -> Plan | None:
        """The plan of the unfinished upgrade a sequential one starts from."""

    def check_sources(self, sequential: bool) -> None:
        """Refuse a gallery whose parts are missing or foreign (GalleryError)."""

    def usage_weights(self) -> usage.Usage:
        """The usage orders' weights (gallery.upgrade.usage_log, else the items table's column)."""

    def done_chunks(self, upgrade_id: str) -> int:
        """How many of ``upgrade_id``'s chunks are backfilled."""

    # ---- the store and MLflow

    def discard(self, upgrade_id: str) -> int:
        """What a planning of ``upgrade_id`` wrote before its plan was, removed; the objects' count."""

    def open_run(self, fields: dict) -> str:
        """The upgrade's MLflow run opened with ``fields`` as params; its id."""

    def close_run(self, run_id: str, status: str, reason: str) -> None:
        """The run closed (a refused planning's: FAILED, with why)."""

    def tag_run(self, run_id: str, tags: dict) -> None:
        """Tags set on the run."""

    def write_sources(self, upgrade_id: str, base: Plan) -> None:
        """A sequential upgrade's sources: the gallery as ``base`` left it."""

    def write_reverse(self, upgrade_id: str, reverse: Any) -> None:
        """Online backfilling's reverse transformation kept with the plan."""

    def commit(self, plan: Plan, order: np.ndarray, embedded: dict, judged: Any, positions: np.ndarray,
               queries: Any, ranks: np.ndarray | None) -> int:
        """The plan written last, with its order, samples and the prefilled chunks; their count."""

    # ---- the work

    def choose_map(self, old: ModelRef, new: ModelRef, new_model: Any, run_id: str,
                   pairs: Callable[[], Any]) -> tuple[Any, str, str, Any]:
        """The alignment map (the registry's, checked once per source, or trained on ``pairs()``):
        (map, its URI, the order it gives, the pairs used or None)."""

    def split_pairs(self, old: ModelRef, new_model: Any) -> Any:
        """The map's pairs from the pipeline's training split; None when there is none."""

    def gallery_pairs(self, positions: np.ndarray, new_model: Any, base: str | None) -> Any:
        """The map's pairs from the gallery's items at ``positions`` (``base``: the unfinished
        upgrade whose features they start from)."""

    def fit_reverse(self, pairs: Any) -> Any:
        """Online backfilling's reverse transformation, fitted on the map's pairs."""

    def transform(self, upgrade_id: str, alignment_map: Any, sequential: bool) -> None:
        """The gallery's features through the map, every part (all ended before it returns)."""

    def order(self, upgrade_id: str, kind: str, seed: int, weights: np.ndarray | None) -> np.ndarray:
        """The backfill order ``kind`` (from the stored sigma, and the usage weights)."""

    def embed_samples(self, new_model: Any, judged: Any, embedded: dict) -> tuple[Any, np.ndarray, Any]:
        """The judged queries and the evaluation sample embedded by ``new_model`` (the judged ones
        by the gallery's model too); ``embedded`` (position -> new features) gains the sample's
        items. (judged with features or None, the sample's positions, its new features or None)."""

    def log(self, line: str) -> None: ...


@dataclass(frozen=True)
class PlanningSettings:
    """What a planning is told: ``gallery.upgrade``, the gallery's distance, the map's validation
    (whether its sample is checked), and where the training split is (map_pairs: splits)."""

    upgrade: Any
    distance: str
    validation_fraction: float
    map_checked: bool
    splits: str

    @classmethod
    def of(cls, params) -> PlanningSettings:
        settings = params.upgrade_map
        return cls(params.gallery.upgrade, params.gallery.distance, settings.validation_fraction,
                   settings.validation_fraction > 0 and settings.check != "off", str(Layout(params.paths).splits))


class PlanningCourse:
    """The planning of one upgrade through ``steps``: ``plan`` returns the committed plan, or
    raises having cleaned up what a refusal leaves."""

    def __init__(self, settings: PlanningSettings, steps: PlanningSteps):
        self.settings, self.steps, self.log = settings, steps, steps.log

    def plan(self, course: Course, new: ModelRef, new_model: Any, judged: Any = None) -> Plan:
        """Plan ``course``'s upgrade to ``new``. With a base (an unfinished upgrade to ``course.old``),
        a sequential upgrade: the map applies to the gallery as that upgrade left it, so items still
        on the gallery's model go through both maps. A gallery whose parts are missing or foreign is
        refused before anything is written; one whose content fails while planning (a NaN, a torn
        part) is refused and what planning wrote is removed. ``judged``: the judged queries, or None
        without them. The usage orders' weights are read here, before anything is written."""
        config, steps, upgrade_id = self.settings.upgrade, self.steps, course.upgrade_id
        assert upgrade_id is not None and course.old is not None  # a course that plans names its upgrade and its start
        base = steps.base_plan(course.base) if course.base else None
        steps.check_sources(base is not None)  # before anything is written
        weights = None
        if config.order in usage.USAGE_ORDERS:  # read and checked against the gallery before any work
            found = steps.usage_weights()
            self.log(found.describe())
            weights = found.weights
        leftover = steps.discard(upgrade_id)  # a killed planning's objects (its prefilled chunks too)
        if leftover:
            self.log(f"removed {leftover} object(s) that a planning of {upgrade_id} killed before its plan was written had left")
        run_id = steps.open_run(plan_fields(config, upgrade_id, course.old.uri, new.uri, course.base))
        try:
            return self._make_plan(upgrade_id, course.old, new, new_model, base, run_id, judged, weights)
        except (GalleryError, StoreError) as error:
            discarded = steps.discard(upgrade_id)
            steps.close_run(run_id, "FAILED", f"planning refused: {error}")
            self.log(f"planning refused; {discarded} object(s) it had written under upgrades/{upgrade_id}/ were removed, so "
                     "the store is as it was")
            raise

    def _make_plan(self, upgrade_id: str, old: ModelRef, new: ModelRef, new_model: Any, base: Plan | None, run_id: str,
                   judged: Any, weights: np.ndarray | None) -> Plan:
        """The map, the gallery through it, the order, the samples embedded now, then the plan written."""
        config, steps, sequential = self.settings.upgrade, self.steps, base is not None
        if base is not None:  # first: the map's pairs and transform start from the gallery as base left it
            steps.write_sources(upgrade_id, base)
            self.log(f"sequential upgrade: starting from {base.upgrade_id} as it stands "
                     f"({steps.done_chunks(base.upgrade_id)}/{base.num_chunks} chunks on {base.new.uri}, the "
                     "rest through its map)")
        alignment_map, map_uri, order_kind, pairs = steps.choose_map(
            old, new, new_model, run_id, lambda: self._map_pairs(upgrade_id, old, new_model, sequential))
        # an order that needs sigma without the map's uncertainty head is refused here, before the transform
        check_map_fits(alignment_map, map_uri, order_kind, old.dim, new.dim, new.uri)
        if config.online:
            pairs = self._online_reverse(upgrade_id, old, new_model, sequential, run_id, pairs)
        steps.transform(upgrade_id, alignment_map, sequential)
        order = steps.order(upgrade_id, order_kind, config.seed, weights)
        embedded = (dict(zip(pairs.positions.tolist(), pairs.new))
                    if pairs is not None and pairs.positions is not None else {})
        judged, positions, queries = steps.embed_samples(new_model, judged, embedded)
        # the items embedded while planning are backfilled from the start: the first chunks of the order
        prefilled = np.fromiter(sorted(embedded), dtype=np.int64, count=len(embedded))
        ranks = (planning.stand_in_ranks(order, prefilled, positions, config.seed)
                 if len(prefilled) and queries is not None else None)
        if len(prefilled):
            order = planning.front_loaded(order, prefilled)
        num_items = steps.num_items
        plan = Plan(upgrade_id, old, new, map_uri, order_kind, config.chunk_size, num_items,
                    len(positions) if queries is not None else 0, self.settings.distance, run_id,
                    base=base.upgrade_id if base else None,
                    bounds=planning.chunk_grid(num_items, config.chunk_size, [len(prefilled)]),
                    prefilled=len(prefilled), online=config.online)
        chunks = steps.commit(plan, order, embedded, judged, positions, queries, ranks)
        if chunks:
            self.log(f"{len(prefilled)} items embedded while planning (map sample and evaluation sample) are "
                     f"backfilled first: chunks 0-{chunks - 1} written")
        self.log(f"planned {upgrade_id}: {plan.num_chunks} chunks of {plan.chunk_size}, {plan.order_kind} order"
                 + (f", {plan.prefilled} items already backfilled" if plan.prefilled else "")
                 + f"; queries now use {new.uri} against the mixed gallery")
        return plan

    def _online_reverse(self, upgrade_id: str, old: ModelRef, new_model: Any, sequential: bool, run_id: str, pairs: Any):
        """gallery.upgrade.online: online backfilling's reverse transformation, fitted on the map's
        pairs (embedded now when the registry's map was used without them) and kept with the plan;
        returns the pairs."""
        if pairs is None:
            self.log("online backfilling: the registry's map was used as it is, so its pairs are embedded now for "
                     "the reverse transformation")
            pairs = self._map_pairs(upgrade_id, old, new_model, sequential)
        if pairs is None:
            raise GalleryError(f"gallery.upgrade.online needs the map's pairs, and there is no training split at "
                               f"{self.settings.splits} (gallery.upgrade.map_pairs: splits); use map_pairs: "
                               "gallery, or set online: false")
        reverse = self.steps.fit_reverse(pairs)
        self.steps.write_reverse(upgrade_id, reverse)
        gain = reverse.new_scale ** 2
        self.steps.tag_run(run_id, {"online": "metric_compatible", "online.new_gain": f"{gain:.6g}"})
        return pairs

    def _map_pairs(self, upgrade_id: str, old: ModelRef, new_model: Any, sequential: bool):
        """The pairs that train and check the map, from ``gallery.upgrade.map_pairs``."""
        config, num_items = self.settings.upgrade, self.steps.num_items
        if config.map_pairs == "splits":
            return self.steps.split_pairs(old, new_model)
        samples.check_map_sample(config, self.settings.validation_fraction, num_items,
                                 checked=self.settings.map_checked)
        positions = samples.map_sample(config, num_items)
        minimum = f", at least {config.map_sample_min}" if isinstance(config.map_sample, float) else ""  # a fraction
        self.log(f"map sample: {len(positions)} of {num_items} gallery items (gallery.upgrade.map_sample "
                 f"{config.map_sample}{minimum})")
        return self.steps.gallery_pairs(positions, new_model, upgrade_id if sequential else None)
