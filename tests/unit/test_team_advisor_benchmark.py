"""benchmarks/team_advisor_map.py's measurement of the advisor against the gate, on small data."""

import numpy as np

from benchmarks.team_advisor_map import calibration, judgments_of, markdown


def _features(n=240, d=8, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    new = (rng.normal(size=(classes, d))[labels] * 2 + rng.normal(size=(n, d))).astype(np.float32)
    old = (new + rng.normal(scale=1.5, size=(n, d))).astype(np.float32)
    return {"old": old, "new": new, "labels": labels}


def test_a_sample_that_is_the_whole_gallery_misses_the_gate_by_nothing():
    feats = _features()
    order = np.random.default_rng(1).permutation(len(feats["labels"]))
    whole = calibration(feats, feats["old"], order, judged=30, eval_size=len(feats["labels"]), draws=2)
    assert whole["mean_abs_miss"] < 1e-6 and whole["within"]["2 s.e."] == 1.0
    sampled = calibration(feats, feats["old"], order, judged=30, eval_size=80, draws=2)
    assert sampled["mean_abs_miss"] > 0  # a sample of a third of the gallery does miss
    assert len(sampled["draws_detail"]) == 2 and len(sampled["draws_detail"][0]["predicted"]) == 21
    assert sampled["mean_se"] >= sampled["mean_se_queries"]  # the sample's draw adds to the queries' error


def test_judged_queries_are_relevant_to_the_rest_of_their_class():
    labels = np.array([0, 0, 1, 1, 1, 2, 2])
    judged = judgments_of(labels, 7, np.random.default_rng(0))
    assert [r.tolist() for r in judged.relevant] == [[1], [0], [3, 4], [2, 4], [2, 3], [6], [5]]


def test_the_report_has_a_row_per_data_set_and_sample_size():
    feats = _features()
    order = np.arange(len(feats["labels"]))
    run = calibration(feats, feats["old"], order, judged=20, eval_size=60, draws=1)
    report = {"arguments": {"gallery": 240, "map_sample": 5000, "judged": 20, "draws": 1}, "seconds": 1.0,
              "results": [{"dataset": "tiny", "map_sample": 240, "held_out": 24, "check": "kept", "used": "candidate",
                           "maps": {"l2-only map, random": {"top1_auc": 1, "map_auc": 2, "top1_0": 3, "top1_100": 4}},
                           "advisor": [run]}]}
    text = markdown(report)
    assert "| tiny | 60 |" in text and "| tiny | 240 | 24 | kept | candidate |" in text
