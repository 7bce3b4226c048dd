"""Every decision of a gallery upgrade, in one place and without Prefect, S3 or MLflow servers.

``UpgradeDecider`` reads the store's state (a ``StoreView``: the gallery's model, the upgrade in
progress, the records of earlier ones) and the registry's answer (the version asked for, the
champion) and says what happens next, as a value: the target, the work to complete first (an
abort or an ending that a killed run left half done), then one of: return an ended upgrade's
result, nothing to do, refuse with a reason, resume, plan a fresh upgrade (from scratch after an
abort or a rollback) or a sequential one. It also owns the end sequence and the advised stop. It
never logs: each answer carries the lines to say, and the flow says them.

The states an upgrade goes through, and where each edge is decided::

                         ┌───────────── complete an interrupted abort / ending first
                         v
    registry answer ──> course ──> refuse (rejected before, nothing to measure against,
                         │                  already built but half done)
                         ├──> up-to-date / ended (return)
                         ├──> resume ──────────┐
                         └──> plan (fresh,     v
                              sequential, ─> backfill ──(budget or advised stop)──> paused
                              start over)      │  ^                                  │
                                               │  └──────── the same command ────────┘
                                     (all chunks done)
                                               v
                      end: decision ──(passed)──> finish ──> registry ──> lock released
                                     └─(rejected)──> reject ──> registry ──> lock released
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

from fastfill.components.gallery.advice.advisor import at_stop
from fastfill.components.gallery.gate.promotion import decide, decision_tags, gate_message
from fastfill.components.gallery.upgrade.lifecycle import TRUTH_NONE, no_truth_refusal, truth_of
from fastfill.components.gallery.upgrade.outcome import Decision, UpgradeResult
from fastfill.components.gallery.upgrade.planning import upgrade_id
from fastfill.components.platform.registry import CHALLENGER, CHAMPION, ModelRef

# what a course does after its preliminaries
ENDED, UP_TO_DATE, REFUSE, RESUME, PLAN = "ended", "up-to-date", "refuse", "resume", "plan"
# how an ended upgrade's gallery switches: to the new model (and champion with it), or back on the champion's features
FINISH, REJECT = "finish", "reject"


class StoreView(Protocol):
    """What the decider reads from the gallery's store (``gallery_view.GalleryView`` reads it
    from a real store; the unit tests give a table)."""

    model: ModelRef  # the model whose features the gallery serves
    current: str | None  # the manifest's upgrade in progress
    num_items: int
    has_labels: bool

    def planned_new(self, upgrade_id: str) -> ModelRef | None:
        """The new model of ``upgrade_id``'s plan, None when it has no plan."""

    def aborted(self, upgrade_id: str) -> bool:
        """``upgrade_id`` has an abort record."""

    def undone(self, upgrade_id: str) -> dict | None:
        """The record of ``upgrade_id``'s abort or rollback, with ``ended``; None when neither."""

    def rejected(self, upgrade_id: str) -> dict | None:
        """The promotion gate's rejection record of ``upgrade_id``, or None."""

    def interrupted_decision(self) -> Decision | None:
        """The decision of an upgrade whose gallery switched (or went back) but whose registry
        step did not happen, or None."""


@dataclass
class Course:
    """What an upgrade does under its lock, in this order: ``complete_abort`` (an upgrade id),
    ``complete_decision`` (a recorded decision), ``start_over`` (the upgrade's earlier objects are
    removed), then ``action``. ``say``: the lines to log."""

    action: str
    upgrade_id: str | None = None
    old: ModelRef | None = None  # the features the map starts from
    base: str | None = None  # a sequential upgrade's unfinished upgrade
    complete_abort: str | None = None
    complete_decision: Decision | None = None
    start_over: bool = False
    point_manifest: bool = False  # resuming: the manifest names another upgrade and must name this one
    truth: str | None = None
    reason: str | None = None  # REFUSE: the message
    say: list[str] = field(default_factory=list)


@dataclass
class Ending:
    """The end of a complete backfill, as the decider says it goes: with no decision recorded,
    ``measure`` (the gate's numbers are taken, or not ungated) and ``decide`` gives the ending;
    with a ``decision`` (just decided, or recorded before: a re-run after a kill completes it and
    never measures again), its ``switch``: ``FINISH`` or ``REJECT``. Then the registry follows,
    and the caller releases the lock last."""

    measure: bool
    decision: Decision | None = None
    switch: str | None = None  # FINISH or REJECT, set with the decision
    say: list[str] = field(default_factory=list)

    @property
    def promotes(self) -> bool:
        """The registry moves champion to the new version."""
        return self.switch == FINISH


