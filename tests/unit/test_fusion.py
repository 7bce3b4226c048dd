"""The shadow-index merges: serving's top-k merges, and the dual backfill curve against a
literal reference (per query and cut: build both lists, merge them, rank, score)."""

from __future__ import annotations

import numpy as np
import pytest

from fastfill.components.evaluation.fusion import merge_lists, normalise_distances, rrf_merge, score_merge

# --------------------------------------------------------------------------------------------
# Top-k merges (serving)


def test_rrf_interleaves_disjoint_lists_by_rank_the_later_list_first_at_equal_rank():
    old, new = np.array([10, 11, 12]), np.array([20, 21])
    ids, scores, sources = rrf_merge([old, new], k=60)
    assert ids.tolist() == [20, 10, 21, 11, 12]
    assert sources.tolist() == [1, 0, 1, 0, 0]
    assert scores == pytest.approx([1 / 61, 1 / 61, 1 / 62, 1 / 62, 1 / 63])
    for k in (0, 1, 1000):  # disjoint lists: k changes no position
        assert rrf_merge([old, new], k=k)[0].tolist() == ids.tolist()


def test_rrf_sums_an_id_found_in_several_lists_and_takes_its_best_list():
    ids, scores, sources = rrf_merge([np.array([1, 2, 3]), np.array([3, 4])], k=0)
    # 3: 1/3 + 1/1; 1: 1; 4: 1/2; 2: 1/2 (4 is in the later list, so first at the tie)
    assert ids.tolist() == [3, 1, 4, 2]
    assert scores == pytest.approx([4 / 3, 1, 1 / 2, 1 / 2])
    assert sources.tolist() == [1, 0, 1, 0]


def test_limits_padding_and_empty_lists():
    ids, _, sources = rrf_merge([np.array([1, 2, -1, -1]), np.array([], dtype=np.int64)], limit=5)
    assert ids.tolist() == [1, 2] and sources.tolist() == [0, 0]
    assert rrf_merge([np.array([1, 2]), np.array([3])], limit=2)[0].tolist() == [3, 1]
    assert rrf_merge([np.array([1, 2]), np.array([3])], limit=0)[0].size == 0
    ids, values, _ = score_merge([np.array([4, -1]), np.array([5, 6])],
                                 [np.array([0.5, np.inf]), np.array([1.0, 3.0])], limit=2)
    assert ids.tolist() == [5, 4] and values.tolist() == [0.0, 0.0]  # one-hit list: 0; later list first
    assert rrf_merge([], limit=3)[0].size == 0


def test_score_merge_orders_by_the_normalised_distance_of_each_list():
    old_ids, new_ids = np.array([1, 2, 3, 4]), np.array([7, 8, 9])
    old_d, new_d = np.array([1.0, 2.0, 2.0, 5.0]), np.array([10.0, 16.0, 40.0])
    ids, values, sources = score_merge([old_ids, new_ids], [old_d, new_d], norm="minmax")
    # old: 0, .25, .25, 1; new: 0, .2, 1 -> at equal value the new hit first, then the list's order
    assert ids.tolist() == [7, 1, 8, 2, 3, 9, 4]
    assert values == pytest.approx([0, 0, 0.2, 0.25, 0.25, 1, 1])
    assert sources.tolist() == [1, 0, 1, 0, 0, 1, 0]
    ids, values, _ = score_merge([old_ids, new_ids], [old_d, new_d], norm="zscore")
    expected = sorted([((d - old_d.mean()) / old_d.std(), 0, r, i) for r, (i, d) in enumerate(zip(old_ids, old_d))]
                      + [((d - new_d.mean()) / new_d.std(), -1, r, i) for r, (i, d) in enumerate(zip(new_ids, new_d))])
    assert ids.tolist() == [e[3] for e in expected]
    assert values == pytest.approx([e[0] for e in expected])
    assert merge_lists("score_zscore", [old_ids, new_ids], [old_d, new_d])[0].tolist() == ids.tolist()
    assert merge_lists("rrf", [old_ids, new_ids], [old_d, new_d], rrf_k=5)[0].tolist() == [7, 1, 8, 2, 9, 3, 4]


