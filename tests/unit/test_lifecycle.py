"""The upgrade's decisions (components.gallery.upgrade.lifecycle): the budget, the map and its order,
whether the map fits, and the chunk scheduler's bookkeeping."""

from types import SimpleNamespace

import numpy as np
import pytest

from fastfill.components.gallery.layouts.catalog import GalleryError
from fastfill.components.gallery.store import open_store
from fastfill.components.gallery.upgrade import planning
from fastfill.components.gallery.upgrade.lifecycle import (
    Backfill,
    budget_items,
    check_map_fits,
    checked_on,
    choose_map,
    cut_for_limit,
    done_prefix,
    failed_on,
    needs_check,
    plan_fields,
    registered_map_order,
)
from fastfill.components.gallery.upgrade.planning import Plan, chunk_grid, front_loaded, stand_in_ranks
from fastfill.components.platform.config import UpgradeConfig
from fastfill.components.platform.registry import ModelRef

OLD, NEW = ModelRef("embedder", "1", 4), ModelRef("embedder", "2", 6)


def _plan(num_items=10, chunk_size=3) -> planning.Plan:
    return planning.Plan(planning.upgrade_id(OLD, NEW), OLD, NEW, "models:/m/1", "sigma", chunk_size, num_items, 0, "l2")


@pytest.mark.parametrize("budget, expected", [(None, 10), (0.25, 3), (0.01, 1), (1.0, 10), (4, 4), (99, 10)])
def test_budget_items(budget, expected):
    assert budget_items(budget, 10) == expected


def test_done_prefix_counts_only_the_unbroken_start():
    assert done_prefix({0, 1, 3}, 5) == 2 and done_prefix(set(), 5) == 0 and done_prefix({0, 1}, 2) == 2


def test_choose_map_prefers_a_map_with_sigma_for_the_sigma_order():
    fct = SimpleNamespace(version="3", tags={"method": "fct"})
    fastfill = SimpleNamespace(version="2", tags={"method": "fastfill"})
    assert choose_map([fct, fastfill], "sigma") is fastfill
    assert choose_map([fct, fastfill], "random") is fct
    assert choose_map([fct], "sigma") is fct and choose_map([], "sigma") is None


def test_registered_map_order_follows_the_fallback_tag():
    assert registered_map_order({"method": "fastfill"}, "sigma") == ("sigma", None)
    order, why = registered_map_order({"method": "fastfill", "fallback_order": "random"}, "sigma")
    assert order == "random" and "fallback_order: random" in why
    assert registered_map_order({"fallback_order": "random"}, "random") == ("random", None)
    # an l2-only map (a small gallery's upgrade registers one): no sigma, so random, said
    order, why = registered_map_order({"method": "fct"}, "sigma")
    assert order == "random" and "no uncertainty head" in why


def test_check_map_fits_names_what_does_not_fit():
    with_head = SimpleNamespace(uncertainty=object(), old_dim=4, new_dim=6)
    check_map_fits(with_head, "models:/m/1", "sigma", 4, 6, NEW.uri)
    with pytest.raises(GalleryError, match="no uncertainty head.*order: random"):
        check_map_fits(SimpleNamespace(uncertainty=None, old_dim=4, new_dim=6), "models:/m/1", "sigma", 4, 6, NEW.uri)
    with pytest.raises(GalleryError, match="no uncertainty head.*order: random or usage"):
        check_map_fits(SimpleNamespace(uncertainty=None, old_dim=4, new_dim=6), "models:/m/1", "usage_sigma", 4, 6,
                       NEW.uri)
    for order in ("random", "usage"):
        check_map_fits(SimpleNamespace(uncertainty=None, old_dim=4, new_dim=6), "models:/m/1", order, 4, 6, NEW.uri)
    with pytest.raises(GalleryError, match=r"maps 4 -> 6 dimensions.*8-d"):
        check_map_fits(with_head, "models:/m/1", "sigma", 4, 8, NEW.uri)


