"""The upgrade's planning course (components.gallery.upgrade.planning_course.PlanningCourse) driven
through its ports with fakes: no Prefect, no store, no MLflow. The fake store keeps the objects a
planning writes under ``upgrades/<id>/`` (and the base upgrade's, which planning never touches),
the fake MLflow the runs and their tags. Each port fails in turn: a refusal (GalleryError,
StoreError) after the run is opened removes what planning wrote and closes the run FAILED; a
crash (anything else) leaves both for the next planning, whose first step discards them; a
failure before the run opens writes nothing."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import numpy as np
import pytest

from fastfill.components.gallery.layouts.catalog import GalleryError
from fastfill.components.gallery.store import StoreError
from fastfill.components.gallery.upgrade import planning
from fastfill.components.gallery.upgrade.decider import PLAN, Course
from fastfill.components.gallery.upgrade.planning import Plan, upgrade_id
from fastfill.components.gallery.upgrade.planning_course import PlanningCourse, PlanningSettings, PlanningSteps
from fastfill.components.gallery.upgrade.usage import Usage
from fastfill.components.platform.config_gallery import UpgradeConfig
from fastfill.components.platform.registry import ModelRef

V1, V2, V3 = (ModelRef("embedder", str(v), 8) for v in (1, 2, 3))
UID12, UID23, UID13 = upgrade_id(V1, V2), upgrade_id(V2, V3), upgrade_id(V1, V3)
N, CHUNK, SAMPLE = 400, 10, 200
EVAL = np.array([3, 150, 399])  # the evaluation sample's positions
BASE = Plan(UID12, V1, V2, "models:/map/1", "sigma", CHUNK, N, 0, "l2", "run-0")


class Crash(Exception):
    """A step killed there (not a refusal: nothing is cleaned up)."""


ERRORS = {"refused (GalleryError)": GalleryError, "refused (StoreError)": StoreError, "crashed": Crash}


class Steps:
    """Every port of the planning over a fake store and a fake MLflow, recording each call in
    ``calls``; ``fail``: the port that raises ``error`` (once)."""

    num_items = N

    def __init__(self, fail: str | None = None, error: type[Exception] = GalleryError, registry_map: bool = False,
                 uncertainty: bool = True, no_split: bool = False):
        self.fail, self.error = fail, error
        self.registry_map, self.uncertainty, self.no_split = registry_map, uncertainty, no_split
        self.calls: list[str] = []
        self.lines: list[str] = []
        self.objects = {f"upgrades/{UID13}/plan.json", f"upgrades/{UID13}/chunks/0", "parts/0"}  # never planning's
        self.runs: dict[str, str] = {}
        self.reasons: dict[str, str] = {}
        self.tags: dict[str, dict] = {}
        self.committed: dict = {}

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name == self.fail:
            self.fail = None
            raise self.error(f"{name} failed")

    def _write(self, upgrade_id: str, name: str) -> None:
        self.objects.add(f"upgrades/{upgrade_id}/{name}")

    def written(self, upgrade_id: str) -> set[str]:
        return {key for key in self.objects if key.startswith(f"upgrades/{upgrade_id}/")}

    # reads
    def base_plan(self, upgrade_id):
        self._call("base_plan")
        assert upgrade_id == UID12
        return BASE

    def check_sources(self, sequential):
        self._call("check_sources")

    def usage_weights(self):
        self._call("usage_weights")
        return Usage("the items table's weight column", np.linspace(0.0, 1.0, N))

    def done_chunks(self, upgrade_id):
        self._call("done_chunks")
        return 1

    # the store and MLflow
    def discard(self, upgrade_id):
        self._call("discard")
        found = self.written(upgrade_id)
        self.objects -= found
        return len(found)

    def open_run(self, fields):
        self._call("open_run")
        run_id = f"run-{len(self.runs) + 1}"
        self.runs[run_id] = "RUNNING"
        return run_id

    def close_run(self, run_id, status, reason):
        self._call("close_run")
        self.runs[run_id], self.reasons[run_id] = status, reason

    def tag_run(self, run_id, tags):
        self._call("tag_run")
        self.tags.setdefault(run_id, {}).update(tags)

    def write_sources(self, upgrade_id, base):
        self._call("write_sources")
        self._write(upgrade_id, "sources")

    def write_reverse(self, upgrade_id, reverse):
        self._call("write_reverse")
        self._write(upgrade_id, "reverse")

    def commit(self, plan, order, embedded, judged, positions, queries, ranks):
        self._call("commit")
        self.committed = {"plan": plan, "order": order, "embedded": dict(embedded), "judged": judged,
                          "positions": positions, "ranks": ranks}
        chunks = int(plan.chunk_of(np.array([plan.prefilled - 1]))[0]) + 1 if plan.prefilled else 0
        for chunk in range(chunks):
            self._write(plan.upgrade_id, f"chunks/{chunk}")
        self._write(plan.upgrade_id, "plan.json")
        return chunks

    # the work
    def choose_map(self, old, new, new_model, run_id, pairs):
        self._call("choose_map")
        alignment_map = SimpleNamespace(uncertainty=object() if self.uncertainty else None, old_dim=8, new_dim=8)
        if self.registry_map:  # the registry's map, used as it is: no pairs
            return alignment_map, "models:/map/7", "sigma", None
        found = pairs()  # trained on the pairs
        return alignment_map, "models:/map/8", "sigma", found

    def split_pairs(self, old, new_model):
        self._call("split_pairs")
        return None if self.no_split else SimpleNamespace(positions=None, new=np.ones((50, 8)))

    def gallery_pairs(self, positions, new_model, base):
        self._call("gallery_pairs")
        assert len(positions) == SAMPLE
        self._write(UID23 if base else UID12, "pairs")  # the map sample's items, written as backfilled
        return SimpleNamespace(positions=np.asarray(positions), new=np.ones((len(positions), 8)))

    def fit_reverse(self, pairs):
        self._call("fit_reverse")
        return SimpleNamespace(new_scale=1.5)

    def transform(self, upgrade_id, alignment_map, sequential):
        self._call("transform")
        self._write(upgrade_id, "transformed")

    def order(self, upgrade_id, kind, seed, weights):
        self._call("order")
        return np.random.default_rng(seed).permutation(N)

    def embed_samples(self, new_model, judged, embedded):
        self._call("embed_samples")
        queries = np.ones((len(EVAL), 8))
        embedded.update(zip(EVAL.tolist(), queries))
        return judged, EVAL, queries

    def log(self, line):
        self.lines.append(line)


def settings(**upgrade) -> PlanningSettings:
    config = UpgradeConfig(**{"chunk_size": CHUNK, "map_sample": SAMPLE, **upgrade})
    return PlanningSettings(config, "l2", 0.1, True, "data/prepared/splits")


# a fresh upgrade: the map trained on a sample of the gallery's items; and the longest course: a
# sequential upgrade in usage_sigma order, online, the registry's map with the split's pairs
FRESH = ("fresh", Course(PLAN, upgrade_id=UID12, old=V1), {"order": "random"}, {})
FULL = ("sequential, usage order, online", Course(PLAN, upgrade_id=UID23, old=V2, base=UID12),
        {"order": "usage_sigma", "online": True, "map_pairs": "splits"}, {"registry_map": True})
FRESH_CALLS = ["check_sources", "discard", "open_run", "choose_map", "gallery_pairs", "transform", "order",
               "embed_samples", "commit"]
FULL_CALLS = ["base_plan", "check_sources", "usage_weights", "discard", "open_run", "write_sources", "done_chunks",
              "choose_map", "split_pairs", "fit_reverse", "write_reverse", "tag_run", "transform", "order",
              "embed_samples", "commit"]
BEFORE_THE_RUN = {"base_plan", "check_sources", "usage_weights", "discard", "open_run"}


def plan(case, steps: Steps) -> Plan:
    _, course, upgrade, _ = case
    return PlanningCourse(settings(**upgrade), steps).plan(course, V3 if course.base else V2, "model", "judged")


@pytest.mark.parametrize("case, calls", [(FRESH, FRESH_CALLS), (FULL, FULL_CALLS)], ids=["fresh", "full"])
def test_the_course_goes_in_order_and_commits_the_plan_last(case, calls):
    steps = Steps(**case[3])
    made = plan(case, steps)
    assert steps.calls == calls
    assert steps.runs == {"run-1": "RUNNING"}, "planning opens the run and leaves it to the backfill"
    assert made.mlflow_run_id == "run-1" and steps.committed["plan"] is made and made.chunk_size == CHUNK
    embedded = steps.committed["embedded"]
    assert set(EVAL.tolist()) <= set(embedded) and made.prefilled == len(embedded) and made.num_items == N
    order = steps.committed["order"]
    assert set(order[:made.prefilled].tolist()) == set(embedded), "the items embedded while planning come first"
    assert sorted(order.tolist()) == list(range(N))
    assert made.bounds == planning.chunk_grid(N, CHUNK, [made.prefilled])
    assert steps.committed["ranks"] is not None and steps.committed["judged"] == "judged"
    assert any(line.startswith(f"planned {made.upgrade_id}: ") for line in steps.lines)


def test_a_fresh_upgrade_backfills_its_map_sample_first():
    steps = Steps()
    made = plan(FRESH, steps)
    assert made.upgrade_id == UID12 and made.base is None and not made.online
    assert made.prefilled == len(set(steps.committed["embedded"])) and SAMPLE <= made.prefilled <= SAMPLE + len(EVAL)
    assert made.order_kind == "sigma" and made.map_uri == "models:/map/8" and made.eval_queries == len(EVAL)
    assert any(line.startswith(f"map sample: {SAMPLE} of {N} gallery items") for line in steps.lines)


def test_a_sequential_online_upgrade_starts_from_its_base_and_keeps_its_reverse():
    steps = Steps(**FULL[3])
    made = plan(FULL, steps)
    assert made.upgrade_id == UID23 and made.base == UID12 and made.online and made.prefilled == len(EVAL)
    assert steps.tags == {"run-1": {"online": "metric_compatible", "online.new_gain": "2.25"}}
    assert {f"upgrades/{UID23}/sources", f"upgrades/{UID23}/reverse"} <= steps.written(UID23)
    assert any(f"starting from {UID12} as it stands (1/{BASE.num_chunks} chunks" in line for line in steps.lines)
    assert any("usage weights from" in line for line in steps.lines)


FAILURES = [(case, step, kind) for case, calls in ((FRESH, FRESH_CALLS), (FULL, FULL_CALLS))
            for step in dict.fromkeys(calls) for kind in ERRORS]


@pytest.mark.parametrize("case, step, kind", FAILURES, ids=[f"{c[0]}: {s}, {k}" for c, s, k in FAILURES])
def test_each_port_failing_in_turn(case, step, kind):
    steps = Steps(fail=step, error=ERRORS[kind], **case[3])
    uid = case[1].upgrade_id
    kept = set(steps.objects)
    with pytest.raises(ERRORS[kind], match=f"{step} failed"):
        plan(case, steps)
    calls = FRESH_CALLS if case[0] == FRESH[0] else FULL_CALLS
    reached = calls[:calls.index(step) + 1]
    assert steps.objects >= kept, "another upgrade's objects and the gallery's are never planning's to remove"
    if step in BEFORE_THE_RUN:  # refused or killed before the run: nothing written, nothing to close
        assert steps.calls == reached and steps.written(uid) == set() and steps.runs == {}
    elif kind == "crashed":  # a killed planning: what it wrote waits for the next planning's first step
        assert steps.calls == reached and steps.runs == {"run-1": "RUNNING"}
        left = set(steps.written(uid))
        again = Steps(**case[3])
        again.objects = set(steps.objects)
        plan(case, again)
        assert again.calls[:again.calls.index("open_run")][-1] == "discard"
        if left:
            assert f"removed {len(left)} object(s) that a planning of {uid} killed" in " ".join(again.lines)
    else:  # refused after the run opened: what planning wrote removed, the run closed FAILED
        assert steps.calls == [*reached, "discard", "close_run"]
        assert steps.written(uid) == set() and steps.objects == kept
        assert steps.runs == {"run-1": "FAILED"} and steps.reasons["run-1"] == f"planning refused: {step} failed"
        assert any(line.startswith("planning refused; ") and f"under upgrades/{uid}/ were removed" in line
                   for line in steps.lines)


@pytest.mark.parametrize("case, options, upgrade, message, last", [
    ("a sigma order without the map's uncertainty head", {"uncertainty": False}, {}, "no uncertainty head",
     "gallery_pairs"),
    ("online without pairs: no training split", {"registry_map": True, "no_split": True},
     {"online": True, "map_pairs": "splits"}, "needs the map's pairs, and there is no training split at "
     "data/prepared/splits", "split_pairs"),
    ("a map sample too small for the map's check", {}, {"map_sample": 50}, "gives 50 items", "choose_map"),
])
def test_the_course_s_own_refusals_clean_up_too(case, options, upgrade, message, last):
    steps = Steps(**options)
    with pytest.raises(GalleryError, match=message):
        PlanningCourse(settings(**{"order": "random", **upgrade}), steps).plan(Course(PLAN, upgrade_id=UID12, old=V1),
                                                                              V2, "model")
    assert steps.calls[-3:] == [last, "discard", "close_run"] and "transform" not in steps.calls
    assert steps.written(UID12) == set() and steps.runs == {"run-1": "FAILED"}


def test_the_flows_steps_are_the_course_s_ports():
    """The flow binds ``flows/upgrade_planning._PlanningSteps``; it and this fake offer the ports'
    methods with their parameters (the course calls nothing else)."""
    from fastfill.flows.upgrade_planning import _PlanningSteps  # the flow's module (Prefect) here only

    ports = {name: list(inspect.signature(member).parameters) for name, member in vars(PlanningSteps).items()
             if inspect.isfunction(member) and not name.startswith("_")}

    def offered(cls):
        return {name: list(inspect.signature(getattr(cls, name)).parameters) for name in ports}

    assert offered(Steps) == ports and offered(_PlanningSteps) == ports
    assert "num_items" in PlanningSteps.__annotations__
