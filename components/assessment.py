"""Evaluation of the methods on stored features: orders, backfill curves, reference points.

All curves go through ``components.evaluation.backfill_curve``, the same code that
``fastfill evaluate --features DIR`` runs on a user's own features.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from components.evaluation import backfill_curve, retrieval_metrics
from components.ordering import distance_order, kendall_tau, oracle_order, random_order, sigma_order


@dataclass(frozen=True)
class MethodOutputs:
    """What an alignment stage leaves for evaluation, on the evaluation images."""

    gallery_old: np.ndarray          # h(phi_old(x)), (n, d_new)
    true_loss: np.ndarray            # per-item training loss measured with phi_new (oracle)
    log_sigma2: np.ndarray | None    # psi's prediction, when the map has an uncertainty head


def build_order(name: str, outputs: MethodOutputs, gallery_new: np.ndarray, seed: int) -> np.ndarray:
    n = len(gallery_new)
    if name == "random":
        return random_order(n, seed)
    if name == "sigma":
        if outputs.log_sigma2 is None:
            raise ValueError("the sigma order needs a map trained with uncertainty: true")
        return sigma_order(outputs.log_sigma2)
    if name == "oracle":
        return oracle_order(outputs.true_loss)
    if name == "distance":
        return distance_order(gallery_new, outputs.gallery_old)
    raise ValueError(f"unknown order {name!r}; expected random, sigma, oracle or distance")


def reference_points(old_features: np.ndarray, new_features: np.ndarray, labels: np.ndarray,
                     distance: str) -> dict[str, dict]:
    """old/old (the lower bound) and new/new (the paragon)."""
    return {
        "old_old": retrieval_metrics(old_features, old_features, labels, distance=distance),
        "new_new": retrieval_metrics(new_features, new_features, labels, distance=distance),
    }


def method_curves(outputs: MethodOutputs, new_features: np.ndarray, labels: np.ndarray, orders: Sequence[str],
                  *, distance: str, curve_points: int, seed: int) -> tuple[dict[str, dict], float | None]:
    """One curve per order (query = gallery_new = the new features), and Kendall's tau between
    the sigma and oracle orders when the map predicts sigma."""
    curves = {}
    for name in orders:
        order = build_order(name, outputs, new_features, seed)
        curve = backfill_curve(new_features, new_features, outputs.gallery_old, labels, order,
                               distance=distance, num_intermediate=curve_points)
        curves[name] = curve.to_dict()
    tau = None
    if outputs.log_sigma2 is not None:
        tau = kendall_tau(outputs.log_sigma2, outputs.true_loss)
    return curves, tau
