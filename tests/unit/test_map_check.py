"""The map check on tiny data: each policy, a deliberately broken map, the held-out split, the
step floor and the best epoch, and the uncertainty weightings."""

import numpy as np
import pytest
import torch

from fastfill.components.experiment.inference import apply_alignment
from fastfill.components.experiment.losses import uncertainty_objective, uncertainty_weighted
from fastfill.components.experiment.map_check import (
    MapCheckError,
    SideOutputs,
    check_map,
    check_metrics,
    check_tags,
    fallback_config,
    fallback_map,
    held_out,
    is_reference,
    judge,
    judge_order,
    reference_config,
)
from fastfill.components.experiment.map_training import feature_schedule, fit_uncertainty_head, train_alignment
from fastfill.components.experiment.map_validation import validation_split
from fastfill.components.platform.config import AlignConfig, ConfigError, parse_params
from testkit.tiny_demo import tiny_params

CPU = torch.device("cpu")


def _clustered(n=300, classes=5, d=8, seed=0):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    centers = rng.normal(size=(classes, d)).astype(np.float32) * 3
    new = (centers[labels] + rng.normal(scale=0.4, size=(n, d))).astype(np.float32)
    return new, labels


def _config(**changes) -> AlignConfig:
    settings = dict(hidden=[16], epochs=4, warmup_epochs=1, batch_size=32, min_steps=0, disc=True, uncertainty=True)
    return AlignConfig(**{**settings, **changes})


def _good_and_broken():
    new, labels = _clustered()
    good = SideOutputs(new + 0.05, new)  # transformed old features close to the new ones
    broken = SideOutputs(np.random.default_rng(1).normal(size=new.shape).astype(np.float32), new,
                         log_sigma2=np.zeros(len(new), dtype=np.float32))
    return good, broken, labels


def test_a_map_as_good_as_the_l2_map_passes():
    good, _, labels = _good_and_broken()
    result = judge("fastfill", _config(check="fail"), good, good, labels)
    assert result.passed and result.action == "kept"
    assert check_tags(result.to_dict())["check"] == "passed"


def test_fail_stops_with_both_numbers_and_what_to_try():
    good, broken, labels = _good_and_broken()
    with pytest.raises(MapCheckError) as error:
        judge("fastfill", _config(check="fail"), broken, good, labels)
    message = str(error.value)
    assert "fastfill (sigma order)" in message and "the l2-only map (random order)" in message
    assert message.count("top1_auc") >= 2 and "min_steps" in message and "check: fallback" in message


def test_fallback_and_warn_record_the_failure():
    good, broken, labels = _good_and_broken()
    fallback = judge("fastfill", _config(check="fallback"), broken, good, labels)
    assert not fallback.passed and fallback.action == "fallback"
    assert fallback.candidate["top1_auc"] < fallback.reference["top1_auc"]
    assert check_tags(fallback.to_dict())["check"] == "fallback"
    metrics = check_metrics(fallback.to_dict())
    assert metrics["check.passed"] == 0.0 and metrics["check.reference.top1_auc"] == fallback.reference["top1_auc"]
    warned = judge("fastfill", _config(check="warn"), broken, good, labels)
    assert not warned.passed and warned.action == "kept"
    assert check_tags(warned.to_dict())["check"] == "warned" and "keeps the map" in warned.message


def test_tolerance_lets_a_slightly_worse_map_pass():
    good, _, labels = _good_and_broken()
    rng = np.random.default_rng(3)
    worse = SideOutputs(good.gallery_old + rng.normal(scale=1.2, size=good.gallery_old.shape).astype(np.float32),
                        good.new_side)
    strict = judge("fct2", _config(uncertainty=False, check="warn"), worse, good, labels)
    assert not strict.passed
    gap = max(strict.reference["top1_auc"] - strict.candidate["top1_auc"],
              strict.reference["map_auc"] - strict.candidate["map_auc"])
    lenient = judge("fct2", _config(uncertainty=False, check="warn", check_tolerance=gap + 1e-6, check_confidence=0.0),
                    worse, good, labels)
    assert lenient.passed


