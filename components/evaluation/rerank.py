"""Candidate reranking: the old index finds candidates, the new model ranks them.

The way of tools that migrate a vector index without a map (EmbedFlow's ``MigrationEngine``,
described in docs/methods.md, "Candidate reranking"): a query is embedded by the old model and
the old index returns its ``K`` nearest items (the candidates); the query is embedded again by
the new model, and the candidates whose new features are known (backfilled) are ranked by their
new distance to the new query. Up to ``sync`` of the candidates without new features, the first
in the old ranking, are embedded on the query path and ranked with them (its
``max_sync_misses``). The other candidates follow in their old order, and every item outside the
candidates keeps its old position: the old list's tail.

Measured on the protocol of ``backfill_curve``: query ``i`` against the other ``n - 1`` images,
at each point the first ``floor(alpha * n)`` items of ``order`` backfilled; top-1, top-5 and AP
over the whole list; ties in either model's distance rank a negative before a positive (the
protocol's pessimistic rule), and otherwise keep the old order. At ``alpha = 0`` without a
synchronous budget the list is the old model's (old/old); at ``alpha = 1`` it is the old top-K
re-ranked by the new model, which is below new/new wherever a relevant item is outside the
old top-K: ``candidate_gap`` measures that loss, G(K).

Where the tool returns only the scored candidates (its list is shorter than ``top_k`` while
the cache is cold), this measure puts the unscored candidates after them in their old order,
then the old tail: a list at least as good for AP, and the same top-1.

Implementation: one full sort of each query row's old keys gives the candidates and the old
positions of the positives. Only the first ``K`` positions change with the backfill, and the
number of positives among them does not, so each positive outside them adds the same
``j / position`` to AP at every point (``tail``). Inside them, an item's position at a point is
a count: of the scored candidates before it in the new order, or of the scored candidates plus
the unscored ones before it in the old order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fastfill.components.evaluation.retrieval import (
    ALPHA_POINTS_DEFAULT,
    BackfillCurve,
    BlockTotals,
    Prepared,
    as_features,
    block_distances,
    check_both_models,
    check_distance,
    check_labels,
    check_num_intermediate,
    check_order,
    curve_alphas,
    curve_from_totals,
    over_blocks,
    per_query_curve,
    ranking_keys,
)

__all__ = ["RerankVariant", "candidate_gap", "candidate_lists", "query_driven_order", "rerank_curves"]

@dataclass(frozen=True)
class RerankVariant:
    """A candidate depth ``K`` and a synchronous budget: candidates without new features that
    are embedded on the query path (``max_sync_misses``)."""

    depth: int
    sync: int = 0

    @property
    def name(self) -> str:
        return f"k{self.depth}" + (f"_sync{self.sync}" if self.sync else "")


def _check_depths(variants: Sequence[RerankVariant], n: int) -> list[RerankVariant]:
    variants = list(dict.fromkeys(variants))
    if not variants:
        raise ValueError("variants must name at least one candidate depth")
    for v in variants:
        if isinstance(v.depth, bool) or not isinstance(v.depth, (int, np.integer)) or not 1 <= v.depth <= n - 1:
            raise ValueError(f"candidate depth must be an integer in [1, {n - 1}] (the gallery less the query's own "
                             f"item), got {v.depth!r}")
        if isinstance(v.sync, bool) or not isinstance(v.sync, (int, np.integer)) or v.sync < 0:
            raise ValueError(f"sync (max_sync_misses) must be an integer >= 0, got {v.sync!r}")
    return variants


class _Inputs:
    """Checked inputs and what every block shares."""

    def __init__(self, query_old, query_new, gallery_old, gallery_new, labels, distance: str):
        self.distance = check_distance(distance)
        query_old, query_new, gallery_old, gallery_new = check_both_models(query_old, query_new, gallery_old,
                                                                           gallery_new)
        self.n = n = query_old.shape[0]
        self.labels = check_labels(labels, n)
        self.query_old, self.query_new = Prepared.of(query_old, self.distance), Prepared.of(query_new, self.distance)
        self.gallery_old = Prepared.of(gallery_old, self.distance)
        self.gallery_new = Prepared.of(gallery_new, self.distance)
        _, inverse, sizes = np.unique(self.labels, return_inverse=True, return_counts=True)
        self.num_positives = sizes[inverse] - 1

    def old_sorted(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``start .. stop-1``: every column in old order (the own item last), and whether
        each is a positive."""
        rows = np.arange(start, stop)
        positive = self.labels[rows, None] == self.labels[None, :]
        keys = ranking_keys(block_distances(self.query_old.rows(start, stop), self.gallery_old, self.distance),
                            positive, np.arange(len(rows)), rows)
        columns = np.argsort(keys, axis=1, kind="stable")
        return columns, np.take_along_axis(positive, columns, axis=1)


