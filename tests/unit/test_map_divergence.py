"""A map whose training diverges: the loop stops and restores finite weights, the map check
never uses a map whose outputs are not finite, and the comparison reports its row as diverged."""

import math

import numpy as np
import pytest
import torch

from fastfill.components.evaluation.comparison import comparison_markdown, plot_comparison, ranking, summarize
from fastfill.components.evaluation.reports import build_metrics
from fastfill.components.experiment.inference import apply_alignment
from fastfill.components.experiment.map_check import (
    MapCheckError,
    check_map,
    check_metrics,
    check_tags,
    fallback_map,
    held_out,
    reference_config,
)
from fastfill.components.experiment.map_training import divergence, train_alignment
from fastfill.components.experiment.models import AlignmentMap
from fastfill.components.platform.config import AlignConfig
from fastfill.tasks.method_curves import diverged_curve
from tests.synthetic import tiny_curves

CPU = torch.device("cpu")


def _pairs(n=128, d_old=6, d_new=5, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    centers = rng.normal(size=(classes, d_new)).astype(np.float32) * 3
    new = (centers[labels] + rng.normal(scale=0.3, size=(n, d_new))).astype(np.float32)
    old = (np.tanh(new @ rng.normal(size=(d_new, d_old))) + rng.normal(scale=0.05, size=(n, d_old))).astype(np.float32)
    classifier = torch.nn.Linear(d_new, classes, bias=False)
    with torch.no_grad():
        classifier.weight.copy_(torch.from_numpy(centers))
    return old, new, labels, classifier


def _config(**changes) -> AlignConfig:
    settings = dict(hidden=[16], epochs=8, warmup_epochs=1, batch_size=32, min_steps=0, disc=True, uncertainty=True,
                    validation_fraction=0.25)
    return AlignConfig(**{**settings, **changes})


def _train(config, *data, **options):
    said = []
    h, history = train_alignment(config, *data, device=CPU, log=said.append, **options)
    return h, history, said


def _finite_map(h, old) -> bool:
    transformed, log_sigma2 = apply_alignment(h, old, device=CPU)
    weights = all(torch.isfinite(v).all() for v in h.state_dict().values() if v.is_floating_point())
    return weights and np.isfinite(transformed).all() and (log_sigma2 is None or np.isfinite(log_sigma2).all())


def test_the_divergence_rule():
    assert divergence(math.nan, 1.0, 2.0, 10.0) and divergence(math.inf, 1.0, 2.0, None)
    assert divergence(1.0, math.inf, 1.0, 10.0) is None  # the first epoch: nothing to compare with
    assert divergence(25.0, 2.0, 3.0, 10.0) is None and divergence(33.5, 2.0, 3.0, 10.0)  # 31.5 > 10 x 3
    assert divergence(1e6, 2.0, 3.0, None) is None  # factor null: only a non-finite loss stops it
    # the joint uncertainty loss can be negative: the scale is a magnitude
    assert divergence(-0.5, -1.0, 2.0, 10.0) is None and divergence(19.5, -1.0, 2.0, 10.0)
    # a best that happens to lie near zero: the first epoch's magnitude keeps a wobble from counting
    assert divergence(0.05, 0.001, 2.0, 10.0) is None


def test_a_huge_learning_rate_stops_the_training_and_restores_finite_weights():
    old, new, labels, classifier = _pairs()
    config = _config(lr=1e3)
    h, history, said = _train(config, old, new, labels, classifier)
    last = history[-1]
    assert len(history) < config.epochs and last["diverged"]["reason"] == "loss inf"
    assert not math.isfinite(last["loss"]) and all("diverged" not in r for r in history[:-1])
    assert last["diverged"]["restored_epoch"] == 0  # epoch 1 never finished: the initial weights
    assert _finite_map(h, old)
    line = next(m for m in said if m.startswith("training diverged"))
    assert f"at epoch {last['epoch']}/{config.epochs}" in line and "loss inf" in line
    assert "restored the initial weights" in line


def test_an_exploding_loss_restores_the_epoch_of_the_lowest_loss():
    """Without held-out pairs the loop keeps the lowest-loss epoch; a finite explosion stops it."""
    old, new, labels, classifier = _pairs()
    config = _config(lr=1.0, validation_fraction=0.0)
    h, history, said = _train(config, old, new, labels, classifier)
    last = history[-1]
    assert math.isfinite(last["loss"]) and "exceeds the best epoch's" in last["diverged"]["reason"]
    restored = last["diverged"]["restored_epoch"]
    assert restored >= 1 and history[restored - 1]["loss"] == min(r["loss"] for r in history[:-1])
    assert _finite_map(h, old)
    assert any(m.startswith(f"training diverged at epoch {last['epoch']}/") and
               f"restored the weights of epoch {restored}, the lowest loss" in m for m in said)


def test_with_held_out_pairs_the_best_validation_is_restored():
    old, new, labels, classifier = _pairs()
    h, history, said = _train(_config(lr=1.0), old, new, labels, classifier)
    restored = history[-1]["diverged"]["restored_epoch"]
    assert restored >= 1 and [r["epoch"] for r in history if r.get("best")] == [restored]
    assert _finite_map(h, old) and any("the best on the held-out pairs" in m for m in said)


def test_a_normal_training_is_not_stopped():
    old, new, labels, classifier = _pairs()
    config = _config(lr=3e-3)
    h, history, said = _train(config, old, new, labels, classifier)
    assert len(history) == config.epochs and not any("diverged" in r for r in history)
    assert not any("diverged" in m for m in said)


@pytest.mark.parametrize("validation_fraction", [0.0, 0.25])
def test_a_diverging_training_resumes_from_its_checkpoint(tmp_path, validation_fraction):
    """Stopped after epoch 1 and resumed, it diverges where the whole run does and restores the
    same weights (the lowest-loss epoch's come from the checkpoint)."""
    old, new, labels, classifier = _pairs()
    config = _config(lr=1.0, validation_fraction=validation_fraction)
    whole, history, _ = _train(config, old, new, labels, classifier)
    assert history[-1]["diverged"]["restored_epoch"] >= 1

    class Stop(Exception):
        pass

    def stop_after_first(epoch, total):
        if epoch == 1:
            raise Stop

    checkpoint = tmp_path / "align.pt"
    with pytest.raises(Stop):
        _train(config, old, new, labels, classifier, checkpoint=checkpoint, on_epoch=stop_after_first)
    reported = []
    resumed, resumed_history, said = _train(config, old, new, labels, classifier, checkpoint=checkpoint,
                                            on_epoch=lambda done, total: reported.append((done, total)))
    assert any(m.startswith("resuming from") for m in said)
    assert reported[-1][0] == reported[-1][1]  # stopped on divergence, the progress still ends at 100%
    assert [r["epoch"] for r in resumed_history] == [r["epoch"] for r in history]
    assert resumed_history[-1]["diverged"] == history[-1]["diverged"]
    for key, value in whole.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[key], value)