def test_a_deliberately_broken_trained_map_is_caught_and_replaced():
    """Train the l2 map and a FastFill map on the same pairs, break the FastFill map's weights:
    fail raises, fallback hands back the l2 map with a fitted uncertainty head."""
    new, labels = _clustered(n=400)
    old = np.tanh(new @ np.random.default_rng(2).normal(size=(8, 6)).astype(np.float32))
    classifier = torch.nn.Linear(8, 5, bias=False)
    config = _config(epochs=8, check="fail", validation_fraction=0.2)
    reference, _ = train_alignment(reference_config(config), old, new, labels, classifier, device=CPU,
                                   log=lambda m: None)
    candidate, _ = train_alignment(config, old, new, labels, classifier, device=CPU, log=lambda m: None)
    with torch.no_grad():
        for parameter in candidate.transform.parameters():
            parameter.zero_()
    pairs = held_out(config, old, new, labels)
    assert len(pairs) == 80
    with pytest.raises(MapCheckError):
        check_map("fastfill", config, candidate, reference, pairs)
    result = check_map("fastfill", config.model_copy(update={"check": "fallback"}), candidate, reference, pairs)
    assert result.action == "fallback"
    used = fallback_config(config)
    fitted = fit_uncertainty_head(reference, used, old, new, labels, classifier, steps=50, device=CPU)
    transformed, log_sigma2 = apply_alignment(fitted, old, device=CPU)
    np.testing.assert_allclose(transformed, apply_alignment(reference, old, device=CPU)[0], atol=1e-6)
    assert log_sigma2 is not None and np.isfinite(log_sigma2).all() and log_sigma2.std() > 0
    # described as the network it is, so its registered version loads back (the fallback map is registered)
    from fastfill.components.experiment.models import build, describe

    rebuilt = build(describe(fitted))
    rebuilt.load_state_dict(fitted.state_dict())
    np.testing.assert_allclose(apply_alignment(rebuilt.eval(), old, device=CPU)[1], log_sigma2, atol=1e-6)


def _partly_broken(sigma_sign: float):
    """A map that sends 40% of the items onto other items' places (of any class); its log sigma^2
    is high on those items (sign +1: an informative head) or low on them (sign -1: a head that
    orders them last)."""
    new, labels = _clustered(n=400)
    rng = np.random.default_rng(5)
    broken = rng.random(len(new)) < 0.4
    gallery_old = np.where(broken[:, None], new[rng.permutation(len(new))], new + 0.05).astype(np.float32)
    log_sigma2 = (sigma_sign * broken + rng.normal(scale=0.01, size=len(new))).astype(np.float32)
    return SideOutputs(gallery_old, new, log_sigma2), labels


def test_an_informative_sigma_order_is_kept_and_a_misleading_one_gives_way_to_random():
    config = _config(check="fallback")
    helpful, labels = _partly_broken(+1.0)
    kept = judge_order("fastfill", config, helpful, labels)
    assert kept["order"] == "sigma" and "keeps its sigma order" in kept["message"]
    assert kept["sigma"]["top1_auc"] > kept["random"]["top1_auc"]
    misleading, labels = _partly_broken(-1.0)
    dropped = judge_order("fastfill", config, misleading, labels)
    assert dropped["order"] == "random" and "random order (FCT)" in dropped["message"]
    assert dropped["sigma"]["top1_auc"] < dropped["random"]["top1_auc"]
    assert dropped["sigma"]["top1_auc_support"] < config.check_confidence


def test_the_fallback_order_is_recorded_in_tags_metrics_and_the_summary():
    from fastfill.components.evaluation.reports import check_summary

    good, broken, labels = _good_and_broken()
    record = judge("fastfill", _config(check="fallback"), broken, good, labels).to_dict()
    misleading, labels = _partly_broken(-1.0)
    record["fallback_order"] = judge_order("fastfill", _config(check="fallback"), misleading, labels)
    assert check_tags(record)["fallback_order"] == "random"
    metrics = check_metrics(record)
    assert metrics["check.fallback.sigma_kept"] == 0.0
    assert metrics["check.fallback.sigma_top1_auc"] == record["fallback_order"]["sigma"]["top1_auc"]
    assert check_summary(record)["fallback_order"] == "random"


