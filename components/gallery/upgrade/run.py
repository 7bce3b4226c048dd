"""The upgrade's course, carried out in one place: ``UpgradeRun`` takes ``UpgradeDecider``'s
course for one gallery and one target and carries it out from start to end (what a killed run
left half done, resume or plan, the chunk loop, the gate, the ending), through small ports it
is given (``UpgradePorts``): the store's writes, the chunks' runner, the gate's measurement, the
records in MLflow, the log; it reads the store through a ``RunView``. It never imports Prefect,
MLflow or a store: ``flows/upgrade.py`` binds retried Prefect tasks to the ports and gives it a
``gallery_view.GalleryView``, ``tests/unit/test_upgrade_run.py`` binds fakes and drives it
through every course and every failure point.

The decider decides, this carries out: each step's order is written here once::

    target ─> lock ─> course ─> complete first (abort, ending, start over)
                                  ├─> ended / up-to-date (return) / refuse (raise)
                                  └─> load the model ─> layout refusal ─> judged queries
                                       ─> resume or plan ─> serving synced ─> advice
                                       ─> chunks (budget / advised stop ─> paused)
                                       ─> end: decision ─> finish or reject ─> registry
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

from fastfill.components.gallery.advice.advisor import at_stop, describe
from fastfill.components.gallery.layouts.catalog import GalleryError
from fastfill.components.gallery.upgrade.decider import (
    ENDED,
    FINISH,
    REFUSE,
    RESUME,
    UP_TO_DATE,
    Course,
    Ending,
    StoreView,
    UpgradeDecider,
    up_to_date,
)
from fastfill.components.gallery.upgrade.lifecycle import (
    TRUTH_JUDGMENTS,
    Backfill,
    budget_items,
    cut_for_limit,
    failure_limit,
)
from fastfill.components.gallery.upgrade.outcome import (
    Advice,
    BackfillSummary,
    Decision,
    Recommendation,
    UpgradeResult,
    backfilled,
)
from fastfill.components.gallery.upgrade.planning import Plan, upgrade_id
from fastfill.components.platform.registry import ModelRef


@runtime_checkable
class RunView(StoreView, Protocol):
    """What a run reads from the gallery's store: the decider's ``StoreView`` and, besides, the
    plans, chunks, decisions and advice of its upgrade (``gallery_view.GalleryView`` reads a
    real store; ``tests/unit/test_upgrade_run.py`` a table, checked against this protocol)."""

    serves_queries: bool  # the gallery has a serving index to keep in step with the mixed gallery

    def refresh(self) -> None:
        """The manifest read again (under the lock: another run may have moved the gallery)."""

    def plan(self, upgrade_id: str) -> Plan:
        """``upgrade_id``'s plan; a GalleryError when it has none."""

    def done_chunks(self, upgrade_id: str) -> set[int]:
        """The chunks of ``upgrade_id`` already backfilled."""

    def failed_images(self, upgrade_id: str) -> list[dict]:
        """The items whose image earlier runs could not read."""

    def decision(self, upgrade_id: str) -> Decision | None:
        """``upgrade_id``'s recorded decision, None before its end."""

    def stored_advice(self, upgrade_id: str) -> dict | None:
        """The budget advisor's prediction stored beside ``upgrade_id``'s plan, or None."""

    def layout_refusal(self, new: ModelRef, task_runner: str) -> str | None:
        """Why the gallery's layout cannot serve ``new`` with ``task_runner``; None when it can."""


class StoreWrites(Protocol):
    """Every write to the gallery's store during a run (the flow binds retried tasks)."""

    def lock(self, upgrade_id: str) -> AbstractContextManager[Any]:
        """The gallery's upgrade lock, held for ``upgrade_id`` until the context ends."""

    def complete_abort(self, upgrade_id: str) -> None:
        """An abort that stopped before the gallery went back: completed."""

    def start_over(self, upgrade_id: str) -> None:
        """An undone (or ungated-again) upgrade's objects removed, so it is planned from scratch."""

    def point_manifest(self, upgrade_id: str) -> None:
        """The manifest names ``upgrade_id`` as the one in progress."""

    def write_plan(self, plan: Plan) -> None:
        """A plan rewritten (a chunk cut in two where a budget stops)."""

    def sync_serving(self) -> str:
        """The serving index brought to the upgrade's mixed gallery; the line to say."""

    def write_decision(self, decided: Decision) -> Decision:
        """The decision recorded (decision.json) once; returns it as stored."""

    def finish(self, plan: Plan) -> None:
        """The gallery switched to the new model's features."""

    def reject(self, plan: Plan, decision: Decision) -> None:
        """The gallery back on the champion's features."""

    def mark_registry_recorded(self, upgrade_id: str) -> None:
        """The decision record says its registry step is done."""


