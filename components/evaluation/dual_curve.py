"""The backfill curve of the shadow-index playbook: two queries, two partitions, one merged list.

No map: the gallery keeps the old model's own features until an item is re-embedded. At each
point of the curve (the points of ``backfill_curve``: the first ``floor(alpha * n)`` items of
``order`` re-embedded), query ``i`` is embedded by both models; the new query ranks the
re-embedded items by their new features, the old query ranks the others by their old features,
each list without the query's own item and ranked with the protocol's pessimistic ties (a
negative before a positive at equal distance). The two lists are merged
(``components.evaluation.fusion`` has the conventions) and the merged list is scored as
``backfill_curve`` scores its ranking: top-1, top-5, AP over the whole list, flips against
``alpha = 0``. At ``alpha = 0`` this is old/old retrieval, at 1 new/new.

- ``rrf``: the lists are disjoint, so an item of rank ``r`` in its list scores ``1 / (k + r)``
  whatever the other list holds: the merge interleaves the lists by rank, the new list's item
  first at equal rank, and ``k`` changes nothing.
- ``score_minmax``, ``score_zscore``: each list's distances (squared l2, or ``1 - cos``) are
  normalised over the whole list, i.e. the partition without the query's own item, in float64;
  a list whose distances are all equal normalises to 0. Merged by ascending normalised distance,
  the new list's item first at an equal value, each list keeping its own order.
- ``distance`` (online backfilling): the two lists merged by their raw distances, the new list's
  item first at an equal distance. Meant for an old-side query that is the new query mapped into
  the old space by a reverse transformation, which makes the two sides' distances comparable.

Implementation
--------------
Within-list ranks change with every point, so the retrieval engine's one sort per point does
not apply. Per side and query row, one sort of 64-bit keys ``(distance, is_positive, e)``,
where ``e`` is the first point at which the column is re-embedded: an item is in the new list
at point ``i`` iff ``e <= i``. An item's rank in its list at every point is then a count of the
items before it with ``e <= i`` (or ``> i``), answered in O(1) from popcounts of the
indicators ``e <= i`` packed in 64-bit words (``_PrefixCounts``). Only the positives are
followed, one pair per positive and point (``R * P`` per row for ``R`` positives). For rrf the
merged position is closed-form (the rank plus the other list's items of lower rank, or of equal
rank for an old item). For the score merges it is the rank plus the other list's items with a
lower normalised distance: the normalisation is affine and increasing, so that is a threshold
on the other side's distances, one ``searchsorted`` of its sorted row, then a count of its
list's items among them. A stable sort merges the two sides' pairs into each point's ranking of
the positives, which gives top-1, top-5 and AP.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, overload

import numpy as np

from fastfill.components.evaluation.retrieval import (
    ALPHA_POINTS_DEFAULT,
    BackfillCurve,
    BlockTotals,
    Prepared,
    block_distances,
    check_both_models,
    check_distance,
    check_labels,
    check_num_intermediate,
    check_order,
    curve_alphas,
    curve_from_totals,
    over_blocks,
)
from fastfill.components.platform.vocabulary import MERGES, ONLINE_MERGE

__all__ = ["CURVE_MERGES", "dual_curve", "dual_curves"]

CURVE_MERGES = (*MERGES, ONLINE_MERGE)
"""The merges a curve can be measured with: the shadow index's and online backfilling's."""

# Query rows ranked together: their keys, prefix counts and pairs (about 22 * R * P * 8 bytes
# per row for R positives, P points) stay in cache; 8 measured best, 16 to 64 about 1.5x slower.
_CHUNK_ROWS = 8


@overload
def dual_curves(query_old: np.ndarray, query_new: np.ndarray, gallery_old: np.ndarray, gallery_new: np.ndarray,
                labels: np.ndarray, order: np.ndarray | None = None, *, merges: Sequence[str] = MERGES,
                distance: str = "l2", num_intermediate: int = ALPHA_POINTS_DEFAULT, block_size: int = 256,
                workers: int = 2, per_query: Literal[False] = False) -> dict[str, BackfillCurve]: ...


@overload
def dual_curves(query_old: np.ndarray, query_new: np.ndarray, gallery_old: np.ndarray, gallery_new: np.ndarray,
                labels: np.ndarray, order: np.ndarray | None = None, *, merges: Sequence[str] = MERGES,
                distance: str = "l2", num_intermediate: int = ALPHA_POINTS_DEFAULT, block_size: int = 256,
                workers: int = 2, per_query: Literal[True]) -> dict[str, tuple[np.ndarray, np.ndarray]]: ...


def dual_curves(query_old: np.ndarray, query_new: np.ndarray, gallery_old: np.ndarray, gallery_new: np.ndarray,
                labels: np.ndarray, order: np.ndarray | None = None, *, merges: Sequence[str] = MERGES,
                distance: str = "l2", num_intermediate: int = ALPHA_POINTS_DEFAULT, block_size: int = 256,
                workers: int = 2, per_query: bool = False
                ) -> dict[str, BackfillCurve] | dict[str, tuple[np.ndarray, np.ndarray]]:
    """The shadow-index playbook's backfill curve for each merge of ``merges`` (one pass).
    With ``per_query``, each merge's ``(top1, ap)`` instead, as ``per_query_curve`` gives them:
    both ``(B + 2, n)``, each query's top-1 hit (bool) and AP at every point.

    Args:
        query_old, gallery_old: ``(n, d_old)`` old-model features of the evaluation images, raw
            (no map), as queries and as the gallery's old side.
        query_new, gallery_new: ``(n, d_new)`` new-model features of the same images.
        labels: ``(n,)`` integer class ids.
        order: permutation of ``0 .. n-1``, the backfill order; ``None`` means ``0 .. n-1``.
        merges: names from CURVE_MERGES.
        distance, num_intermediate: as for ``backfill_curve``.
        block_size: query rows whose distances are computed together; a worker holds about
            ``8 * block_size * n`` bytes of them, and ranks ``_CHUNK_ROWS`` rows at a time.
        workers: threads over blocks.

    Raises:
        ValueError: naming the offending argument, for any malformed input.
    """
    distance = check_distance(distance)
    num_intermediate = check_num_intermediate(num_intermediate)
    merges = list(dict.fromkeys(merges))
    unknown = [m for m in merges if m not in CURVE_MERGES]
    if unknown or not merges:
        raise ValueError(f"merges must name at least one of {CURVE_MERGES}, got {merges!r}")
    for name, value in (("block_size", block_size), ("workers", workers)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    query_old, query_new, gallery_old, gallery_new = check_both_models(query_old, query_new, gallery_old, gallery_new)
    n = query_old.shape[0]
    labels = check_labels(labels, n)
    order = check_order(order, n)

    cuts = np.array([(i * n) // (num_intermediate + 1) for i in range(num_intermediate + 2)], dtype=np.int64)
    setup = _Setup(order, labels, cuts, gallery_old[order], gallery_new[order], distance, merges, per_query)

    def run(start: int) -> dict[str, BlockTotals]:
        stop = min(start + block_size, n)
        return setup.block(query_old[start:stop], query_new[start:stop], start, stop)

    totals = over_blocks(run, n, block_size, workers)
    if per_query:
        return {merge: (totals[merge].query_top1, totals[merge].query_ap) for merge in merges}
    alphas = curve_alphas(num_intermediate)
    return {merge: curve_from_totals(alphas, totals[merge], labels) for merge in merges}


def dual_curve(query_old: np.ndarray, query_new: np.ndarray, gallery_old: np.ndarray, gallery_new: np.ndarray,
               labels: np.ndarray, order: np.ndarray | None = None, *, merge: str = "rrf", **options) -> BackfillCurve:
    """``dual_curves`` for one merge."""
    return dual_curves(query_old, query_new, gallery_old, gallery_new, labels, order, merges=[merge],
                       **options)[merge]


class _Setup:
    """What every block shares: the galleries with their columns in backfill order, each
    column's first point on the new side (``e``), the label of each column."""

    def __init__(self, order, labels, cuts, gallery_old, gallery_new, distance, merges, per_query):
        n = len(order)
        self.per_query = per_query
        self.n, self.cuts, self.points = n, cuts, len(cuts)
        self.distance, self.merges = distance, merges
        self.gallery_old, self.gallery_new = Prepared.of(gallery_old, distance), Prepared.of(gallery_new, distance)
        self.labels, self.column_labels = labels, labels[order]
        self.self_column = np.empty(n, dtype=np.int64)
        self.self_column[order] = np.arange(n)
        # column c is re-embedded from the first point i with c < cuts[i]: e = #{i : cuts[i] <= c}, in [1, P-1]
        self.e_bits = max(1, (self.points - 1).bit_length())
        self.e_column = np.searchsorted(cuts, np.arange(n), side="right").astype(np.uint64)
        _, inverse, sizes = np.unique(labels, return_inverse=True, return_counts=True)
        self.num_positives = sizes[inverse] - 1
        self.norms = {m: m.removeprefix("score_") for m in merges if m != "rrf"}  # distance: raw
        self._weights: dict[int, np.ndarray] = {}

    def ap_weights(self, positives: int) -> np.ndarray:
        """``k / R`` for the k-th of R positives (AP = sum over them of k / R / position), for
        every point of a row."""
        if positives not in self._weights:
            self._weights[positives] = np.tile(np.arange(1, positives + 1) / max(positives, 1), self.points)
        return self._weights[positives]

    def block(self, query_old, query_new, start: int, stop: int) -> dict[str, BlockTotals]:
        """The totals of query rows ``start .. stop-1``: their distances at once, ranked a few
        rows at a time (their keys, counts and pairs then stay in cache)."""
        new = block_distances(Prepared.of(query_new, self.distance), self.gallery_new, self.distance)
        old = block_distances(Prepared.of(query_old, self.distance), self.gallery_old, self.distance)
        totals: dict[str, BlockTotals] = {}
        for first in range(start, stop, _CHUNK_ROWS):
            last = min(first + _CHUNK_ROWS, stop)
            chunk = self.chunk(new[first - start:last - start], old[first - start:last - start], first, last)
            totals = {m: totals[m] + chunk[m] for m in self.merges} if totals else chunk
        return totals

    def chunk(self, new_distances, old_distances, start: int, stop: int) -> dict[str, BlockTotals]:
        n, cuts, points = self.n, self.cuts, self.points
        self_column = self.self_column[start:stop]
        positive = self.labels[start:stop, None] == self.column_labels[None, :]
        new = _Side(new_distances, positive, self_column, self, is_new=True)
        old = _Side(old_distances, positive, self_column, self, is_new=False)
        del positive
        in_new = cuts[None, :] > self_column[:, None]  # (b, P): whether the query's own item is re-embedded
        # each list's length at each point, flat by group = row * P + point
        size = {new: (cuts[None, :] - in_new).ravel(), old: (n - cuts[None, :] - ~in_new).ravel()}
        positions = {}
        if "rrf" in self.merges:  # interleave by rank, the new list first at equal rank
            positions["rrf"] = (new.rank + np.minimum(new.rank - 1, size[old][new.group]),
                                old.rank + np.minimum(old.rank, size[new][old.group]))
        for merge, norm in self.norms.items():
            new.normalise(norm, size[new])
            old.normalise(norm, size[old])
            # the other list's items with a lower normalised distance (the new list's at a tie)
            positions[merge] = (new.rank + old.count_below(new, size[old], strict=True),
                                          old.rank + new.count_below(old, size[new], strict=False))
        scoring = _Scoring(self.num_positives[start:stop], points, n, self.ap_weights, self.per_query)
        return {merge: scoring.totals(new.group, positions[merge][0], old.group, positions[merge][1])
                for merge in self.merges}


