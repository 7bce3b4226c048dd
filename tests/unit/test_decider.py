"""Every state the upgrade's decider can meet (components.gallery.upgrade.decider), as a table: no
Prefect, no S3, no MLflow; the store is a small in-memory view."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from fastfill.components.gallery.upgrade.decider import ENDED, PLAN, REFUSE, RESUME, UP_TO_DATE, UpgradeDecider
from fastfill.components.gallery.upgrade.gallery_view import GalleryView
from fastfill.components.gallery.upgrade.outcome import Decision, UpgradeResult
from fastfill.components.platform.config import PromotionConfig
from fastfill.components.platform.registry import ModelRef

V1, V2, V3 = (ModelRef("embedder", str(v), 8) for v in (1, 2, 3))
UID12, UID13, UID23 = "embedder-v1-to-embedder-v2", "embedder-v1-to-embedder-v3", "embedder-v2-to-embedder-v3"
STORE = "s3://bucket/gallery"


@dataclass
class View:
    model: ModelRef = V1
    current: str | None = None
    num_items: int = 100
    has_labels: bool = True
    plans: dict = field(default_factory=dict)  # upgrade id -> its new model
    aborts: set = field(default_factory=set)
    undos: dict = field(default_factory=dict)
    rejections: dict = field(default_factory=dict)
    ending: dict | None = None

    def planned_new(self, upgrade_id):
        return self.plans.get(upgrade_id)

    def aborted(self, upgrade_id):
        return upgrade_id in self.aborts

    def undone(self, upgrade_id):
        return self.undos.get(upgrade_id)

    def rejected(self, upgrade_id):
        return self.rejections.get(upgrade_id)

    def interrupted_decision(self):
        return self.ending


def ending_of(upgrade_id: str, new: ModelRef, passed: bool = True) -> Decision:
    return Decision(upgrade_id, passed, [], None, new=new, decided="2026-01-01T00:00:00Z")


ABORTED = {"ended": "aborted", "aborted": "2026-01-02", "by": {"user": "ana", "host": "h"}}
REJECTED = {"rejected": "2026-01-03", "reasons": ["top-1 gain below the minimum"]}

# (case, view, wanted, decider options) -> (action, uid, old, base, what else holds, a phrase said or refused)
COURSES = [
    ("fresh upgrade", View(), V2, {}, (PLAN, UID12, V1, None, {}, None)),
    ("resume a planned one", View(current=UID12, plans={UID12: V2}), V2, {},
     (RESUME, UID12, V1, None, {"point_manifest": False}, "resuming upgrade")),
    ("resume after a crash between plan and manifest", View(plans={UID12: V2}), V2, {},
     (RESUME, UID12, V1, None, {"point_manifest": True}, "resuming upgrade")),
    ("a newer version during an upgrade: sequential", View(current=UID12, plans={UID12: V2}), V3, {},
     (PLAN, UID23, V2, UID12, {}, "starts a sequential upgrade")),
    ("already on the version", View(model=V2), V2, {}, (UP_TO_DATE, None, None, None, {}, "nothing to upgrade")),
    ("already on the version, another upgrade half done", View(model=V2, current=UID23, plans={UID23: V3}), V2, {},
     (REFUSE, None, None, None, {}, "is half done; run `fastfill upgrade --to models:/embedder/3`")),
    ("an abort cut short is completed first, then a fresh plan",
     View(current=UID12, plans={UID12: V2}, aborts={UID12}, undos={UID13: None}), V3, {},
     (PLAN, UID13, V1, None, {"complete_abort": UID12}, "completing the abort first")),
    ("an interrupted ending of the version asked for is completed and returned",
     View(model=V2, ending=ending_of(UID12, V2)), V2, {},
     (ENDED, UID12, None, None, {"complete_decision": ending_of(UID12, V2)}, "recording its decision in the registry")),
    ("an interrupted ending of another version is completed, then the upgrade goes on",
     View(model=V2, ending=ending_of(UID12, V2)), V3, {},
     (PLAN, UID23, V2, None, {"complete_decision": ending_of(UID12, V2)}, "recording its decision in the registry")),
    ("an interrupted rejection of the version asked for is completed and returned",
     View(ending=ending_of(UID12, V2, passed=False), rejections={UID12: REJECTED}), V2, {},
     (ENDED, UID12, None, None, {}, "went back")),
    ("aborted before: planned again from scratch", View(plans={UID12: V2}, undos={UID12: ABORTED}), V2, {},
     (PLAN, UID12, V1, None, {"start_over": True}, "planning it again from scratch")),
    ("rolled back before, and rejected: the undo wins",
     View(undos={UID12: {**ABORTED, "ended": "rolled back"}}, rejections={UID12: REJECTED}), V2, {},
     (PLAN, UID12, V1, None, {"start_over": True}, "was rolled back on")),
    ("rejected before", View(rejections={UID12: REJECTED}), V2, {},
     (REFUSE, UID12, V1, None, {}, "was rejected by the promotion gate on 2026-01-03")),
    ("rejected before, asked for again with the gate off: planned again, ungated",
     View(plans={UID12: V2}, rejections={UID12: REJECTED}), V2, {"gate": False},
     (PLAN, UID12, V1, None, {"start_over": True}, "planned again from scratch and runs ungated")),
    ("no labels, no judgments, gated: refused before any work", View(has_labels=False), V2, {},
     (REFUSE, UID12, V1, None, {"truth": "none"}, "has nothing to measure the upgrade against")),
    ("no labels, no judgments, ungated: runs", View(has_labels=False), V2, {"gate": False},
     (PLAN, UID12, V1, None, {"truth": "none"}, "runs ungated")),
    ("judged queries and no labels", View(has_labels=False), V2, {"judgments": "q.csv"},
     (PLAN, UID12, V1, None, {"truth": "judgments"}, None)),
    ("labels", View(), V2, {}, (PLAN, UID12, V1, None, {"truth": "labels"}, None)),
]


def decider(gate: bool = True, judgments: str | None = None, gain_below: float | None = None) -> UpgradeDecider:
    return UpgradeDecider(STORE, "embedder", gate=gate, judgments=judgments, stop_when_gain_below=gain_below)


@pytest.mark.parametrize("case, view, wanted, options, expected", COURSES, ids=[c[0] for c in COURSES])
def test_the_course_of_an_upgrade(case, view, wanted, options, expected):
    action, uid, old, base, holds, phrase = expected
    course = decider(**options).course(view, wanted)
    assert (course.action, course.upgrade_id, course.old, course.base) == (action, uid, old, base)
    for key, value in holds.items():
        assert getattr(course, key) == value, key
    said = " ".join(course.say) + " " + (course.reason or "")
    if phrase is not None:
        assert phrase in said
    assert (course.reason is not None) == (action == REFUSE)


TARGETS = [
    ("--to or the challenger", View(current=UID12, plans={UID12: V2}), V3, V3),
    ("no challenger: the upgrade in progress", View(current=UID12, plans={UID12: V2}), None, V2),
    ("no challenger: an interrupted ending", View(model=V2, ending=ending_of(UID12, V2)), None, V2),
    ("no challenger, nothing in progress", View(), None, None),
    ("no challenger, the upgrade in progress has no plan", View(current=UID12), None, None),
]


@pytest.mark.parametrize("case, view, asked, expected", TARGETS, ids=[c[0] for c in TARGETS])
def test_the_target(case, view, asked, expected):
    assert decider().target(asked, view) == expected


@pytest.mark.parametrize("champion, serving, said", [
    ("1", V1, "champion is version 1, which the gallery serves"),
    ("2", V1, "champion is version 2, while the gallery serves models:/embedder/1"),
    (None, V1, "no `champion` either"),
])
def test_nothing_to_upgrade_says_why(champion, serving, said):
    result = decider().no_target(View(model=serving), champion)
    assert result.state == UP_TO_DATE and result.complete and result.items_done == 100
    assert said in result.message and "--to models:/embedder/VERSION" in result.message


@pytest.mark.parametrize("gate, recorded, measure, switch", [
    (True, None, True, None),
    (False, None, False, None),
    (True, Decision(UID12, True, [], {"top1": 1}, decided="t"), False, "finish"),
    (False, Decision(UID12, False, ["worse"], None, decided="t"), False, "reject"),
])
def test_the_end_measures_once_and_completes_a_recorded_decision(gate, recorded, measure, switch):
    ending = decider(gate=gate).ending(recorded, UID12)
    assert (ending.measure, ending.switch, ending.decision) == (measure, switch, recorded)
    assert ending.promotes == (switch == "finish")
    assert bool(ending.say) == (recorded is not None)


NUMBERS = {"champion_top1": 0.5, "top1_auc": 0.6, "top1_auc_gain": 0.1, "nfr1_mean": 0.02, "fraction_to_gain": 0.2,
           "top1": [0.5, 0.7], "nfr1": [0.0, 0.02], "queries": 30}


@pytest.mark.parametrize("numbers, passed, tag", [
    (None, True, "ungated"),
    (NUMBERS, True, "passed"),
    ({**NUMBERS, "nfr1_mean": 0.5}, False, "rejected"),
    ({**NUMBERS, "top1_auc_gain": -0.01, "top1_auc": 0.49}, False, "rejected"),
])
def test_the_decision(numbers, passed, tag):
    ending = decider().decide(numbers, PromotionConfig(), UID12, V2, V1)
    decided, said = ending.decision, ending.say
    assert ending.switch == ("finish" if passed else "reject") and not ending.measure
    assert (decided.upgrade_id, decided.new, decided.champion, decided.gated) == (UID12, V2, V1, numbers is not None)
    assert decided.passed is passed and decided.tags["promotion"] == tag
    assert bool(decided.reasons) == (not passed)
    assert bool(said) == (numbers is not None)


ADVICE = {"fractions": [0.0, 0.5, 1.0], "top1": [0.5, 0.7, 0.71], "map": [0.3, 0.4, 0.41],
          "recommendation": {"fraction": 0.5, "gain_below": 1.0, "metric": "top1"}}


@pytest.mark.parametrize("gain_below, advice, budget, stops_at", [
    (None, ADVICE, None, None),  # not asked for
    (1.0, None, None, None),  # nothing predicted
    (1.0, ADVICE, 0.2, None),  # the user's budget wins
    (1.0, ADVICE, None, 0.5),
    (1.0, {**ADVICE, "recommendation": {"fraction": 1.0, "gain_below": 1.0}}, None, None),  # 100%: no stop
])
def test_the_advised_stop(gain_below, advice, budget, stops_at):
    stop = decider(gain_below=gain_below).advised_stop(advice, budget)
    assert (stop and stop["fraction"]) == stops_at


def test_a_paused_backfill_says_how_to_go_on():
    result = UpgradeResult(state="paused", items_done=40, items=100, fraction=0.4, complete=False)
    paused, line = decider().paused(result, None)
    assert paused.state == "paused" and paused.stopped == "budget" and "run the same command" in line
    paused, line = decider().paused(result, {"fraction": 0.4, "gain_below": 1.0})
    assert paused.stopped == "recommended" and "the recommended stop for a gain below 1 top-1 points" in line


def test_the_gallery_view_reads_what_the_decider_needs(tmp_path):
    """The real store's view against the table's: a planned, then aborted upgrade."""
    import numpy as np

    from fastfill.components.gallery.layouts.catalog import PartsGallery, ingest
    from fastfill.components.gallery.store import open_store
    from fastfill.components.gallery.upgrade.planning import Plan, write_plan
    from fastfill.components.gallery.upgrade.reversal import abort

    store = open_store(tmp_path / "g")
    rng = np.random.default_rng(0)
    ingest(store, rng.integers(0, 255, (6, 1, 4, 4), dtype=np.uint8), rng.normal(size=(6, 8)).astype(np.float32), V1,
           labels=np.arange(6) % 2, part_size=3)
    gallery = PartsGallery(store)
    plan = Plan(UID12, V1, V2, "models:/map/1", "random", 3, 6, 0, "l2", "run")
    write_plan(store, plan)
    gallery.write_manifest({**gallery.manifest(refresh=True), "upgrade": UID12})
    view = GalleryView(gallery)
    assert (view.model, view.current, view.num_items, view.has_labels) == (V1, UID12, 6, True)
    assert view.planned_new(UID12) == V2 and view.planned_new(UID13) is None
    assert not view.aborted(UID12) and view.undone(UID12) is None and view.interrupted_decision() is None
    assert decider().course(view, V2).action == RESUME
    abort(gallery, UID12)
    view = GalleryView(gallery)
    assert view.current is None and view.undone(UID12)["ended"] == "aborted"
    course = decider().course(view, V2)
    assert course.action == PLAN and course.start_over
