"""The map check's decision (map_check.decide_map) on tiny trained maps: a map that passes is
used, one that falls back is replaced by the l2-only map with a fitted head or by the l2-only map
alone (with the order each earns), the reference is trained when none is handed over, and the
cases the check skips say why."""

import copy

import numpy as np
import pytest
import torch

from fastfill.components.experiment.inference import apply_alignment
from fastfill.components.experiment.map_check import (
    MapCheckError,
    check_metrics,
    check_tags,
    decide_map,
    reference_config,
    skip_reason,
)
from fastfill.components.experiment.map_training import train_alignment
from fastfill.components.platform.config import AlignConfig

CPU = torch.device("cpu")


def _quiet(_):
    pass


def _config(**changes) -> AlignConfig:
    settings = dict(hidden=[16], epochs=8, warmup_epochs=1, batch_size=32, min_steps=0, disc=True, uncertainty=True,
                    validation_fraction=0.2, check="fallback")
    return AlignConfig(**{**settings, **changes})


@pytest.fixture(scope="module")
def trained():
    """Pairs (old 6-d, new 8-d, 5 classes), the new classifier, the l2-only reference and a
    FastFill map whose transform is zeroed (it retrieves far worse; its head still orders)."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 5, 400)
    centers = rng.normal(size=(5, 8)).astype(np.float32) * 3
    new = (centers[labels] + rng.normal(scale=0.4, size=(400, 8))).astype(np.float32)
    old = np.tanh(new @ np.random.default_rng(2).normal(size=(8, 6)).astype(np.float32))
    classifier = torch.nn.Linear(8, 5, bias=False)
    reference, _ = train_alignment(reference_config(_config()), old, new, labels, classifier, device=CPU, log=_quiet)
    broken, _ = train_alignment(_config(), old, new, labels, classifier, device=CPU, log=_quiet)
    with torch.no_grad():
        for parameter in broken.transform.parameters():
            parameter.zero_()
    return (old, new, labels), classifier, reference, broken


def _decide(trained, config, candidate=None, *, ready=True, **options):
    pairs, classifier, reference, broken = trained
    asked = []

    def given():
        asked.append(True)
        return reference if ready else None

    decision = decide_map("fastfill", config, broken if candidate is None else candidate, pairs, given, classifier,
                          device=CPU, **options)
    return decision, asked


def test_a_map_that_passes_is_used_with_its_order(trained):
    _, _, reference, _ = trained
    decision, asked = _decide(trained, _config(check_tolerance=1.0, check_confidence=0.0))
    assert asked and decision.use == "candidate" and decision.map is trained[3] and decision.order == "sigma"
    assert decision.record["passed"] and decision.record["action"] == "kept" and decision.skipped is None
    assert decision.reference is reference and not decision.reference_trained
    assert check_tags(decision.record)["check"] == "passed" and "fallback_order" not in decision.record


def test_warn_keeps_a_failed_map_and_fail_stops(trained):
    warned, _ = _decide(trained, _config(check="warn"))
    assert warned.use == "candidate" and not warned.record["passed"] and check_tags(warned.record)["check"] == "warned"
    with pytest.raises(MapCheckError):
        _decide(trained, _config(check="fail"))


def _diverged(trained):
    """The broken map with outputs that are not finite: it falls back under any tolerance."""
    candidate = copy.deepcopy(trained[3])
    with torch.no_grad():
        for parameter in candidate.transform.parameters():
            parameter.fill_(float("nan"))
    return candidate


def test_a_fallback_in_sigma_order_gets_the_reference_with_a_fitted_head(trained):
    """A map that diverged falls back; a tolerance wide enough for the sigma order against
    random keeps the fitted map, a map of the method, in sigma order."""
    _, _, reference, _ = trained
    config = _config(check_tolerance=1.0, check_confidence=0.0)
    decision, _ = _decide(trained, config, _diverged(trained), order="sigma")
    assert decision.record["action"] == "fallback" and decision.record["non_finite"]
    assert decision.use == "fitted" and decision.order == "sigma"
    assert decision.map is not reference and decision.map.uncertainty is not None and decision.config.uncertainty
    assert decision.record["fallback_order"]["order"] == "sigma"
    assert check_tags(decision.record)["fallback_order"] == "sigma"
    assert check_metrics(decision.record)["check.fallback.sigma_kept"] == 1.0
    old = trained[0][0]
    np.testing.assert_allclose(apply_alignment(decision.map, old, device=CPU)[0],
                               apply_alignment(reference, old, device=CPU)[0], atol=1e-6)


def test_a_fallback_whose_sigma_order_does_not_help_is_the_reference_in_random_order(trained):
    _, _, reference, _ = trained
    strict = _config().model_copy(update={"check_tolerance": -1.0})  # sigma must beat random by 100 points: never
    decision, _ = _decide(trained, strict)  # the method's own order: sigma
    assert decision.use == "reference" and decision.map is reference and decision.order == "random"
    assert decision.config == reference_config(strict) and not decision.config.uncertainty
    assert decision.record["fallback_order"]["order"] == "random"


def test_a_fallback_in_random_order_is_the_reference_without_a_head(trained):
    _, _, reference, _ = trained
    decision, _ = _decide(trained, _config(check_tolerance=1.0, check_confidence=0.0), _diverged(trained),
                          order="random")
    assert decision.record["action"] == "fallback" and decision.use == "reference" and decision.map is reference
    assert decision.order == "random" and "fallback_order" not in decision.record
    assert decision.config == reference_config(_config())


def test_without_a_ready_reference_the_check_trains_and_hands_it_over(trained):
    pairs, classifier, reference, _ = trained
    kept, said = [], []
    decision, asked = _decide(trained, _config(check_tolerance=1.0, check_confidence=0.0), ready=False,
                              keep_reference=kept.append, log=said.append, pairs_from="split")
    assert asked and decision.reference_trained and kept == [decision.reference]
    old = pairs[0]
    np.testing.assert_allclose(apply_alignment(decision.reference, old, device=CPU)[0],  # seeded: the same map
                               apply_alignment(reference, old, device=CPU)[0], atol=1e-5)
    assert any(line.startswith("map check: training the l2-only reference on the same 400 pairs (split)")
               for line in said)
    assert any(line.startswith("map check (fallback) on split: passed") for line in said)
    kept.clear()
    with pytest.raises(MapCheckError):  # a failed check still hands the trained reference over first
        _decide(trained, _config(check="fail"), ready=False, keep_reference=kept.append)
    assert len(kept) == 1


@pytest.mark.parametrize("changes, reason", [
    ({"check": "off"}, "align.fastfill.check is off"),
    ({"disc": False, "uncertainty": False}, "an l2-only map is the map check's own reference"),
    ({"validation_fraction": 0.0}, "align.fastfill.validation_fraction is 0"),
])
def test_the_skipped_cases_say_why_and_use_the_map(trained, changes, reason):
    config = _config(**changes)
    decision, asked = _decide(trained, config)
    assert decision.skipped == reason and decision.use == "candidate" and decision.map is trained[3]
    assert decision.record is None and decision.config is config and not asked
    assert skip_reason("fastfill", config) == (None if "validation_fraction" in changes else reason)


def test_an_l2_only_map_is_checked_when_asked(trained):
    """The upgrade checks an l2-only map too: a later upgrade may use it as the reference."""
    _, _, reference, _ = trained
    config = _config(disc=False, uncertainty=False, check_tolerance=1.0, check_confidence=0.0)
    assert skip_reason("fct", config, check_l2_only=True) is None
    decision, asked = _decide(trained, config, candidate=reference, check_l2_only=True, order="random")
    assert asked and decision.use == "candidate" and decision.record["passed"] and decision.order == "random"