def test_a_fallback_map_without_a_helpful_head_is_the_l2_map_in_random_order():
    """fallback_map on trained maps: the l2 map with a fitted head (sigma kept) or the l2 map
    alone (random), whichever the held-out pairs support; an l2-only method gets no head."""
    new, labels = _clustered(n=400)
    old = np.tanh(new @ np.random.default_rng(2).normal(size=(8, 6)).astype(np.float32))
    classifier = torch.nn.Linear(8, 5, bias=False)
    config = _config(epochs=8, check="fallback", validation_fraction=0.2)
    reference, _ = train_alignment(reference_config(config), old, new, labels, classifier, device=CPU,
                                   log=lambda m: None)
    pairs = held_out(config, old, new, labels)
    used, used_config, decision = fallback_map("fastfill", config, reference, (old, new, labels), pairs, classifier,
                                               device=CPU)
    assert decision["order"] in ("sigma", "random")
    if decision["order"] == "sigma":
        assert used is not reference and used_config.uncertainty and used.uncertainty is not None
    else:
        assert used is reference and not used_config.uncertainty
    strict = config.model_copy(update={"check_tolerance": -1.0})  # sigma must beat random by 100 points: never
    used, used_config, decision = fallback_map("fastfill", strict, reference, (old, new, labels), pairs, classifier,
                                               device=CPU)
    assert decision["order"] == "random" and used is reference and not used_config.uncertainty
    plain = _config(check="fallback", uncertainty=False, validation_fraction=0.2)
    used, used_config, decision = fallback_map("l2_disc", plain, reference, (old, new, labels), pairs, classifier,
                                               device=CPU)
    assert decision is None and used is reference


def test_l2_only_mlp_is_its_own_reference():
    assert is_reference(AlignConfig(hidden=[16]))
    assert not is_reference(_config())
    assert not is_reference(AlignConfig(architecture="rbt"))
    reference = reference_config(_config(lr=1e-3, seed=4))
    assert (reference.l2, reference.disc, reference.uncertainty) == (True, False, False)
    assert (reference.lr, reference.seed, reference.hidden, reference.min_steps) == (1e-3, 4, [16], 0)


def test_validation_split_is_seeded_disjoint_and_checked():
    train, val = validation_split(1000, 0.1, seed=3)
    assert len(val) == 100 and len(train) == 900 and not set(train) & set(val)
    np.testing.assert_array_equal(val, validation_split(1000, 0.1, seed=3)[1])
    assert not np.array_equal(val, validation_split(1000, 0.1, seed=4)[1])
    assert len(validation_split(50, 0.0, seed=0)[1]) == 0
    with pytest.raises(ValueError, match="align.fastfill.validation_fraction = 0.1 holds out 5 of 50"):
        validation_split(50, 0.1, seed=0, key="align.fastfill.validation_fraction")


def test_min_steps_extends_small_data_and_the_best_epoch_is_kept():
    config = _config(epochs=5, min_steps=60, batch_size=50, validation_fraction=0.2)
    assert feature_schedule(config, 100)["epochs"] == 30  # 2 steps an epoch
    assert feature_schedule(config, 10_000)["epochs"] == 5
    new, labels = _clustered(n=125)
    old = new[:, :6].copy()
    h, history = train_alignment(config, old, new, labels, torch.nn.Linear(8, 5, bias=False), device=CPU,
                                 log=lambda m: None)
    assert history[-1]["step"] == 60 and len(history) == 30
    best = [r for r in history if r.get("best")]
    assert len(best) == 1 and {"val_l2", "val_disc", "val_top1", "val_map"} <= set(best[0])
    measured = [r for r in history if "val_top1" in r]
    assert best[0]["val_top1"] + best[0]["val_map"] == max(r["val_top1"] + r["val_map"] for r in measured)


def test_uncertainty_weightings_by_hand():
    loss = torch.tensor([4.0, 1.0], requires_grad=True)
    s = torch.tensor([1.0, 0.0], requires_grad=True)
    joint = uncertainty_objective(loss, s, weighting="joint")
    assert joint.item() == pytest.approx(uncertainty_weighted(loss, s).mean().item())
    # normalized: the map's gradient is 0.5 * w_i / n with w = exp(-s) / mean(exp(-s))
    uncertainty_objective(loss, s, weighting="normalized").backward()
    w = np.exp([-1.0, 0.0])
    w /= w.mean()
    np.testing.assert_allclose(loss.grad.numpy(), 0.5 * w / 2, rtol=1e-6)
    # psi's gradient is the one of its own term on the detached loss: 0.5 (1 - exp(-s) L) / n
    np.testing.assert_allclose(s.grad.numpy(), 0.5 * (1 - np.exp([-1.0, 0.0]) * [4.0, 1.0]) / 2, rtol=1e-6)
    loss.grad = None
    uncertainty_objective(loss, s.detach(), weighting="detached").backward()
    np.testing.assert_allclose(loss.grad.numpy(), [0.25, 0.25])
    loss.grad = None
    uncertainty_objective(loss, s.detach(), weighting="joint", warm=True).backward()
    np.testing.assert_allclose(loss.grad.numpy(), [0.25, 0.25])
    with pytest.raises(ValueError, match="uncertainty weighting"):
        uncertainty_objective(loss, s, weighting="other")