def candidate_lists(query_old: np.ndarray, gallery_old: np.ndarray, depth: int, *, labels: np.ndarray | None = None,
                    distance: str = "l2", block_size: int = 256) -> np.ndarray:
    """``(n, depth)`` the old index's candidates of each query row (the query's own item left
    out), nearest first; with ``labels``, the protocol's tie rule (a negative first)."""
    query_old = as_features(query_old, "query_old")
    n = query_old.shape[0]
    labels = np.zeros(n, dtype=np.int64) if labels is None else labels
    inputs = _Inputs(query_old, query_old, gallery_old, gallery_old, labels, distance)
    _check_depths([RerankVariant(depth)], n)
    out = np.empty((n, depth), dtype=np.int64)
    for start in range(0, n, block_size):
        stop = min(start + block_size, n)
        out[start:stop] = inputs.old_sorted(start, stop)[0][:, :depth]
    return out


def query_driven_order(candidates: np.ndarray, *, seed: int) -> np.ndarray:
    """The backfill order of a query-driven worker, from each query's candidates (``(n, K)``,
    ``candidate_lists``; a shallower depth is their first columns): the queries arrive in a
    random order (from ``seed``), each queues its candidates not queued before, in their old
    order, and the worker embeds the queue first in, first out; the items no query touched come
    last, in a random order. A permutation of ``0 .. n-1``."""
    candidates = np.asarray(candidates, dtype=np.int64)
    n = candidates.shape[0]
    rng = np.random.default_rng(seed)
    stream = candidates[rng.permutation(n)].ravel()
    _, first = np.unique(stream, return_index=True)  # each item's first touch
    touched = stream[np.sort(first)]
    untouched = np.setdiff1d(np.arange(n), touched)
    return np.concatenate([touched, untouched[rng.permutation(len(untouched))]]).astype(np.int64)


