"""--target-top1: which way (the map in each order, or the shadow index) reaches a top-1 first."""

import numpy as np
import pytest

from components.evaluation.dual_curve import dual_curve
from components.gallery.advisor import ranks_of
from components.gallery.target_advice import compare_ways, first_reaching, shadow_top1, ways_to_target
from tests.gallery_cases import N, _gallery, make_data, make_models


def _clustered(n=120, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    centres_old, centres_new = rng.normal(size=(classes, 6)), rng.normal(size=(classes, 9))
    old = centres_old[labels] + 1.3 * rng.normal(size=(n, 6))   # the old model: classes overlap
    new = centres_new[labels] + 0.5 * rng.normal(size=(n, 9))   # the new model: far better
    return old.astype(np.float32), new.astype(np.float32), labels


@pytest.mark.parametrize("distance", ["l2", "cosine"])
def test_the_shadow_top1_is_the_evaluations_rrf_curve_when_the_sample_is_the_gallery(distance):
    old, new, labels = _clustered()
    order = np.random.default_rng(1).permutation(len(labels))
    predicted = shadow_top1(old, new, labels, ranks_of(order, np.arange(len(labels))), len(labels),
                            distance=distance)
    measured = dual_curve(old, new, old, new, labels, order, merge="rrf", distance=distance, num_intermediate=19)
    np.testing.assert_allclose(predicted["top1"], measured.top1, atol=1e-12)
    assert predicted["error_scale"] == 1.0


def test_the_old_anchor_scales_the_error_rate():
    old, new, labels = _clustered()
    ranks = np.arange(len(labels))
    plain = shadow_top1(old, new, labels, ranks, 10 * len(labels))
    anchor = np.zeros(len(labels), dtype=bool)
    anchor[: int(0.5 * len(labels))] = True  # the whole gallery's old/old top-1: 50%
    scaled = shadow_top1(old, new, labels, ranks, 10 * len(labels), anchor)
    assert scaled["top1"][0] == pytest.approx(0.5)
    error = 1 - np.asarray(plain["top1"])
    np.testing.assert_allclose(1 - np.asarray(scaled["top1"]), np.clip(error * scaled["error_scale"], 0, 1))


def test_the_way_that_reaches_the_target_with_the_least_backfill_wins():
    f = [0.0, 0.25, 0.5, 0.75, 1.0]
    ways = {"map, sigma order": {"fractions": f, "top1": [0.6, 0.8, 0.86, 0.88, 0.9], "items": 1000},
            "shadow index (rrf), random order": {"fractions": f, "top1": [0.5, 0.6, 0.75, 0.85, 0.92], "items": 1000},
            "map, random order": {"fractions": f, "top1": [0.6, 0.7, 0.8, 0.85, 0.9], "items": 1000}}
    result = compare_ways(0.85, ways)
    assert result["best"] == "map, sigma order"
    by = {w["way"]: w for w in result["ways"]}
    assert by["map, sigma order"]["fraction"] == 0.5 and by["map, sigma order"]["items"] == 500
    assert by["shadow index (rrf), random order"]["fraction"] == 0.75
    assert "map, sigma order reaches top-1 85.00% first: after 50%" in result["line"]
    high = compare_ways(0.91, ways)  # only the shadow index gets there
    assert high["best"] == "shadow index (rrf), random order" and first_reaching(ways["map, sigma order"], 0.91) is None
    never = compare_ways(0.95, ways)
    assert never["best"] is None and "no way reaches top-1 95.00%" in never["line"]


def test_every_allowed_way_on_a_stored_gallery(tmp_path):
    from components.experiment.inference import apply_alignment, embed

    models, data = make_models(), make_data()
    old, new, h = models
    gallery = _gallery(str(tmp_path / "store"), models, data)
    positions = np.arange(0, N, 2)
    queries = embed(new, data[0][positions])
    transformed, log_sigma2 = apply_alignment(h, gallery.all_features(gallery.model))
    weights = np.arange(N, dtype=np.float64) % 3

    result = ways_to_target(0.5, gallery, positions=positions, prefilled=positions, queries=queries,
                            old_side=gallery.all_features(gallery.model)[positions], sample_transformed=transformed[positions],
                            transformed_parts=lambda: iter([(0, transformed)]), log_sigma2=log_sigma2,
                            weights=weights, seed=0)
    names = [w["way"] for w in result["ways"]]
    assert names == ["map, sigma order", "map, usage_sigma order", "map, usage order", "map, random order",
                     "shadow index (rrf), random order", "shadow index (rrf), sigma order"]
    for way in result["ways"]:
        assert 0 <= way["top1_at_0"] <= 1 and 0 <= way["top1_full"] <= 1
    # the shadow index starts where the old model is, whatever its order
    at_0 = {w["way"]: w["top1_at_0"] for w in result["ways"]}
    assert at_0["shadow index (rrf), random order"] == at_0["shadow index (rrf), sigma order"]

    no_sigma = ways_to_target(0.5, gallery, positions=positions, prefilled=positions, queries=queries,
                              old_side=gallery.all_features(gallery.model)[positions], sample_transformed=transformed[positions],
                              transformed_parts=lambda: iter([(0, transformed)]), log_sigma2=None, weights=None, seed=0)
    assert [w["way"] for w in no_sigma["ways"]] == ["map, random order", "shadow index (rrf), random order"]


def test_the_option_is_checked_before_anything_runs():
    from typer.testing import CliRunner

    from cli import app

    runner = CliRunner()
    alone = runner.invoke(app, ["upgrade", "--target-top1", "85%"])
    assert alone.exit_code == 2 and "--target-top1 goes with --dry-run" in alone.output
    for bad in ("0", "120", "most"):
        result = runner.invoke(app, ["upgrade", "--dry-run", "--target-top1", bad])
        assert result.exit_code == 2 and f"--target-top1 {bad!r}" in result.output