class UpgradeDecider:
    """The upgrade's decisions for one gallery and one configuration (``gallery.upgrade``,
    ``promotion.gate``, the registered model's name)."""

    def __init__(self, store_uri: str, registered_model: str, gate: bool, judgments: str | None = None,
                 stop_when_gain_below: float | None = None):
        self.store_uri = store_uri
        self.registered_model = registered_model
        self.gate = gate
        self.judgments = judgments
        self.gain_below = stop_when_gain_below

    # ---- before the lock: which version

    def target(self, asked: ModelRef | None, view: StoreView) -> ModelRef | None:
        """The version to upgrade to: ``asked`` (``--to``, or the registry's challenger), else
        the one the gallery is in the middle of reaching (an interrupted ending, or the upgrade
        in progress), so that the same command resumes or completes it; None: nothing to do."""
        if asked is not None:
            return asked
        ending = view.interrupted_decision()
        if ending is not None:
            return ending.new
        return view.planned_new(view.current) if view.current else None

    def no_target(self, view: StoreView, champion: str | None) -> UpgradeResult:
        """The result when no version is asked for and nothing is in progress: a success that
        says so (``message``)."""
        name, serving = self.registered_model, view.model
        where = ("which the gallery serves" if champion == str(serving.version) and name == serving.name else
                 f"while the gallery serves {serving.uri}")
        held = f"champion is version {champion}" if champion else f"no `{CHAMPION}` either"
        message = (f"{name} has no `{CHALLENGER}` ({held}, {where}); nothing to upgrade. Set the alias "
                   f"`{CHALLENGER}` on a new version, or pass --to models:/{name}/VERSION")
        return up_to_date(serving, view.num_items).with_message(message)

    # ---- under the lock: what happens next

    def course(self, view: StoreView, wanted: ModelRef) -> Course:
        """What to do about ``wanted``, from the store as it is under the lock (another upgrade
        may have finished, or been interrupted at its end, while this one waited)."""
        say: list[str] = []
        current = view.current
        complete_abort = None
        if current and view.aborted(current):  # an abort that stopped before the gallery went back
            complete_abort, current = current, None
            say.append(f"upgrade {complete_abort} was aborted, but the abort stopped before the gallery went back to "
                       "its own model's features; completing the abort first")
        ending = view.interrupted_decision()
        if ending is not None:
            say.append(f"upgrade {ending.upgrade_id} was interrupted at its end, after the gallery "
                       f"{'switched' if ending.passed else 'went back'}: recording its decision in the registry now")
            if ending.new is not None and ending.new.same_version(wanted):
                return Course(ENDED, upgrade_id=ending.upgrade_id, complete_abort=complete_abort, complete_decision=ending,
                              say=say)
        course = Course(REFUSE, complete_abort=complete_abort, complete_decision=ending, say=say)
        if view.model.same_version(wanted):
            if current:
                moving = view.planned_new(current)
                course.reason = (f"the gallery at {self.store_uri} is already built with {wanted.uri}, and upgrade "
                                 f"{current} is half done; run `fastfill upgrade --to "
                                 f"{moving.uri if moving else '...'}` to finish it")
                return course
            say.append(f"the gallery at {self.store_uri} is already built with {wanted.uri}; nothing to upgrade")
            course.action = UP_TO_DATE
            return course
        old, moving = view.model, view.planned_new(current) if current else None
        if moving is not None and not moving.same_version(wanted):
            course.base, old = current, moving
            say.append(f"{self.store_uri} is in the middle of upgrade {current} to {moving.uri}: {wanted.uri} starts a "
                       "sequential upgrade from the gallery as it stands")
        course.old, course.upgrade_id = old, upgrade_id(old, wanted)
        undone = view.undone(course.upgrade_id)
        if undone is not None:  # the user ended it: its old plan and chunks count for nothing
            course.start_over = True
            when, by = undone.get("aborted") or undone.get("rolled_back"), undone.get("by") or {}
            say.append(f"upgrade {course.upgrade_id} was {undone['ended']} on {when} by {by.get('user')}@{by.get('host')}; "
                       "planning it again from scratch (its earlier objects were removed)")
        else:
            rejected = view.rejected(course.upgrade_id)
            if rejected is not None and self.gate:
                course.reason = (f"upgrade {course.upgrade_id} was rejected by the promotion gate on {rejected['rejected']} "
                                 f"({'; '.join(rejected.get('reasons', []))}); register a better version, or run it "
                                 "ungated (--no-gate) to plan it again without the gate")
                return course
            if rejected is not None:  # the user turned the gate off for it: planned again, ungated
                course.start_over = True
                say.append(f"upgrade {course.upgrade_id} was rejected by the promotion gate on {rejected['rejected']}; the "
                           "gate is off for this run, so it is planned again from scratch and runs ungated")
        course.truth = truth_of(view.has_labels, self.judgments)
        if course.truth == TRUTH_NONE and self.gate:  # decided before any embedding
            course.reason = no_truth_refusal(self.store_uri)
            return course
        if course.truth == TRUTH_NONE:
            say.append(f"{self.store_uri} has no labels and no judged queries: the upgrade runs ungated "
                       "(promotion.gate false), and no retrieval is measured along the backfill")
        if not course.start_over and view.planned_new(course.upgrade_id) is not None:
            course.action, course.point_manifest = RESUME, current != course.upgrade_id
            say.append(f"resuming upgrade {course.upgrade_id}")
        else:
            course.action = PLAN
        return course

    # ---- what the layout can serve

    @staticmethod
    def layout_refusal(gallery, new: ModelRef, task_runner: str) -> str | None:
        """Why the gallery's layout cannot take ``new`` (its dim known, the model loaded) with
        this backfill's task runner, decided before any work; None when it can."""
        reason = gallery.cannot_serve(new, task_runner)
        return None if reason is None else (f"{gallery.store.uri} ({gallery.layout} layout) cannot serve {new.uri}: "
                                            f"{reason}. Nothing was written.")

    # ---- the backfill's stop

    def advised_stop(self, advice: dict | None, budget) -> dict | None:
        """The budget advisor's recommended stop when stop_when_gain_below asks for one and no
        explicit budget is given (a budget is the user's own limit and wins); None when it is 100%."""

        if self.gain_below is None or advice is None or budget is not None:
            return None
        stop = at_stop(advice, self.gain_below)
        return stop if stop is not None and stop["fraction"] < 1 else None

    def paused(self, result: UpgradeResult, stop: dict | None) -> tuple[UpgradeResult, str]:
        """The result and the line of a backfill that stopped before its last chunk."""
        done, items = result.items_done, result.items
        if stop:
            metric = "top-1" if stop.get("metric", "top1") == "top1" else "agreement"
            return (replace(result, state="paused", stopped="recommended"),
                    f"stopped at {done}/{items} items: the recommended stop for a gain below {stop['gain_below']:g} "
                    f"{metric} points per 5% ({100 * stop['fraction']:.0f}%); queries are served by the mixed gallery. "
                    "To go on, run again with a --budget, or without stop_when_gain_below")
        return (replace(result, state="paused", stopped="budget"),
                f"stopped at {done}/{items} items (budget); run the same command to go on")

    # ---- the end sequence: decision, switch, registry, lock

    def ending(self, recorded: Decision | None, upgrade_id: str) -> Ending:
        """How the end of a complete backfill goes: measured by the gate (or ungated) when no
        decision is recorded; completed from the recorded decision otherwise."""
        if recorded is None:
            return Ending(measure=self.gate)
        return replace(self.decided(recorded),
                       say=[f"completing the end of upgrade {upgrade_id}: its decision ("
                            f"{'passed' if recorded.passed else 'rejected'}, {recorded.decided}) was recorded "
                            "before the last run stopped"])

    @staticmethod
    def decided(decision: Decision) -> Ending:
        """The end of ``decision`` (recorded): the gallery switches to the new model when it
        passed, back on the champion's features when it did not."""
        return Ending(measure=False, decision=decision, switch=FINISH if decision.passed else REJECT)

    def decide(self, numbers: dict | None, promotion, upgrade_id: str, new: ModelRef, champion: ModelRef) -> Ending:
        """The ending to record: the gate's decision on ``numbers`` (``promotion``: its
        thresholds), or passed ungated when ``numbers`` is None, with the lines to say."""
        if numbers is None:
            return self.decided(Decision(upgrade_id, True, [], None, {"promotion": "ungated",
                                                                      "promotion.upgrade": upgrade_id},
                                         champion=champion, new=new))
        passed, reasons = decide(numbers, promotion)
        tags = decision_tags(passed, reasons, numbers, champion.version, upgrade_id)
        return replace(self.decided(Decision(upgrade_id, passed, reasons, numbers, tags, champion=champion, new=new)),
                       say=[gate_message(numbers, passed, reasons, new.uri, champion.uri)])

    @staticmethod
    def ended_line(result: UpgradeResult, upgrade_id: str, new: ModelRef, champion: ModelRef) -> str:
        return (f"upgrade {upgrade_id} complete: the gallery's model is now {new.uri}" if result.state == "complete" else
                f"upgrade {upgrade_id} rejected: the gallery serves {champion.uri}'s features again")


def up_to_date(model: ModelRef, num_items: int) -> UpgradeResult:
    """The result of an upgrade with nothing to do."""
    return UpgradeResult(state="up-to-date", model=model.uri, items=num_items, items_done=num_items, fraction=1.0,
                         complete=True)