class ChunkRunner(Protocol):
    """Runs a backfill's chunks somewhere (a task runner): ``submit`` returns a handle, ``first_done``
    waits for one of the handles, ``result`` is the chunk's record or raises its failure."""

    def submit(self, plan: Plan, chunk: int, model: Any) -> Any: ...

    def first_done(self, handles: list[Any]) -> Any: ...

    def result(self, handle: Any) -> dict: ...


class BackfillProgress(Protocol):
    """What a run records while chunks land (MLflow's metrics, a progress artifact, lines)."""

    def landed(self, chunk: int, record: dict, done: set[int], items_done: int) -> None: ...

    def close(self, ok: bool) -> None: ...


class UpgradeRecords(Protocol):
    """The upgrade's records in MLflow: its run's series, the registry's decision."""

    def champion_version(self) -> str | None: ...

    def prediction(self, plan: Plan, advice: dict) -> None: ...

    def gate(self, plan: Plan, numbers: dict) -> None: ...

    def follow_decision(self, plan: Plan, tags: dict, promote: bool) -> None: ...

    def progress(self, plan: Plan, done: set[int], total: int, items_done: int) -> BackfillProgress: ...


class UpgradeWork(Protocol):
    """The heavy work a run asks for: the model loaded, the judged queries read, the upgrade
    planned, the budget advisor's prediction (stored beside the plan)."""

    def load_model(self, ref: ModelRef) -> Any: ...

    def judgments(self) -> Any: ...

    def plan(self, course: Course, new: ModelRef, new_model: Any, judged: Any) -> Plan: ...

    def advise(self, plan: Plan) -> dict | None: ...


@dataclass
class UpgradePorts:
    """Everything a run does besides reading its view. ``clock`` (seconds) is what every timing
    of the run reads, the throttle's and the logged durations alike, and ``sleep`` how it waits:
    a test's fake pair makes both deterministic."""

    writes: StoreWrites
    chunks: ChunkRunner
    measure_gate: Callable[[Plan], dict]
    records: UpgradeRecords
    work: UpgradeWork
    log: Callable[[str], None]
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep


@dataclass(frozen=True)
class RunSettings:
    """What a run is told: ``gallery.upgrade``'s settings it reads, ``promotion``'s thresholds,
    this run's budget (None: all) and whether the gate is on (in the decider)."""

    budget: float | int | None
    max_concurrency: int
    max_failed_images: float | int
    max_items_per_second: float | None
    task_runner: str
    gain_below: float | None
    promotion: Any

    @classmethod
    def of(cls, params, budget: float | int | None = None) -> RunSettings:
        config = params.gallery.upgrade
        return cls(config.budget if budget is None else budget, config.max_concurrency, config.max_failed_images,
                   config.max_items_per_second, config.task_runner, config.stop_when_gain_below, params.promotion)


