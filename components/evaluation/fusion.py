"""Merging the ranked lists of a shadow index: reciprocal rank fusion and normalised scores.

The shadow-index playbook (docs/methods.md) searches two indexes per query: the old model's
query in the old features of the items not yet re-embedded, the new model's query in the new
features of those that are. These functions merge such ranked lists into one, for serving
(``fastfill search --merge``); ``components.evaluation.dual_curve`` measures the same merges
along a backfill.

Conventions, for both merges:

- ``lists_of_ids``: one 1-D integer array per list, best first, **in model order, the oldest
  model first** (``[old, new]``). Negative ids are padding (faiss's ``-1`` where an index holds
  fewer than ``k`` items) and are dropped, with their distances. An id may appear once per list.
- Ranks are 1-based positions in a list.
- **Tie rule.** At equal merged score the hit of the later list (the newer model) comes first,
  then the better rank in its list. So at equal rank the new model's hit leads, as in the curve.
- The source of a hit is the index of the list it was taken from; an id found in several lists
  (the two parts of a shadow index are disjoint, so only outside the playbook) takes the list
  where it scores best, and the later list at a tie.
- ``limit``: the most hits returned (``None``: all).

Merges:

- ``rrf_merge``: reciprocal rank fusion, score = sum over the lists holding the id of
  ``1 / (k + rank)``, highest first. When no id is in two lists (a shadow index), each hit's score
  is ``1 / (k + its rank)``: the merge interleaves the lists by rank and ``k`` changes nothing.
- ``score_merge``: each list's distances normalised over that list, ``minmax``
  (``(d - min) / (max - min)``) or ``zscore`` (``(d - mean) / std``, the population std), then
  the lowest normalised distance first; a list whose distances are all equal (one hit, say)
  normalises to 0. An id in several lists keeps its lowest normalised distance. The statistics
  come from the lists as given: top-k lists normalise over their k hits.
- ``distance_merge``: online backfilling's merge: each list's raw distances, times that list's
  scale (the reverse transformation's gain on the new space), the lowest first. Meaningful only
  where the lists' distances are comparable, which the metric-compatible reverse transformation
  is trained to make them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fastfill.components.platform.vocabulary import DISTANCES, MERGES

__all__ = ["NORMS", "distance_merge", "merge_lists", "normalise_distances", "rrf_merge", "score_merge"]

NORMS = ("minmax", "zscore")
"""Per-list normalisations of ``score_merge`` (the merges ``score_<norm>`` of MERGES)."""

# A cosine distance is 1 - cos, in [0, 2]; rounding may step just outside.
_COSINE_SLACK = 1e-5


def rrf_merge(lists_of_ids: Sequence, k: float = 60, limit: int | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reciprocal rank fusion of ranked id lists (see the module docs for the conventions).

    Returns ``(ids, scores, sources)``: the merged ids (int64), each one's fused score
    (float64, descending) and the index of the list it came from (int64).

    Raises:
        ValueError: a list that is not 1-D integers or repeats an id, a negative or non-finite
            ``k``, or a negative ``limit``.
    """
    if isinstance(k, bool) or not isinstance(k, (int, float, np.integer, np.floating)) \
            or not np.isfinite(k) or k < 0:
        raise ValueError(f"k must be a finite number >= 0 (60 is usual), got {k!r}")
    lists = [_ids(ids, j) for j, ids in enumerate(lists_of_ids)]
    ids, sources, ranks = _entries(lists)
    scores = 1.0 / (float(k) + ranks)
    return _fuse(ids, -scores, sources, ranks, limit, combine="sum")


def score_merge(lists_of_ids: Sequence, lists_of_distances: Sequence, norm: str = "minmax",
                distance: str = "l2", limit: int | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge ranked lists by their distances normalised per list (see the module docs).

    ``lists_of_distances``: each list's distances as the search gives them, ascending (lower is
    nearer): squared l2 for ``distance="l2"``, ``1 - cos`` for ``"cosine"`` (checked to lie in
    [0, 2]). They are normalised as given. Returns ``(ids, normalised distances, sources)``,
    the normalised distances ascending.

    Raises:
        ValueError: an unknown ``norm`` or ``distance``, lists whose ids and distances differ in
            length, distances that are not finite, not ascending (similarities instead of
            distances?) or outside the distance's range, or a repeated id within a list.
    """
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if distance not in DISTANCES:
        raise ValueError(f"distance must be one of {DISTANCES}, got {distance!r}")
    lists, distances = _checked_lists(lists_of_ids, lists_of_distances, distance)
    normalised = [normalise_distances(values, norm) for values in distances]
    ids, sources, ranks = _entries(lists)
    values = np.concatenate(normalised) if normalised else np.zeros(0)
    return _fuse(ids, values, sources, ranks, limit, combine="min")


def distance_merge(lists_of_ids: Sequence, lists_of_distances: Sequence, scales: Sequence[float] | None = None,
                   limit: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge ranked lists by their raw distances, list ``j``'s multiplied by ``scales[j]`` (None:
    all 1); see the module docs for the conventions. Returns ``(ids, scaled distances, sources)``,
    the distances ascending.

    Raises:
        ValueError: lists whose ids and distances differ in length, distances that are not
            finite, negative or not ascending, a scale that is not a positive finite number, or a
            repeated id within a list.
    """
    scales = [1.0] * len(lists_of_ids) if scales is None else list(scales)
    if len(scales) != len(lists_of_ids) or not all(np.isfinite(s) and s > 0 for s in scales):
        raise ValueError(f"give one positive finite scale per list ({len(lists_of_ids)}), got {scales!r}")
    lists, distances = _checked_lists(lists_of_ids, lists_of_distances, "l2")
    scaled = [values * float(scale) for values, scale in zip(distances, scales)]
    ids, sources, ranks = _entries(lists)
    return _fuse(ids, np.concatenate(scaled) if scaled else np.zeros(0), sources, ranks, limit, combine="min")


