"""The executor of the upgrade's course (components.gallery.upgrade.run.UpgradeRun) driven through
every course and every failure point with fake ports: no Prefect, no store, no MLflow. The fake
store keeps what the real one keeps (plans, done chunks, decisions, the manifest's model and
upgrade in progress); a port told to fail raises once, as a killed or failing step would, and
the same run started again must carry the upgrade to the same end, measuring the gate once."""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Protocol

import pytest

from fastfill.components.gallery.layouts.catalog import GalleryError
from fastfill.components.gallery.upgrade.decider import UpgradeDecider
from fastfill.components.gallery.upgrade.gallery_view import GalleryView
from fastfill.components.gallery.upgrade.planning import Plan, upgrade_id
from fastfill.components.gallery.upgrade.run import RunSettings, RunView, UpgradePorts, UpgradeRun
from fastfill.components.platform.config import PromotionConfig
from fastfill.components.platform.registry import ModelRef

V1, V2, V3 = (ModelRef("embedder", str(v), 8) for v in (1, 2, 3))
UID12 = upgrade_id(V1, V2)
N, CHUNK = 40, 10
PASSING = {"champion_top1": 0.5, "top1_auc": 0.6, "top1_auc_gain": 0.1, "nfr1_mean": 0.02, "fraction_to_gain": 0.2,
           "top1": [0.5, 0.7], "nfr1": [0.0, 0.02], "queries": 30}
