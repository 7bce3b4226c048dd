"""The promotion gate's numbers on the whole gallery: measured with a team's judged queries
(``measure_judged_gate``), and, for galleries with neither labels nor judgments, the label-free
fallback (``agreement_at``). Both read the gallery a block at a time.

Protocol of ``measure_judged_gate`` (that of ``components.gallery.gate.promotion.measure_gate`` and
``components.evaluation``, on the whole gallery): each query ranks every gallery item except
itself (a query that is a gallery item never retrieves itself and is never its own relevant
item); top-1 is a hit when the nearest item is relevant; AP is ``(1/R) * sum_k k / rank_k`` over
the query's ``R`` relevant items in the full ranking. Ties are pessimistic, as in
``components.evaluation``: an irrelevant item at exactly the distance of a relevant one ranks
before it. (A relevant item's distance is computed apart from the blocks it is compared with, so
an exact tie, such as a duplicate image judged irrelevant, can come out one float32 rounding
either way.)
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from fastfill.components.evaluation import curve_alphas, pairwise_distances


class Judgments(Protocol):
    """What the gate reads of judged queries (``components.gallery.inputs.judgments.Judgments``,
    which imports this module): each query's gallery position (-1: an image) and its relevant
    positions."""

    query_positions: np.ndarray
    relevant: list[np.ndarray]

    def __len__(self) -> int: ...


# The distances of one gallery block to every query, per side: the block's width is chosen so
# that this many bytes hold them (the sort is in place; pairwise_distances' temporaries add a
# small multiple, one side at a time).
BLOCK_BYTES = 64 << 20


# ------------------------------------------------------------------------------------------------
# The gate's numbers with judgments


def _negatives_before(queries: np.ndarray, first: np.ndarray, rest: np.ndarray, order: np.ndarray, cuts: list[int],
                      judgments: Judgments, distance: str, block_bytes: int) -> np.ndarray:
    """For each cut ``m`` and each judged pair (query q, relevant item p), flattened in query
    order: how many irrelevant gallery items (q itself excluded) are at most as far from q as p
    is, in the gallery whose first ``m`` items of ``order`` have their ``first`` features and the
    others their ``rest`` ones. Shape ``(len(cuts), pairs)``.

    The gallery is walked once in backfill order, in blocks whose edges include every cut, so
    each block is wholly ``first`` or wholly ``rest`` at every cut. Per block and side: the
    distances of every query to it (relevant items and the query itself set to +inf), each row
    sorted in place, and each pair's two possible distances (its item on either side) counted
    into it by binary search. Running sums of these counts, taken at every cut, give the
    ``first`` part (blocks before the cut) and the ``rest`` part (the total minus the sum
    before the cut)."""
    n, count = len(order), len(judgments)
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    items = np.concatenate(judgments.relevant)
    item_rank = rank[items]
    pairs = len(items)
    per_query = _pair_thresholds(queries, first, rest, judgments, items, distance)
    hide_q, hide_rank = _hidden_entries(judgments, rank, item_rank)

    width = max(256, block_bytes // (4 * max(1, count)))
    edges = np.unique(np.concatenate([np.arange(0, n, width), cuts, [n]]).astype(np.int64))
    cut_at: dict[int, list[int]] = {}
    for index, cut in enumerate(cuts):
        cut_at.setdefault(int(cut), []).append(index)
    running = np.zeros((2, pairs, 2), dtype=np.int64)  # [side, pair, threshold side]
    snapshots = np.zeros((2, len(cuts), pairs), dtype=np.int64)  # running sums at each cut, the cut's threshold
    pair_index = np.arange(pairs)

    def snapshot(at: int) -> None:
        for index in cut_at.get(at, []):
            chosen = (item_rank >= cuts[index]).astype(np.int64)  # threshold side: 0 first, 1 rest
            snapshots[:, index] = running[:, pair_index, chosen]

    snapshot(0)
    for start, stop in zip(edges[:-1], edges[1:]):
        block = order[start:stop]
        lo, hi = np.searchsorted(hide_rank, [start, stop])
        for side, gallery in enumerate((first, rest)):
            if side and rest is first:  # one gallery (the champion's): the same counts
                running[1] = running[0]
                continue
            d = pairwise_distances(queries, gallery[block], distance)
            d[hide_q[lo:hi], hide_rank[lo:hi] - start] = np.inf
            d.sort(axis=1)
            counts = np.concatenate([np.searchsorted(d[q], per_query[q], side="right") for q in range(count)])
            running[side] += counts.reshape(pairs, 2)
            del d
        snapshot(int(stop))
    total = running[1][pair_index[None, :], (item_rank[None, :] >= np.asarray(cuts)[:, None]).astype(np.int64)]
    return snapshots[0] + total - snapshots[1]


def _pair_thresholds(queries: np.ndarray, first: np.ndarray, rest: np.ndarray, judgments: Judgments,
                     items: np.ndarray, distance: str) -> list[np.ndarray]:
    """Per query, each of its judged pairs' distance with the item on either side, flattened
    (pair 0 on ``first``, pair 0 on ``rest``, pair 1 on ``first``, ...)."""
    count = len(judgments)
    starts = np.concatenate([[0], np.cumsum([len(r) for r in judgments.relevant])])
    thresholds = np.empty((len(items), 2), dtype=np.float32)
    for q in range(count):
        span = slice(starts[q], starts[q + 1])
        thresholds[span, 0] = pairwise_distances(queries[q:q + 1], first[items[span]], distance)[0]
        thresholds[span, 1] = (thresholds[span, 0] if rest is first else
                               pairwise_distances(queries[q:q + 1], rest[items[span]], distance)[0])
    return [thresholds[starts[q]:starts[q + 1]].ravel() for q in range(count)]


def _hidden_entries(judgments: Judgments, rank: np.ndarray, item_rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The entries a block's distances set to +inf, every (query, relevant item) and (query,
    itself), as (query, the item's rank in the backfill order), sorted by rank."""
    owner = np.repeat(np.arange(len(judgments)), [len(r) for r in judgments.relevant])
    own = judgments.query_positions
    hide_q = np.concatenate([owner, np.flatnonzero(own >= 0)])
    hide_rank = np.concatenate([item_rank, rank[own[own >= 0]]])
    by_rank = np.argsort(hide_rank, kind="stable")
    return hide_q[by_rank], hide_rank[by_rank]