def _params_with(**sections):
    data = tiny_params("/nonexistent")
    for dotted, value in sections.items():
        node = data
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node[key]
        node[leaf] = value
    return parse_params(data)


@pytest.mark.parametrize("change, message", [
    ({"align__fastfill__check": "ignore"}, "align.fastfill.check"),
    ({"align__fastfill__validation_fraction": 1.0}, "align.fastfill.validation_fraction"),
    ({"prepare__unseen_classes": []}, "prepare.unseen_classes is empty"),
    ({"prepare__unseen_classes": [2, 5]}, "overlap in [2]"),
])
def test_bad_settings_name_the_key(change, message):
    with pytest.raises(ConfigError) as error:
        _params_with(**change)
    assert message in str(error.value)


def test_per_query_scores_average_to_the_curve_numbers():
    """The per-query scores the check's bootstrap resamples average to the curve numbers."""
    from fastfill.components.experiment.map_check import curve_numbers
    from fastfill.components.experiment.map_judging import _measured

    new, labels = _clustered(n=120, classes=6)
    rng = np.random.default_rng(4)
    side = SideOutputs(new + rng.normal(scale=1.5, size=new.shape).astype(np.float32), new,
                       rng.normal(size=len(new)).astype(np.float32))
    labels = labels.copy()
    labels[0] = 99  # a query without a positive: a top-1 failure, left out of mAP
    for order in ("sigma", "random"):
        for distance in ("l2", "cosine"):
            numbers = curve_numbers(side, labels, order, 3, distance)
            _, (top1, precision) = _measured(side, order, labels, 3, distance)
            assert len(top1) == 120 and len(precision) == 119 and top1[0] == 0
            assert top1.mean() == pytest.approx(numbers["top1_auc"], abs=1e-9)
            assert precision.mean() == pytest.approx(numbers["map_auc"], abs=1e-9)


def test_weak_evidence_falls_back_and_strong_evidence_passes():
    """A map ahead by a hair on few pairs is not shown to be as good at 90% confidence: the
    bootstrap support names it; the same map with confidence 0 (the plain comparison) passes."""
    new, labels = _clustered(n=60, classes=5, seed=5)
    rng = np.random.default_rng(18)
    reference = SideOutputs(new + rng.normal(scale=4.0, size=new.shape).astype(np.float32), new)
    candidate = SideOutputs(new + rng.normal(scale=4.0, size=new.shape).astype(np.float32), new)
    plain = judge("fct2", _config(uncertainty=False, check="warn", check_confidence=0.0), candidate, reference, labels)
    strict = judge("fct2", _config(uncertainty=False, check="warn"), candidate, reference, labels)
    supports = [strict.candidate[f"{key}_support"] for key in ("top1_auc", "map_auc")]
    assert min(supports) < 0.9 and not strict.passed and "bootstrap" in strict.message
    assert plain.candidate["top1_auc"] >= plain.reference["top1_auc"] and plain.passed
    good = SideOutputs(new + 0.05, new)
    clear = judge("fct2", _config(uncertainty=False, check="fail"), good, reference, labels)
    assert clear.passed and min(clear.candidate["top1_auc_support"], clear.candidate["map_auc_support"]) == 1.0


def test_the_check_reports_the_backfill_curve_numbers():
    """judge ranks each side once, per query; the numbers it reports are curve_numbers'."""
    from fastfill.components.experiment.map_check import curve_numbers

    good, broken, labels = _good_and_broken()
    result = judge("fastfill", _config(check="warn"), broken, good, labels)
    for side, name, order in ((broken, "candidate", "sigma"), (good, "reference", "random")):
        expected = curve_numbers(side, labels, order, 0)
        for key in ("top1_0", "map_0", "top1_auc", "map_auc"):
            assert getattr(result, name)[key] == pytest.approx(expected[key], abs=1e-9)