FAILING = {**PASSING, "nfr1_mean": 0.5}
ADVICE = {"fractions": [0.0, 0.5, 1.0], "top1": [0.5, 0.7, 0.71], "map": [0.3, 0.4, 0.41],
          "top1_se": [0.01] * 3, "map_se": [0.01] * 3, "sample": 30, "items": N, "k": 10,
          "recommendation": {"fraction": 0.5, "gain_below": 1.0, "metric": "top1", "items": N // 2,
                             "items_saved": N // 2, "top1": 0.7, "top1_full": 0.71, "top1_given_up": 0.01}}


class Crash(Exception):
    """A step that failed (or a process killed there)."""


@dataclass
class Store:
    """What the gallery's store holds, as the fakes read and write it."""

    model: ModelRef = V1
    current: str | None = None
    has_labels: bool = True
    serves_queries: bool = False
    plans: dict = field(default_factory=dict)
    done: dict = field(default_factory=dict)  # upgrade -> set of chunks
    decisions: dict = field(default_factory=dict)  # upgrade -> its Decision
    switched: set = field(default_factory=set)  # upgrades whose gallery switched (or went back) on their decision
    aborts: set = field(default_factory=set)
    undos: dict = field(default_factory=dict)
    rejections: dict = field(default_factory=dict)
    advice: dict = field(default_factory=dict)
    failed_images: dict = field(default_factory=dict)
    locked: str | None = None


@dataclass
class View:
    """The run's reads, from the fake store: a ``run.RunView``, as ``gallery_view.GalleryView`` is."""

    store: Store
    num_items: int = N
    refusal: str | None = None

    def refresh(self):
        self.model, self.current, self.has_labels = self.store.model, self.store.current, self.store.has_labels
        self.serves_queries = self.store.serves_queries

    def __post_init__(self):
        self.refresh()

    def planned_new(self, upgrade_id):
        plan = self.store.plans.get(upgrade_id)
        return plan.new if plan else None

    def aborted(self, upgrade_id):
        return upgrade_id in self.store.aborts

    def undone(self, upgrade_id):
        return self.store.undos.get(upgrade_id)

    def rejected(self, upgrade_id):
        return self.store.rejections.get(upgrade_id)

    def interrupted_decision(self):
        for decision in self.store.decisions.values():  # the gallery switched (or went back), the registry not told
            if decision.registry_recorded is None and decision.upgrade_id in self.store.switched:
                return decision
        return None

    def plan(self, upgrade_id):
        return self.store.plans[upgrade_id]

    def done_chunks(self, upgrade_id):
        return set(self.store.done.get(upgrade_id, set()))

    def failed_images(self, upgrade_id):
        return list(self.store.failed_images.get(upgrade_id, []))

    def decision(self, upgrade_id):
        return self.store.decisions.get(upgrade_id)

    def stored_advice(self, upgrade_id):
        return self.store.advice.get(upgrade_id)

    def layout_refusal(self, new, task_runner):
        return self.refusal


@dataclass(eq=False)
class Handle:
    chunk: int
    outcome: dict | Exception


class Ports:
    """Every port of the run over the fake store, recording each call in ``calls``; ``fail``
    names the calls that raise (once each, as a crash there would)."""

    def __init__(self, store: Store, gate_numbers=PASSING, advice=None, fail=(), failed_items=None,
                 advise_seconds=0.0):
        self.store, self.gate_numbers, self.advice = store, gate_numbers, advice
        self.advise_seconds = advise_seconds  # how long the advisor's prediction takes on the fake clock
        self.fail = set(fail)
        self.failed_items = failed_items or {}  # chunk -> items whose image fails
        self.calls: list[str] = []
        self.lines: list[str] = []
        self.now, self.slept = 0.0, 0.0

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail:
            self.fail.discard(name)
            raise Crash(name)

    def bind(self) -> UpgradePorts:
        return UpgradePorts(writes=self, chunks=self, measure_gate=self.measure_gate, records=Records(self),
                            work=self, log=self.lines.append, clock=lambda: self.now, sleep=self.sleep)

    def sleep(self, seconds):
        self.slept += seconds
        self.now += seconds

    # StoreWrites
    @contextmanager
    def lock(self, upgrade_id):
        self._call("lock")
        assert self.store.locked is None, "one run at a time"
        self.store.locked = upgrade_id
        try:
            yield
        finally:
            self.store.locked = None
            self.calls.append("unlock")

    def complete_abort(self, upgrade_id):
        self._call("complete_abort")
        self.store.aborts.discard(upgrade_id)
        self.store.current = None

    def start_over(self, upgrade_id):
        self._call("start_over")
        for table in (self.store.plans, self.store.done, self.store.decisions, self.store.undos,
                      self.store.rejections, self.store.advice):
            table.pop(upgrade_id, None)
        self.store.switched.discard(upgrade_id)

    def point_manifest(self, upgrade_id):
        self._call("point_manifest")
        self.store.current = upgrade_id

    def write_plan(self, plan):
        self._call("write_plan")
        self.store.plans[plan.upgrade_id] = plan

    def sync_serving(self):
        self._call("sync_serving")
        return "the index serves the mixed gallery"

    def write_decision(self, decided):
        self._call("write_decision")
        return self.store.decisions.setdefault(decided.upgrade_id, replace(decided, decided="t"))

    def finish(self, plan):
        self._call("finish")
        self.store.model, self.store.current = plan.new, None
        self.store.switched.add(plan.upgrade_id)

    def reject(self, plan, decision):
        self._call("reject")
        self.store.current = None
        self.store.rejections[plan.upgrade_id] = {"rejected": "t", "reasons": decision.reasons}
        self.store.switched.add(plan.upgrade_id)

    def mark_registry_recorded(self, upgrade_id):
        self._call("mark_registry_recorded")
        self.store.decisions[upgrade_id] = replace(self.store.decisions[upgrade_id], registry_recorded="t")

    # ChunkRunner: a chunk runs when it is submitted; its record (or failure) waits in the handle
    def submit(self, plan, chunk, model):
        assert model.embedding_dim == 8
        self.calls.append(f"chunk {chunk}")
        if f"chunk {chunk}" in self.fail:
            self.fail.discard(f"chunk {chunk}")
            return Handle(chunk, Crash(f"chunk {chunk}"))
        start, stop = plan.chunk_bounds(chunk)
        failed = [{"id": f"item-{i}", "uri": f"s3://b/{i}.png", "reason": "truncated"}
                  for i in self.failed_items.get(chunk, [])]
        self.store.done.setdefault(plan.upgrade_id, set()).add(chunk)
        self.store.failed_images.setdefault(plan.upgrade_id, []).extend(failed)
        return Handle(chunk, {"count": stop - start, "start": start, "stop": stop, "failed": failed})

    def first_done(self, handles):
        return handles[0]

    def result(self, handle):
        if isinstance(handle.outcome, Exception):
            raise handle.outcome
        return handle.outcome

    def measure_gate(self, plan):
        self._call("measure_gate")
        return self.gate_numbers

    # UpgradeWork
    def load_model(self, ref):
        self._call("load_model")
        return type("Model", (), {"embedding_dim": 8})()

    def judgments(self):
        self._call("judgments")
        return "judged"

    def plan(self, course, new, new_model, judged):
        self._call("plan")
        plan = Plan(course.upgrade_id, course.old, new, "models:/map/1", "sigma", CHUNK, N, 10, "l2", "run-1",
                    base=course.base, bounds=None)
        self.store.plans[plan.upgrade_id] = plan
        self.store.current = plan.upgrade_id
        return plan

    def advise(self, plan):
        self._call("advise")
        self.now += self.advise_seconds
        if self.advice is not None:
            self.store.advice[plan.upgrade_id] = self.advice
        return self.advice


class Records:
    def __init__(self, ports: Ports):
        self.ports = ports

    def champion_version(self):
        return str(self.ports.store.model.version)

    def prediction(self, plan, advice):
        self.ports._call("record_prediction")

    def gate(self, plan, numbers):
        self.ports._call("record_gate")

    def follow_decision(self, plan, tags, promote):
        self.ports._call(f"follow_decision promote={promote}")

    def progress(self, plan, done, total, items_done):
        ports = self.ports

        class Progress:
            def landed(self, chunk, record, done, items_done):
                ports.calls.append(f"landed {chunk} at {items_done}")

            def close(self, ok):
                ports.calls.append(f"progress closed ok={ok}")

        return Progress()


def run(store: Store, ports: Ports, asked=V2, budget=None, gate=True, judgments=None, gain_below=None,
        refusal=None, max_failed=0.5, max_rate=None):
    promotion = PromotionConfig(gate=gate)
    settings = RunSettings(budget=budget, max_concurrency=2, max_failed_images=max_failed,
                           max_items_per_second=max_rate, task_runner="threads", gain_below=gain_below,
                           promotion=promotion)
    decider = UpgradeDecider("s3://b/g", "embedder", gate, judgments, gain_below)
    return UpgradeRun(decider, View(store, refusal=refusal), settings, ports.bind()).run(asked)


def chunk_calls(ports):
    return [c for c in ports.calls if c.startswith("chunk ")]


def test_a_fresh_upgrade_goes_the_whole_course_in_order():
    store = Store()
    ports = Ports(store)
    result = run(store, ports)
    assert result.state == "complete" and result.complete and result.items_done == N and result.upgrade_id == UID12
    assert result.promotion.passed and result.promotion.numbers == PASSING and not result.resumed_ending
    assert ports.calls == ["lock", "load_model", "plan", "advise", "chunk 0", "chunk 1", "chunk 2", "landed 0 at 10",
                           "chunk 3", "landed 1 at 20", "landed 2 at 30", "landed 3 at 40", "progress closed ok=True",
                           "measure_gate", "write_decision", "record_gate", "finish", "follow_decision promote=True",
                           "mark_registry_recorded", "unlock"]
    assert store.model == V2 and store.current is None and store.decisions[UID12].registry_recorded == "t"
    assert any(f"upgrade {UID12} complete" in line for line in ports.lines)


# (case, store, run options, port options) -> (state, calls that must happen, calls that must not, phrase said)
COURSES = [
    ("rejected by the gate", {}, {}, {"gate_numbers": FAILING},
     ("rejected", ["measure_gate", "reject", "follow_decision promote=False"], ["finish"], "rejected: the gallery serves")),
    ("ungated: never measured", {}, {"gate": False}, {},
     ("complete", ["write_decision", "finish"], ["measure_gate", "record_gate"], "complete")),
    ("no target: nothing locked", {}, {"asked": None}, {},
     ("up-to-date", [], ["lock", "plan"], "has no `challenger`")),
    ("already built with it", {"model": V2}, {}, {},
     ("up-to-date", ["lock", "unlock"], ["load_model", "plan"], "already built with")),
    ("the budget pauses it", {}, {"budget": 0.5}, {},
     ("paused", ["chunk 0", "chunk 1"], ["chunk 2", "measure_gate", "finish"], "(budget); run the same command")),
    ("the advised stop pauses it", {}, {"gain_below": 1.0}, {"advice": ADVICE},
     ("paused", ["record_prediction", "chunk 1"], ["chunk 2", "measure_gate"], "the recommended stop")),
    ("a budget inside a chunk cuts it", {}, {"budget": 15}, {},
     ("paused", ["write_plan", "chunk 0", "chunk 1"], ["chunk 2"], "cut in two at item 15")),
    ("judged queries read before planning", {"has_labels": False}, {"judgments": "j.csv"}, {},
     ("complete", ["judgments", "plan"], [], "complete")),
    ("a serving index synced before the chunks", {"serves_queries": True}, {}, {},
     ("complete", ["sync_serving", "chunk 0"], [], "serves the mixed gallery")),
    ("no truth and no gate: ungated", {"has_labels": False}, {"gate": False}, {},
     ("complete", ["finish"], ["measure_gate"], "runs ungated")),
]


@pytest.mark.parametrize("case, stored, options, port_options, expected", COURSES, ids=[c[0] for c in COURSES])
def test_each_course(case, stored, options, port_options, expected):
    state, happen, never, phrase = expected
    store = Store(**stored)
    ports = Ports(store, **port_options)
    result = run(store, ports, **options)
    assert result.state == state
    for call in happen:
        assert call in ports.calls, call
    for call in never:
        assert call not in ports.calls, call
    assert phrase in " ".join(ports.lines) + " " + (result.message or "")
    assert store.locked is None
    if "judgments" in happen:
        assert ports.calls.index("judgments") < ports.calls.index("plan")
    if "sync_serving" in happen:
        assert ports.calls.index("sync_serving") < ports.calls.index("chunk 0")


@pytest.mark.parametrize("case, stored, options, message", [
    ("rejected before, gate on", {"rejections": {UID12: {"rejected": "t", "reasons": ["worse"]}}}, {},
     "was rejected by the promotion gate"),
    ("no labels, no judgments, gate on", {"has_labels": False}, {}, "nothing to measure the upgrade against"),
    ("the layout cannot serve it", {}, {"refusal": "vectors too long"}, "vectors too long"),
])
def test_a_refusal_writes_nothing(case, stored, options, message):
    store = Store(**stored)
    ports = Ports(store)
    with pytest.raises(GalleryError, match=message):
        run(store, ports, **options)
    assert not {"plan", "chunk 0", "write_decision", "finish", "reject"} & set(ports.calls)
    assert store.locked is None and ports.calls[-1] == "unlock"


def test_a_paused_upgrade_resumes_where_it_stopped():
    store = Store()
    ports = Ports(store)
    assert run(store, ports, budget=0.5).state == "paused"
    again = Ports(store)
    result = run(store, again)
    assert result.state == "complete" and result.items_done == N
    assert "plan" not in again.calls and chunk_calls(again) == ["chunk 2", "chunk 3"]
    assert any("resuming upgrade" in line for line in again.lines)


def test_a_crash_between_the_plan_and_the_manifest_points_it_again():
    store = Store()
    ports = Ports(store)
    run(store, ports, budget=0.25)
    store.current = None  # as if the manifest's switch to the plan never landed
    again = Ports(store)
    assert run(store, again).state == "complete" and "point_manifest" in again.calls


def test_completing_an_abort_and_starting_over():
    store = Store()
    run(store, Ports(store), budget=0.5)
    store.aborts.add(UID12)  # the abort recorded, the gallery not yet back
    store.undos[UID12] = {"ended": "aborted", "aborted": "t", "by": {"user": "ana", "host": "h"}}
    ports = Ports(store)
    result = run(store, ports)
    assert result.state == "complete"
    assert ports.calls.index("complete_abort") < ports.calls.index("start_over") < ports.calls.index("plan")
    assert chunk_calls(ports) == ["chunk 0", "chunk 1", "chunk 2", "chunk 3"], "planned from scratch"


def test_a_sequential_upgrade_starts_from_the_unfinished_one():
    store = Store()
    run(store, Ports(store), budget=0.5)
    ports = Ports(store)
    result = run(store, ports, asked=V3)
    assert result.state == "complete" and store.plans[upgrade_id(V2, V3)].base == UID12
    assert store.model == V3


def test_a_failing_chunk_lets_the_others_land_then_raises_and_the_rerun_finishes():
    store = Store()
    ports = Ports(store, fail=["chunk 1"])
    with pytest.raises(Crash, match="chunk 1"):
        run(store, ports)
    assert "chunk 3" not in ports.calls, "nothing new starts once the failure is seen; what is in flight lands"
    assert "landed 2 at 20" in ports.calls and "progress closed ok=False" in ports.calls and store.locked is None
    assert store.done[UID12] == {0, 2}
    again = Ports(store)
    assert run(store, again).state == "complete" and chunk_calls(again) == ["chunk 1", "chunk 3"]


def test_unreadable_images_past_the_limit_stop_the_backfill():
    store = Store()
    ports = Ports(store, failed_items={0: [1, 2, 3]})
    with pytest.raises(GalleryError, match="4 images could not be read|3 images could not be read"):
        run(store, ports, max_failed=2)
    assert "measure_gate" not in ports.calls
    assert any("keeps its transformed features" in line for line in ports.lines)


def test_the_throttle_waits_its_turn():
    store = Store()
    ports = Ports(store)
    assert run(store, ports, max_rate=10.0).state == "complete"
    assert ports.slept >= 3.0  # 40 items at 10 items/s: the last chunk starts no sooner than 3 s in


# a crash at each step of the end: the rerun completes the same end, and the gate is measured once
END_STEPS = ["measure_gate", "write_decision", "record_gate", "finish", "follow_decision promote=True",
             "mark_registry_recorded"]


@pytest.mark.parametrize("step", END_STEPS)
def test_a_crash_at_each_step_of_the_end_is_completed_by_the_rerun(step):
    store = Store()
    ports = Ports(store, fail=[step])
    with pytest.raises(Crash):
        run(store, ports)
    again = Ports(store)
    result = run(store, again)
    assert result.state == "complete" and store.model == V2
    assert store.decisions[UID12].registry_recorded == "t"
    measured = ports.calls.count("measure_gate") + again.calls.count("measure_gate")
    decided_before = "write_decision" in ports.calls and step != "write_decision"
    assert measured == (1 if decided_before else 2 if step in ("measure_gate", "write_decision") else 1)
    assert again.calls.count("finish") == (0 if step in ("follow_decision promote=True", "mark_registry_recorded")
                                           else 1)
    if step in ("follow_decision promote=True", "mark_registry_recorded"):
        assert result.resumed_ending and result.decision.upgrade_id == UID12
        assert "recording its decision in the registry" in " ".join(again.lines)


def test_a_rejection_interrupted_before_the_registry_is_completed_as_a_rejection():
    store = Store()
    ports = Ports(store, gate_numbers=FAILING, fail=["follow_decision promote=False"])
    with pytest.raises(Crash):
        run(store, ports)
    again = Ports(store)
    result = run(store, again)
    assert result.state == "rejected" and result.resumed_ending and result.reasons
    assert "follow_decision promote=False" in again.calls and store.model == V1


def test_the_advice_is_predicted_once_and_recorded_once():
    store = Store()
    ports = Ports(store, advice=ADVICE, advise_seconds=2.5)
    run(store, ports, budget=0.25)
    again = Ports(store, advice=ADVICE)
    result = run(store, again)
    assert ports.calls.count("advise") == 1 and "advise" not in again.calls
    assert "record_prediction" not in again.calls
    # timed on the run's clock port, as every timing of the run
    assert "budget advisor: predicted the backfill curve in 2.5 s" in ports.lines
    assert not any("predicted the backfill curve" in line for line in again.lines)
    assert result.advice is not None and result.advice.top1 == ADVICE["top1"] and result.advice.agreement is None


def test_the_result_is_a_record_with_one_name_per_idea():
    store = Store()
    result = run(store, Ports(store))
    fields = result.as_dict()
    assert fields["state"] == "complete" and fields["upgrade"] == UID12 and "decided" not in fields
    assert replace(result, state="paused").state == "paused"


def _protocol_members(protocol) -> tuple[dict, set]:
    """A protocol's reads (name -> parameter names) and attributes, its protocol bases' included."""
    reads: dict = {}
    attributes: set = set()
    for cls in protocol.__mro__:
        if cls is Protocol or not getattr(cls, "_is_protocol", False):
            continue
        attributes |= set(vars(cls).get("__annotations__", {}))
        reads.update({name: list(inspect.signature(member).parameters) for name, member in vars(cls).items()
                      if inspect.isfunction(member) and not name.startswith("_")})
    return reads, attributes


def _reads(cls) -> dict:
    return {name: list(inspect.signature(member).parameters) for name, member in vars(cls).items()
            if callable(member) and not name.startswith("_")}


def test_the_real_view_and_the_fake_are_both_the_runs_view():
    """``UpgradeRun`` is typed against ``run.RunView`` (the decider's ``StoreView`` and the run's
    own reads); the flow gives it a ``gallery_view.GalleryView``, these runs a fake ``View``. Both
    offer exactly the protocol's reads, with its parameters, and its attributes once refreshed: a
    read the run starts making, or one the real view changes, shows here and not first in a flow."""
    reads, attributes = _protocol_members(RunView)
    assert {"model", "current", "num_items", "has_labels", "serves_queries"} <= attributes
    assert {"planned_new", "interrupted_decision", "refresh", "plan", "layout_refusal"} <= set(reads)
    manifest = {"model": V1.to_dict(), "upgrade": None, "has_labels": True}
    gallery = SimpleNamespace(num_items=N, serves_queries=False, manifest=lambda refresh=False: manifest)
    real, fake = GalleryView(gallery), View(Store())
    for view in (real, fake):
        assert isinstance(view, RunView), type(view).__name__
        assert _reads(type(view)) == reads, type(view).__name__  # the same reads, nothing the protocol lacks
    assert set(vars(real)) - {"gallery"} == set(vars(fake)) - {"store", "refusal"} == attributes  # the fakes' own
    assert (real.model, real.current, real.has_labels, real.num_items) == (fake.model, fake.current,
                                                                             fake.has_labels, fake.num_items)
    assert not isinstance(SimpleNamespace(**{name: None for name in attributes}), RunView)  # reads missing: not one