class UpgradeRun:
    """One run of the upgrade of one gallery: ``run(asked)`` carries the course out and returns
    its ``UpgradeResult``; a failure raises, leaving the store where the same command goes on."""

    def __init__(self, decider: UpgradeDecider, view: RunView, settings: RunSettings, ports: UpgradePorts):
        self.decider, self.view, self.settings, self.ports = decider, view, settings, ports
        self.log = ports.log
        self.target: ModelRef | None = None  # the version this run goes to, once known

    # ---- the course

    def run(self, asked: ModelRef | None) -> UpgradeResult:
        """Upgrade to ``asked`` (None: whatever the gallery is in the middle of reaching)."""
        wanted = self.target = self.decider.target(asked, self.view)
        if wanted is None:
            return self._said(self.decider.no_target(self.view, self.ports.records.champion_version()))
        with self.ports.writes.lock(upgrade_id(self.view.model, wanted)):  # released last, after every ending
            self.view.refresh()  # under the lock: another run may have moved the gallery while this one waited
            return self._carry_out(self.decider.course(self.view, wanted), wanted)

    def _carry_out(self, course: Course, wanted: ModelRef) -> UpgradeResult:
        completed = self._complete_first(course)
        if course.action == ENDED:
            assert completed is not None
            return completed
        if course.action == UP_TO_DATE:
            return up_to_date(wanted, self.view.num_items)
        if course.action == REFUSE:
            raise GalleryError(course.reason)
        new_model = self.ports.work.load_model(wanted)
        new = ModelRef(wanted.name, wanted.version, new_model.embedding_dim)
        refusal = self.view.layout_refusal(new, self.settings.task_runner)
        if refusal is not None:
            raise GalleryError(refusal)
        judged = self.ports.work.judgments() if course.truth == TRUTH_JUDGMENTS else None  # before any work
        plan = (self._resume(course) if course.action == RESUME else
                self.ports.work.plan(course, new, new_model, judged))
        if self.view.serves_queries:  # the index serves the upgrade's mixed gallery (a killed switch completed)
            self.log(self.ports.writes.sync_serving())
        advice = self._advice(plan)
        stop = self.decider.advised_stop(advice, self.settings.budget)
        summary = self.backfill(plan, new_model, stop["items"] if stop else self.settings.budget)
        ran = backfilled(summary, plan.mlflow_run_id, _advice_record(advice, self.settings.gain_below))
        if not ran.complete:
            return self._said(*self.decider.paused(ran, stop))
        ending = self._end(plan)
        result = replace(ran, **_ended_fields(ending))
        assert ending.decision is not None  # an ending carries out a decision
        self.log(self.decider.ended_line(result, plan.upgrade_id, plan.new, ending.decision.champion or self.view.model))
        return result

    def _said(self, result: UpgradeResult, line: str | None = None) -> UpgradeResult:
        self.log(line or result.message or "")
        return result.with_message(line) if line else result

    def _complete_first(self, course: Course) -> UpgradeResult | None:
        """What a killed run left half done, before anything else: an abort, an ending (whose
        result it returns), an undone upgrade's objects (it is planned from scratch)."""
        for line in course.say:
            self.log(line)
        if course.complete_abort:
            self.ports.writes.complete_abort(course.complete_abort)
        completed = None
        if course.complete_decision:
            ending = self.decider.decided(course.complete_decision)
            plan = self.view.plan(course.complete_decision.upgrade_id)
            self._follow_in_registry(plan, ending)
            n = self.view.num_items
            completed = UpgradeResult(**_ended_fields(ending), items=n, items_done=n, fraction=1.0, complete=True,
                                      resumed_ending=True, decision=course.complete_decision,
                                      mlflow_run_id=plan.mlflow_run_id)
        if course.start_over:
            assert course.upgrade_id is not None  # the course names the upgrade it starts over
            self.ports.writes.start_over(course.upgrade_id)
        return completed

    def _resume(self, course: Course) -> Plan:
        """The upgrade's plan, made before; the gallery pointed at it again if a crash came between
        the plan and that switch."""
        assert course.upgrade_id is not None  # a course that resumes names its upgrade
        if course.point_manifest:
            self.ports.writes.point_manifest(course.upgrade_id)
        return self.view.plan(course.upgrade_id)

    def _advice(self, plan: Plan) -> dict | None:
        """The budget advisor's prediction for the planned upgrade (stored beside the plan, made
        once; the first time, recorded in the upgrade's MLflow run)."""
        advice = self.view.stored_advice(plan.upgrade_id)
        if advice is None:
            started = self.ports.clock()
            advice = self.ports.work.advise(plan)
            if advice is None:
                if self.settings.gain_below is not None:
                    self.log("stop_when_gain_below is set, but this upgrade has no evaluation sample to predict the "
                             "curve from (eval_queries 0): the backfill goes to its budget")
                return None
            self.log(f"budget advisor: predicted the backfill curve in {self.ports.clock() - started:.1f} s")
            self.ports.records.prediction(plan, advice)
        for line in describe(advice, gain_below=self.settings.gain_below):
            self.log(line)
        return advice

    # ---- the chunks

    def backfill(self, plan: Plan, model: Any, budget: float | int | None) -> BackfillSummary:
        """Run the chunks the budget allows, ``max_concurrency`` at a time, recorded as they land;
        the bookkeeping is ``lifecycle.Backfill``'s."""
        settings = self.settings
        done = self.view.done_chunks(plan.upgrade_id)
        limit = budget_items(budget, plan.num_items)
        cut, split = cut_for_limit(plan, done, limit)
        if split is not None:  # the stop falls inside a chunk: that chunk becomes two, so the stop is exact
            self.ports.writes.write_plan(cut)
            self.log(f"chunk {split} of {plan.upgrade_id} cut in two at item {limit}, where this run stops")
            plan = cut
        state = Backfill(plan, done, limit, settings.max_concurrency,
                         failure_limit(settings.max_failed_images, plan.num_items), settings.max_items_per_second,
                         self.ports.clock())
        state.failed_images = self.view.failed_images(plan.upgrade_id)
        self.log(f"backfill of {plan.upgrade_id}: {len(state.done)}/{plan.num_chunks} chunks already done; "
                 f"{len(state.pending)} to go" + (f", budget {state.limit} items" if state.limit < plan.num_items else "")
                 + (f", at most {settings.max_items_per_second:g} items/s" if settings.max_items_per_second else ""))
        recorded = self.ports.records.progress(plan, set(state.done), min(state.limit, plan.num_items),
                                               state.items_done)
        ok = False
        try:
            for chunk, record in self._landings(state, plan, model):
                recorded.landed(chunk, record, state.done, state.items_done)
            ok = True
        finally:
            recorded.close(ok)
        return state.summary()

    def _landings(self, state: Backfill, plan: Plan, model: Any) -> Iterator[tuple[int, dict]]:
        """The chunks ``state`` lets start, the next one started as soon as one lands; each landed
        chunk with its record. Held back by the throttle, it waits its turn. The first failure stops
        new starts; what is in flight finishes, then it is raised."""
        chunks, clock = self.ports.chunks, self.ports.clock
        in_flight: dict[Any, int] = {}

        def start() -> None:
            for chunk in state.to_start(clock()):
                in_flight[chunks.submit(plan, chunk, model)] = chunk

        start()
        while in_flight or state.can_start_more:
            if not in_flight:  # held back by the throttle: wait for its turn
                self.ports.sleep(max(state.wait_time(clock()), 0.01))
                start()
                continue
            handle = chunks.first_done(list(in_flight))
            chunk = in_flight.pop(handle)
            try:
                record = chunks.result(handle)
            except BaseException as error:  # noqa: BLE001 - finish what is in flight, then raise
                state.failed(chunk, error)
                continue
            state.landed(chunk, record["count"], record.get("failed", []))
            for entry in record.get("failed", []):
                self.log(f"chunk {chunk}: item {entry['id']} keeps its transformed features: {entry['uri']}: "
                         f"{entry['reason']}")
            start()  # the next chunk starts before this one's bookkeeping
            yield chunk, record
        if state.failure is not None:
            raise state.failure

    # ---- the end

    def _end(self, plan: Plan) -> Ending:
        """The end of a complete backfill, as a recoverable sequence: the decision recorded first,
        then the gallery switched (or back on the champion's features), then the registry; the
        lock is released last. A decision already recorded (a re-run after a kill) is completed,
        never measured again. Returns the ending the decider gave, as carried out."""
        ending = self.decider.ending(self.view.decision(plan.upgrade_id), plan.upgrade_id)
        for line in ending.say:
            self.log(line)
        if ending.decision is None:
            numbers = self.ports.measure_gate(plan) if ending.measure else None
            decided = self.decider.decide(numbers, self.settings.promotion, plan.upgrade_id, plan.new, self.view.model)
            for line in decided.say:
                self.log(line)
            assert decided.decision is not None  # decide gives the decision to record
            ending = self.decider.decided(self.ports.writes.write_decision(decided.decision))  # as stored
            if numbers is not None and plan.mlflow_run_id:
                self.ports.records.gate(plan, numbers)
        assert ending.decision is not None
        if ending.switch == FINISH:
            self.ports.writes.finish(plan)
        else:
            self.ports.writes.reject(plan, ending.decision)
        self._follow_in_registry(plan, ending)
        return ending

    def _follow_in_registry(self, plan: Plan, ending: Ending) -> None:
        """The end's registry step: the decision's tags on the version and the upgrade's run, and
        champion moved when the ending promotes; then the decision record says so."""
        assert ending.decision is not None
        self.ports.records.follow_decision(plan, ending.decision.tags, promote=ending.promotes)
        self.ports.writes.mark_registry_recorded(ending.decision.upgrade_id)


def _ended_fields(ending: Ending) -> dict:
    """The result's fields of an upgrade whose end is done (or completed now): its state, and
    the decision when the gate measured it."""
    decision = ending.decision
    return {"state": "complete" if ending.promotes else "rejected",
            "promotion": decision if decision is not None and decision.gated else None}


def _advice_record(advice: dict | None, gain_below: float | None) -> Advice | None:
    if advice is None:
        return None
    curves = ("agreement",) if advice.get("metric") == "agreement" else ("top1", "map")
    stop = at_stop(advice, gain_below)
    return Advice(recommendation=Recommendation.from_dict(stop) if stop else None, fractions=advice["fractions"],
                  **{key: advice[key] for key in curves})