class _Block:
    """One block of query rows: its candidates, their new order and the AP of the tail."""

    def __init__(self, inputs: _Inputs, start: int, stop: int, depths: Sequence[int]):
        self.start, self.stop = start, stop
        columns, positive = inputs.old_sorted(start, stop)
        self.num_positives = inputs.num_positives[start:stop]
        kmax = max(depths)
        self.columns, self.positive = columns[:, :kmax], positive[:, :kmax]
        q_new = inputs.query_new.rows(start, stop)
        new = block_distances(q_new, inputs.gallery_new, inputs.distance)
        new_keys = new.view(np.uint32) << np.uint32(1)
        self.new_keys = np.take_along_axis(new_keys, self.columns, axis=1) | self.positive.astype(np.uint32)
        # the tail: positives at old positions >= K keep them, and their index among the row's
        # positives, whatever happens inside the first K
        hit = positive[:, :-1]  # the own item (last) is never a positive
        j = np.cumsum(hit, axis=1)
        position = np.arange(1, hit.shape[1] + 1)
        precision = np.where(hit, j / position, 0.0)
        # tail[k] = sum of the precisions at positions >= k
        suffix = np.cumsum(precision[:, ::-1], axis=1)[:, ::-1]
        self.tail = {k: suffix[:, k] if k < suffix.shape[1] else np.zeros(stop - start) for k in depths}
        self.tail_top5 = {k: hit[:, k:5].any(axis=1) for k in depths}  # a depth under 5 leaves old places in the top 5

    def ranks(self, depth: int) -> np.ndarray:
        """Each of the first ``depth`` candidates' index in the new order (stable: the old order
        at an equal key)."""
        return np.argsort(self.new_keys[:, :depth], axis=1, kind="stable")

    def measure(self, depth: int, sync: int, by_new: np.ndarray, available: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Top-1 hit, top-5 hit and AP of each row, the candidates in ``available`` (``(b,
        depth)`` bool, old order) having new features."""
        scored = available.copy()
        if sync:
            missing = ~available
            scored |= missing & (np.cumsum(missing, axis=1) <= sync)
        count = scored.sum(axis=1)
        # scored: their rank among the scored in the new order; unscored: after every scored, in old order
        in_new = np.take_along_axis(scored, by_new, axis=1)
        position_new = np.empty_like(by_new)
        np.put_along_axis(position_new, by_new, np.cumsum(in_new, axis=1) - 1, axis=1)
        position_old = count[:, None] + np.cumsum(~scored, axis=1) - 1
        position = np.where(scored, position_new, position_old)
        positive = self.positive[:, :depth]
        top1 = (positive & (position == 0)).any(axis=1)
        top5 = (positive & (position < 5)).any(axis=1) | self.tail_top5[depth]
        big = np.iinfo(np.int64).max
        sorted_positions = np.sort(np.where(positive, position, big), axis=1)
        j = np.arange(1, depth + 1)
        head = np.where(sorted_positions < big, j / (sorted_positions + 1.0), 0.0).sum(axis=1)
        ap = np.divide(head + self.tail[depth], self.num_positives,
                       out=np.zeros(len(head)), where=self.num_positives > 0)
        return np.asarray(top1), np.asarray(top5), ap


def rerank_curves(query_old: np.ndarray, query_new: np.ndarray, gallery_old: np.ndarray, gallery_new: np.ndarray,
                  labels: np.ndarray, order: np.ndarray | None = None, *,
                  variants: Sequence[RerankVariant] = (RerankVariant(50),), distance: str = "l2",
                  num_intermediate: int = ALPHA_POINTS_DEFAULT, counts: Sequence[int] | None = None,
                  block_size: int = 256, workers: int = 2, per_query: bool = False
                  ) -> dict[RerankVariant, BackfillCurve] | dict[RerankVariant, tuple]:
    """Candidate reranking's backfill curve for each variant (depth, synchronous budget), in one
    pass. With ``per_query``, each variant's ``(top1, ap)`` instead, both ``(B + 2, n)``, as
    ``per_query_curve`` gives them.

    Args:
        query_old, gallery_old: ``(n, d_old)`` old-model features of the evaluation images (the
            old index and the old query).
        query_new, gallery_new: ``(n, d_new)`` new-model features of the same images.
        labels: ``(n,)`` integer class ids.
        order: permutation of ``0 .. n-1``, the backfill order; ``None`` means ``0 .. n-1``.
        variants: ``RerankVariant``s, each depth in ``[1, n - 1]``.
        distance, num_intermediate: as for ``backfill_curve``.
        counts: instead of ``num_intermediate``'s even points, the numbers of backfilled items
            at each point (non-decreasing, in ``[0, n]``), as ``curve_at_counts`` takes them.
        block_size: query rows whose distances are computed together (about ``24 * block_size * n``
            bytes per worker).
        workers: threads over blocks.

    Raises:
        ValueError: naming the offending argument, for any malformed input.
    """
    inputs = _Inputs(query_old, query_new, gallery_old, gallery_new, labels, distance)
    num_intermediate = check_num_intermediate(num_intermediate)
    n = inputs.n
    variants = _check_depths(variants, n)
    order = check_order(order, n)
    for name, value in (("block_size", block_size), ("workers", workers)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if counts is None:
        cuts = np.array([(i * n) // (num_intermediate + 1) for i in range(num_intermediate + 2)], dtype=np.int64)
        alphas = curve_alphas(num_intermediate)
    else:
        cuts = np.array([int(c) for c in counts], dtype=np.int64)
        if not len(cuts) or (cuts < 0).any() or (cuts > n).any() or (np.diff(cuts) < 0).any():
            raise ValueError(f"counts must be a non-empty, non-decreasing list of integers in [0, {n}], got {counts!r}")
        alphas = cuts / n
    # item -> the first point at which it has new features: #{p : cuts[p] <= its place in order}
    place = np.empty(n, dtype=np.int64)
    place[order] = np.arange(n)
    first_point = np.searchsorted(cuts, place, side="right")
    depths = sorted({v.depth for v in variants})

    def run(start: int) -> dict[RerankVariant, BlockTotals]:
        block = _Block(inputs, start, min(start + block_size, n), depths)
        ready = first_point[block.columns]
        totals = {}
        for depth in depths:
            by_new = block.ranks(depth)
            for variant in (v for v in variants if v.depth == depth):
                rows = block.stop - block.start
                top1 = np.empty((len(cuts), rows), dtype=bool)
                top5 = np.zeros(len(cuts), dtype=np.int64)
                ap = np.empty((len(cuts), rows))
                for p in range(len(cuts)):
                    hit1, hit5, ap[p] = block.measure(depth, variant.sync, by_new, ready[:, :depth] <= p)
                    top1[p], top5[p] = hit1, np.count_nonzero(hit5)
                at_start = top1[0]
                totals[variant] = BlockTotals(
                    top1=np.count_nonzero(top1, axis=1), top5=top5, ap=ap.sum(axis=1),
                    negative_flips=np.count_nonzero(at_start & ~top1, axis=1),
                    positive_flips=np.count_nonzero(~at_start & top1, axis=1),
                    correct_at_start=int(np.count_nonzero(at_start)),
                    query_top1=top1 if per_query else None, query_ap=ap if per_query else None)
        return totals

    totals = over_blocks(run, n, block_size, workers)
    if per_query:
        return {v: (totals[v].query_top1, totals[v].query_ap) for v in variants}
    return {v: curve_from_totals(alphas, totals[v], inputs.labels) for v in variants}


def candidate_gap(query_old: np.ndarray, query_new: np.ndarray, gallery_old: np.ndarray, gallery_new: np.ndarray,
                  labels: np.ndarray, depths: Sequence[int], *, distance: str = "l2",
                  groups: dict[str, np.ndarray] | None = None) -> dict[str, dict]:
    """G(K) = M_T - M_{T|S_K}: how much of the new model's own retrieval (new query, every
    item's new features: new/new) is lost when it may only rank the old model's top-K, for top-1
    and mAP, by K. ``groups[name]`` is a boolean mask of the queries to average over (e.g. the
    old model's unseen classes); ``"all"`` is every query. Per group: ``queries``, ``native``
    ({top1, map}), and per K ``restricted`` and ``gap`` ({top1, map}), ``recall``, the share
    of a query's relevant items inside its old top-K, and ``precision``, the share of its old
    top-K that is relevant."""
    depths = sorted({int(k) for k in depths})
    variants = [RerankVariant(k) for k in depths]
    labels = check_labels(labels, np.asarray(query_old).shape[0])
    n = labels.shape[0]
    everything = np.arange(n)  # at the last point every item has new features
    restricted = rerank_curves(query_old, query_new, gallery_old, gallery_new, labels, everything,
                               variants=variants, distance=distance, num_intermediate=0, per_query=True)
    native_top1, native_ap = per_query_curve(query_new, gallery_new, gallery_new, labels, distance=distance,
                                             num_intermediate=0)
    _, inverse, sizes = np.unique(labels, return_inverse=True, return_counts=True)
    has_positive = sizes[inverse] > 1
    recall, precision = {}, {}
    deepest = candidate_lists(query_old, gallery_old, depths[-1], labels=labels, distance=distance)
    for k in depths:
        inside = (labels[deepest[:, :k]] == labels[:, None]).sum(axis=1)
        recall[k] = np.divide(inside, sizes[inverse] - 1, out=np.zeros(n), where=has_positive)
        precision[k] = inside / k
    out = {}
    for name, mask in {"all": np.ones(n, dtype=bool), **(groups or {})}.items():
        mask = np.asarray(mask, dtype=bool)
        if mask.shape != (n,) or not mask.any():
            raise ValueError(f"group {name!r} must be a boolean mask of {n} queries with at least one True")
        ap_mask = mask & has_positive

        def mean(values: np.ndarray, over: np.ndarray) -> float:
            return float(values[over].mean()) if over.any() else 0.0

        native = {"top1": mean(native_top1[-1], mask), "map": mean(native_ap[-1], ap_mask)}
        by_depth = {}
        for v in variants:
            pair = restricted[v]
            assert isinstance(pair, tuple)  # per_query gives (top1, ap)
            top1, ap = pair
            kept = {"top1": mean(top1[-1], mask), "map": mean(ap[-1], ap_mask)}
            by_depth[v.depth] = {"restricted": kept, "gap": {m: native[m] - kept[m] for m in kept},
                                 "recall": mean(recall[v.depth], ap_mask), "precision": mean(precision[v.depth], mask)}
        out[name] = {"queries": int(mask.sum()), "native": native, "by_depth": by_depth}
    return out


def depth_advice(gaps: dict[int, float], *, at: int, epsilon: float = 0.01) -> dict:
    """A candidate depth from a measured G(K) curve (``gaps[K]``, one metric): the smallest
    measured K whose gap is at most ``epsilon``. ``SAFE`` where ``at`` (the depth meant to be
    served) already is within ``epsilon``; ``EXPAND`` where a deeper measured K is; ``UNSAFE``
    where none is: no measured depth keeps the new model's quality, and a backfill (or a map)
    is the way."""
    if not gaps:
        raise ValueError("gaps must hold at least one measured depth")
    within = sorted(k for k, g in gaps.items() if g <= epsilon)
    depth = within[0] if within else None
    label = "UNSAFE" if depth is None else ("SAFE" if at in gaps and gaps[at] <= epsilon else "EXPAND")
    return {"label": label, "depth": depth, "at": at, "epsilon": epsilon}
