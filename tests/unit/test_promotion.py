"""The promotion gate's numbers on hand-made features, and its decisions."""

import numpy as np
import pytest

from fastfill.components.gallery.gate.promotion import decide, decision_tags, gate_message, measure_gate, top1_correct
from fastfill.components.platform.config import PromotionConfig


def _clusters(n_per: int = 5, classes: int = 3, noise: float = 0.1, seed: int = 0):
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(classes), n_per)
    centres = np.eye(classes, 4) * 4
    return labels, (centres[labels] + rng.normal(scale=noise, size=(len(labels), 4))).astype(np.float32)


def test_top1_excludes_the_query_itself():
    labels = np.array([0, 0, 1, 1])
    features = np.array([[0.0], [0.1], [5.0], [0.3]], np.float32)  # item 3 sits in class 0's cluster
    # item 2's nearest other item is item 3 (same label), not itself; item 3's is item 1 (wrong)
    np.testing.assert_array_equal(top1_correct(features, features, labels, "l2"), [True, True, True, False])


def test_a_better_challenger_gains_and_the_gain_arrives_with_the_backfill():
    labels, good = _clusters(noise=0.1)
    rng = np.random.default_rng(2)
    champion = good.copy()  # the champion puts class 2 on top of class 1
    champion[labels == 2] = good[labels == 1] + rng.normal(scale=0.1, size=(5, 4)).astype(np.float32)
    champion_top1 = top1_correct(champion, champion, labels, "l2").mean()
    assert champion_top1 < 0.9
    transformed = champion.copy()  # the old side, mapped: as confused as the champion
    order = np.argsort(labels != 2, kind="stable")  # the confused class first
    numbers = measure_gate(champion, good, good, transformed, labels, order, curve_points=3)
    assert numbers["alpha"] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert numbers["champion_top1"] == pytest.approx(champion_top1)
    assert numbers["top1"][-1] == 1.0 and numbers["nfr1"][-1] == 0.0
    assert numbers["top1_auc"] == pytest.approx(np.mean(numbers["top1"]))
    assert numbers["top1_auc_gain"] == pytest.approx(numbers["top1_auc"] - champion_top1)
    # by 0.5 (7 of 15 items, the 5 confused ones among them) the confusion is gone
    assert numbers["top1"][2] == 1.0
    assert numbers["fraction_to_gain"] == next(a for a, t in zip(numbers["alpha"], numbers["top1"]) if t > champion_top1)
    assert numbers["fraction_to_gain"] <= 0.5
    passed, reasons = decide(numbers, PromotionConfig(min_top1_auc_gain=0.0, max_nfr1=0.5, max_fraction_to_gain=0.5))
    assert passed and reasons == []


def test_a_worse_challenger_is_rejected_with_every_reason():
    labels, good = _clusters()
    rng = np.random.default_rng(1)
    noise = rng.normal(size=good.shape).astype(np.float32)  # a model that knows nothing
    numbers = measure_gate(good, noise, noise, noise, labels, np.arange(len(labels)), curve_points=2)
    assert numbers["champion_top1"] == 1.0 and numbers["fraction_to_gain"] is None
    assert numbers["nfr1_mean"] == pytest.approx(1 - np.mean(numbers["top1"]))  # every champion hit it misses is a flip
    passed, reasons = decide(numbers, PromotionConfig())
    assert not passed
    assert any("below the minimum" in r for r in reasons) and any("negative flip rate" in r for r in reasons)
    assert any("never exceeds" in r for r in reasons)
    tags = decision_tags(passed, reasons, numbers, "3", "embedder-v3-to-embedder-v4")
    assert tags["promotion"] == "rejected" and "negative flip rate" in tags["promotion.reason"]
    assert tags["promotion.fraction_to_gain"] == "never" and tags["promotion.champion_version"] == "3"
    line = gate_message(numbers, passed, reasons, "models:/e/4", "models:/e/3")
    assert "REJECTED" in line and "gain reached at never" in line and reasons[0] in line
    # by default the flips are judged against those of errors that ignore the champion's right answers:
    # a model that knows nothing flips exactly as many (relative 1.0), above the default 0.8
    flip = next(r for r in reasons if "negative flip rate" in r)
    assert "is 1.00 of the" in flip and "above the maximum 0.80 (promotion.max_relative_nfr1; both the mean along " \
                                        "the backfill over 4 points)" in flip, flip
    assert tags["promotion.nfr1_relative"] == "1.000000"
    # the absolute bound, where set, says which rate it compares (the mean along the curve) and the one at the end
    _, reasons = decide(numbers, PromotionConfig(max_nfr1=0.1))
    flip = next(r for r in reasons if "promotion.max_nfr1" in r)
    assert "promotion.max_nfr1; the mean along the backfill over 4 points from 0% to 100%" in flip
    assert f"at the end, all backfilled: {100 * numbers['nfr1_end']:.2f}%" in flip
    assert f"({100 * numbers['nfr1_end']:.2f}% at the end)" in line


def test_a_much_better_model_over_a_weak_champion_passes_the_default_flip_bound():
    """Champion top-1 55.33%, challenger 74.26% along the backfill with 15.50% of the champion's
    right answers flipped (a team's own pair of models, measured by the gate): the earlier absolute
    10% bound rejected it; the flips are 0.60 of what errors independent of the champion's would
    give, so the default passes it, while the same flips with the challenger's top-1 at 82% do not
    (0.155 / 0.18 = 0.86)."""
    numbers = {"champion_top1": 0.5533, "top1_auc": 0.7426, "top1_auc_gain": 0.7426 - 0.5533, "nfr1_mean": 0.155,
               "fraction_to_gain": 0.0}
    assert not decide(numbers, PromotionConfig(max_nfr1=0.1))[0]
    passed, reasons = decide(numbers, PromotionConfig())
    assert passed and reasons == [], reasons
    churned = {**numbers, "top1_auc": 0.82, "top1_auc_gain": 0.82 - 0.5533}
    passed, reasons = decide(churned, PromotionConfig())
    assert not passed and "is 0.86 of the 18.00%" in reasons[0], reasons


def test_late_gain_fails_the_fraction_gate():
    numbers = {"top1_auc_gain": 0.05, "nfr1_mean": 0.0, "fraction_to_gain": 0.8, "champion_top1": 0.5}
    passed, reasons = decide(numbers, PromotionConfig(max_fraction_to_gain=0.5))
    assert not passed and reasons == ["top-1 exceeds the champion's only at 80% backfilled, later than the allowed 50%"]


def test_inputs_of_different_lengths_are_refused():
    labels, good = _clusters()
    with pytest.raises(ValueError, match="same >= 2 items"):
        measure_gate(good[:-1], good, good, good, labels, np.arange(len(labels)))
