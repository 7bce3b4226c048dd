"""Evaluation of the methods on stored features: orders, backfill curves, reference points.

All curves go through ``components.evaluation.backfill_curve``, the same code that
``fastfill evaluate --features DIR`` runs on a user's own features.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fastfill.components.evaluation import backfill_curve, retrieval_metrics
from fastfill.components.evaluation.ordering import (
    descending_order,
    distance_order,
    entropy_uncertainty,
    kendall_tau,
    least_confidence,
    margin_uncertainty,
    oracle_order,
    random_order,
    sigma_order,
)
from fastfill.components.platform.vocabulary import ORDERS

UNCERTAINTY = {"least_confidence": least_confidence, "margin": margin_uncertainty, "entropy": entropy_uncertainty}


@dataclass(frozen=True)
class MethodOutputs:
    """What a method's stage leaves for evaluation, on the evaluation images.

    A map into the new space (FCT, FastFill, RBT): ``gallery_old`` = h(phi_old), queries and
    backfilled items are phi_new. A unified map: ``gallery_old`` = T_g(phi_old), ``query`` =
    T_q(phi_new). A compatible new model (BCT, RACT): ``gallery_old`` = phi_old itself,
    ``query`` = its own features, ``logits`` = its classifier on phi_old.
    """

    gallery_old: np.ndarray                  # the old side of the gallery, (n, d)
    true_loss: np.ndarray | None = None      # per-item training loss measured with phi_new (oracle)
    log_sigma2: np.ndarray | None = None     # psi's prediction, when the map has an uncertainty head
    query: np.ndarray | None = None          # queries and backfilled items; None = the new model's features
    logits: np.ndarray | None = None         # the new classifier on the old gallery features
    sigma_is_random: bool = False            # a fallback map whose sigma order was not shown to help:
                                             # it is backfilled, and its "sigma" order measured, in random order


def build_order(name: str, outputs: MethodOutputs, gallery_new: np.ndarray, seed: int) -> np.ndarray:
    n = len(gallery_new)
    if name == "random":
        return random_order(n, seed)
    if name == "sigma":
        if outputs.log_sigma2 is None:
            if outputs.sigma_is_random:
                return random_order(n, seed)
            raise ValueError("the sigma order needs a map trained with uncertainty: true")
        return sigma_order(outputs.log_sigma2)
    if name == "oracle":
        if outputs.true_loss is None:
            raise ValueError("the oracle order needs the true per-item loss of a map")
        return oracle_order(outputs.true_loss)
    if name == "distance":
        return distance_order(gallery_new, outputs.gallery_old)
    if name in UNCERTAINTY:
        if outputs.logits is None:
            raise ValueError(f"the {name} order needs the new classifier's logits on the old gallery features "
                             "(a compatible new model)")
        return descending_order(UNCERTAINTY[name](outputs.logits))
    raise ValueError(f"unknown order {name!r}; expected one of {', '.join(ORDERS)}")


def reference_points(old_features: np.ndarray, new_features: np.ndarray, labels: np.ndarray,
                     distance: str) -> dict[str, dict]:
    """old/old (the lower bound) and new/new (the paragon)."""
    return {
        "old_old": retrieval_metrics(old_features, old_features, labels, distance=distance),
        "new_new": retrieval_metrics(new_features, new_features, labels, distance=distance),
    }


def method_curves(outputs: MethodOutputs, new_features: np.ndarray, labels: np.ndarray, orders: Sequence[str],
                  *, distance: str, curve_points: int, seed: int) -> tuple[dict[str, dict], float | None]:
    """One curve per order (query = gallery_new = the method's new side: the new features, or
    ``outputs.query``), and Kendall's tau between the sigma and oracle orders when the map
    predicts sigma."""
    new_side = new_features if outputs.query is None else outputs.query
    curves = {}
    for name in orders:
        order = build_order(name, outputs, new_side, seed)
        curve = backfill_curve(new_side, new_side, outputs.gallery_old, labels, order,
                               distance=distance, num_intermediate=curve_points)
        curves[name] = curve.to_dict()
    tau = None
    if outputs.log_sigma2 is not None and outputs.true_loss is not None:
        tau = kendall_tau(outputs.log_sigma2, outputs.true_loss)
    return curves, tau