class _Side:
    """One side of a block, the new query against the new features or the old against the old:
    each row's keys sorted (the query's own item dropped), and its pairs: each positive at each
    curve point where it is in this side's list, in the order (row, point, position), with its
    ``group`` (row * P + point), position ``at`` in the sorted row, and ``rank`` in the list."""

    def __init__(self, distances: np.ndarray, positive: np.ndarray, self_column: np.ndarray, setup: _Setup,
                 is_new: bool):
        b, n = distances.shape
        bits, points = setup.e_bits, setup.points
        self.setup, self.is_new, self.distances, self.self_column = setup, is_new, distances, self_column
        # (distance, is_positive, e), the sign bit of a clamped -0.0 dropped; the own item above all
        keys = (distances.view(np.uint32) & np.uint32(0x7FFFFFFF)).astype(np.uint64)
        keys <<= np.uint64(bits + 1)
        keys |= positive.astype(np.uint64) << np.uint64(bits)
        keys |= setup.e_column[None, :]
        keys[np.arange(b), self_column] = np.uint64((1 << (33 + bits)) - 1)
        keys.sort(axis=1)
        self.keys = keys[:, :n - 1]
        e = (self.keys & np.uint64((1 << bits) - 1)).astype(np.uint8 if points < 256 else np.int64)
        self.counts = _PrefixCounts(e, points)

        # the positives, row by row, padded to a power-of-two width
        pos_rows, pos_at = np.nonzero((self.keys >> np.uint64(bits)) & np.uint64(1))
        per_row = np.bincount(pos_rows, minlength=b)
        shift = max(int(per_row.max(initial=0)) - 1, 0).bit_length()
        slot = np.arange(len(pos_rows)) - (np.cumsum(per_row) - per_row)[pos_rows]
        at = np.zeros((b, 1 << shift), dtype=np.int64)
        at[pos_rows, slot] = pos_at
        first = np.full((b, 1 << shift), points, dtype=np.int64)  # a padded slot is in neither list
        first[pos_rows, slot] = e[pos_rows, pos_at]
        cut = np.arange(points)[None, :, None]
        listed = (first[:, None, :] <= cut) if is_new else ((first[:, None, :] > cut) & (first[:, None, :] < points))
        flat = np.flatnonzero(listed)
        self.rows = np.repeat(np.arange(b), np.count_nonzero(listed.reshape(b, -1), axis=1))
        self.group = flat >> shift
        self.at = at.ravel()[(self.rows << shift) | (flat & ((1 << shift) - 1))]
        before = self.counts.count(self.group, self.at)  # the items before it that are in the new list
        self.rank = 1 + (before if is_new else self.at - before)

    def normalise(self, norm: str, size: np.ndarray) -> None:
        """This side's list statistics at every point for ``norm`` (``low``, ``spread``, flat by
        group) and each pair's normalised distance (``value``); ``distance``: the raw distance."""
        if norm == ONLINE_MERGE:
            low, spread = np.zeros(size.shape), np.ones(size.shape)
        else:
            low, spread = _list_statistics(self.distances, self.self_column, self.setup.cuts,
                                           size.reshape(-1, self.setup.points), norm, self.is_new)
        self.low, self.spread = low.ravel(), spread.ravel()
        if not hasattr(self, "sorted_distances"):  # the keys' distances, exactly
            self.sorted_distances = (self.keys >> np.uint64(self.setup.e_bits + 1)).astype(np.uint32).view(
                np.float32).astype(np.float64)
        distance = self.sorted_distances.ravel()[self.rows * self.keys.shape[1] + self.at]
        self.value = (distance - self.low[self.group]) / self.spread[self.group]

    def count_below(self, other: _Side, size: np.ndarray, strict: bool) -> np.ndarray:
        """For each pair of ``other``: the items of this side's list (at the pair's point) whose
        normalised distance is below the pair's (``strict``), or at most it. The normalisation
        is affine and increasing, so this is a threshold on the distance, found by one search
        of this side's sorted rows; the count keeps the items in this side's list."""
        group, value = other.group, other.value
        low, spread = self.low[group], self.spread[group]
        constant = np.isinf(spread)  # a list normalised to 0 throughout
        with np.errstate(invalid="ignore"):
            threshold = np.where(constant, 0.0, low + spread * value)
        # one search per row: the pairs are grouped by row (np.searchsorted compares in float64)
        ends = np.empty(len(group), dtype=np.int64)
        bounds = np.searchsorted(other.rows, np.arange(len(self.keys) + 1))
        for row, (first, last) in enumerate(zip(bounds[:-1], bounds[1:])):
            ends[first:last] = np.searchsorted(self.sorted_distances[row], threshold[first:last],
                                               side="left" if strict else "right")
        new_before = self.counts.count(group, ends)
        found = new_before if self.is_new else ends - new_before
        everything = size[group] * ((value > 0) if strict else (value >= 0))
        return np.where(constant, everything, found)