def _scores(before: np.ndarray, judgments: Judgments) -> tuple[np.ndarray, np.ndarray]:
    """(top-1 hit, AP) per cut and query, from ``_negatives_before``'s counts: the relevant items
    of a query in order of distance are in order of their counts, and the k-th of them ranks at
    k + its count."""
    sizes = np.array([len(r) for r in judgments.relevant])
    owner = np.repeat(np.arange(len(sizes)), sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    k = np.arange(len(owner)) - starts[owner] + 1  # 1.. within each query's relevant items
    top1 = np.zeros((len(before), len(sizes)), dtype=bool)
    ap = np.zeros((len(before), len(sizes)))
    for row, counts in enumerate(before):
        ranked = counts[np.lexsort((counts, owner))]
        ap[row] = np.bincount(owner, weights=k / (k + ranked), minlength=len(sizes)) / sizes
        top1[row] = ranked[starts] == 0
    return top1, ap


def _check_inputs(judgments: Judgments, order: np.ndarray, **arrays) -> int:
    n = len(arrays["champion_gallery"])
    count = len(judgments)
    problems = [f"{name} has {len(array)} rows" for name, array in arrays.items()
                if len(array) != (count if name.endswith("queries") else n)]
    if problems or count < 1 or n < 2:
        raise ValueError(f"the judged gate needs {count} >= 1 queries and a gallery of n >= 2 items in every input "
                         f"(n = {n}): {'; '.join(problems) or 'too few'}")
    if len(order) != n or not np.array_equal(np.sort(order), np.arange(n)):
        raise ValueError(f"order must be a permutation of the {n} gallery positions")
    for q, relevant in enumerate(judgments.relevant):
        if not len(relevant) or relevant.min() < 0 or relevant.max() >= n or judgments.query_positions[q] in relevant:
            raise ValueError(f"judged query {q} needs relevant positions in [0, {n}) other than its own")
    return n


def measure_judged_gate(champion_queries: np.ndarray, champion_gallery: np.ndarray, new_queries: np.ndarray,
                        new_gallery: np.ndarray, transformed_gallery: np.ndarray, judgments: Judgments,
                        order: np.ndarray, *, distance: str = "l2", curve_points: int = 20,
                        block_bytes: int = BLOCK_BYTES) -> dict:
    """The promotion gate's numbers (``promotion.measure_gate``'s keys, plus ``map`` per alpha
    and ``champion_map``) on judged queries against the whole gallery.

    ``champion_queries`` / ``new_queries``: the judged queries' features (judgments order) by
    the champion / the challenger; ``champion_gallery``, ``new_gallery``,
    ``transformed_gallery``: every gallery item's features (positions 0..N-1); ``order``: the
    backfill order over the whole gallery. At alpha the gallery holds new features for
    ``order[:floor(alpha * N)]`` and transformed ones elsewhere, alpha = curve_alphas(curve_points).

    Memory: the inputs, plus one block of query-by-gallery distances (``block_bytes``, 64 MB by
    default, and pairwise_distances' temporaries) and a few int64 counts per judged pair and
    curve point; time: the distances to each gallery side once, and one row sort per block."""
    order = np.asarray(order, dtype=np.int64)
    n = _check_inputs(judgments, order, champion_queries=champion_queries, new_queries=new_queries,
                      champion_gallery=champion_gallery, new_gallery=new_gallery,
                      transformed_gallery=transformed_gallery)
    alphas = curve_alphas(curve_points)
    cuts = [(i * n) // (curve_points + 1) for i in range(len(alphas))]
    champion_before = _negatives_before(np.asarray(champion_queries), champion_gallery, champion_gallery,
                                        np.arange(n), [0], judgments, distance, block_bytes)
    right, champion_ap = (a[0] for a in _scores(champion_before, judgments))
    top1_hits, ap = _scores(_negatives_before(np.asarray(new_queries), new_gallery, transformed_gallery, order, cuts,
                                              judgments, distance, block_bytes), judgments)
    top1 = [float(hits.mean()) for hits in top1_hits]
    nfr1 = [float((right & ~hits).sum() / max(1, right.sum())) for hits in top1_hits]
    champion_top1 = float(right.mean())
    beyond = [float(a) for a, t in zip(alphas, top1) if t > champion_top1]
    return {"queries": len(judgments), "champion_top1": champion_top1, "alpha": [float(a) for a in alphas],
            "top1": top1, "nfr1": nfr1, "top1_auc": float(np.mean(top1)),
            "top1_auc_gain": float(np.mean(top1)) - champion_top1, "nfr1_mean": float(np.mean(nfr1)),
            "nfr1_end": nfr1[-1], "fraction_to_gain": beyond[0] if beyond else None,
            "map": [float(row.mean()) for row in ap], "champion_map": float(champion_ap.mean())}


# ------------------------------------------------------------------------------------------------
# Without labels or judgments


def agreement_at(queries: np.ndarray, mixed_gallery: np.ndarray, final_gallery: np.ndarray, positions: np.ndarray,
                 k: int = 10, distance: str = "l2") -> float:
    """Mean overlap, in %, of each query's top-k in ``mixed_gallery`` (the gallery mid-backfill)
    with its top-k in ``final_gallery`` (every item with new features). ``queries``: new
    features of sample items, ``positions``: their gallery positions (each excluded from its own
    top-k). It measures agreement with the finished upgrade, not correctness: 100 means the
    mixed gallery already answers as the finished one will, right or wrong."""
    positions = np.asarray(positions, dtype=np.int64)
    n = len(final_gallery)
    if len(mixed_gallery) != n or len(queries) != len(positions) or not len(positions) or n < 2:
        raise ValueError(f"agreement_at needs >= 1 query with a position each and two galleries of the same "
                         f">= 2 items, got {len(queries)} queries, {len(positions)} positions, galleries of "
                         f"{len(mixed_gallery)} and {n}")
    k = min(int(k), n - 1)
    width = max(k, BLOCK_BYTES // (4 * len(positions)))
    tops = []
    for gallery in (mixed_gallery, final_gallery):  # each query's k nearest, a block of the gallery at a time
        best = np.empty((len(positions), 0), dtype=np.float32)
        index = np.empty((len(positions), 0), dtype=np.int64)
        for start in range(0, n, width):
            d = pairwise_distances(queries, gallery[start:start + width], distance)
            own = (positions >= start) & (positions < start + d.shape[1])
            d[own, positions[own] - start] = np.inf
            near = _smallest(d, k)
            best = np.concatenate([best, np.take_along_axis(d, near, 1)], axis=1)
            index = np.concatenate([index, near + start], axis=1)
            keep = _smallest(best, k)
            best, index = np.take_along_axis(best, keep, 1), np.take_along_axis(index, keep, 1)
        tops.append(index)
    overlap = sum(len(np.intersect1d(a, b)) for a, b in zip(*tops))
    return 100.0 * overlap / (k * len(positions))


def _smallest(values: np.ndarray, k: int) -> np.ndarray:
    """Column indices of each row's k smallest values (all of them when a row has no more)."""
    if values.shape[1] <= k:
        return np.broadcast_to(np.arange(values.shape[1]), values.shape)
    return np.argpartition(values, k - 1, axis=1)[:, :k]
