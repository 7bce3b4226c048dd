"""The budget advisor: the backfill curve predicted before the backfill, and where to stop.

What is known before any gallery item is re-embedded: the transformed features h(old) and
the backfill order (sigma's, or random) of every item, and the upgrade's evaluation sample S,
labeled items whose new-model features are computed when the upgrade is planned. The
prediction (docs/upgrade.md, "How much backfill is enough"):

- mAP at fraction f: the curve of S measured on S alone (S the queries and the gallery, the
  first f of the order new within S, as ``BackfillMeter`` measures it). Average precision
  does not change, in expectation, when the gallery is a uniform sample of itself, so S
  alone estimates it.
- top-1 at fraction f: the same curve of S, corrected for the gallery's size. Top-1 does
  depend on it (a denser gallery has a nearer same-class neighbour). At 0% the correction is
  measured exactly: the S queries searched against the whole transformed gallery give the
  whole gallery's error rate, and its ratio to the S-only curve's first point scales the S-only
  error rate at every point of the curve.
- Each point has a standard error from the spread of the S queries' own hits and average
  precisions (with the finite-population factor 1 - |S|/N): the sample's size, not the
  method, is the limit of the prediction's accuracy (docs/results.md measures both).

The recommended stop for a marginal gain ``g`` (top-1 points per 5% of the gallery) is the
first fraction from which no later point of the predicted curve is worth reaching at that
rate: for every later f', top1(f') - top1(f) < g * (f' - f) / 5%.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from fastfill.components.gallery.store import ObjectMissing
from fastfill.components.gallery.upgrade.backfill import transformed_rows
from fastfill.components.gallery.upgrade.planning import (
    eval_ranks,
    order_of,
    stored_eval_sample,
    transformed_key,
    upgrade_key,
)

STEP = 0.05  # the advisor's curve: every 5% of the gallery
ADVICE = "advice.json"


def _retrieval():
    """The evaluation's ranking code (components/evaluation/retrieval.py), loaded on first use: it
    loads scipy, which `fastfill status` and the services' start-up do without."""
    from fastfill.components.evaluation import retrieval

    return retrieval


def fractions(step: float = STEP) -> np.ndarray:
    points = int(round(1 / step))
    return np.arange(points + 1) / points


