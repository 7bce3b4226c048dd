"""Online backfilling (Seo et al., "Metric Compatible Training for Online Backfilling in Large-Scale
Retrieval", WACV 2025; docs/methods.md, "Online backfilling").

During the backfill every query is embedded by the new model only. The items already re-embedded
are searched with the new query in the new space; the items not yet re-embedded with the same
query mapped into the old space by a reverse transformation ``rho`` (new -> old), against their
stored old features. The two ranked lists are merged by their raw distances: ``rho`` is trained
to land on the old features, so a distance in the old space and one in the new space are meant to
be comparable. One query embedding and two searches per query; at 0% the ranking is
``rho(phi_new(q))`` against the old gallery, at 100% new/new.

The paper's claim is a curve that rises monotonically, with no drop at the end: ``monotonicity``
measures it on the curve.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fastfill.components.evaluation.dual_curve import dual_curves
from fastfill.components.evaluation.retrieval import ALPHA_POINTS_DEFAULT, BackfillCurve
from fastfill.components.platform.vocabulary import ONLINE_MERGE

__all__ = ["MONOTONICITY_KEYS", "monotonicity", "online_curve"]

MONOTONICITY_KEYS = ("top1_max_drop", "map_max_drop", "monotone")


def online_curve(reverse_query: np.ndarray, query_new: np.ndarray, gallery_old: np.ndarray,
                 gallery_new: np.ndarray, labels: np.ndarray, order: np.ndarray | None = None, *,
                 distance: str = "l2", num_intermediate: int = ALPHA_POINTS_DEFAULT, workers: int = 2) -> BackfillCurve:
    """The online-backfilling curve.

    Args:
        reverse_query: ``(n, d_old)``: the new model's query features mapped into the old space
            (``rho(phi_new(q))``), which search the items not yet re-embedded.
        query_new: ``(n, d_new)``: the new model's query features, which search the others.
        gallery_old, gallery_new: ``(n, d_old)``, ``(n, d_new)``: the gallery's stored old
            features and its new ones.
        labels, order, distance, num_intermediate, workers: as for ``dual_curves``.
    """
    return dual_curves(reverse_query, query_new, gallery_old, gallery_new, labels, order, merges=[ONLINE_MERGE],
                       distance=distance, num_intermediate=num_intermediate, workers=workers)[ONLINE_MERGE]


def monotonicity(curve: Mapping) -> dict:
    """How far a curve is from rising monotonically: the largest fall of top-1 and of mAP from
    one point to the next (0 when it never falls), and ``monotone`` (neither ever falls)."""
    drops = {key: max(0.0, float(np.max(-np.diff(np.asarray(curve[key], dtype=np.float64)), initial=0.0)))
             for key in ("top1", "map")}
    return {"top1_max_drop": drops["top1"], "map_max_drop": drops["map"],
            "monotone": drops["top1"] == 0.0 and drops["map"] == 0.0}