def test_plan_fields_record_the_models_and_settings():
    fields = plan_fields(UpgradeConfig(), "u", OLD.uri, NEW.uri, None)
    assert fields["old"] == OLD.uri and fields["new"] == NEW.uri and fields["base"] is None
    assert fields["order"] == UpgradeConfig().order and fields["chunk_size"] == UpgradeConfig().chunk_size


def test_backfill_keeps_concurrency_budget_and_stops_after_a_failure():
    plan = _plan(num_items=10, chunk_size=3)  # chunks of 3, 3, 3, 1
    state = Backfill(plan, {1}, limit=10, max_concurrency=2)
    assert state.items_done == 3 and state.to_start() == [0, 2] and state.to_start() == []
    state.landed(0, 3)
    assert state.to_start() == [3] and not state.complete
    state.failed(2, RuntimeError("disk full"))
    state.landed(3, 1)
    assert state.to_start() == [] and isinstance(state.failure, RuntimeError)
    assert state.summary().chunks_done == 3 and state.summary().items_done == 7

    budgeted = Backfill(plan, set(), limit=4, max_concurrency=4)
    assert budgeted.to_start() == [0]  # a second chunk would pass the budget of 4: never rounded up
    budgeted.landed(0, 3)
    assert budgeted.to_start() == [] and budgeted.summary().fraction == pytest.approx(0.3)


def test_a_stop_inside_a_chunk_cuts_that_chunk_so_the_backfill_ends_exactly_there():
    plan = _plan(num_items=10, chunk_size=6)  # chunks of 6, 4: one chunk larger than the stop
    cut, split = cut_for_limit(plan, set(), 4)
    assert split == 0 and [cut.chunk_bounds(c) for c in range(cut.num_chunks)] == [(0, 4), (4, 6), (6, 10)]
    state = Backfill(cut, set(), limit=4, max_concurrency=4)
    assert state.to_start() == [0]
    state.landed(0, 4)
    assert state.to_start() == [] and state.items_done == 4
    # resumed without a limit, the rest of the split chunk and the chunks after it follow
    rest = Backfill(cut, {0}, limit=10, max_concurrency=4)
    assert rest.to_start() == [1, 2]
    assert list(cut.chunk_of(np.arange(10))) == [0, 0, 0, 0, 1, 1, 2, 2, 2, 2]
    # on a boundary, or with a chunk past it done (cutting would renumber it), nothing is cut
    assert cut_for_limit(cut, set(), 6) == (cut, None)
    assert cut_for_limit(plan, {1}, 4) == (plan, None)
    assert Plan.from_dict(cut.to_dict()) == cut


def test_the_chunk_grid_restarts_after_the_prefilled_front():
    assert chunk_grid(10, 4, [3]) == (0, 3, 7, 10)
    assert chunk_grid(10, 4, []) is None and chunk_grid(10, 4, [10]) is None
    assert chunk_grid(9, 3, [5]) == (0, 3, 5, 8, 9)


def test_the_throttle_paces_chunk_starts_by_items_per_second():
    plan = _plan(num_items=10, chunk_size=3)  # chunks of 3, 3, 3, 1
    state = Backfill(plan, set(), limit=10, max_concurrency=4, max_items_per_second=1.5, started=100.0)
    assert state.to_start(100.0) == [0]  # the first chunk at once; 3 items buy 2 seconds
    assert state.wait_time(100.5) == 1.5 and state.to_start(101.0) == []
    assert state.to_start(102.0) == [1] and state.wait_time(102.0) == 2.0
    state.landed(0, 3)
    state.landed(1, 3)
    assert state.can_start_more and state.to_start(104.0) == [2] and state.to_start(106.0) == [3]
    assert not state.can_start_more
    unthrottled = Backfill(plan, set(), limit=10, max_concurrency=4)
    assert unthrottled.wait_time(0.0) == 0.0 and unthrottled.to_start(0.0) == [0, 1, 2, 3]


def _version(number: str, **tags) -> SimpleNamespace:
    return SimpleNamespace(version=number, tags=tags)