def ranks_of(order: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Where each of ``positions`` comes in the backfill ``order``."""
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    return rank[np.asarray(positions, dtype=np.int64)]


class NearestLabel:
    """The S queries' nearest item (self excluded) in a gallery read part by part, so a gallery
    of any size is searched in the memory of one part: ``add`` each part of transformed
    features, then ``hits`` says which queries' nearest item has their label."""

    def __init__(self, queries: np.ndarray, positions: np.ndarray, labels: np.ndarray, distance: str = "l2"):
        self.queries, self.positions = np.asarray(queries, dtype=np.float32), np.asarray(positions, dtype=np.int64)
        self.labels, self.distance = np.asarray(labels), distance
        self.best = np.full(len(self.positions), np.inf)
        self.best_label = np.full(len(self.positions), -1, dtype=np.int64)
        self.seen = 0

    def add(self, start: int, features: np.ndarray, block: int = 4096) -> None:
        pairwise_distances = _retrieval().pairwise_distances
        for offset in range(0, len(features), block):
            rows = np.asarray(features[offset:offset + block], dtype=np.float32)
            first = start + offset
            d = pairwise_distances(self.queries, rows, self.distance)
            inside = (self.positions >= first) & (self.positions < first + len(rows))
            d[np.flatnonzero(inside), self.positions[inside] - first] = np.inf  # not itself
            nearest = d.argmin(axis=1)
            value = d[np.arange(len(d)), nearest]
            better = value < self.best
            self.best[better] = value[better]
            self.best_label[better] = self.labels[first + nearest[better]]
            self.seen += len(rows)

    def hits(self) -> np.ndarray:
        return self.best_label == self.labels[self.positions]


def predict(queries: np.ndarray, transformed: np.ndarray, labels: np.ndarray, ranks: np.ndarray, num_items: int,
            anchor_hits: np.ndarray | None = None, *, distance: str = "l2", step: float = STEP) -> dict:
    """The predicted curve at every ``step`` of the gallery.

    ``queries``: new-model features of S; ``transformed``: h(old) of S; ``labels``: of S;
    ``ranks``: each S item's place in the backfill order of the ``num_items`` items;
    ``anchor_hits``: whether each S query's nearest item in the whole transformed gallery has
    its label (``NearestLabel``); None leaves top-1 as S measures it (S is the whole gallery)."""
    # the ranking code of the evaluation, per query (its public curves give only the means)
    evaluate_blocks = _retrieval().evaluate_blocks

    m = len(queries)
    if m < 2:
        raise ValueError(f"the advisor needs an evaluation sample of at least 2 labeled items, got {m}")
    points = fractions(step)
    counts = [int((ranks < math.floor(round(f * num_items, 9))).sum()) for f in points]
    local = np.argsort(ranks, kind="stable")
    totals = evaluate_blocks(np.asarray(queries, np.float32), np.asarray(queries, np.float32),
                       np.asarray(transformed, np.float32), np.asarray(labels), local, distance, counts, 1024, 2,
                       per_query=True)
    hits, ap = totals.query_top1.astype(np.float64), totals.query_ap
    _, inverse, sizes = np.unique(labels, return_inverse=True, return_counts=True)
    with_positive = sizes[inverse] > 1
    fpc = max(0.0, 1.0 - m / max(num_items, m))  # finite population: S is drawn without replacement
    top1 = hits.mean(axis=1)
    # the gallery's size scales the error rate: the ratio measured at 0% is kept along the curve
    scale = 1.0 if anchor_hits is None else (1 - float(np.mean(anchor_hits))) / max(1e-9, 1 - float(top1[0]))
    top1_se = np.sqrt(hits.var(axis=1, ddof=1) / m * fpc)
    if anchor_hits is not None:  # the correction's own error: the anchor and the first point are paired
        top1_se = np.sqrt(top1_se ** 2 + np.var(np.asarray(anchor_hits, float) - hits[0], ddof=1) / m * fpc)
    ap = ap[:, with_positive]
    return {
        "fractions": points.tolist(), "sample": m, "items": int(num_items),
        "top1": np.clip(1 - (1 - top1) * scale, 0, 1).tolist(), "top1_se": top1_se.tolist(),
        "map": ap.mean(axis=1).tolist(), "map_se": np.sqrt(ap.var(axis=1, ddof=1) / max(1, ap.shape[1]) * fpc).tolist(),
        "sample_top1": top1.tolist(), "error_scale": scale,
    }


def recommend(prediction: dict, gain_below: float, step: float = STEP) -> dict:
    """The recommended stop for a marginal gain of ``gain_below`` points per ``step`` of the
    prediction's metric (top-1, or the label-free agreement)."""
    if not gain_below > 0:
        raise ValueError(f"the marginal gain must be positive (points per 5% of the gallery), got {gain_below!r}")
    metric = prediction.get("metric", "top1")
    f = np.asarray(prediction["fractions"])
    values = 100 * np.asarray(prediction[metric])
    stop = len(f) - 1
    for k in range(len(f)):
        later = np.arange(k + 1, len(f))
        if not len(later) or np.all(values[later] - values[k] < gain_below * (f[later] - f[k]) / step):
            stop = k
            break
    items = prediction["items"]
    embedded = min(items, math.ceil(round(f[stop] * items, 9)))
    result = {"gain_below": gain_below, "fraction": float(f[stop]), "items": int(embedded),
              "items_saved": int(items - embedded), "metric": metric}
    if metric == "top1":
        return {**result, "top1": float(values[stop] / 100), "top1_full": float(values[-1] / 100),
                "top1_given_up": float((values[-1] - values[stop]) / 100),
                "map": float(prediction["map"][stop]), "map_full": float(prediction["map"][-1])}
    return {**result, metric: float(values[stop] / 100), f"{metric}_full": float(values[-1] / 100),
            f"{metric}_given_up": float((values[-1] - values[stop]) / 100)}


def predict_judged(queries: np.ndarray, judged, positions: np.ndarray, sample_new: np.ndarray,
                   sample_transformed: np.ndarray, ranks: np.ndarray, num_items: int, anchor_hits: np.ndarray,
                   *, distance: str = "l2", step: float = STEP) -> dict | None:
    """The predicted curve from judged queries, with the protocol of the labeled one: the judged
    queries (``queries``: their new-model features) search the evaluation sample S (uniform, its
    new and transformed features known, each item backfilled once the backfill passes its
    ``ranks``), a hit being an item the judgments call relevant; top-1 is scaled to the whole
    gallery by ``anchor_hits`` (each query's nearest item in the whole transformed gallery,
    relevant or not), mAP is S's. Queries with no relevant item in S are left out; None when
    fewer than 2 are left (judgments too sparse for a sample: the gate still measures them)."""
    pairwise_distances = _retrieval().pairwise_distances

    used, relevant, own = judged.in_sample(positions)
    if len(used) < 2:
        return None
    d_new = pairwise_distances(np.asarray(queries, np.float32)[used], np.asarray(sample_new, np.float32), distance)
    d_old = pairwise_distances(np.asarray(queries, np.float32)[used], np.asarray(sample_transformed, np.float32),
                               distance)
    rows = np.flatnonzero(own >= 0)
    d_new[rows, own[rows]] = d_old[rows, own[rows]] = np.inf  # a query never retrieves itself
    points = fractions(step)
    relevant_mask = np.zeros(d_new.shape, dtype=bool)
    for q, rel in enumerate(relevant):
        relevant_mask[q, rel] = True
    halves = sample_halves(d_new.shape[1])
    hits = np.zeros((len(points), len(used)))
    ap = np.zeros((len(points), len(used)))
    drawn = np.zeros(len(points))
    for p, f in enumerate(points):
        d = np.where(ranks[None, :] < math.floor(round(f * num_items, 9)), d_new, d_old)
        hits[p] = relevant_mask[np.arange(len(d)), d.argmin(axis=1)]
        drawn[p] = _halves_variance(d, relevant_mask, halves)
        for q, (row, rel) in enumerate(zip(d, relevant)):
            rank_of = np.argsort(np.argsort(row, kind="stable"), kind="stable")
            found = np.sort(rank_of[rel]) + 1  # 1-based places of the relevant items
            ap[p, q] = float(np.mean(np.arange(1, len(found) + 1) / found))
    m = len(used)
    fpc = max(0.0, 1.0 - len(positions) / max(num_items, len(positions)))
    top1 = hits.mean(axis=1)
    anchor = np.asarray(anchor_hits, dtype=np.float64)[used]
    scale = (1 - float(anchor.mean())) / max(1e-9, 1 - float(top1[0]))
    queries_variance = hits.var(axis=1, ddof=1) / m * fpc + np.var(anchor - hits[0], ddof=1) / m * fpc
    top1_se = np.sqrt(queries_variance + drawn * fpc)
    return {"truth": "judgments", "fractions": points.tolist(), "sample": int(len(positions)), "queries": int(m),
            "queries_left_out": int(len(judged.relevant) - m), "items": int(num_items),
            "top1": np.clip(1 - (1 - top1) * scale, 0, 1).tolist(), "top1_se": top1_se.tolist(),
            "top1_se_queries": np.sqrt(queries_variance).tolist(),
            "map": ap.mean(axis=1).tolist(), "map_se": np.sqrt(ap.var(axis=1, ddof=1) / m).tolist(),
            "sample_top1": top1.tolist(), "error_scale": scale}


SPLITS = 8  # the sample's halves that measure how much its own draw moves the prediction


def sample_halves(items: int, splits: int = SPLITS) -> list[np.ndarray]:
    """``splits`` seeded random halves of an evaluation sample of ``items`` (masks: the first half)."""
    rng = np.random.default_rng(items)
    halves = []
    for _ in range(splits):
        first = np.zeros(items, dtype=bool)
        first[rng.choice(items, size=items // 2, replace=False)] = True
        halves.append(first)
    return halves


def _halves_variance(d: np.ndarray, relevant: np.ndarray, halves: list[np.ndarray]) -> float:
    """The variance that the evaluation sample's own draw adds to the judged top-1 at one point
    (which items the sample holds decides each query's nearest one; the queries are the gate's
    own, so their sampling is not this): the judged queries search each of the two ``halves`` of
    every split, and half the squared difference of the two halves' top-1 is the variance of a
    half's top-1: an upper bound of a whole sample's, which holds twice the items (half of it
    covered the miss at a rate short of the stated one, docs/results.md). ``d``: query-by-sample
    distances at that point (new features where backfilled, transformed elsewhere);
    ``relevant``: query-by-sample judgments."""
    rows = np.arange(len(d))
    total = 0.0
    for first in halves:
        a = relevant[rows, np.where(first[None, :], d, np.inf).argmin(axis=1)].mean()
        b = relevant[rows, np.where(first[None, :], np.inf, d).argmin(axis=1)].mean()
        total += (a - b) ** 2 / 2
    return total / len(halves)


def judged_anchor(queries: np.ndarray, judged, parts: Iterable[tuple[int, np.ndarray]], distance: str = "l2"
                  ) -> np.ndarray:
    """Whether each judged query's nearest item in the whole transformed gallery (given as
    ``(first item, rows)`` parts; itself excluded) is relevant to it."""
    pairwise_distances = _retrieval().pairwise_distances

    queries = np.asarray(queries, dtype=np.float32)
    best = np.full(len(queries), np.inf)
    nearest = np.full(len(queries), -1, dtype=np.int64)
    for start, rows in parts:
        d = pairwise_distances(queries, np.asarray(rows, np.float32), distance)
        inside = (judged.query_positions >= start) & (judged.query_positions < start + len(rows))
        d[np.flatnonzero(inside), judged.query_positions[inside] - start] = np.inf
        index = d.argmin(axis=1)
        value = d[np.arange(len(d)), index]
        better = value < best
        best[better], nearest[better] = value[better], start + index[better]
    return np.array([n in set(rel.tolist()) for n, rel in zip(nearest, judged.relevant)])


AGREEMENT_K = 10  # the label-free prediction compares each query's 10 nearest items


def predict_agreement(queries: np.ndarray, transformed: np.ndarray, ranks: np.ndarray, num_items: int, *,
                      k: int = AGREEMENT_K, distance: str = "l2", step: float = STEP) -> dict:
    """The label-free prediction, for a gallery with neither labels nor judged queries: at every
    ``step``, the agreement (a fraction; points in the logs) of the mixed gallery's top-``k``
    with the finished upgrade's top-``k`` for the evaluation sample's items as queries (their
    new features are known). The sample is its own gallery, as for top-1 and mAP: its items
    count as backfilled once the backfill passes their ``ranks``. It says how far the mixed
    gallery already answers as the finished one will, not whether either answer is right."""
    from fastfill.components.gallery.gate.judged_gate import agreement_at

    queries = np.asarray(queries, dtype=np.float32)
    transformed = np.asarray(transformed, dtype=np.float32)
    m = len(queries)
    if m < 2:
        raise ValueError(f"the advisor needs an evaluation sample of at least 2 items, got {m}")
    points = fractions(step)
    local = np.argsort(ranks, kind="stable")
    own = np.arange(m)
    values = []
    for f in points:
        count = int((ranks < math.floor(round(f * num_items, 9))).sum())
        mixed = transformed.copy()
        mixed[local[:count]] = queries[local[:count]]
        values.append(agreement_at(queries, mixed, queries, own, k=k, distance=distance) / 100)
    return {"metric": "agreement", "k": min(k, m - 1), "fractions": points.tolist(), "sample": m,
            "items": int(num_items), "agreement": values}


def advise(parts: Iterable[tuple[int, np.ndarray]], order: np.ndarray, positions: np.ndarray,
           queries: np.ndarray, labels: np.ndarray, *, distance: str = "l2", gain_below: float | None = None,
           ranks: np.ndarray | None = None) -> dict:
    """The prediction (and, with ``gain_below``, the recommended stop) from the gallery's
    transformed features given as ``(first item, rows)`` parts, the backfill ``order``, and the
    evaluation sample: ``positions`` of its items, ``queries`` their new-model features;
    ``ranks``: their places in the backfill where these are not their places in ``order``
    (``plan.stand_in_ranks``)."""
    positions = np.asarray(positions, dtype=np.int64)
    anchor = NearestLabel(queries, positions, labels, distance)
    transformed = np.empty((len(positions), np.asarray(queries).shape[1]), dtype=np.float32)
    for start, rows in parts:
        anchor.add(start, rows)
        inside = (positions >= start) & (positions < start + len(rows))
        transformed[inside] = rows[positions[inside] - start]
    if anchor.seen != len(order):
        raise ValueError(f"the transformed parts hold {anchor.seen} items, the order {len(order)}")
    full = len(positions) == len(order)  # S is the gallery: nothing to shift
    ranks = ranks_of(order, positions) if ranks is None else ranks
    prediction = predict(queries, transformed, labels[positions], ranks, len(order),
                         None if full else anchor.hits(), distance=distance)
    if gain_below is not None:
        prediction["recommendation"] = recommend(prediction, gain_below)
    return prediction


def at_stop(prediction: dict, gain_below: float | None) -> dict | None:
    """The recommendation for ``gain_below`` (recomputed when it differs from the stored one)."""
    if gain_below is None:
        return prediction.get("recommendation")
    stored = prediction.get("recommendation")
    return stored if stored and stored["gain_below"] == gain_below else recommend(prediction, gain_below)


def describe(prediction: dict, measured: dict[float, float] | None = None, gain_below: float | None = None,
             every: int = 2) -> list[str]:
    """Lines for the terminal: the predicted curve every ``every`` steps (10% by default), the
    measured top-1 beside it where the backfill has reached, and the recommended stop."""
    f = prediction["fractions"]
    if prediction.get("metric") == "agreement":
        lines = [f"predicted agreement with the finished upgrade (label-free: the gallery has no labels, and judged "
                 f"queries are measured by the gate only; from {prediction['sample']} items of "
                 f"{prediction['items']:,}, each a query; the share of "
                 f"its {prediction['k']} nearest items that the finished upgrade also returns, not whether they are "
                 "right):", "  backfilled   agreement"]
        lines += [f"  {100 * f[i]:>5.0f}%      {100 * prediction['agreement'][i]:6.2f}" for i in range(0, len(f), every)]
        stop = at_stop(prediction, gain_below)
        if stop is not None:
            lines.append(
                f"recommended stop for a gain below {stop['gain_below']:g} agreement points per 5%: "
                f"{100 * stop['fraction']:.0f}% ({stop['items']:,} items embedded, {stop['items_saved']:,} not); "
                f"predicted agreement {100 * stop['agreement']:.2f}% there")
        return lines
    source = (f"{prediction['queries']} judged queries against {prediction['sample']} sampled items of "
              f"{prediction['items']:,}" if prediction.get("truth") == "judgments" else
              f"{prediction['sample']} labeled items of {prediction['items']:,}")
    lines = [f"predicted backfill curve (from {source}; ± one standard error):",
             "  backfilled   top-1            mAP" + ("              measured top-1" if measured else "")]
    for i in range(0, len(f), every):
        row = (f"  {100 * f[i]:>5.0f}%      {100 * prediction['top1'][i]:6.2f} ± {100 * prediction['top1_se'][i]:.2f}"
               f"   {100 * prediction['map'][i]:6.2f} ± {100 * prediction['map_se'][i]:.2f}")
        if measured:
            near = [v for k, v in measured.items() if abs(k - f[i]) < 1e-9]
            row += f"    {100 * near[0]:6.2f}" if near else ""
        lines.append(row)
    stop = at_stop(prediction, gain_below)
    if stop is not None:
        lines.append(
            f"recommended stop for a gain below {stop['gain_below']:g} top-1 points per 5%: {100 * stop['fraction']:.0f}% "
            f"({stop['items']:,} items embedded, {stop['items_saved']:,} not); predicted top-1 {100 * stop['top1']:.2f}% "
            f"there, {100 * stop['top1_full']:.2f}% at 100% ({_given_up(stop['top1_given_up'])})")
    return lines


def _given_up(points: float) -> str:
    """What stopping early costs against the full backfill, in top-1 points (a fraction here)."""
    if points >= 0:
        return f"{100 * points:.2f} points given up"
    return f"{-100 * points:.2f} points above it: the predicted curve falls after the stop"


# ------------------------------------------------------------------------------------------------
# A planned upgrade's advice, kept beside its plan


def advice_key(upgrade_id: str) -> str:

    return upgrade_key(upgrade_id, ADVICE)


def stored_advice(store, upgrade_id: str) -> dict | None:

    try:
        return store.get_json(advice_key(upgrade_id))
    except ObjectMissing:
        return None


def predict_upgrade(positions: np.ndarray, queries: np.ndarray, sample_transformed: np.ndarray, ranks: np.ndarray,
                    num_items: int, parts, order: np.ndarray, *, labels: np.ndarray | None, judged: tuple | None,
                    distance: str = "l2", gain_below: float | None = None) -> dict:
    """The prediction an upgrade makes (when planning, and in the dry run): from the judged
    queries when there are (``judged``: (judgments, their new-model features); ``predict_judged``),
    else from the labels (``advise``), else the label-free agreement (``predict_agreement``).
    ``positions``/``queries``/``sample_transformed``/``ranks``: the evaluation sample; ``parts()``
    gives the whole gallery's transformed features as ``(first item, rows)`` parts."""
    prediction = None
    if judged is not None:  # judged queries first, as the gate: the sample is their gallery
        judgments, judged_queries = judged
        anchor = judged_anchor(judged_queries, judgments, parts(), distance)
        prediction = predict_judged(judged_queries, judgments, positions, queries, sample_transformed, ranks,
                                    num_items, anchor, distance=distance)
    if prediction is None and labels is not None:
        prediction = advise(parts(), order, positions, queries, labels, distance=distance, ranks=ranks)
    elif prediction is None:  # nothing says what is right: how far the mixed gallery agrees with the finished one
        prediction = predict_agreement(queries, sample_transformed, ranks, num_items, distance=distance)
    if gain_below is not None:
        prediction["recommendation"] = recommend(prediction, gain_below)
    return prediction


def advise_upgrade(gallery, plan, gain_below: float | None = None) -> dict | None:
    """The prediction of a planned upgrade (``predict_upgrade``) from what its plan stored
    (transformed parts, order, evaluation sample, judged queries), written to
    upgrades/<id>/advice.json. None when the upgrade has no evaluation sample (eval_queries 0):
    nothing to predict from."""
    from fastfill.components.gallery.inputs.judgments import stored_judged

    if plan.eval_queries < 2:
        return None
    store = gallery.store
    positions, queries = stored_eval_sample(store, plan.upgrade_id)

    def transformed_parts():
        return ((gallery.part_bounds(p)[0], gallery.part_rows(transformed_key(plan.upgrade_id, p), p))
                for p in range(gallery.num_parts))

    judged = stored_judged(store, plan.upgrade_id)
    prediction = predict_upgrade(positions, queries, transformed_rows(gallery, plan.upgrade_id, positions),
                                 eval_ranks(store, plan, positions), plan.num_items, transformed_parts,
                                 order_of(store, plan.upgrade_id), labels=gallery.labels(),
                                 judged=judged[:2] if judged is not None else None, distance=plan.distance,
                                 gain_below=gain_below)
    prediction["upgrade"] = plan.upgrade_id
    store.put_json(advice_key(plan.upgrade_id), prediction)
    return prediction
