"""Which way reaches a top-1 target with the least backfill: the advisor's curves side by side.

``fastfill upgrade --dry-run --target-top1 T`` predicts, on the team's own truth (its judged
queries when it has them, as the gate; else the gallery's labels on the evaluation sample S),
the curve of every way the upgrade could go, and names the one that first reaches T:

- the map's way in each backfill order the gallery allows (sigma, the usage orders when the
  items have weights, random): ``advisor.predict`` (labels) or ``advisor.predict_judged``
  (judged queries) with that order's places of S;
- the shadow index (``dual_rrf``): no map, the old query in the old features of the items not
  yet re-embedded, the new query in the new features of those that are, merged by reciprocal
  rank fusion (``components.evaluation.fusion``), backfilled in random order (as teams do), in
  usage order when the items have weights (most-hit first, as teams also do), and in the map's
  sigma order when there is one;
- online backfilling (``reverse``: its metric-compatible reverse transformation): no map, the
  new query in the re-embedded items' new features, its reverse transform in the others' old
  features, merged by distance (the new side's times the transformation's gain), in the shadow
  index's orders;
- candidate reranking (``rerank_depth``, K; ``components.evaluation.rerank``): no map, the old
  query's K nearest items in every item's old features, the re-embedded ones among them ranked
  by the new query's distance, in the shadow index's orders;
- other maps (``other_maps``: the lambda-orthogonal affine map), each in random order and, when
  the items have weights, usage order (they have no sigma head).

The shadow index's top-1 needs no full ranking. The two parts are disjoint, so RRF gives each
part's first hit the same score and the tie rule puts the new part's first: the merged top-1 is
the new query's nearest re-embedded item whenever one exists (its own item excluded), else the
old query's nearest among the rest. S measures it with S as the gallery, as ``advisor.predict``
does; its error rate is scaled to the whole gallery by the ratio measured at 0%, where the
shadow index is the old model alone: the old queries against the whole stored gallery
(``NearestLabel``, or ``advisor.judged_anchor`` for judged queries), against S alone. Online
backfilling's top-1 is the nearest item of S by the merged distance (each S item by its new
features when re-embedded, else by its old ones against the query's reverse transform), scaled
the same way: at 0% it is the reverse-transformed queries against the whole old gallery.

Candidate reranking's top-1 is the new query's nearest re-embedded item among the old query's K
nearest items when one of them is re-embedded, else the old query's nearest item. On S as the
gallery the depth scales with the sample: a query's old top-K among the gallery's N items holds
about K * m / N items of S (m items), so S takes its top K_S = max(1, round(K * m / N)). Its
error rate is scaled as the shadow index's, by the same anchor: at 0% reranking is the old model
alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from fastfill.components.evaluation.retrieval import pairwise_distances
from fastfill.components.gallery.advice.advisor import (
    STEP,
    NearestLabel,
    fractions,
    judged_anchor,
    predict,
    predict_judged,
    ranks_of,
)
from fastfill.components.gallery.upgrade.planning import stand_in_ranks
from fastfill.components.gallery.upgrade.usage import backfill_order
from fastfill.components.platform.vocabulary import RERANK_DEPTH


def shadow_top1(sample_old: np.ndarray, sample_new: np.ndarray, labels: np.ndarray, ranks: np.ndarray,
                num_items: int, anchor_old_hits: np.ndarray | None = None, *, distance: str = "l2",
                step: float = STEP) -> dict:
    """The shadow index's (rrf) predicted top-1 at every ``step`` of the gallery. ``sample_old`` /
    ``sample_new``: S's old and new features; ``labels``: S's; ``ranks``: S's places in the
    backfill of ``num_items``; ``anchor_old_hits``: whether each S item's nearest item in the whole
    old gallery has its label (None: S is the gallery)."""

    labels = np.asarray(labels)
    m = len(labels)
    if m < 2:
        raise ValueError(f"the advisor needs an evaluation sample of at least 2 labeled items, got {m}")
    d_old = pairwise_distances(np.asarray(sample_old, np.float32), np.asarray(sample_old, np.float32), distance)
    d_new = pairwise_distances(np.asarray(sample_new, np.float32), np.asarray(sample_new, np.float32), distance)
    np.fill_diagonal(d_old, np.inf)  # a query never retrieves itself
    np.fill_diagonal(d_new, np.inf)
    return _shadow_prediction(d_old, d_new, lambda nearest: labels[nearest] == labels, ranks, num_items,
                              anchor_old_hits, step)


def online_top1(sample_old: np.ndarray, sample_new: np.ndarray, twins: np.ndarray, labels: np.ndarray,
                ranks: np.ndarray, num_items: int, anchor_hits: np.ndarray | None = None, *, gain: float = 1.0,
                distance: str = "l2", step: float = STEP) -> dict:
    """Online backfilling's predicted top-1 at every ``step`` of the gallery: ``twins`` are S's
    new features through the reverse transformation (the queries' old-space side); ``gain``
    multiplies the new space's distances (``reverse.new_scale ** 2`` for l2, 1 for cosine);
    ``anchor_hits``: whether each twin's nearest item in the whole old gallery has its label
    (None: S is the gallery). The rest as ``shadow_top1``."""

    labels = np.asarray(labels)
    if len(labels) < 2:
        raise ValueError(f"the advisor needs an evaluation sample of at least 2 labeled items, got {len(labels)}")
    d_old = pairwise_distances(np.asarray(twins, np.float32), np.asarray(sample_old, np.float32), distance)
    d_new = pairwise_distances(np.asarray(sample_new, np.float32), np.asarray(sample_new, np.float32), distance) * gain
    np.fill_diagonal(d_old, np.inf)
    np.fill_diagonal(d_new, np.inf)
    return _shadow_prediction(d_old, d_new, lambda nearest: labels[nearest] == labels, ranks, num_items,
                              anchor_hits, step, by_distance=True)


def shadow_top1_judged(query_old: np.ndarray, query_new: np.ndarray, judged, positions: np.ndarray,
                       sample_old: np.ndarray, sample_new: np.ndarray, ranks: np.ndarray, num_items: int,
                       anchor_old_hits: np.ndarray, *, distance: str = "l2", step: float = STEP,
                       gain: float | None = None) -> dict | None:
    """``shadow_top1`` with a team's judged queries for truth, as ``advisor.predict_judged`` has
    them: the judged queries (``query_old``/``query_new``: both models' features of them) search
    S (``positions``; its old and new features), a hit being an item the judgments call
    relevant; the queries with no relevant item in S are left out (None when fewer than 2 are
    left); ``anchor_old_hits``: whether each judged query's nearest item in the whole old
    gallery is relevant (``advisor.judged_anchor`` over the stored features). With ``gain``, online
    backfilling's prediction instead:
    ``query_old`` are the queries' reverse transforms, and the two sides merge by distance, the
    new side's times ``gain``."""

    found = _judged_distances(query_old, query_new, judged, positions, sample_old, sample_new, distance, gain)
    if found is None:
        return None
    used, d_old, d_new, is_hit = found
    prediction = _shadow_prediction(d_old, d_new, is_hit, ranks, num_items, np.asarray(anchor_old_hits)[used], step,
                                    by_distance=gain is not None)
    return _judged_result(prediction, judged, used)


def _judged_distances(query_old, query_new, judged, positions, sample_old, sample_new, distance: str,
                      gain: float | None = None):
    """(the judged queries used, their distances to S's old and new features, their own items at
    +inf, and ``is_hit``), or None when fewer than 2 queries have a relevant item in S."""
    used, relevant, own = judged.in_sample(np.asarray(positions, dtype=np.int64))
    if len(used) < 2:
        return None
    d_old = pairwise_distances(np.asarray(query_old, np.float32)[used], np.asarray(sample_old, np.float32), distance)
    d_new = pairwise_distances(np.asarray(query_new, np.float32)[used], np.asarray(sample_new, np.float32), distance)
    if gain is not None:
        d_new *= gain
    rows = np.flatnonzero(own >= 0)
    d_old[rows, own[rows]] = d_new[rows, own[rows]] = np.inf  # a query never retrieves itself
    relevant_sets = [set(r.tolist()) for r in relevant]

    def is_hit(nearest):
        return np.array([n in r for n, r in zip(nearest.tolist(), relevant_sets)])

    return used, d_old, d_new, is_hit


def _judged_result(prediction: dict, judged, used: np.ndarray) -> dict:
    return {**prediction, "truth": "judgments", "queries": int(len(used)),
            "queries_left_out": int(len(judged) - len(used))}


def sample_depth(depth: int, sample: int, num_items: int) -> int:
    """K_S, candidate reranking's depth on a sample of ``sample`` items of a gallery of
    ``num_items``: a query's old top ``depth`` among the gallery holds about ``depth * sample /
    num_items`` items of the sample; at least 1."""
    if isinstance(depth, bool) or not isinstance(depth, (int, np.integer)) or depth < 1:
        raise ValueError(f"the candidate depth must be an integer >= 1, got {depth!r}")
    return max(1, int(round(depth * sample / max(num_items, sample))))


class _Reranking:
    """Candidate reranking's top-1 on S, its candidates found once for every backfill order:
    each query row's old top K_S of S (``d_old``: its distances to S's old features, its own
    item at +inf and never a candidate), and their new distances (``d_new``)."""

    def __init__(self, d_old: np.ndarray, d_new: np.ndarray, is_hit, depth: int, num_items: int,
                 anchor_old_hits: np.ndarray | None, block: int = 256):
        self.sample = d_old.shape[1]
        self.depth, self.num_items, self.is_hit, self.anchor = int(depth), num_items, is_hit, anchor_old_hits
        self.sample_depth = min(sample_depth(depth, self.sample, num_items), self.sample)
        self.candidates = np.concatenate([  # row blocks: the full sort of each row, never the whole matrix's
            np.argsort(d_old[start:start + block], axis=1, kind="stable")[:, :self.sample_depth]
            for start in range(0, len(d_old), block)])
        self.valid = np.isfinite(np.take_along_axis(d_old, self.candidates, axis=1))  # not the row's own item
        self.new = np.take_along_axis(d_new, self.candidates, axis=1)

    def __call__(self, ranks: np.ndarray, step: float = STEP) -> dict:
        """The predicted curve with S's places in the backfill ``ranks``: at each point the
        nearest candidate by new distance among those re-embedded (the first in old order at a
        tie), else the old nearest; scaled as the shadow index's.

        A candidate of S stands for ``N / m`` of the gallery's candidates, and the query's answer
        improves as soon as any of them is re-embedded: with a fraction ``f`` of a random order
        done, that is ``1 - (1 - f)^(N/m)`` of them, not ``f``. So an S item counts as re-embedded
        at ``f`` when its place is below ``N (1 - (1 - f)^(N/m))`` (``f`` itself when S is the
        gallery). Without this, the prediction lagged the measured curve by up to 9.5 points of
        top-1 (K 50 and 200, 2,000 of 10,000 items); with it, by at most 3.6
        (benchmarks/rerank_advisor_check.py)."""
        points = fractions(step)
        rows = np.arange(len(self.candidates))
        hits = np.zeros((len(points), len(rows)))
        stands_for = self.num_items / max(self.sample, 1) if self.num_items > self.sample else 1.0
        ranks = np.asarray(ranks)
        for p, f in enumerate(points):
            reached = 1.0 - (1.0 - f) ** stands_for
            on_new = ranks < math.floor(round(reached * self.num_items, 9))
            scored = on_new[self.candidates] & self.valid
            best = np.where(scored, self.new, np.inf).argmin(axis=1)
            hits[p] = self.is_hit(np.where(scored.any(axis=1), self.candidates[rows, best], self.candidates[:, 0]))
        prediction = _scaled(hits, points, self.sample, self.num_items, self.anchor,
                             f"candidate reranking (K={self.depth})")
        return {**prediction, "depth": self.depth, "sample_depth": self.sample_depth}


def rerank_top1(sample_old: np.ndarray, sample_new: np.ndarray, labels: np.ndarray, ranks: np.ndarray,
                num_items: int, anchor_old_hits: np.ndarray | None = None, *, depth: int = RERANK_DEPTH,
                distance: str = "l2", step: float = STEP) -> dict:
    """Candidate reranking's predicted top-1 at every ``step`` of the gallery, ``depth`` (K) the
    candidates per query in the whole gallery: each S item's old top K_S of S (``sample_depth``;
    itself excluded), the nearest re-embedded one by new distance when there is one, else the
    old nearest. The arguments as ``shadow_top1``'s; the anchor is the shadow index's (at 0%
    both are the old model alone)."""
    labels = np.asarray(labels)
    if len(labels) < 2:
        raise ValueError(f"the advisor needs an evaluation sample of at least 2 labeled items, got {len(labels)}")
    return _labeled_reranking(sample_old, sample_new, labels, depth, num_items, anchor_old_hits, distance)(ranks, step)


def _labeled_reranking(sample_old, sample_new, labels: np.ndarray, depth: int, num_items: int,
                       anchor_old_hits: np.ndarray | None, distance: str) -> _Reranking:
    d_old = pairwise_distances(np.asarray(sample_old, np.float32), np.asarray(sample_old, np.float32), distance)
    d_new = pairwise_distances(np.asarray(sample_new, np.float32), np.asarray(sample_new, np.float32), distance)
    np.fill_diagonal(d_old, np.inf)  # a query never retrieves itself
    np.fill_diagonal(d_new, np.inf)
    return _Reranking(d_old, d_new, lambda nearest: labels[nearest] == labels, depth, num_items, anchor_old_hits)


def rerank_top1_judged(query_old: np.ndarray, query_new: np.ndarray, judged, positions: np.ndarray,
                       sample_old: np.ndarray, sample_new: np.ndarray, ranks: np.ndarray, num_items: int,
                       anchor_old_hits: np.ndarray, *, depth: int = RERANK_DEPTH, distance: str = "l2",
                       step: float = STEP) -> dict | None:
    """``rerank_top1`` with a team's judged queries for truth, as ``shadow_top1_judged`` takes
    them (the same anchor; None when fewer than 2 queries have a relevant item in S)."""
    reranking = _judged_reranking(query_old, query_new, judged, positions, sample_old, sample_new, depth, num_items,
                                  anchor_old_hits, distance)
    return None if reranking is None else reranking(ranks, step)


def _judged_reranking(query_old, query_new, judged, positions, sample_old, sample_new, depth: int, num_items: int,
                      anchor_old_hits, distance: str) -> Callable | None:
    """A callable ``ranks -> prediction`` of the judged rerank way, or None (as ``_judged_distances``)."""
    found = _judged_distances(query_old, query_new, judged, positions, sample_old, sample_new, distance)
    if found is None:
        return None
    used, d_old, d_new, is_hit = found
    reranking = _Reranking(d_old, d_new, is_hit, depth, num_items, np.asarray(anchor_old_hits)[used])
    return lambda ranks, step=STEP: _judged_result(reranking(ranks, step), judged, used)


def _shadow_prediction(d_old: np.ndarray, d_new: np.ndarray, is_hit, ranks: np.ndarray, num_items: int,
                       anchor_old_hits: np.ndarray | None, step: float, by_distance: bool = False) -> dict:
    """The merged top-1 of each query row (``d_old``/``d_new``: its distances to S's old and new
    features, its own item at +inf) at every ``step``: its nearest re-embedded item of S when one
    is, else its nearest of the rest (rrf); ``by_distance``: its nearest item by either side's
    distance, the new side's where the item is re-embedded (online backfilling; the new side
    first at a tie). ``is_hit(nearest)`` scores the rows' picks. Scaled to the whole gallery by
    ``anchor_old_hits`` (each row's hit against the whole old gallery) at 0%."""
    sample = d_old.shape[1]
    points = fractions(step)
    hits = np.zeros((len(points), len(d_old)))
    for p, f in enumerate(points):
        on_new = np.asarray(ranks) < math.floor(round(f * num_items, 9))
        new_part = np.where(on_new[None, :], d_new, np.inf)
        old_part = np.where(on_new[None, :], np.inf, d_old)
        if by_distance:
            rows = np.arange(len(d_old))
            from_new = new_part[rows, new_part.argmin(axis=1)] <= old_part[rows, old_part.argmin(axis=1)]
        else:
            from_new = np.isfinite(new_part).any(axis=1)
        hits[p] = is_hit(np.where(from_new, new_part.argmin(axis=1), old_part.argmin(axis=1)))
    return _scaled(hits, points, sample, num_items, anchor_old_hits,
                   "online backfilling" if by_distance else "shadow index (rrf)")


def _scaled(hits: np.ndarray, points: np.ndarray, sample: int, num_items: int, anchor_old_hits: np.ndarray | None,
            way: str) -> dict:
    """A way's prediction from its per-point, per-query hits on S: the error rate scaled to the
    whole gallery by the anchor's at 0% (None: S is the gallery), with its standard error."""
    top1 = hits.mean(axis=1)
    scale = 1.0 if anchor_old_hits is None else \
        (1 - float(np.mean(anchor_old_hits))) / max(1e-9, 1 - float(top1[0]))
    fpc = max(0.0, 1.0 - sample / max(num_items, sample))
    return {"way": way, "fractions": points.tolist(),
            "sample": sample, "items": int(num_items),
            "top1": np.clip(1 - (1 - top1) * scale, 0, 1).tolist(),
            "top1_se": np.sqrt(hits.var(axis=1, ddof=1) / hits.shape[1] * fpc).tolist(),
            "sample_top1": top1.tolist(), "error_scale": scale}


def first_reaching(prediction: dict, target: float) -> float | None:
    """The first fraction at which the predicted top-1 reaches ``target`` (a fraction), or None."""
    for f, value in zip(prediction["fractions"], prediction["top1"]):
        if value >= target - 1e-12:
            return float(f)
    return None


def compare_ways(target: float, predictions: dict[str, dict]) -> dict:
    """Each way's first fraction reaching ``target`` (top-1 as a fraction), the best way (the
    least backfill; at a tie the higher top-1 at 100%, then the way listed first), and a line."""
    ways = []
    for name, prediction in predictions.items():
        fraction = first_reaching(prediction, target)
        items = prediction["items"]
        ways.append({"way": name, "fraction": fraction,
                     "items": None if fraction is None else int(min(items, math.ceil(round(fraction * items, 9)))),
                     "top1_at_0": float(prediction["top1"][0]), "top1_full": float(prediction["top1"][-1])})
    reached = [w for w in ways if w["fraction"] is not None]
    best = min(reached, key=lambda w: (w["fraction"], -w["top1_full"])) if reached else None
    if best is None:
        line = (f"no way reaches top-1 {100 * target:.2f}% on the evaluation sample; the best at 100% is "
                f"{max(ways, key=lambda w: w['top1_full'])['way']} with "
                f"{100 * max(w['top1_full'] for w in ways):.2f}%")
    else:
        line = (f"{best['way']} reaches top-1 {100 * target:.2f}% first: after {100 * best['fraction']:.0f}% of the "
                f"gallery ({best['items']} items)" + "".join(
                    f"; {w['way']}: " + ("never" if w["fraction"] is None else f"{100 * w['fraction']:.0f}%")
                    for w in ways if w is not best))
    return {"target_top1": target, "ways": ways, "best": None if best is None else best["way"], "line": line}


class _Ways(NamedTuple):
    """How each way predicts on one truth (judged queries or labels): ``map_of(S through a map,
    its transformed_parts)`` gives that map's ``ranks -> prediction``; ``shadow``, ``online``
    (None without a reverse transformation) and ``rerank`` take S's places in the backfill."""

    map_of: Callable
    shadow: Callable
    online: Callable | None
    rerank: Callable | None


def ways_to_target(target: float, gallery, *, positions: np.ndarray, prefilled: np.ndarray, queries: np.ndarray,
                   old_side: np.ndarray, sample_transformed: np.ndarray, transformed_parts,
                   log_sigma2: np.ndarray | None, weights: np.ndarray | None, seed: int, distance: str = "l2",
                   judged: tuple | None = None, reverse=None, other_maps: dict | None = None,
                   rerank_depth: int = RERANK_DEPTH) -> dict:
    """``compare_ways`` for a gallery before its upgrade, on its judged queries when there are
    (``judged``: the judgments, the queries' new-model and serving-model features), else on its
    labels. ``positions``/``queries``: the evaluation sample S and its new-model features;
    ``prefilled``: what planning would embed first; ``old_side``: S's stored old-model features;
    ``sample_transformed``: S through the map; ``transformed_parts()``: the whole gallery through
    the map, as ``(first item, rows)`` parts; ``log_sigma2``/``weights``: what orders the map's
    sigma and the usage weights allow (None: not known); ``reverse``: online backfilling's
    reverse transformation (None: not among the ways); ``other_maps``: ``{name: (S through that
    map, its transformed_parts)}``, each a way in random (and usage) order; ``rerank_depth``:
    candidate reranking's K in the whole gallery (``gallery.upgrade.rerank_depth``)."""

    labels = gallery.labels()
    if labels is None and judged is None:
        return {"target_top1": target, "note": "the comparison of ways needs judged queries (--judgments) or the "
                "gallery's labels; this gallery has neither"}
    positions = np.asarray(positions, dtype=np.int64)
    gain = float(reverse.new_scale) ** 2 if reverse is not None and distance == "l2" else 1.0
    if judged is not None:  # judged queries first, as the gate and the prediction take them
        usable = len(judged[0].in_sample(positions)[0])
        if usable < 2:  # before any pass over the gallery: every way would leave these queries out
            return {"target_top1": target, "note": "the comparison of ways needs at least 2 judged queries with a "
                    f"relevant item in the evaluation sample ({len(positions)} items), and {usable} have one; raise "
                    "gallery.upgrade.eval_queries or judge more items"}
        ways = _judged_ways(gallery, judged, positions, queries, old_side, reverse, gain, distance, rerank_depth)
    else:
        ways = _labeled_ways(gallery, labels, positions, queries, old_side, reverse, gain, distance, rerank_depth)
    predictions = _predictions(ways, gallery.num_items, positions, prefilled, sample_transformed, transformed_parts,
                               log_sigma2, weights, seed, other_maps)
    result = compare_ways(target, predictions)
    first = next(iter(predictions.values()))
    truth = (f"{first['queries']} judged queries against {len(positions)} sampled items" if judged is not None
             else f"the labels of {len(positions)} sampled items")
    return {**result, "line": f"{result['line']} (on {truth})",
            "truth": "judgments" if judged is not None else "labels"}


def _old_parts(gallery):
    """The gallery's stored old-model features, as ``(first item, rows)`` parts."""
    return ((gallery.part_bounds(part)[0], gallery.features(gallery.model, part)) for part in range(gallery.num_parts))


def _judged_ways(gallery, judged: tuple, positions: np.ndarray, queries: np.ndarray, old_side: np.ndarray, reverse,
                 gain: float, distance: str, depth: int = RERANK_DEPTH) -> _Ways:
    """The ways predicted on the judged queries (``advisor.predict_judged``, ``shadow_top1_judged``,
    ``rerank_top1_judged``)."""
    judgments, query_new, query_old = judged
    num_items = gallery.num_items

    def map_of(sample_t, parts):
        anchor = judged_anchor(query_new, judgments, parts(), distance)
        return lambda ranks: predict_judged(query_new, judgments, positions, queries, sample_t, ranks, num_items,
                                            anchor, distance=distance)

    anchor_old = judged_anchor(query_old, judgments, _old_parts(gallery), distance)

    def shadow(ranks):
        return shadow_top1_judged(query_old, query_new, judgments, positions, old_side, queries, ranks,
                                  num_items, anchor_old, distance=distance)

    # the candidates are found once, for every order; the shadow index's anchor (at 0% both are the old model)
    rerank = _judged_reranking(query_old, query_new, judgments, positions, old_side, queries, depth, num_items,
                               anchor_old, distance)
    if reverse is None:
        return _Ways(map_of, shadow, None, rerank)
    twins = reverse(query_new)
    anchor_twins = judged_anchor(twins, judgments, _old_parts(gallery), distance)

    def online(ranks):
        return shadow_top1_judged(twins, query_new, judgments, positions, old_side, queries, ranks,
                                  num_items, anchor_twins, distance=distance, gain=gain)

    return _Ways(map_of, shadow, online, rerank)


def _labeled_ways(gallery, labels: np.ndarray, positions: np.ndarray, queries: np.ndarray, old_side: np.ndarray,
                  reverse, gain: float, distance: str, depth: int = RERANK_DEPTH) -> _Ways:
    """The ways predicted on the gallery's labels (``advisor.predict``, ``shadow_top1``,
    ``online_top1``, ``rerank_top1``), scaled to the whole gallery unless S is the gallery."""
    num_items = gallery.num_items
    full = len(positions) == num_items  # S is the gallery: nothing to scale

    def map_of(sample_t, parts):
        anchor = NearestLabel(queries, positions, labels, distance)
        for start, rows in parts():
            anchor.add(start, rows)
        hits = None if full else anchor.hits()
        return lambda ranks: predict(queries, sample_t, labels[positions], ranks, num_items, hits,
                                     distance=distance)

    def anchored(features):
        anchor = NearestLabel(features, positions, labels, distance)
        for start, rows in _old_parts(gallery):
            anchor.add(start, rows)
        return None if full else anchor.hits()

    anchor_old = anchored(old_side)

    def shadow(ranks):
        return shadow_top1(old_side, queries, labels[positions], ranks, num_items, anchor_old, distance=distance)

    # the candidates are found once, for every order; the shadow index's anchor (at 0% both are the old model)
    rerank = _labeled_reranking(old_side, queries, labels[positions], depth, num_items, anchor_old, distance)
    if reverse is None:
        return _Ways(map_of, shadow, None, rerank)
    twins = reverse(queries)
    anchor_twins = anchored(twins)

    def online(ranks):
        return online_top1(old_side, queries, twins, labels[positions], ranks, num_items, anchor_twins,
                           gain=gain, distance=distance)

    return _Ways(map_of, shadow, online, rerank)


def _predictions(ways: _Ways, num_items: int, positions: np.ndarray, prefilled: np.ndarray,
                 sample_transformed: np.ndarray, transformed_parts, log_sigma2: np.ndarray | None,
                 weights: np.ndarray | None, seed: int, other_maps: dict | None) -> dict[str, dict]:
    """Each way's predicted curve in each order it allows, by name, in the order ``compare_ways``
    breaks ties by: the map's, the other maps', then in each of the shadow index's orders the
    shadow index's, online backfilling's and candidate reranking's."""
    kinds = [kind for kind, needs in (("sigma", log_sigma2), ("usage_sigma", weights if log_sigma2 is not None
                                                                                       else None),
                                      ("usage", weights), ("random", True)) if needs is not None]
    predictions = {}
    map_way = ways.map_of(sample_transformed, transformed_parts)
    for kind in kinds:
        order = backfill_order(kind, num_items, seed, log_sigma2, weights)
        predictions[f"map, {kind} order"] = map_way(stand_in_ranks(order, prefilled, positions, seed))
    for name, (sample_t, parts) in (other_maps or {}).items():
        other_way = ways.map_of(sample_t, parts)
        for kind in [kind for kind, needs in (("usage", weights), ("random", True)) if needs is not None]:
            order = backfill_order(kind, num_items, seed, None, weights)
            predictions[f"{name}, {kind} order"] = other_way(stand_in_ranks(order, prefilled, positions, seed))
    shadow_kinds = [kind for kind, needs in (("random", True), ("usage", weights), ("sigma", log_sigma2))
                    if needs is not None]
    for kind in shadow_kinds:  # a team without a map breaks the usage order's ties by id, not by sigma
        order = backfill_order(kind, num_items, seed, log_sigma2 if kind == "sigma" else None, weights)
        # no map, nothing embedded before the backfill: S's own places
        ranks = ranks_of(order, positions)
        predictions[f"shadow index (rrf), {kind} order"] = ways.shadow(ranks)
        if ways.online is not None:
            predictions[f"online backfilling (metric-compatible), {kind} order"] = ways.online(ranks)
        if ways.rerank is not None:
            reranked = ways.rerank(ranks)
            predictions[f"{reranked['way']}, {kind} order"] = reranked
    return predictions
