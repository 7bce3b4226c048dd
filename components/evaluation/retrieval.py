"""Retrieval metrics and backfill curves for a model upgrade.

Protocol
--------
The same ``n`` evaluation images are both the queries and the gallery. Query ``i`` never sees
its own gallery item ``i``: it is neither a result nor a positive. Every other gallery item with
the query's label is a positive.

During a backfill the gallery is a mix of two feature sets for the same images: items already
re-embedded use the new model's features (``gallery_new``), the others still use the old
model's features, already transformed into the new space (``gallery_old``). Items are
backfilled in ``order``; at fraction ``alpha`` the first ``floor(alpha * n)`` items of ``order``
are new. Queries always use the new model (``query``). The curve is sampled at
``alpha_i = i / (B + 1)``, ``i = 0 .. B + 1`` (both ends included), and ``floor(alpha_i * n)``
is computed exactly in integers as ``(i * n) // (B + 1)``.

Metrics, per curve point:

- ``top1`` / ``top5`` (CMC): fraction of queries with a positive among their 1 / 5 nearest
  gallery items. Queries without any positive count, as failures.
- ``map``: mean over queries with at least one positive of the average precision over the
  full ranking, ``AP = (1/R) * sum_k k / rank_k`` for the ``R`` positives at ranks
  ``rank_1 < ... < rank_R``. It is 0.0 if no query has a positive.
- Flips, from each query's top-1 correctness compared with ``alpha = 0``: a negative flip is a
  query right at ``alpha = 0`` and wrong at ``alpha``; ``nfr1`` divides their number by the
  queries right at ``alpha = 0`` (0 if none). Positive flips and ``pfr1`` are the reverse.

Ties are pessimistic: items are ranked by distance, and a negative at exactly the same distance
as a positive ranks before it. Ties among positives only, or among negatives only, change
nothing, so every metric is independent of the order of the gallery's indices.

Implementation
--------------
Distances are computed once per side (query vs ``gallery_new``, query vs ``gallery_old``), in
blocks of query rows; each block then serves every curve point. The gallery columns are
permuted into backfill order, so at every point the mixed gallery is the new side's first
``m`` columns followed by the old side's remaining ones: two slice copies, no masking.

Ranking uses one exact integer key per (query, item): the bit pattern of a non-negative
float32 is monotonic in its value, so ``(bits << 1) | is_positive`` fits in a uint32 and
orders by distance first and puts negatives before positives at equal distance. The query's
own item gets a key above every other (and an even one, so never a hit). One SIMD ``np.sort``
per row then yields the ranking, and the low bits of the sorted keys are the hit pattern.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from fastfill.components.evaluation.ordering import check_permutation
from fastfill.components.platform.vocabulary import DISTANCES

__all__ = [
    "ALPHA_POINTS_DEFAULT",
    "DISTANCES",
    "BackfillCurve",
    "backfill_curve",
    "curve_alphas",
    "pairwise_distances",
    "per_query_curve",
    "retrieval_metrics",
]

ALPHA_POINTS_DEFAULT = 20
"""Default number of intermediate curve points ``B``; the curve has ``B + 2`` points."""


# Above every real key: a finite or infinite distance gives at most (0x7F800000 << 1) | 1.
# Even, so the query's own item is never read as a hit.
_SELF_KEY = np.uint32(0xFFFFFFFE)
# Query rows ranked together at every curve point. Their keys on both sides plus scratch take
# about 13 * n bytes per row (4 MB for n = 10,000), so they stay in cache across the points;
# 16 to 64 rows measured alike, whole blocks were ~25% slower.
_CHUNK_ROWS = 32
# Norms below this count as zero vectors for cosine (they stay zero after normalisation).
_TINY_NORM = np.float32(1e-30)


def curve_alphas(num_intermediate: int = ALPHA_POINTS_DEFAULT) -> np.ndarray:
    """Backfill fractions ``i / (B + 1)`` for ``i = 0 .. B + 1`` (``B = num_intermediate``)."""
    num_intermediate = check_num_intermediate(num_intermediate)
    return np.arange(num_intermediate + 2, dtype=np.float64) / (num_intermediate + 1)


def pairwise_distances(
    queries: np.ndarray, gallery: np.ndarray, distance: str = "l2"
) -> np.ndarray:
    """Distances between every query and every gallery item, float32 ``(nq, ng)``, all >= 0.

    ``"l2"`` is the squared euclidean distance ``|q|^2 + |g|^2 - 2 q.g`` (same ranking as the
    euclidean one); ``"cosine"`` is ``1 - cos`` on L2-normalised rows, where a zero vector has
    cosine 0 with everything. Rounding can make either slightly negative; it is clamped to 0.

    Raises:
        ValueError: unknown ``distance``, inputs that are not 2-D, differing feature dims,
            non-finite features, or features so large that the distances overflow float32.
    """
    distance = check_distance(distance)
    queries = as_features(queries, "queries", min_rows=1)
    gallery = as_features(gallery, "gallery", min_rows=1)
    if queries.shape[1] != gallery.shape[1]:
        raise ValueError(
            f"queries have {queries.shape[1]} feature dims but gallery has {gallery.shape[1]}; "
            "both must come from the same embedding space"
        )
    return block_distances(Prepared.of(queries, distance), Prepared.of(gallery, distance), distance)


@dataclass
class BackfillCurve:
    """Retrieval metrics along a backfill, one entry per curve point (see the module docs)."""

    alphas: np.ndarray
    top1: np.ndarray
    top5: np.ndarray
    map: np.ndarray
    nfr1: np.ndarray
    pfr1: np.ndarray
    negative_flips: np.ndarray
    positive_flips: np.ndarray

    # Plain means weight every curve point equally; the trapezoid areas integrate over alpha.
    # With evenly spaced points they differ only in how the two end points are weighted.
    @property
    def top1_auc(self) -> float:
        return float(np.mean(self.top1))

    @property
    def top5_auc(self) -> float:
        return float(np.mean(self.top5))

    @property
    def map_auc(self) -> float:
        return float(np.mean(self.map))

    @property
    def top1_trapz(self) -> float:
        return float(np.trapezoid(self.top1, self.alphas))

    @property
    def top5_trapz(self) -> float:
        return float(np.trapezoid(self.top5, self.alphas))

    @property
    def map_trapz(self) -> float:
        return float(np.trapezoid(self.map, self.alphas))

    @property
    def nfr1_mean(self) -> float:
        """Mean negative flip rate over all curve points (``alpha = 0``, always 0, included)."""
        return float(np.mean(self.nfr1))

    def to_dict(self) -> dict:
        """JSON-ready summary: per-point lists (flip counts as ints) and scalar summaries."""
        return {
            "alpha": [float(v) for v in self.alphas],
            "top1": [float(v) for v in self.top1],
            "top5": [float(v) for v in self.top5],
            "map": [float(v) for v in self.map],
            "nfr1": [float(v) for v in self.nfr1],
            "pfr1": [float(v) for v in self.pfr1],
            "negative_flips": [int(v) for v in self.negative_flips],
            "positive_flips": [int(v) for v in self.positive_flips],
            "top1_auc": self.top1_auc,
            "top5_auc": self.top5_auc,
            "map_auc": self.map_auc,
            "top1_trapz": self.top1_trapz,
            "top5_trapz": self.top5_trapz,
            "map_trapz": self.map_trapz,
            "nfr1_mean": self.nfr1_mean,
        }


def backfill_curve(
    query: np.ndarray,
    gallery_new: np.ndarray,
    gallery_old: np.ndarray,
    labels: np.ndarray,
    order: np.ndarray | None = None,
    *,
    distance: str = "l2",
    num_intermediate: int = ALPHA_POINTS_DEFAULT,
    block_size: int = 1024,
    workers: int = 2,
) -> BackfillCurve:
    """Top-1, top-5, mAP and top-1 flips at each point of the backfill curve.

    Args:
        query: ``(n, d)`` new-model features of the evaluation images (the queries).
        gallery_new: ``(n, d)`` new-model features of the same images.
        gallery_old: ``(n, d)`` old-side features of the same images, already transformed
            into the new model's space.
        labels: ``(n,)`` integer class ids.
        order: permutation of ``0 .. n-1``, the backfill order; ``None`` means ``0 .. n-1``.
        distance: ``"l2"`` or ``"cosine"`` (see :func:`pairwise_distances`).
        num_intermediate: ``B``, points strictly between 0 and 1; the curve has ``B + 2``.
        block_size: query rows per block; each worker holds about ``9 * block_size * n``
            bytes (the block's distances to both gallery sides, and its label mask).
        workers: threads over blocks (numpy releases the GIL while sorting).

    Ties between a positive and a negative at exactly equal distance rank the negative first,
    so the result does not depend on the order of the gallery's indices.

    Raises:
        ValueError: naming the offending argument, for any malformed input.
    """
    distance = check_distance(distance)
    num_intermediate = check_num_intermediate(num_intermediate)
    query, gallery_new, gallery_old, labels, order = _check_curve_inputs(query, gallery_new, gallery_old, labels, order)
    n = query.shape[0]

    # Number of backfilled items at each point: floor(i * n / (B + 1)), exactly.
    cuts = [(i * n) // (num_intermediate + 1) for i in range(num_intermediate + 2)]
    totals = evaluate_blocks(query, gallery_new, gallery_old, labels, order, distance, cuts,
                       block_size, workers)
    return curve_from_totals(curve_alphas(num_intermediate), totals, labels)


def curve_at_counts(
    query: np.ndarray,
    gallery_new: np.ndarray,
    gallery_old: np.ndarray,
    labels: np.ndarray,
    order: np.ndarray | None,
    counts: list[int],
    *,
    distance: str = "l2",
    block_size: int = 1024,
    workers: int = 2,
) -> BackfillCurve:
    """Like :func:`backfill_curve`, at given numbers of backfilled items (the first
    ``counts[p]`` items of ``order`` new) instead of evenly spaced points: what a real backfill
    measures as its chunks land. ``alphas`` are ``counts / n``."""
    distance = check_distance(distance)
    query, gallery_new, gallery_old, labels, order = _check_curve_inputs(query, gallery_new, gallery_old, labels, order)
    n = query.shape[0]
    counts = [int(c) for c in counts]
    if not counts or any(c < 0 or c > n for c in counts):
        raise ValueError(f"counts must be a non-empty list of integers in [0, {n}], got {counts!r}")
    totals = evaluate_blocks(query, gallery_new, gallery_old, labels, order, distance, counts, block_size, workers)
    return curve_from_totals(np.asarray(counts, dtype=np.float64) / n, totals, labels)


def per_query_curve(
    query: np.ndarray,
    gallery_new: np.ndarray,
    gallery_old: np.ndarray,
    labels: np.ndarray,
    order: np.ndarray | None = None,
    *,
    distance: str = "l2",
    num_intermediate: int = ALPHA_POINTS_DEFAULT,
) -> tuple[np.ndarray, np.ndarray]:
    """Like :func:`backfill_curve`, but each query's own numbers: ``(top1, ap)``, both
    ``(B + 2, n)``, top-1 hit (bool) and average precision per curve point and query (AP is 0
    for a query without positives; :func:`backfill_curve`'s ``map`` leaves those out). For
    statistics over queries, e.g. a paired bootstrap of two maps."""
    distance = check_distance(distance)
    num_intermediate = check_num_intermediate(num_intermediate)
    query, gallery_new, gallery_old, labels, order = _check_curve_inputs(query, gallery_new, gallery_old, labels, order)
    n = query.shape[0]
    cuts = [(i * n) // (num_intermediate + 1) for i in range(num_intermediate + 2)]
    totals = evaluate_blocks(query, gallery_new, gallery_old, labels, order, distance, cuts, 1024, 2, per_query=True)
    assert totals.query_top1 is not None and totals.query_ap is not None  # kept by per_query
    return totals.query_top1, totals.query_ap


def retrieval_metrics(
    query: np.ndarray, gallery: np.ndarray, labels: np.ndarray, *, distance: str = "l2"
) -> dict:
    """``{"top1", "top5", "map"}`` of ``query`` against one gallery of the same ``n`` images.

    Same protocol and tie rule as :func:`backfill_curve` (self excluded, negatives first at
    equal distance), e.g. for old-vs-old or new-vs-new retrieval.
    """
    distance = check_distance(distance)
    query = as_features(query, "query")
    gallery = as_features(gallery, "gallery", query.shape)
    labels = check_labels(labels, query.shape[0])
    order = np.arange(query.shape[0])
    totals = evaluate_blocks(query, gallery, gallery, labels, order, distance, [0], 1024, 2)
    curve = curve_from_totals(np.zeros(1), totals, labels)
    return {"top1": float(curve.top1[0]), "top5": float(curve.top5[0]), "map": float(curve.map[0])}


# --------------------------------------------------------------------------------------------
# Validation


def check_distance(distance: str) -> str:
    if distance not in DISTANCES:
        raise ValueError(f"distance must be one of {DISTANCES}, got {distance!r}")
    return distance


def check_num_intermediate(num_intermediate: int) -> int:
    if isinstance(num_intermediate, bool) or not isinstance(num_intermediate, (int, np.integer)) \
            or num_intermediate < 0:
        raise ValueError(
            f"num_intermediate must be an integer >= 0 (points strictly between alpha 0 and 1), "
            f"got {num_intermediate!r}"
        )
    return int(num_intermediate)


def as_features(x, name: str, shape: tuple[int, int] | None = None, min_rows: int = 2
                 ) -> np.ndarray:
    """``x`` as a C-contiguous float32 (n, d) array (copied only if needed), checked finite."""
    try:
        arr = np.ascontiguousarray(x, dtype=np.float32)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name} must be a numeric (n, d) array: {error}") from None
    if arr.ndim != 2:
        raise ValueError(f"{name} must be a 2-D (n, d) feature array, got shape {arr.shape}")
    if shape is not None and arr.shape != tuple(shape):
        raise ValueError(
            f"{name} has shape {arr.shape} but query has shape {tuple(shape)}; pass features "
            "of the same n images, in the same row order and embedding space"
        )
    if arr.shape[0] < min_rows:
        raise ValueError(
            f"{name} has {arr.shape[0]} rows; it needs at least {min_rows}"
            + (" (each query needs another image to retrieve)" if min_rows > 1 else "")
        )
    if arr.shape[1] < 1:
        raise ValueError(f"{name} has no feature dimensions (shape {arr.shape})")
    finite = np.isfinite(arr).all(axis=1)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        raise ValueError(
            f"{name} has NaN/inf (or values beyond float32 range) in {bad.size} rows, first "
            f"{bad[:5].tolist()}; fix or drop those images before evaluating"
        )
    return arr


def check_both_models(query_old, query_new, gallery_old, gallery_new) -> tuple[np.ndarray, ...]:
    """The features of both models for the ways without a map (the shadow index, online
    backfilling, candidate reranking): each model's queries and gallery of the same ``n`` images,
    checked (``as_features``); returns them in that order."""
    query_old = as_features(query_old, "query_old")
    n = query_old.shape[0]
    gallery_old = as_features(gallery_old, "gallery_old", query_old.shape)
    query_new = as_features(query_new, "query_new")
    if query_new.shape[0] != n:
        raise ValueError(f"query_new has {query_new.shape[0]} rows but query_old has {n}; pass both models' "
                         "features of the same images, in the same row order")
    gallery_new = as_features(gallery_new, "gallery_new", query_new.shape)
    return query_old, query_new, gallery_old, gallery_new


def _check_curve_inputs(query, gallery_new, gallery_old, labels, order) -> tuple:
    """The arrays of a backfill curve, checked and converted (see :func:`backfill_curve`)."""
    query = as_features(query, "query")
    n, dim = query.shape
    gallery_new = as_features(gallery_new, "gallery_new", (n, dim))
    gallery_old = as_features(gallery_old, "gallery_old", (n, dim))
    return query, gallery_new, gallery_old, check_labels(labels, n), check_order(order, n)


def check_labels(labels, n: int) -> np.ndarray:
    arr = np.asarray(labels)
    if arr.ndim != 1 or arr.shape[0] != n:
        raise ValueError(f"labels must have shape ({n},), one per image, got shape {arr.shape}")
    if not (np.issubdtype(arr.dtype, np.integer) or arr.dtype == bool):
        raise ValueError(
            f"labels must be integer class ids, got dtype {arr.dtype}; convert them, "
            "e.g. with np.unique(labels, return_inverse=True)[1]"
        )
    return arr.astype(np.int64, copy=False)


def check_order(order, n: int) -> np.ndarray:
    return np.arange(n) if order is None else check_permutation(order, n)


# --------------------------------------------------------------------------------------------
# Distances


@dataclass(frozen=True)
class Prepared:
    """Features ready for :func:`block_distances`: L2-normalised for cosine, squared norms for l2."""

    x: np.ndarray
    sq: np.ndarray | None

    @classmethod
    def of(cls, x: np.ndarray, distance: str) -> Prepared:
        sq = np.einsum("ij,ij->i", x, x)
        if not np.isfinite(sq).all():
            raise ValueError(
                "feature norms overflow float32; rescale the features (e.g. L2-normalise them)"
            )
        if distance == "cosine":
            norms = np.maximum(np.sqrt(sq), _TINY_NORM)
            return cls(x / norms[:, None], None)
        return cls(x, sq)

    def rows(self, start: int, stop: int) -> Prepared:
        return Prepared(self.x[start:stop], None if self.sq is None else self.sq[start:stop])


def block_distances(q: Prepared, g: Prepared, distance: str) -> np.ndarray:
    d = q.x @ g.x.T
    # In-place updates: the (rows, n) matrix is the largest array alive, so no temporaries.
    if distance == "l2":
        assert q.sq is not None and g.sq is not None  # Prepared.of keeps the squared norms for l2
        d *= -2.0
        d += q.sq[:, None]
        d += g.sq[None, :]
    else:
        np.subtract(1.0, d, out=d)
    np.maximum(d, 0.0, out=d)
    if not np.isfinite(d.max()):  # NaN propagates through both maxima
        raise ValueError(
            "distances overflow float32; rescale the features (e.g. L2-normalise them)"
        )
    return d


# --------------------------------------------------------------------------------------------
# Ranking


@dataclass
class BlockTotals:
    """Per-point sums over a block of queries (arrays of length P = number of curve points)."""

    top1: np.ndarray
    top5: np.ndarray
    ap: np.ndarray
    negative_flips: np.ndarray
    positive_flips: np.ndarray
    correct_at_start: int
    # With ``per_query``: (P, rows) top-1 hits and AP of each query of the block, in row order.
    query_top1: np.ndarray | None = None
    query_ap: np.ndarray | None = None

    def __add__(self, other: BlockTotals) -> BlockTotals:
        joined = (None, None) if self.query_top1 is None else (
            np.concatenate([self.query_top1, other.query_top1], axis=1),
            np.concatenate([self.query_ap, other.query_ap], axis=1))
        return BlockTotals(
            self.top1 + other.top1,
            self.top5 + other.top5,
            self.ap + other.ap,
            self.negative_flips + other.negative_flips,
            self.positive_flips + other.positive_flips,
            self.correct_at_start + other.correct_at_start,
            *joined,
        )


def evaluate_blocks(query, gallery_new, gallery_old, labels, order, distance, cuts, block_size,
                    workers, per_query: bool = False) -> BlockTotals:
    """Sum the metrics over all queries, with the first ``cuts[p]`` items of ``order`` new;
    ``per_query`` also keeps each query's top-1 hit and AP per point."""
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) \
            or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    n = query.shape[0]
    q = Prepared.of(query, distance)
    # Columns in backfill order: at every point the new side is a prefix of the columns.
    g_old = Prepared.of(gallery_old[order], distance)
    # One gallery on both sides (retrieval_metrics): compute its distances once.
    g_new = g_old if gallery_new is gallery_old else Prepared.of(gallery_new[order], distance)
    column_labels = labels[order]
    self_column = np.empty(n, dtype=np.int64)
    self_column[order] = np.arange(n)
    # Positives per query: the other images of its class, whatever the gallery side.
    _, inverse, class_sizes = np.unique(labels, return_inverse=True, return_counts=True)
    num_positives = class_sizes[inverse] - 1

    def run(start: int) -> BlockTotals:
        stop = min(start + block_size, n)
        return _rank_block(
            q.rows(start, stop), g_new, g_old, distance, labels[start:stop], column_labels,
            self_column[start:stop], num_positives[start:stop], cuts, per_query,
        )

    return over_blocks(run, n, int(block_size), int(workers))


def over_blocks(run, n: int, block_size: int, workers: int):
    """``run(start)`` for every block of query rows ``start .. start + block_size - 1`` of
    ``n``, on ``workers`` threads; the blocks' results added in row order (a block's result
    is a BlockTotals, or a dict of them added key by key)."""
    starts = range(0, n, block_size)
    if workers == 1 or len(starts) == 1:
        results = [run(s) for s in starts]
    else:
        with ThreadPoolExecutor(max_workers=min(workers, len(starts))) as pool:
            results = list(pool.map(run, starts))
    total = results[0]
    for block in results[1:]:
        total = {key: total[key] + block[key] for key in total} if isinstance(total, dict) else total + block
    return total


def ranking_keys(distances: np.ndarray, positive: np.ndarray, rows: np.ndarray,
                 self_column: np.ndarray) -> np.ndarray:
    """Turn a (rows, n) distance block into ranking keys, in place (see the module docs): the
    distance's bits shifted left, the positive flag in the lowest bit (a negative first at an
    equal distance), each row's own column (``rows[i], self_column[i]``) after every other."""
    keys = distances.view(np.uint32)
    # Distances are >= 0 (the clamp may leave -0.0, whose sign bit the shift drops).
    np.left_shift(keys, 1, out=keys)
    np.bitwise_or(keys, positive, out=keys)
    keys[rows, self_column] = _SELF_KEY
    return keys


def _rank_block(q, g_new, g_old, distance, row_labels, column_labels, self_column,
                num_positives, cuts, per_query: bool = False) -> BlockTotals:
    b = q.x.shape[0]
    rows = np.arange(b)
    positive = row_labels[:, None] == column_labels[None, :]
    keys_old = ranking_keys(block_distances(q, g_old, distance), positive, rows, self_column)
    keys_new = (keys_old if g_new is g_old
                else ranking_keys(block_distances(q, g_new, distance), positive, rows, self_column))
    del positive

    num_points = len(cuts)
    correct1 = np.empty((num_points, b), dtype=bool)
    top5 = np.zeros(num_points, dtype=np.int64)
    ap = np.zeros(num_points, dtype=np.float64)
    query_ap = np.zeros((num_points, b), dtype=np.float64) if per_query else None
    # Rank a few rows at a time, through all curve points: their keys and the scratch buffers
    # then stay in cache, where a whole block would stream through memory at every point.
    for start in range(0, b, _CHUNK_ROWS):
        chunk = slice(start, min(start + _CHUNK_ROWS, b))
        _rank_chunk(keys_new[chunk], keys_old[chunk], num_positives[chunk], cuts,
                    correct1[:, chunk], top5, ap, None if query_ap is None else query_ap[:, chunk])

    at_start = correct1[0]
    return BlockTotals(
        top1=np.count_nonzero(correct1, axis=1),
        top5=top5,
        ap=ap,
        negative_flips=np.count_nonzero(at_start & ~correct1, axis=1),
        positive_flips=np.count_nonzero(~at_start & correct1, axis=1),
        correct_at_start=int(np.count_nonzero(at_start)),
        query_top1=correct1 if per_query else None,
        query_ap=query_ap,
    )


def _rank_chunk(keys_new, keys_old, num_positives, cuts, correct1, top5, ap, query_ap=None) -> None:
    """Rank rows at every curve point; write top-1 hits into ``correct1`` (and each row's AP
    into ``query_ap`` when given), add to the sums."""
    r, n = keys_new.shape
    # Every positive shows up exactly once per sorted row, so flatnonzero returns the hits
    # grouped by row with known sizes. The row sums of AP = (1/R) sum_k k / rank_k then need,
    # per hit: the weight k / R (k: its index among its row's hits, 1-based) and the offset
    # that turns its flat index into its rank. Rows without positives have no hits.
    hit_row = np.repeat(np.arange(r), num_positives)
    row_start = np.cumsum(num_positives) - num_positives
    hit_k = np.arange(1, hit_row.size + 1) - row_start[hit_row]
    hit_weight = hit_k / num_positives[hit_row]
    hit_offset = hit_row * n - 1

    mixed = np.empty_like(keys_new)
    hits = np.empty((r, n), dtype=np.uint8)
    hit_mask = hits.view(bool)
    for p, m in enumerate(cuts):
        mixed[:, :m] = keys_new[:, :m]
        mixed[:, m:] = keys_old[:, m:]
        mixed.sort(axis=1)
        np.bitwise_and(mixed, 1, out=hits, casting="unsafe")
        correct1[p] = hit_mask[:, 0]
        top5[p] += np.count_nonzero(hit_mask[:, :5].any(axis=1))
        ranks = np.flatnonzero(hit_mask)
        ranks -= hit_offset
        precision = hit_weight / ranks
        ap[p] += np.sum(precision)
        if query_ap is not None:
            query_ap[p] = np.bincount(hit_row, weights=precision, minlength=r)


def curve_from_totals(
    alphas: np.ndarray, totals: BlockTotals, labels: np.ndarray
) -> BackfillCurve:
    n = labels.shape[0]
    _, class_sizes = np.unique(labels, return_counts=True)
    # Queries whose class has another image; the others are skipped for mAP.
    num_ap_queries = int(class_sizes[class_sizes > 1].sum())
    wrong_at_start = n - totals.correct_at_start
    return BackfillCurve(
        alphas=np.asarray(alphas, dtype=np.float64),
        top1=totals.top1 / n,
        top5=totals.top5 / n,
        map=totals.ap / num_ap_queries if num_ap_queries else np.zeros(len(alphas)),
        nfr1=(totals.negative_flips / totals.correct_at_start if totals.correct_at_start
              else np.zeros(len(alphas))),
        pfr1=(totals.positive_flips / wrong_at_start if wrong_at_start
              else np.zeros(len(alphas))),
        negative_flips=np.asarray(totals.negative_flips, dtype=np.int64),
        positive_flips=np.asarray(totals.positive_flips, dtype=np.int64),
    )
