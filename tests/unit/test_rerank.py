"""Candidate reranking (components/evaluation/rerank.py) against a literal reference: for every
query and curve point the whole list is built item by item, as the method describes it, and
scored; the product's counting must give the same curve. Integer features make exact distance
ties, so the tie rules are checked too."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fastfill.components.evaluation import per_query_curve
from fastfill.components.evaluation.rerank import (
    RerankVariant,
    candidate_gap,
    candidate_lists,
    depth_advice,
    query_driven_order,
    rerank_curves,
)


def _data(n=36, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    old = rng.integers(0, 3, (n, 5)).astype(np.float32)       # coarse: many exact ties
    new = (labels[:, None] == np.arange(classes)[None, :]) * 2.0 + rng.integers(0, 2, (n, classes))
    return old, new.astype(np.float32), labels


def _sq(a, b):
    a, b = a.astype(np.float64), b.astype(np.float64)
    return ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)


def _scores(ranked, positive):
    hits = [positive[c] for c in ranked]
    r = sum(hits)
    ap, found = 0.0, 0
    for position, hit in enumerate(hits, 1):
        if hit:
            found += 1
            ap += found / position
    return hits[0], any(hits[:5]), (ap / r if r else 0.0)


def _reference(old, new, labels, order, depth, sync, points):
    """(top1, top5, ap) per point, each ``(points, n)``, built literally."""
    n = len(labels)
    d_old, d_new = _sq(old, old), _sq(new, new)
    cuts = [(i * n) // (points - 1) for i in range(points)]
    out = np.zeros((3, points, n))
    for i in range(n):
        positive = labels == labels[i]
        others = [c for c in range(n) if c != i]
        ranked_old = sorted(others, key=lambda c: (d_old[i, c], positive[c], c))
        candidates, tail = ranked_old[:depth], ranked_old[depth:]
        for p, cut in enumerate(cuts):
            backfilled = set(order[:cut].tolist())
            scored, missing = [], 0
            for c in candidates:
                if c in backfilled:
                    scored.append(c)
                elif missing < sync:
                    missing += 1
                    scored.append(c)
            unscored = [c for c in candidates if c not in scored]
            place = {c: k for k, c in enumerate(candidates)}
            by_new = sorted(scored, key=lambda c: (d_new[i, c], positive[c], place[c]))
            out[:, p, i] = _scores(by_new + unscored + tail, positive)
    return out


@pytest.mark.parametrize(("depth", "sync"), [(1, 0), (5, 0), (5, 2), (12, 0), (12, 30), (35, 0)])
def test_curve_equals_the_literal_reference(depth, sync):
    old, new, labels = _data()
    order = np.random.default_rng(3).permutation(len(labels))
    variant = RerankVariant(depth, sync)
    top1, ap = rerank_curves(old, new, old, new, labels, order, variants=[variant], num_intermediate=4,
                             block_size=7, per_query=True)[variant]
    ref = _reference(old, new, labels, order, depth, sync, points=6)
    np.testing.assert_array_equal(top1, ref[0].astype(bool))
    np.testing.assert_allclose(ap, ref[2], rtol=0, atol=1e-12)
    curve = rerank_curves(old, new, old, new, labels, order, variants=[variant], num_intermediate=4,
                          block_size=5, workers=2)[variant]
    np.testing.assert_allclose(curve.top5, ref[1].mean(axis=1), atol=1e-12)
    np.testing.assert_allclose(curve.top1, ref[0].mean(axis=1), atol=1e-12)
    flips = (ref[0][0] == 1) & (ref[0] == 0)
    np.testing.assert_array_equal(curve.negative_flips, flips.sum(axis=1))


def test_one_pass_over_many_variants_equals_each_alone():
    old, new, labels = _data(n=30, seed=4)
    variants = [RerankVariant(3), RerankVariant(10), RerankVariant(10, 4)]
    together = rerank_curves(old, new, old, new, labels, variants=variants, num_intermediate=3)
    for v in variants:
        alone = rerank_curves(old, new, old, new, labels, variants=[v], num_intermediate=3)[v]
        np.testing.assert_array_equal(together[v].map, alone.map)
        np.testing.assert_array_equal(together[v].top1, alone.top1)


def test_ends_of_the_curve_are_old_old_and_the_full_depth_is_new_new():
    old, new, labels = _data(n=30, seed=5)
    n = len(labels)
    curves = rerank_curves(old, new, old, new, labels, variants=[RerankVariant(n - 1), RerankVariant(4)],
                           num_intermediate=2)
    old_top1, old_ap = per_query_curve(old, old, old, labels, num_intermediate=0)
    new_top1, new_ap = per_query_curve(new, new, new, labels, num_intermediate=0)
    for curve in curves.values():  # nothing backfilled, no budget: the old model's list
        assert curve.top1[0] == pytest.approx(old_top1[0].mean())
    full = curves[RerankVariant(n - 1)]  # every item a candidate, every item backfilled: new/new
    assert full.top1[-1] == pytest.approx(new_top1[-1].mean())
    assert full.map[-1] == pytest.approx(new_ap[-1].mean())


def test_candidate_lists_and_the_query_driven_order_follow_the_old_ranking():
    old, _, labels = _data(n=25, seed=6)
    d = _sq(old, old)
    lists = candidate_lists(old, old, 4, labels=labels)
    for i in range(len(labels)):
        positive = labels == labels[i]
        expected = sorted((c for c in range(len(labels)) if c != i), key=lambda c: (d[i, c], positive[c], c))[:4]
        assert lists[i].tolist() == expected
    order = query_driven_order(lists, seed=9)
    deeper = candidate_lists(old, old, 7, labels=labels)
    assert (deeper[:, :4] == lists).all()  # a shallower depth is the first columns of a deeper one
    assert sorted(order.tolist()) == list(range(len(labels)))
    stream = np.random.default_rng(9).permutation(len(labels))
    queued = []
    for q in stream:
        queued += [c for c in lists[q].tolist() if c not in queued]
    assert order[:len(queued)].tolist() == queued
    assert set(order[len(queued):].tolist()) == set(range(len(labels))) - set(queued)


def test_candidate_gap_is_zero_at_full_depth_and_counts_recall():
    old, new, labels = _data(n=30, seed=7)
    n = len(labels)
    unseen = labels >= 2
    gap = candidate_gap(old, new, old, new, labels, [2, n - 1], groups={"unseen": unseen})
    for group in ("all", "unseen"):
        assert gap[group]["by_depth"][n - 1]["gap"] == {"top1": pytest.approx(0.0), "map": pytest.approx(0.0)}
        assert gap[group]["by_depth"][n - 1]["recall"] == pytest.approx(1.0)
    assert gap["unseen"]["queries"] == int(unseen.sum())
    lists = candidate_lists(old, old, 2, labels=labels)
    sizes = np.bincount(labels)[labels] - 1
    recall = np.mean([(labels[lists[i]] == labels[i]).sum() / sizes[i] for i in range(n) if sizes[i]])
    assert gap["all"]["by_depth"][2]["recall"] == pytest.approx(recall)
    precision = np.mean([(labels[lists[i]] == labels[i]).sum() / 2 for i in range(n)])
    assert gap["all"]["by_depth"][2]["precision"] == pytest.approx(precision)
    new_top1, new_ap = per_query_curve(new, new, new, labels, num_intermediate=0)
    assert gap["unseen"]["native"]["map"] == pytest.approx(new_ap[-1][unseen].mean())


def test_depth_advice_labels():
    assert depth_advice({50: 0.005, 200: 0.0}, at=50) == {"label": "SAFE", "depth": 50, "at": 50, "epsilon": 0.01}
    assert depth_advice({50: 0.04, 200: 0.008}, at=50)["label"] == "EXPAND"
    assert depth_advice({50: 0.04, 200: 0.008}, at=50)["depth"] == 200
    assert depth_advice({50: 0.2, 200: 0.1}, at=50) == {"label": "UNSAFE", "depth": None, "at": 50, "epsilon": 0.01}
    with pytest.raises(ValueError, match="at least one"):
        depth_advice({}, at=50)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"variants": [RerankVariant(0)]}, r"candidate depth must be an integer in \[1, 19\]"),
    ({"variants": [RerankVariant(20)]}, r"candidate depth must be an integer in \[1, 19\]"),
    ({"variants": [RerankVariant(5, -1)]}, "max_sync_misses"),
    ({"variants": []}, "at least one candidate depth"),
    ({"block_size": 0, "variants": [RerankVariant(5)]}, "block_size"),
])
def test_bad_input_is_named(kwargs, message):
    old, new, labels = _data(n=20)
    with pytest.raises(ValueError, match=message):
        rerank_curves(old, new, old, new, labels, **kwargs)
    with pytest.raises(ValueError, match="query_new has 19 rows"):
        rerank_curves(old, new[:19], old, new[:19], labels)


def test_variant_names():
    assert [RerankVariant(*a).name for a in itertools.product([50, 200], [0, 4])] == [
        "k50", "k50_sync4", "k200", "k200_sync4"]


def test_counts_measure_at_given_numbers_of_backfilled_items():
    old, new, labels = _data(n=30, seed=8)
    order = np.random.default_rng(2).permutation(len(labels))
    v = RerankVariant(6, 1)
    even = rerank_curves(old, new, old, new, labels, order, variants=[v], num_intermediate=4)[v]
    cuts = [(i * 30) // 5 for i in range(6)]
    at = rerank_curves(old, new, old, new, labels, order, variants=[v], counts=cuts)[v]
    np.testing.assert_array_equal(at.top1, even.top1)
    np.testing.assert_array_equal(at.map, even.map)
    np.testing.assert_allclose(at.alphas, np.array(cuts) / 30)
    with pytest.raises(ValueError, match="non-decreasing"):
        rerank_curves(old, new, old, new, labels, order, variants=[v], counts=[10, 5])


def test_the_evaluation_stage_measures_each_spec_in_each_order(tmp_path):
    """fastfill.tasks.method_curves.rerank_curves_of on a stage layout: random from evaluate.seed,
    sigma from the named map's stored log_sigma2, query from a query-driven worker per depth."""
    from fastfill.components.evaluation.ordering import random_order, sigma_order
    from fastfill.components.platform.config import EvaluateConfig, RerankSpec
    from fastfill.tasks.method_curves import rerank_curves_of
    from tests.stage_layouts import evaluation_layout

    old, new, labels = _data(n=30, seed=10)
    log_sigma2 = np.random.default_rng(2).normal(size=30)
    layout = evaluation_layout(tmp_path, labels, old, new, log_sigma2=log_sigma2)

    config = EvaluateConfig(rerank=[RerankSpec(depth=5), RerankSpec(depth=9, sync=2)], curve_points=3, seed=4)
    curves = rerank_curves_of(config, layout)
    assert set(curves) == {"rerank_k5", "rerank_k9_sync2"}
    assert config.headlines["rerank_k9_sync2"] == "random"
    orders = {"random": random_order(30, 4), "sigma": sigma_order(log_sigma2),
              "query": query_driven_order(candidate_lists(old, old, 9, labels=labels), seed=4)}
    for name, order in orders.items():
        v = RerankVariant(9, 2)
        expected = rerank_curves(old, new, old, new, labels, order, variants=[v], num_intermediate=3)[v]
        assert curves["rerank_k9_sync2"][name]["top1"] == pytest.approx(expected.top1.tolist())
        assert curves["rerank_k9_sync2"][name]["map"] == pytest.approx(expected.map.tolist())


def test_the_advisors_way_equals_the_evaluation_when_the_sample_is_the_gallery():
    """The budget advisor's candidate-reranking way (target_advice.rerank_top1) predicts, with S
    the whole gallery, exactly the top-1 the evaluation measures at the same backfilled counts."""
    from fastfill.components.gallery.advice.target_advice import rerank_top1

    rng = np.random.default_rng(12)
    n, labels = 60, rng.integers(0, 4, 60)
    centers = rng.normal(size=(4, 6))
    old = (centers[labels] + 1.5 * rng.normal(size=(n, 6))).astype(np.float32)   # continuous: no ties
    new = (centers[labels] + 0.7 * rng.normal(size=(n, 6))).astype(np.float32)
    order = rng.permutation(n)
    ranks = np.empty(n, dtype=np.int64)
    ranks[order] = np.arange(n)
    predicted = rerank_top1(old, new, labels, ranks, n, depth=7)
    counts = [int(np.floor(f * n + 1e-9)) for f in predicted["fractions"]]
    v = RerankVariant(7)
    measured = rerank_curves(old, new, old, new, labels, order, variants=[v], counts=counts)[v]
    np.testing.assert_allclose(predicted["top1"], measured.top1, atol=1e-12)