def test_normalisation_of_a_constant_list_is_zero():
    assert normalise_distances(np.array([3.0, 3.0]), "zscore").tolist() == [0.0, 0.0]
    assert normalise_distances(np.array([3.0]), "minmax").tolist() == [0.0]
    assert normalise_distances(np.array([]), "minmax").size == 0


@pytest.mark.parametrize("call, message", [
    (lambda: rrf_merge([np.array([1, 1])]), "more than once"),
    (lambda: rrf_merge([np.array([0.5])]), "integer ids"),
    (lambda: rrf_merge([np.array([1])], k=-1), "k must be"),
    (lambda: rrf_merge([np.array([1])], limit=-1), "limit"),
    (lambda: score_merge([np.array([1, 2])], [np.array([0.9, 0.1])]), "not ascending"),
    (lambda: score_merge([np.array([1, 2])], [np.array([0.1])]), "distances"),
    (lambda: score_merge([np.array([1])], [np.array([2.5])], distance="cosine"), "range"),
    (lambda: score_merge([np.array([1])], [np.array([np.nan])]), "non-finite"),
    (lambda: score_merge([np.array([1])], [np.array([1.0])], norm="rank"), "norm"),
    (lambda: merge_lists("sum", [], []), "merge must be"),
])
def test_malformed_lists_are_refused_with_what_is_wrong(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --------------------------------------------------------------------------------------------
# The dual backfill curve against a literal reference

from fastfill.components.evaluation import backfill_curve, curve_alphas, pairwise_distances, retrieval_metrics  # noqa: E402
from fastfill.components.evaluation.dual_curve import dual_curve, dual_curves  # noqa: E402

MERGES = ("rrf", "score_minmax", "score_zscore")


def _ranked_list(items, dist, labels, query):
    """(item, distance, is_positive), nearest first, a negative before a positive at equal distance."""
    entries = [(int(j), float(dist[query, j]), bool(labels[j] == labels[query])) for j in items if j != query]
    return sorted(entries, key=lambda e: (e[1], e[2]))


def _normalised(values, norm):
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return values
    low, spread = (values.min(), values.max() - values.min()) if norm == "minmax" else (values.mean(), values.std())
    return (values - low) / spread if spread > 0 else np.zeros_like(values)


def _merged_hits(new_list, old_list, merge, k=60):
    """The two lists merged literally; the is_positive flags in merged order."""
    entries = []
    for source, ranked in ((0, new_list), (1, old_list)):  # 0 = new: first at a tie
        if merge == "rrf":
            keys = [-1.0 / (k + rank) for rank in range(1, len(ranked) + 1)]
        else:
            keys = list(_normalised([d for _, d, _ in ranked], merge.removeprefix("score_")))
        entries += [(key, source, rank, positive) for rank, (key, (_, _, positive)) in enumerate(zip(keys, ranked))]
    return [positive for *_, positive in sorted(entries, key=lambda e: e[:3])]


def reference_dual_curve(query_old, query_new, gallery_old, gallery_new, labels, order, merge, distance, points=20):
    n = len(labels)
    d_new = pairwise_distances(query_new, gallery_new, distance)
    d_old = pairwise_distances(query_old, gallery_old, distance)
    cuts = [(i * n) // (points + 1) for i in range(points + 2)]
    top1, top5, ap = np.zeros((len(cuts), n)), np.zeros((len(cuts), n)), np.full((len(cuts), n), np.nan)
    for p, m in enumerate(cuts):
        for q in range(n):
            hits = _merged_hits(_ranked_list(order[:m], d_new, labels, q), _ranked_list(order[m:], d_old, labels, q),
                                merge)
            top1[p, q], top5[p, q] = hits[0], any(hits[:5])
            ranks = [r + 1 for r, hit in enumerate(hits) if hit]
            if ranks:
                ap[p, q] = np.mean([(i + 1) / r for i, r in enumerate(ranks)])
    flips = (top1[0][None] == 1) & (top1 == 0)
    return {"top1": top1.mean(axis=1), "top5": top5.mean(axis=1), "map": np.nanmean(ap, axis=1),
            "negative_flips": flips.sum(axis=1), "query_top1": top1 == 1, "query_ap": np.nan_to_num(ap)}


def _case(n=40, classes=3, d_old=5, d_new=7, seed=0, integer=False):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    centres_old, centres_new = rng.normal(size=(classes, d_old)), rng.normal(size=(classes, d_new))
    old = (centres_old[labels] + rng.normal(scale=1.2, size=(n, d_old))).astype(np.float32)
    new = (centres_new[labels] + rng.normal(scale=0.8, size=(n, d_new))).astype(np.float32)
    if integer:  # few distinct distances: ties inside each list and across them
        old, new = np.round(old).astype(np.float32), np.round(new).astype(np.float32)
    query_old = old + rng.normal(scale=0.3, size=old.shape).astype(np.float32)
    query_new = new + rng.normal(scale=0.3, size=new.shape).astype(np.float32)
    if integer:
        query_old, query_new = np.round(query_old).astype(np.float32), np.round(query_new).astype(np.float32)
    return query_old, query_new, old, new, labels, rng.permutation(n)


@pytest.mark.parametrize("distance", ["l2", "cosine"])
@pytest.mark.parametrize("integer", [False, True], ids=["continuous", "tied"])
def test_dual_curves_match_the_literal_merge_at_every_point(distance, integer):
    query_old, query_new, old, new, labels, order = _case(integer=integer)
    curves = dual_curves(query_old, query_new, old, new, labels, order, distance=distance, block_size=7)
    assert set(curves) == set(MERGES)
    for merge, curve in curves.items():
        expected = reference_dual_curve(query_old, query_new, old, new, labels, order, merge, distance)
        np.testing.assert_allclose(curve.alphas, curve_alphas(20))
        for key in ("top1", "top5", "map"):
            np.testing.assert_allclose(getattr(curve, key), expected[key], atol=1e-12, err_msg=f"{merge} {key}")
        np.testing.assert_array_equal(curve.negative_flips, expected["negative_flips"])


def test_the_ends_are_old_old_and_new_new_retrieval():
    query_old, query_new, old, new, labels, order = _case(n=60, classes=4, seed=3)
    for merge, curve in dual_curves(query_old, query_new, old, new, labels, order).items():
        at_start = retrieval_metrics(query_old, old, labels)
        at_end = backfill_curve(query_new, new, new, labels, order)
        assert [curve.top1[0], curve.top5[0], curve.map[0]] == pytest.approx(
            [at_start["top1"], at_start["top5"], at_start["map"]], abs=1e-12), merge
        assert [curve.top1[-1], curve.top5[-1], curve.map[-1]] == pytest.approx(
            [at_end.top1[-1], at_end.top5[-1], at_end.map[-1]], abs=1e-12), merge
        assert curve.nfr1[0] == 0


def test_blocks_workers_and_one_merge_give_the_same_curve():
    query_old, query_new, old, new, labels, order = _case(n=50, seed=5)
    whole = dual_curves(query_old, query_new, old, new, labels, order, block_size=50, workers=1)
    split = dual_curves(query_old, query_new, old, new, labels, order, block_size=3, workers=2)
    for merge in MERGES:
        one = dual_curve(query_old, query_new, old, new, labels, order, merge=merge, block_size=9)
        for curve in (split[merge], one):
            for key in ("top1", "top5", "map", "negative_flips", "positive_flips"):
                np.testing.assert_allclose(getattr(curve, key), getattr(whole[merge], key), atol=1e-12)


@pytest.mark.parametrize("integer", [False, True], ids=["continuous", "tied"])
def test_per_query_numbers_are_each_querys_own_in_row_order(integer):
    query_old, query_new, old, new, labels, order = _case(n=30, seed=11, integer=integer)
    labels = labels.copy()
    labels[order[-1]] = 99  # a query without positives: a miss, AP 0 (as per_query_curve gives it)
    per_query = dual_curves(query_old, query_new, old, new, labels, order, block_size=4, per_query=True)
    for merge, (top1, ap) in per_query.items():
        expected = reference_dual_curve(query_old, query_new, old, new, labels, order, merge, "l2")
        assert top1.shape == ap.shape == (22, 30)
        np.testing.assert_array_equal(top1, expected["query_top1"], err_msg=merge)
        np.testing.assert_allclose(ap, expected["query_ap"], atol=1e-12, err_msg=merge)


def test_a_singleton_class_and_few_points():
    query_old, query_new, old, new, labels, order = _case(n=12, seed=7)
    labels = labels.copy()
    labels[order[0]] = 99  # its query has no positive: top-1 fails, AP is skipped
    for merge, curve in dual_curves(query_old, query_new, old, new, labels, order, num_intermediate=2).items():
        expected = reference_dual_curve(query_old, query_new, old, new, labels, order, merge, "l2", points=2)
        for key in ("top1", "top5", "map"):
            np.testing.assert_allclose(getattr(curve, key), expected[key], atol=1e-12, err_msg=f"{merge} {key}")


@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "query_old": a["query_old"][:, :3]}, "gallery_old"),
    (lambda a: {**a, "gallery_new": a["gallery_new"][:-1]}, "gallery_new"),
    (lambda a: {**a, "query_new": a["query_new"][:-1]}, "query_new"),
    (lambda a: {**a, "labels": a["labels"][:-1]}, "labels"),
    (lambda a: {**a, "order": np.zeros(40, dtype=np.int64)}, "permutation"),
    (lambda a: {**a, "merges": ["sum"]}, "merges"),
])
def test_malformed_inputs_are_named(change, message):
    query_old, query_new, old, new, labels, order = _case()
    arguments = dict(query_old=query_old, query_new=query_new, gallery_old=old, gallery_new=new, labels=labels,
                     order=order)
    with pytest.raises(ValueError, match=message):
        dual_curves(**change(arguments))


