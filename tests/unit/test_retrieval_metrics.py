"""Retrieval metrics and backfill curves against a brute-force reference.

The reference ranks each query's gallery with a Python sort on (distance, is_positive), so a
negative precedes a positive at exactly equal distance, and takes CMC and AP straight from
their definitions. Distances come from ``pairwise_distances`` on an explicitly built mixed
gallery, so both sides rank identical float32 values; what is tested is the ranking, the
self exclusion, the backfill mixing and the aggregation.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from fastfill.components.evaluation import (
    ALPHA_POINTS_DEFAULT,
    BackfillCurve,
    backfill_curve,
    curve_alphas,
    pairwise_distances,
    retrieval_metrics,
)

# ---------------------------------------------------------------------------------------------
# Brute-force reference


def reference_point(query, gallery, labels, distance):
    """Per-query top-1 hit, top-5 hit and AP (None without positives), self excluded."""
    dist = pairwise_distances(query, gallery, distance).astype(np.float64)
    n = len(labels)
    top1, top5, aps = [], [], []
    for i in range(n):
        items = [(dist[i, j], labels[j] == labels[i]) for j in range(n) if j != i]
        # False < True: at equal distance the negative comes first (pessimistic).
        ranked = [is_pos for _, is_pos in sorted(items, key=lambda item: (item[0], item[1]))]
        top1.append(bool(ranked[0]))
        top5.append(any(ranked[:5]))
        num_pos = sum(ranked)
        if num_pos == 0:
            aps.append(None)
            continue
        precisions, seen = [], 0
        for rank, is_pos in enumerate(ranked, start=1):
            if is_pos:
                seen += 1
                precisions.append(seen / rank)
        aps.append(sum(precisions) / num_pos)
    return top1, top5, aps


def reference_curve(query, gallery_new, gallery_old, labels, order, distance, num_intermediate):
    n = len(labels)
    alphas = [i / (num_intermediate + 1) for i in range(num_intermediate + 2)]
    points = []
    for alpha in alphas:
        backfilled = set(order[: int(np.floor(alpha * n + 1e-9))].tolist())
        mixed = np.stack(
            [gallery_new[j] if j in backfilled else gallery_old[j] for j in range(n)]
        )
        points.append(reference_point(query, mixed, labels, distance))
    start = points[0][0]
    out = {key: [] for key in ("top1", "top5", "map", "nfr1", "pfr1", "nf", "pf")}
    for top1, top5, aps in points:
        valid = [ap for ap in aps if ap is not None]
        out["top1"].append(sum(top1) / n)
        out["top5"].append(sum(top5) / n)
        out["map"].append(sum(valid) / len(valid) if valid else 0.0)
        nf = sum(1 for s, c in zip(start, top1) if s and not c)
        pf = sum(1 for s, c in zip(start, top1) if not s and c)
        out["nf"].append(nf)
        out["pf"].append(pf)
        out["nfr1"].append(nf / sum(start) if sum(start) else 0.0)
        out["pfr1"].append(pf / (n - sum(start)) if n - sum(start) else 0.0)
    return np.array(alphas), {key: np.array(value) for key, value in out.items()}


def assert_matches_reference(curve, query, gallery_new, gallery_old, labels, order, distance,
                             num_intermediate):
    alphas, ref = reference_curve(query, gallery_new, gallery_old, labels, order, distance,
                                  num_intermediate)
    np.testing.assert_allclose(curve.alphas, alphas, rtol=0, atol=1e-15)
    for name in ("top1", "top5", "map", "nfr1", "pfr1"):
        np.testing.assert_allclose(getattr(curve, name), ref[name], rtol=0, atol=1e-12,
                                   err_msg=name)
    np.testing.assert_array_equal(curve.negative_flips, ref["nf"])
    np.testing.assert_array_equal(curve.positive_flips, ref["pf"])


def assert_same_curve(actual, expected):
    """Equal up to float summation order: counts exactly, rates and means to 1e-12."""
    a, e = actual.to_dict(), expected.to_dict()
    assert a.keys() == e.keys()
    for key in a:
        if key in ("negative_flips", "positive_flips"):
            assert a[key] == e[key], key
        else:
            np.testing.assert_allclose(a[key], e[key], rtol=0, atol=1e-12, err_msg=key)


def random_case(seed, n=60, d=4, num_classes=4):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, n)
    centers = rng.standard_normal((num_classes, d))
    query = centers[labels] + rng.standard_normal((n, d))
    gallery_new = centers[labels] + rng.standard_normal((n, d))
    gallery_old = centers[labels] + 1.5 * rng.standard_normal((n, d))
    order = rng.permutation(n)
    return [x.astype(np.float32) for x in (query, gallery_new, gallery_old)] + [labels, order]


def tied_case(seed, n=60, d=3, num_classes=3):
    """Small-integer features: many exactly equal distances, computed exactly in float32."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, n)
    query = rng.integers(-2, 3, (n, d)).astype(np.float32)
    gallery_new = rng.integers(-2, 3, (n, d)).astype(np.float32)
    gallery_old = rng.integers(-2, 3, (n, d)).astype(np.float32)
    # Duplicated rows: identical features under different labels tie exactly.
    gallery_new[n // 2:] = gallery_new[: n - n // 2]
    gallery_old[1::3] = query[1::3]
    return [query, gallery_new, gallery_old, labels, rng.permutation(n)]


# ---------------------------------------------------------------------------------------------
# Against the reference


@pytest.mark.parametrize("distance", ["l2", "cosine"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_curve_matches_brute_force(seed, distance):
    query, gallery_new, gallery_old, labels, order = random_case(seed, num_classes=3 + seed)
    curve = backfill_curve(query, gallery_new, gallery_old, labels, order, distance=distance,
                           num_intermediate=4)
    assert_matches_reference(curve, query, gallery_new, gallery_old, labels, order, distance, 4)


@pytest.mark.parametrize("distance", ["l2", "cosine"])
@pytest.mark.parametrize("seed", [0, 1])
def test_curve_with_ties_matches_brute_force(seed, distance):
    query, gallery_new, gallery_old, labels, order = tied_case(seed)
    # Small blocks and two workers: several blocks, several chunks, merged totals.
    curve = backfill_curve(query, gallery_new, gallery_old, labels, order, distance=distance,
                           num_intermediate=3, block_size=7, workers=2)
    assert_matches_reference(curve, query, gallery_new, gallery_old, labels, order, distance, 3)


def test_ties_really_occur_between_positives_and_negatives():
    query, _, gallery_old, labels, _ = tied_case(0)
    dist = pairwise_distances(query, gallery_old)
    tied_pairs = 0
    for i in range(len(labels)):
        others = np.arange(len(labels)) != i
        pos = set(dist[i, others & (labels == labels[i])].tolist())
        neg = set(dist[i, others & (labels != labels[i])].tolist())
        tied_pairs += len(pos & neg)
    assert tied_pairs > 50


def test_default_curve_has_22_points_and_matches_brute_force():
    query, gallery_new, gallery_old, labels, order = random_case(7, n=45)
    curve = backfill_curve(query, gallery_new, gallery_old, labels, order)
    assert curve.alphas.shape == (ALPHA_POINTS_DEFAULT + 2,)
    assert_matches_reference(curve, query, gallery_new, gallery_old, labels, order, "l2",
                             ALPHA_POINTS_DEFAULT)


def test_block_size_and_workers_do_not_change_the_result():
    query, gallery_new, gallery_old, labels, order = tied_case(3, n=90)
    reference = backfill_curve(query, gallery_new, gallery_old, labels, order, workers=1)
    for block_size, workers in [(1, 1), (13, 2), (64, 3)]:
        curve = backfill_curve(query, gallery_new, gallery_old, labels, order,
                               block_size=block_size, workers=workers)
        assert_same_curve(curve, reference)


# ---------------------------------------------------------------------------------------------
# Hand-computed and structural checks


def test_four_points_on_a_line():
    # Squared distances: item 2 (x=3) has item 1 at 4, then items 0 and 3 tied at 9. Item 3
    # shares its label, item 0 does not: the negative ranks first, so item 2's positive is at
    # rank 3 (AP 1/3, top-1 miss, top-5 hit). Every other query finds its positive first.
    x = np.array([[0.0], [1.0], [3.0], [6.0]], dtype=np.float32)
    labels = np.array([0, 0, 1, 1])
    metrics = retrieval_metrics(x, x, labels)
    assert metrics["top1"] == pytest.approx(3 / 4)
    assert metrics["top5"] == pytest.approx(1.0)
    assert metrics["map"] == pytest.approx((1 + 1 + 1 / 3 + 1) / 4)


def test_tie_rule_is_pessimistic_and_index_order_free():
    # The query at 0 has a positive and a negative at the same distance, in both index orders.
    x = np.array([[0.0], [1.0], [-1.0]], dtype=np.float32)
    for labels in (np.array([0, 0, 1]), np.array([0, 1, 0])):
        metrics = retrieval_metrics(x, x, labels)
        # Query 0: negative first, positive at rank 2 -> miss, AP 1/2. The other labelled-0
        # query sees query 0 first (distance 1), the lone label-1 item has no positive.
        assert metrics["top1"] == pytest.approx(1 / 3)
        assert metrics["map"] == pytest.approx((1 / 2 + 1) / 2)


def test_metrics_do_not_depend_on_image_order():
    query, gallery_new, gallery_old, labels, order = tied_case(4)
    curve = backfill_curve(query, gallery_new, gallery_old, labels, order)
    perm = np.random.default_rng(0).permutation(len(labels))
    inverse = np.argsort(perm)
    permuted = backfill_curve(query[perm], gallery_new[perm], gallery_old[perm], labels[perm],
                              inverse[order])
    assert_same_curve(permuted, curve)


def test_self_is_neither_result_nor_positive():
    # Every image has a unique label: no positives at all, whatever the distances.
    x = np.random.default_rng(0).standard_normal((10, 3)).astype(np.float32)
    metrics = retrieval_metrics(x, x, np.arange(10))
    assert metrics == {"top1": 0.0, "top5": 0.0, "map": 0.0}


def test_queries_without_positives_count_for_cmc_but_not_map():
    x = np.array([[0.0], [1.0], [10.0]], dtype=np.float32)
    metrics = retrieval_metrics(x, x, np.array([0, 0, 1]))
    assert metrics["top1"] == pytest.approx(2 / 3)
    assert metrics["map"] == pytest.approx(1.0)


@pytest.mark.parametrize("distance", ["l2", "cosine"])
def test_curve_ends_are_the_pure_galleries(distance):
    query, gallery_new, gallery_old, labels, order = random_case(5)
    curve = backfill_curve(query, gallery_new, gallery_old, labels, order, distance=distance)
    old = retrieval_metrics(query, gallery_old, labels, distance=distance)
    new = retrieval_metrics(query, gallery_new, labels, distance=distance)
    for name in ("top1", "top5", "map"):
        assert getattr(curve, name)[0] == pytest.approx(old[name], abs=1e-12)
        assert getattr(curve, name)[-1] == pytest.approx(new[name], abs=1e-12)
    assert curve.negative_flips[0] == 0 and curve.positive_flips[0] == 0
    assert curve.nfr1[0] == 0.0 and curve.pfr1[0] == 0.0


def test_flip_counts_follow_top1_changes():
    query, gallery_new, gallery_old, labels, order = random_case(6)
    curve = backfill_curve(query, gallery_new, gallery_old, labels, order)
    n = len(labels)
    # Net change in correct queries = positive flips - negative flips.
    np.testing.assert_array_equal(
        np.rint((curve.top1 - curve.top1[0]) * n).astype(int),
        curve.positive_flips - curve.negative_flips,
    )
    correct_at_start = round(curve.top1[0] * n)
    np.testing.assert_allclose(curve.nfr1, curve.negative_flips / correct_at_start)
    np.testing.assert_allclose(curve.pfr1, curve.positive_flips / (n - correct_at_start))


def test_identical_sides_give_a_flat_curve_without_flips():
    query, gallery_new, _, labels, order = random_case(8)
    curve = backfill_curve(query, gallery_new, gallery_new, labels, order)
    assert np.all(curve.top1 == curve.top1[0]) and np.all(curve.map == curve.map[0])
    assert curve.negative_flips.sum() == 0 and curve.positive_flips.sum() == 0


def test_curve_alphas():
    alphas = curve_alphas()
    assert alphas.shape == (22,)
    assert alphas[0] == 0.0 and alphas[-1] == 1.0
    np.testing.assert_allclose(np.diff(alphas), 1 / 21)
    np.testing.assert_allclose(curve_alphas(0), [0.0, 1.0])


def test_summaries_and_dict():
    query, gallery_new, gallery_old, labels, order = random_case(9)
    curve = backfill_curve(query, gallery_new, gallery_old, labels, order)
    assert isinstance(curve, BackfillCurve)
    assert curve.top1_auc == pytest.approx(np.mean(curve.top1))
    assert curve.map_auc == pytest.approx(np.mean(curve.map))
    assert curve.top5_trapz == pytest.approx(np.trapezoid(curve.top5, curve.alphas))
    assert curve.nfr1_mean == pytest.approx(np.mean(curve.nfr1))
    data = json.loads(json.dumps(curve.to_dict()))
    assert set(data) == {
        "alpha", "top1", "top5", "map", "nfr1", "pfr1", "negative_flips", "positive_flips",
        "top1_auc", "top5_auc", "map_auc", "top1_trapz", "top5_trapz", "map_trapz", "nfr1_mean",
    }
    assert len(data["alpha"]) == 22 and data["map_trapz"] == curve.map_trapz


def test_pairwise_distances_values():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((5, 8)).astype(np.float32)
    b = rng.standard_normal((7, 8)).astype(np.float32)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    l2 = ((a64[:, None, :] - b64[None, :, :]) ** 2).sum(-1)
    cos = 1 - (a64 / np.linalg.norm(a64, axis=1, keepdims=True)) @ (
        b64 / np.linalg.norm(b64, axis=1, keepdims=True)).T
    d = pairwise_distances(a, b)
    assert d.dtype == np.float32 and d.shape == (5, 7)
    np.testing.assert_allclose(d, l2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(pairwise_distances(a, b, "cosine"), cos, rtol=1e-5, atol=1e-6)
    # Rounding never leaves a negative distance, even between identical vectors.
    assert pairwise_distances(a, a).min() >= 0 and pairwise_distances(a, a, "cosine").min() >= 0


# ---------------------------------------------------------------------------------------------
# Bad inputs


def test_pairwise_distances_rejects_bad_inputs():
    a = np.zeros((3, 4), dtype=np.float32)
    with pytest.raises(ValueError, match="'euclid'"):
        pairwise_distances(a, a, "euclid")
    with pytest.raises(ValueError, match="4 feature dims but gallery has 5"):
        pairwise_distances(a, np.zeros((3, 5), dtype=np.float32))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.update(distance="cos"), "distance must be one of .*'cos'"),
        (lambda c: c.update(gallery_new=c["gallery_new"][:, :3]), "gallery_new has shape"),
        (lambda c: c.update(gallery_old=c["gallery_old"][:-1]), "gallery_old has shape"),
        (lambda c: c.update(query=c["query"][0]), "query must be a 2-D"),
        (lambda c: c["gallery_old"].__setitem__((2, 1), np.nan),
         "gallery_old has NaN/inf.*\\[2\\]"),
        (lambda c: c["query"].__setitem__((0, 0), np.inf), "query has NaN/inf"),
        (lambda c: c.update(labels=c["labels"][:-1]), "labels must have shape \\(12,\\)"),
        (lambda c: c.update(labels=c["labels"].astype(float)), "labels must be integer"),
        (lambda c: c.update(order=c["order"][:-1]), "order must have shape \\(12,\\)"),
        (lambda c: c.update(order=np.zeros(12, dtype=int)), "order must be a permutation.*missing"),
        (lambda c: c.update(order=np.arange(1, 13)), "order must be a permutation.*from 1 to 12"),
        (lambda c: c.update(order=np.arange(12.0)), "order must hold integer"),
        (lambda c: c.update(num_intermediate=-1), "num_intermediate"),
        (lambda c: c.update(block_size=0), "block_size"),
        (lambda c: c.update(workers=0), "workers"),
    ],
)
def test_backfill_curve_rejects_bad_inputs(change, message):
    rng = np.random.default_rng(0)
    call = {
        "query": rng.standard_normal((12, 4)).astype(np.float32),
        "gallery_new": rng.standard_normal((12, 4)).astype(np.float32),
        "gallery_old": rng.standard_normal((12, 4)).astype(np.float32),
        "labels": rng.integers(0, 3, 12),
        "order": rng.permutation(12),
    }
    change(call)
    with pytest.raises(ValueError, match=message):
        backfill_curve(**call)


def test_a_single_image_is_rejected_for_retrieval_but_fine_for_distances():
    x = np.ones((1, 3), dtype=np.float32)
    with pytest.raises(ValueError, match="query has 1 rows; it needs at least 2"):
        retrieval_metrics(x, x, np.zeros(1, dtype=int))
    assert pairwise_distances(x, x).shape == (1, 1)


def test_retrieval_metrics_rejects_mismatched_gallery():
    x = np.zeros((4, 2), dtype=np.float32)
    with pytest.raises(ValueError, match="gallery has shape"):
        retrieval_metrics(x, x[:3], np.arange(4))
