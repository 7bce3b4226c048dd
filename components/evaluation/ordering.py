"""Backfill orders: which gallery items get new-model features first.

An order is a permutation of the gallery indices 0..n-1; the first items are backfilled first.
Score-based orders put the highest score first and break ties by the lower index, so an order
is a pure function of its scores. The usage orders rank by how often queries hit an item (its
usage weight, >= 0) and break ties by sigma (least certain first) when it is known.
"""

from __future__ import annotations

import numpy as np


def random_order(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(n)


def descending_order(scores: np.ndarray) -> np.ndarray:
    """Indices by descending score, ties by ascending index."""
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 1:
        raise ValueError(f"scores must be one value per gallery item, got shape {scores.shape}")
    if not np.isfinite(scores).all():
        raise ValueError("scores contain NaN or infinite values; the order would be undefined")
    return np.argsort(-scores, kind="stable")


def sigma_order(log_sigma2: np.ndarray) -> np.ndarray:
    """FastFill: least certain first (descending predicted sigma^2, from old features alone)."""
    return descending_order(log_sigma2)


def check_weights(weights, n: int | None = None) -> np.ndarray:
    """Usage weights as float64 when they are one finite value >= 0 per item (``n`` of them when
    given); otherwise a ValueError that says what is wrong."""
    weights = np.asarray(weights, dtype=np.float64)
    if weights.ndim != 1 or (n is not None and len(weights) != n):
        raise ValueError(f"usage weights must be one value per gallery item ({n if n is not None else 'n'}), "
                         f"got shape {weights.shape}")
    bad = ~np.isfinite(weights) | (weights < 0)
    if bad.any():
        raise ValueError(f"usage weights must be finite and >= 0; {int(bad.sum())} are not (first: item "
                         f"{int(np.flatnonzero(bad)[0])}, {weights[bad][0]})")
    return weights


def usage_order(weights: np.ndarray, log_sigma2: np.ndarray | None = None) -> np.ndarray:
    """Most-asked first: descending usage weight. Ties (the items never hit among them) go by
    descending ``log_sigma2`` (least certain first) when it is given, else by ascending index."""
    weights = check_weights(weights)
    tie = np.zeros(len(weights)) if log_sigma2 is None else _finite(log_sigma2, len(weights))
    return np.lexsort((-tie, -weights)).astype(np.int64)  # stable: equal keys keep the lower index first


def expected_gain_order(weights: np.ndarray, log_sigma2: np.ndarray) -> np.ndarray:
    """The usage weight times the predicted error first: descending ``weight * sigma^2``
    (sigma^2 = exp(log_sigma2)), the error a backfill removes from the queries of the workload.
    The items never hit (weight 0) follow in sigma order, so the tail is FastFill's order. Ties
    by descending sigma, then ascending index."""
    weights = check_weights(weights)
    log_sigma2 = _finite(log_sigma2, len(weights))
    hit = weights > 0
    # log(weight) + log sigma^2 orders as the product does, without overflowing exp()
    gain = np.where(hit, np.log(np.where(hit, weights, 1.0)) + log_sigma2, 0.0)
    return np.lexsort((-log_sigma2, -gain, ~hit)).astype(np.int64)


def _finite(scores, n: int) -> np.ndarray:
    scores = np.asarray(scores, dtype=np.float64)
    if scores.shape != (n,):
        raise ValueError(f"log sigma^2 must be one value per gallery item ({n}), got shape {scores.shape}")
    if not np.isfinite(scores).all():
        raise ValueError("log sigma^2 contains NaN or infinite values; the order would be undefined")
    return scores


def oracle_order(true_loss: np.ndarray) -> np.ndarray:
    """Analysis only: descending true alignment loss, which needs the new features."""
    return descending_order(true_loss)


def distance_order(new_features: np.ndarray, transformed_old: np.ndarray) -> np.ndarray:
    """Analysis only: descending ||phi_new - h(phi_old)||."""
    return descending_order(np.linalg.norm(new_features - transformed_old, axis=1))


def check_permutation(order, n: int) -> np.ndarray:
    """``order`` as int64 when it is a permutation of 0..n-1; otherwise a ValueError that says
    what is wrong with it (shape, dtype, range, or which indices are missing)."""
    arr = np.asarray(order)
    if arr.ndim != 1 or arr.shape[0] != n:
        raise ValueError(
            f"order must have shape ({n},), a permutation of 0..{n - 1}, got shape {arr.shape}"
        )
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"order must hold integer indices, got dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() >= n:
        raise ValueError(
            f"order must be a permutation of 0..{n - 1}, but it holds values from {arr.min()} "
            f"to {arr.max()}"
        )
    counts = np.bincount(arr, minlength=n)
    if (counts != 1).any():
        missing = np.flatnonzero(counts == 0)
        raise ValueError(
            f"order must be a permutation of 0..{n - 1}, but {missing.size} indices are missing "
            f"(first {missing[:5].tolist()}) and others repeated; every image must be "
            "backfilled exactly once"
        )
    return arr.astype(np.int64, copy=False)


def kendall_tau(scores_a: np.ndarray, scores_b: np.ndarray) -> float:
    """Kendall's tau-b between two orders given by their scores (the sigma and oracle orders
    rank by descending score, so the tau of the scores is the tau of the orders). scipy.stats
    loads here, where it is used: a second of every command's start-up otherwise."""
    from scipy.stats import kendalltau

    tau = kendalltau(scores_a, scores_b).statistic
    return float(tau)


def _probabilities(logits: np.ndarray) -> np.ndarray:
    logits = np.asarray(logits, dtype=np.float64)
    shifted = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(shifted)
    return p / p.sum(axis=1, keepdims=True)


def least_confidence(logits: np.ndarray) -> np.ndarray:
    """RACT: 1 - p1 of the new classifier on an old gallery feature (higher = less certain)."""
    return 1.0 - _probabilities(logits).max(axis=1)


def margin_uncertainty(logits: np.ndarray) -> np.ndarray:
    """RACT: 1 - (p1 - p2)."""
    top2 = np.sort(_probabilities(logits), axis=1)[:, -2:]
    return 1.0 - (top2[:, 1] - top2[:, 0])


def entropy_uncertainty(logits: np.ndarray) -> np.ndarray:
    """RACT: -sum p log p."""
    p = _probabilities(logits)
    return -(p * np.log(np.clip(p, 1e-300, None))).sum(axis=1)
