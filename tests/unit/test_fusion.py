"""The shadow-index merges: serving's top-k merges, and the dual backfill curve against a
literal reference (per query and cut: build both lists, merge them, rank, score)."""

from __future__ import annotations

import numpy as np
import pytest

from components.evaluation.fusion import merge_lists, normalise_distances, rrf_merge, score_merge

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