class _PrefixCounts:
    """``count(group, at)`` = ``#{q < at : e[row, q] <= point}`` for ``group = row * P + point``,
    in O(1) per query: the indicator ``e <= point`` of each row and point packed in 64-bit words,
    with the words' running popcounts."""

    def __init__(self, e: np.ndarray, points: int):
        b, length = e.shape
        self.words = length // 64 + 1
        indicator = np.zeros((b, points, 64 * self.words), dtype=bool)
        np.less_equal(e[:, None, :], np.arange(points, dtype=e.dtype)[None, :, None], out=indicator[:, :, :length])
        self.bits = np.packbits(indicator, axis=2, bitorder="little").view("<u8").ravel()
        ones = np.bitwise_count(self.bits).reshape(-1, self.words)
        self.before = (np.cumsum(ones, axis=1, dtype=np.int64) - ones).ravel()

    def count(self, group: np.ndarray, at: np.ndarray) -> np.ndarray:
        word = group * self.words + (at >> 6)
        below = (np.uint64(1) << (at & 63).astype(np.uint64)) - np.uint64(1)
        return self.before[word] + np.bitwise_count(self.bits[word] & below)


class _Scoring:
    """top-1, top-5, AP and flips of a block from each positive's merged position (1-based) at
    each point. Each (row, point) group holds its row's positives, every one once."""

    def __init__(self, num_positives: np.ndarray, points: int, n: int, ap_weights, per_query: bool = False):
        self.b, self.points, self.shift = len(num_positives), points, int(n).bit_length()
        self.per_query = per_query
        sizes = np.repeat(num_positives, points)
        self.has = sizes > 0
        self.first = (np.cumsum(sizes) - sizes)[self.has]
        self.weight = np.concatenate([ap_weights(int(r)) for r in num_positives])

    def totals(self, group_new, position_new, group_old, position_old) -> BlockTotals:
        # each side's pairs are in (group, position) order: a stable sort merges the two runs
        key = np.concatenate([(group_new << self.shift) | position_new, (group_old << self.shift) | position_old])
        position = np.sort(key, kind="stable") & ((1 << self.shift) - 1)
        b, points = self.b, self.points
        best: np.ndarray  # flat, then (b, P)
        ap, best = np.zeros(b * points), np.zeros(b * points, dtype=np.int64)
        if len(position):
            ap[self.has] = np.add.reduceat(self.weight / position, self.first)
            best[self.has] = position[self.first]
        best = best.reshape(b, points)
        correct1 = (best == 1).T  # (P, b)
        at_start = correct1[0]
        return BlockTotals(
            top1=np.count_nonzero(correct1, axis=1),
            top5=np.count_nonzero((best >= 1) & (best <= 5), axis=0),
            ap=ap.reshape(b, points).sum(axis=0),
            negative_flips=np.count_nonzero(at_start & ~correct1, axis=1),
            positive_flips=np.count_nonzero(~at_start & correct1, axis=1),
            correct_at_start=int(np.count_nonzero(at_start)),
            query_top1=correct1 if self.per_query else None,
            query_ap=ap.reshape(b, points).T if self.per_query else None,
        )


