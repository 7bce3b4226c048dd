"""--target-top1: which way (the map in each order, the shadow index, candidate reranking) reaches
a top-1 first."""

import numpy as np
import pytest

from fastfill.components.evaluation.dual_curve import dual_curve
from fastfill.components.gallery.advice.advisor import ranks_of
from fastfill.components.gallery.advice.target_advice import (
    compare_ways,
    first_reaching,
    rerank_top1,
    sample_depth,
    shadow_top1,
    ways_to_target,
)
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
    from fastfill.components.experiment.inference import apply_alignment, embed

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
                     "shadow index (rrf), random order", "candidate reranking (K=50), random order",
                     "shadow index (rrf), usage order", "candidate reranking (K=50), usage order",
                     "shadow index (rrf), sigma order", "candidate reranking (K=50), sigma order"]
    for way in result["ways"]:
        assert 0 <= way["top1_at_0"] <= 1 and 0 <= way["top1_full"] <= 1
    # the shadow index starts where the old model is, whatever its order
    at_0 = {w["way"]: w["top1_at_0"] for w in result["ways"]}
    assert at_0["shadow index (rrf), random order"] == at_0["shadow index (rrf), sigma order"] \
        == at_0["shadow index (rrf), usage order"]
    # so does candidate reranking: at 0% both are the old model alone, scaled by the same anchor
    for kind in ("random", "usage", "sigma"):
        assert at_0[f"candidate reranking (K=50), {kind} order"] == pytest.approx(at_0["shadow index (rrf), random order"])

    no_sigma = ways_to_target(0.5, gallery, positions=positions, prefilled=positions, queries=queries,
                              old_side=gallery.all_features(gallery.model)[positions], sample_transformed=transformed[positions],
                              transformed_parts=lambda: iter([(0, transformed)]), log_sigma2=None, weights=None, seed=0)
    assert [w["way"] for w in no_sigma["ways"]] == ["map, random order", "shadow index (rrf), random order",
                                                    "candidate reranking (K=50), random order"]
    deep = ways_to_target(0.5, gallery, positions=positions, prefilled=positions, queries=queries,
                          old_side=gallery.all_features(gallery.model)[positions], sample_transformed=transformed[positions],
                          transformed_parts=lambda: iter([(0, transformed)]), log_sigma2=None, weights=None, seed=0,
                          rerank_depth=200)
    assert [w["way"] for w in deep["ways"]][-1] == "candidate reranking (K=200), random order"


def _ways_inputs(gallery, models, data):
    from fastfill.components.experiment.inference import apply_alignment, embed

    positions = np.arange(0, N, 2)
    stored = gallery.all_features(gallery.model)
    transformed, log_sigma2 = apply_alignment(models[2], stored)
    return dict(positions=positions, prefilled=positions, queries=embed(models[1], data[0][positions]),
                old_side=stored[positions], sample_transformed=transformed[positions],
                transformed_parts=lambda: iter([(0, transformed)]), log_sigma2=log_sigma2,
                weights=np.arange(N, dtype=np.float64) % 3, seed=0)


def _judged_by_label(labels, positions, source="by label"):
    """Judgments that call relevant every other gallery item of the query's label: the labels' truth."""
    from fastfill.components.gallery.inputs.judgments import Judgments

    relevant = [np.flatnonzero((labels == labels[p]) & (np.arange(len(labels)) != p)) for p in positions]
    return Judgments(source, np.asarray(positions, dtype=np.int64), [None] * len(positions), relevant)