def merge_lists(merge: str, lists_of_ids: Sequence, lists_of_distances: Sequence, *, rrf_k: float = 60,
                distance: str = "l2", limit: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``rrf_merge`` or ``score_merge``, by the name of the merge (one of MERGES)."""
    if merge not in MERGES:
        raise ValueError(f"merge must be one of {MERGES}, got {merge!r}")
    if merge == "rrf":
        return rrf_merge(lists_of_ids, k=rrf_k, limit=limit)
    return score_merge(lists_of_ids, lists_of_distances, norm=merge.removeprefix("score_"),
                       distance=distance, limit=limit)


def normalise_distances(values: np.ndarray, norm: str) -> np.ndarray:
    """One list's distances, min-max or z-score normalised (float64); all equal -> all 0."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return values
    if norm == "minmax":
        low, spread = values.min(), values.max() - values.min()
    elif norm == "zscore":
        low, spread = values.mean(), values.std()
    else:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if not spread > 0:
        return np.zeros_like(values)
    return (values - low) / spread


# --------------------------------------------------------------------------------------------


def _ids(ids, j: int) -> np.ndarray:
    """List ``j``'s ids as int64 with the padding (negative ids) dropped, checked."""
    arr = np.asarray(ids)
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise ValueError(f"list {j} must be a 1-D array of integer ids, got {arr.dtype} {arr.shape}")
    arr = arr[arr >= 0].astype(np.int64, copy=False)
    unique, counts = np.unique(arr, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"list {j} holds id {int(unique[counts > 1][0])} more than once; a ranked list "
                         "names each item once")
    return arr


def _checked_lists(lists_of_ids: Sequence, lists_of_distances: Sequence, distance: str
                   ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each list's ids (``_ids``) and its distances (``_distances``, float64), the padding dropped
    from both; the lists checked to pair up, one distance per id."""
    if len(lists_of_ids) != len(lists_of_distances):
        raise ValueError(f"{len(lists_of_ids)} lists of ids but {len(lists_of_distances)} lists of "
                         "distances; give one distance list per id list")
    lists, distances = [], []
    for j, (ids, values) in enumerate(zip(lists_of_ids, lists_of_distances)):
        ids = np.asarray(ids)
        values = np.asarray(values, dtype=np.float64)
        if values.shape != ids.shape:
            raise ValueError(f"list {j} has {ids.shape} ids but {values.shape} distances; one each")
        real = ids >= 0 if ids.ndim == 1 and np.issubdtype(ids.dtype, np.integer) else slice(None)
        lists.append(_ids(ids, j))
        distances.append(_distances(values[real], j, distance))
    return lists, distances


def _distances(values: np.ndarray, j: int, distance: str) -> np.ndarray:
    if not np.isfinite(values).all():
        raise ValueError(f"list {j} has non-finite distances; drop those hits (padding has id -1)")
    if values.size and (np.diff(values) < 0).any():
        raise ValueError(f"list {j}'s distances are not ascending; pass distances (lower is nearer), best "
                         "first, not similarities")
    high = 2 + _COSINE_SLACK if distance == "cosine" else np.inf
    if values.size and (values[0] < -_COSINE_SLACK or values[-1] > high):
        raise ValueError(f"list {j}'s distances run from {values[0]:g} to {values[-1]:g}, outside a "
                         f"{distance} distance's range ({'[0, 2], 1 - cos' if distance == 'cosine' else '>= 0'})")
    return values


def _entries(lists: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (id, source list, 1-based rank) of the lists, concatenated."""
    if not lists:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float64)
    ids = np.concatenate(lists)
    sources = np.concatenate([np.full(len(ids_j), j, np.int64) for j, ids_j in enumerate(lists)])
    ranks = np.concatenate([np.arange(1, len(ids_j) + 1, dtype=np.float64) for ids_j in lists])
    return ids, sources, ranks


def _fuse(ids, costs, sources, ranks, limit, combine: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Order by ascending cost, then the later source, then the better rank. An id in several
    lists is kept once: from its lowest-cost entry, with the costs summed (``combine="sum"``,
    RRF, where the cost is minus the score) or the lowest kept (``"min"``)."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit < 0):
        raise ValueError(f"limit must be None or an integer >= 0, got {limit!r}")
    # the best entry of each id first: lexsort's last key is the primary one
    best = np.lexsort((ranks, -sources, costs, ids))
    ids, costs, sources, ranks = ids[best], costs[best], sources[best], ranks[best]
    first = np.ones(len(ids), dtype=bool)
    first[1:] = ids[1:] != ids[:-1]
    if combine == "sum" and not first.all():
        costs = np.add.reduceat(costs, np.flatnonzero(first)) if len(ids) else costs
    else:
        costs = costs[first]
    ids, sources, ranks = ids[first], sources[first], ranks[first]
    merged = np.lexsort((ranks, -sources, costs))[:limit]
    values = -costs[merged] if combine == "sum" else costs[merged]
    return ids[merged], values, sources[merged]