def test_a_map_checked_on_the_same_source_is_used_as_it_is_and_one_that_failed_there_is_passed_over():
    here, there = "gallery s3://team/main", "gallery s3://team/other"
    passed = _version("3", method="fastfill", check="passed", **{"check.source": here})
    assert checked_on(passed.tags, here) and not needs_check(passed.tags, here)
    assert needs_check(passed.tags, there) and needs_check(passed.tags, here, recheck=True)
    pipeline = _version("1", method="fastfill", check="passed")  # the pipeline's map: checked on its split
    assert checked_on(pipeline.tags, "splits") and needs_check(pipeline.tags, here)
    assert not needs_check({"method": "fct"}, here)  # an l2-only map is the check's own reference
    failed = _version("4", method="fastfill", check="fallback", **{"check.source": here})
    fallback = _version("5", method="fct", check="fallback map", **{"check.source": here})
    assert failed_on(failed.tags, here) and not failed_on(failed.tags, there)
    assert choose_map([fallback, failed, passed], "sigma", here) is passed  # checked here, with a sigma head
    assert choose_map([fallback, failed], "sigma", here) is fallback  # never the map that failed here
    assert choose_map([failed, pipeline], "sigma", there) is failed  # on another gallery it is checked again


def test_prefilled_items_come_first_and_the_sample_stands_for_the_whole_gallery():
    order = np.array([5, 3, 9, 0, 1, 2, 4, 6, 7, 8])
    assert list(front_loaded(order, np.array([0, 9]))) == [9, 0, 5, 3, 1, 2, 4, 6, 7, 8]
    rng = np.random.default_rng(0)
    n = 10_000
    order = rng.permutation(n)
    prefilled = np.sort(rng.choice(n, 2000, replace=False))
    sample = prefilled[:1000]
    ranks = stand_in_ranks(order, prefilled, sample, seed=0)
    # about a fifth of the sample stands for the prefilled front; the rest spreads over the remaining places
    assert (ranks < 2000).sum() == 200
    assert 2000 <= ranks[ranks >= 2000].min() and ranks.max() <= n
    assert abs(np.median(ranks[ranks >= 2000]) - 6000) < 400
    np.testing.assert_array_equal(ranks, stand_in_ranks(order, prefilled, sample, seed=0))  # seeded


# plan.json as written before the plan's field was called upgrade_id: its key stays "id"
PLAN_JSON = b"""{
 "base": "embedder-v0-to-embedder-v1",
 "bounds": [
  0,
  2,
  5,
  8,
  10
 ],
 "chunk_size": 3,
 "created": "2024-05-01T12:00:00",
 "distance": "l2",
 "eval_queries": 5,
 "id": "embedder-v1-to-embedder-v2",
 "map_uri": "models:/m/1",
 "mlflow_run_id": "abc123",
 "new": {
  "dim": 6,
  "name": "embedder",
  "uri": "models:/embedder/2",
  "version": "2"
 },
 "num_chunks": 4,
 "num_items": 10,
 "old": {
  "dim": 4,
  "name": "embedder",
  "uri": "models:/embedder/1",
  "version": "1"
 },
 "online": true,
 "order": "sigma",
 "prefilled": 2
}
"""


def test_a_plan_json_written_before_loads_and_is_written_back_byte_for_byte(tmp_path):
    upgrade_id = planning.upgrade_id(OLD, NEW)
    before = open_store(tmp_path / "before")
    before.put(planning.plan_key(upgrade_id), PLAN_JSON)
    plan = planning.load_plan(before, upgrade_id)
    assert plan is not None and plan.upgrade_id == upgrade_id == "embedder-v1-to-embedder-v2"
    assert (plan.old, plan.new, plan.base, plan.bounds, plan.prefilled, plan.online) == (
        OLD, NEW, "embedder-v0-to-embedder-v1", (0, 2, 5, 8, 10), 2, True)
    assert plan.to_dict()["id"] == upgrade_id and "upgrade_id" not in plan.to_dict()
    after = open_store(tmp_path / "after")
    planning.write_plan(after, plan)
    assert after.get(planning.plan_key(upgrade_id)) == PLAN_JSON