def test_judged_queries_that_say_what_the_labels_say_compare_the_ways_as_the_labels_do(tmp_path):
    from fastfill.components.gallery.layouts.catalog import PartsGallery, ingest
    from fastfill.components.gallery.store import open_store
    from tests.gallery_cases import OLD

    models, data = make_models(), make_data()
    labeled = _gallery(str(tmp_path / "labeled"), models, data)
    inputs = _ways_inputs(labeled, models, data)
    judged = (_judged_by_label(data[1], inputs["positions"]), inputs["queries"], inputs["old_side"])
    by_labels = ways_to_target(0.5, labeled, **inputs)
    # a team's gallery: the same items without labels, its judged queries the truth
    ingest(open_store(str(tmp_path / "team")), data[0], labeled.all_features(labeled.model), OLD,
           ids=np.arange(N) + 1000, part_size=10)
    team = PartsGallery(open_store(str(tmp_path / "team")))
    assert team.labels() is None
    by_judgments = ways_to_target(0.5, team, **inputs, judged=judged)
    assert by_labels["truth"] == "labels" and by_judgments["truth"] == "judgments"
    assert [w["way"] for w in by_judgments["ways"]] == [w["way"] for w in by_labels["ways"]]
    for mine, theirs in zip(by_judgments["ways"], by_labels["ways"]):
        assert mine["top1_at_0"] == pytest.approx(theirs["top1_at_0"], abs=1e-12), mine["way"]
        assert mine["top1_full"] == pytest.approx(theirs["top1_full"], abs=1e-12), mine["way"]
        assert mine["fraction"] == theirs["fraction"], mine["way"]
    assert by_judgments["best"] == by_labels["best"]

    neither = ways_to_target(0.5, team, **inputs)
    assert "needs judged queries (--judgments) or the gallery's labels" in neither["note"]
    # judgments with no relevant item in the sample cannot compare the ways: said, not guessed
    outside = _judged_by_label(data[1], inputs["positions"])
    outside.relevant = [np.array([1]) for _ in outside.relevant]  # item 1 is not in the sample (even places)
    sparse = ways_to_target(0.5, team, **inputs, judged=(outside, inputs["queries"], inputs["old_side"]))
    assert "at least 2 judged queries with a relevant item in the evaluation sample" in sparse["note"]


def test_the_judged_shadow_top1_follows_the_judgments_not_the_labels():
    from fastfill.components.gallery.advice.target_advice import shadow_top1_judged

    old, new, labels = _clustered(n=60)
    order = np.random.default_rng(2).permutation(60)
    positions, ranks = np.arange(60), ranks_of(order, np.arange(60))
    truth = _judged_by_label(labels, positions)
    # judge each query's true class wrong: every label-hit becomes a miss
    flipped = _judged_by_label((labels + 1) % 4, positions)
    flipped.relevant = [np.flatnonzero(labels == (labels[p] + 1) % 4) for p in positions]
    right = shadow_top1_judged(old, new, truth, positions, old, new, ranks, 60, np.ones(60, bool))
    wrong = shadow_top1_judged(old, new, flipped, positions, old, new, ranks, 60, np.ones(60, bool))
    by_label = shadow_top1(old, new, labels, ranks, 60)
    np.testing.assert_allclose(right["sample_top1"], by_label["sample_top1"], atol=1e-12)
    assert max(wrong["sample_top1"]) < min(right["sample_top1"])
    assert right["queries"] == 60 and right["queries_left_out"] == 0


def _rerank_reference(old, new, labels, ranks, num_items, depth, step=0.05):
    """Candidate reranking's top-1 on S written out, query by query: the old top K_S of the other
    items (K_S = max(1, round(depth * m / num_items))), the nearest re-embedded one of them by new
    distance (the first in old order at a tie), else the old nearest; per point, the share of hits.
    An S item counts as re-embedded at f when its place is below N (1 - (1 - f)^(N/m)): it stands
    for N/m of the gallery's candidates, any of which improves the answer."""
    m = len(labels)
    k_s = max(1, round(depth * m / num_items))
    d_old = ((old[:, None, :].astype(np.float64) - old[None]) ** 2).sum(-1)
    d_new = ((new[:, None, :].astype(np.float64) - new[None]) ** 2).sum(-1)
    curve = []
    for f in np.arange(int(round(1 / step)) + 1) * step:
        done = int(np.floor(round((1 - (1 - f) ** (max(num_items, m) / m)) * num_items, 9)))
        hits = 0
        for i in range(m):
            others = [j for j in np.argsort(d_old[i], kind="stable") if j != i]
            candidates = others[:k_s]
            embedded = [j for j in candidates if ranks[j] < done]
            pick = min(embedded, key=lambda j: d_new[i, j]) if embedded else candidates[0]
            hits += labels[pick] == labels[i]
        curve.append(hits / m)
    return np.array(curve)