def _list_statistics(distances, self_column, cuts, size, norm: str, is_new: bool):
    """``(low, spread)`` of one side's list at every point, each (b, P), for ``norm``: the list
    is the first columns (new side) or the rest (old side), without the query's own item. A list
    that is empty or of one distance gets ``(0, inf)``: it normalises to 0 throughout."""
    rows = np.arange(len(distances))
    starts, empty = cuts[:-1], cuts[1:] == cuts[:-1]  # interval v: columns cuts[v] .. cuts[v+1]-1

    def per_interval(reduce, own, values=distances):
        values[rows, self_column] = own  # the query's own item counts for nothing
        out = reduce.reduceat(values, starts, axis=1)
        out[:, empty] = own
        return out

    def over_list(values, accumulate, identity):  # intervals -> the list at each point
        edge = np.full((len(rows), 1), identity)
        if is_new:  # point i: intervals 0 .. i-1
            return np.hstack([edge, accumulate.accumulate(values, axis=1)])
        return np.hstack([accumulate.accumulate(values[:, ::-1], axis=1)[:, ::-1], edge])

    with np.errstate(invalid="ignore", divide="ignore"):
        if norm == "minmax":
            low = over_list(per_interval(np.minimum, np.inf).astype(np.float64), np.minimum, np.inf)
            spread = over_list(per_interval(np.maximum, -np.inf).astype(np.float64), np.maximum, -np.inf) - low
        else:
            total = over_list(per_interval(np.add, 0.0, distances.astype(np.float64)), np.add, 0.0)
            squares = over_list(per_interval(np.add, 0.0, np.square(distances, dtype=np.float64)), np.add, 0.0)
            low = total / size
            spread = np.sqrt(np.maximum(squares / size - low * low, 0.0))
    usable = (size > 1) & np.isfinite(low) & np.isfinite(spread) & (spread > 0)
    return np.where(usable, low, 0.0), np.where(usable, spread, np.inf)