def _nan_map(config, old, new):
    h = AlignmentMap.from_config(config, old.shape[1], new.shape[1])
    with torch.no_grad():
        for parameter in h.parameters():
            parameter.fill_(math.nan)
    return h.eval()


@pytest.fixture(scope="module")
def checked():
    old, new, labels, classifier = _pairs(n=200)
    config = _config(check="fallback")
    reference, _ = train_alignment(reference_config(config), old, new, labels, classifier, device=CPU,
                                   log=lambda m: None)
    return config, _nan_map(config, old, new), reference, held_out(config, old, new, labels), (old, new, labels), \
        classifier


@pytest.mark.parametrize("policy", ["fallback", "warn"])
def test_a_map_with_non_finite_outputs_falls_back_under_fallback_and_warn(checked, policy):
    config, h, reference, pairs, training, classifier = checked
    result = check_map("fastfill", config.model_copy(update={"check": policy}), h, reference, pairs)
    assert not result.passed and result.action == "fallback"
    assert result.message.startswith("non-finite outputs: ")
    assert "transformed features in 50 of 50 rows" in result.message
    assert "log sigma^2 in 50 of 50 rows" in result.message and "uses the l2-only map instead" in result.message
    record = result.to_dict()
    tags = check_tags(record)
    assert tags["check"] == "fallback" and tags["check_reason"].startswith("non-finite outputs")
    assert "transformed features" in tags["check_non_finite"]
    metrics = check_metrics(record)
    assert metrics["check.non_finite"] == 1.0 and metrics["check.passed"] == 0.0
    assert math.isnan(metrics["check.map.top1_auc"]) and 0 <= metrics["check.reference.top1_auc"] <= 1
    used, _, decision = fallback_map("fastfill", config, reference, training, pairs, classifier, device=CPU)
    assert decision["order"] in ("sigma", "random") and _finite_map(used, training[0])


def test_a_map_with_non_finite_outputs_fails_the_check_in_one_line_under_fail(checked):
    config, h, reference, pairs, _, _ = checked
    with pytest.raises(MapCheckError) as error:
        check_map("fastfill", config.model_copy(update={"check": "fail"}), h, reference, pairs)
    message = str(error.value)
    assert message.startswith("map check failed: non-finite outputs") and "\n" not in message
    assert "align.fastfill.lr" in message


def test_a_diverged_row_is_reported_as_such_and_the_others_complete(tmp_path):
    reference, curves = tiny_curves()
    headline = {"fct": "random", "fastfill": "sigma"}
    per_seed_metrics, per_seed_curves = {}, {}
    for seed in ("0", "1"):
        by_method = dict(curves)
        if seed == "1":
            points = len(curves["fct"]["random"]["alpha"]) - 2
            by_method["fastfill"] = {o: diverged_curve(points, "diverged: its outputs are not finite")
                                     for o in curves["fastfill"]}
        per_seed_metrics[seed] = build_metrics(reference, by_method, headline, {})
        per_seed_curves[seed] = {"reference": reference, "curves": by_method}
    summary = summarize(per_seed_metrics, per_seed_curves, {}, headline)
    rows = summary["rows"]
    assert rows["fastfill (sigma)"]["diverged"] == ["1"] and math.isnan(rows["fastfill (sigma)"]["top1_auc"]["mean"])
    assert "diverged" not in rows["fct (random)"] and math.isfinite(rows["fct (random)"]["top1_auc"]["mean"])
    assert [label for label, _ in ranking(summary, "top1_auc")] == ["fct (random)"]
    table = comparison_markdown(summary)
    assert "**fastfill (sigma)** (diverged: seed 1)" in table and "left out, diverged: fastfill (sigma)" in table
    plot_comparison(tmp_path / "comparison.png", summary)
    assert (tmp_path / "comparison.png").is_file()