@pytest.mark.parametrize("depth, num_items", [(5, 60), (50, 60), (40, 400), (1, 60)])
def test_rerank_top1_is_its_literal_reference_query_by_query(depth, num_items):
    old, new, labels = _clustered(n=60)
    order = np.random.default_rng(3).permutation(num_items)
    ranks = ranks_of(order, np.arange(60))  # S: the first 60 items of a gallery of num_items
    predicted = rerank_top1(old, new, labels, ranks, num_items, depth=depth)
    expected = _rerank_reference(old, new, labels, ranks, num_items, depth)
    np.testing.assert_allclose(predicted["sample_top1"], expected, atol=1e-12)
    np.testing.assert_allclose(predicted["top1"], expected, atol=1e-12)  # no anchor: nothing scaled
    assert predicted["way"] == f"candidate reranking (K={depth})" and predicted["depth"] == depth
    assert predicted["sample_depth"] == min(59, max(1, round(depth * 60 / num_items))) == \
        min(59, sample_depth(depth, 60, num_items))
    # at 0% it is the old model alone: the shadow index's start; with an anchor, scaled as the shadow index is
    shadow = shadow_top1(old, new, labels, ranks, num_items)
    assert predicted["top1"][0] == pytest.approx(shadow["top1"][0])
    anchor = np.arange(60) < 45
    scaled = rerank_top1(old, new, labels, ranks, 10 * num_items, anchor, depth=depth)
    assert scaled["error_scale"] == pytest.approx(shadow_top1(old, new, labels, ranks, 10 * num_items,
                                                              anchor)["error_scale"])
    assert scaled["top1"][0] == pytest.approx(0.75)


def test_rerank_as_deep_as_the_gallery_is_the_new_model_once_everything_is_re_embedded():
    old, new, labels = _clustered(n=80)
    ranks = ranks_of(np.random.default_rng(4).permutation(80), np.arange(80))
    for depth in (80, 500):
        predicted = rerank_top1(old, new, labels, ranks, 80, depth=depth)
        d_new = ((new[:, None, :].astype(np.float64) - new[None]) ** 2).sum(-1)
        np.fill_diagonal(d_new, np.inf)
        new_alone = float(np.mean(labels[d_new.argmin(axis=1)] == labels))
        assert predicted["top1"][-1] == pytest.approx(new_alone)
        assert predicted["top1"][-1] == pytest.approx(shadow_top1(old, new, labels, ranks, 80)["top1"][-1])
    shallow = rerank_top1(old, new, labels, ranks, 80, depth=1)  # K = 1: the old nearest, re-embedded or not
    assert shallow["top1"] == pytest.approx([shallow["top1"][0]] * len(shallow["top1"]))
    with pytest.raises(ValueError, match="candidate depth"):
        rerank_top1(old, new, labels, ranks, 80, depth=0)


def test_the_judged_rerank_top1_is_the_labeled_one_when_the_judgments_say_what_the_labels_say():
    from fastfill.components.gallery.advice.target_advice import rerank_top1_judged

    old, new, labels = _clustered(n=60)
    positions, ranks = np.arange(60), ranks_of(np.random.default_rng(5).permutation(60), np.arange(60))
    judged = rerank_top1_judged(old, new, _judged_by_label(labels, positions), positions, old, new, ranks, 60,
                                np.ones(60, bool), depth=12)
    by_label = rerank_top1(old, new, labels, ranks, 60, depth=12)
    np.testing.assert_allclose(judged["sample_top1"], by_label["sample_top1"], atol=1e-12)
    assert judged["truth"] == "judgments" and judged["queries"] == 60 and judged["sample_depth"] == 12


def test_the_option_is_checked_before_anything_runs():
    from typer.testing import CliRunner

    from fastfill.cli import app

    runner = CliRunner()
    alone = runner.invoke(app, ["upgrade", "--target-top1", "85%"])
    assert alone.exit_code == 2 and "--target-top1 goes with --dry-run" in alone.output
    for bad in ("0", "120", "most"):
        result = runner.invoke(app, ["upgrade", "--dry-run", "--target-top1", bad])
        assert result.exit_code == 2 and f"--target-top1 {bad!r}" in result.output