def test_the_evaluation_stage_measures_each_merge_in_each_order_with_its_headline(tmp_path):
    """fastfill.tasks.method_curves.dual_curves_of on a stage layout: the old model's raw test features,
    the sigma order from the named map's stored log_sigma2, random from evaluate.seed."""
    from fastfill.components.evaluation.ordering import random_order, sigma_order
    from fastfill.components.evaluation.reports import build_metrics
    from fastfill.components.platform.config import EvaluateConfig
    from fastfill.tasks.method_curves import dual_curves_of
    from tests.stage_layouts import evaluation_layout

    query_old, query_new, old, new, labels, _ = _case(n=30, seed=11)
    log_sigma2 = np.random.default_rng(2).normal(size=30)
    layout = evaluation_layout(tmp_path, labels, old, new, log_sigma2=log_sigma2)

    config = EvaluateConfig(dual=["rrf", "score_zscore"], curve_points=3, seed=4)
    curves = dual_curves_of(config, layout)
    assert set(curves) == {"dual_rrf", "dual_score_zscore"}
    for name, order in (("random", random_order(30, 4)), ("sigma", sigma_order(log_sigma2))):
        expected = dual_curve(old, new, old, new, labels, order, merge="score_zscore", num_intermediate=3)
        assert curves["dual_score_zscore"][name]["top1"] == pytest.approx(expected.top1.tolist())
    assert config.headlines["dual_rrf"] == "random"
    reference = {"new_new": {"top1": 1.0, "top5": 1.0, "map": 1.0}}
    metrics = build_metrics(reference, curves, config.headlines, {})
    assert metrics["dual_rrf"]["order"] == "random" and set(metrics["dual_rrf"]["by_order"]) == {"random", "sigma"}
    assert metrics["dual_rrf"]["top1_auc"] == curves["dual_rrf"]["random"]["top1_auc"]

    np.save(layout.align_dir("fastfill") / "log_sigma2.npy", np.full(30, np.nan))  # a diverged map
    curves = dual_curves_of(config, layout)
    assert "diverged" in curves["dual_rrf"]["sigma"] and np.isnan(curves["dual_rrf"]["sigma"]["top1_auc"])
    assert np.isfinite(curves["dual_rrf"]["random"]["top1_auc"])
