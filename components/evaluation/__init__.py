"""Evaluation of an embedding-model upgrade: retrieval metrics along the backfill."""

# the module dual_curve keeps its name in the package (its function of one merge is not re-exported)
from fastfill.components.evaluation.dual_curve import dual_curves
from fastfill.components.evaluation.retrieval import (
    ALPHA_POINTS_DEFAULT,
    DISTANCES,
    BackfillCurve,
    backfill_curve,
    curve_alphas,
    curve_at_counts,
    pairwise_distances,
    per_query_curve,
    retrieval_metrics,
)

__all__ = [
    "ALPHA_POINTS_DEFAULT",
    "DISTANCES",
    "BackfillCurve",
    "backfill_curve",
    "curve_at_counts",
    "curve_alphas",
    "dual_curves",
    "pairwise_distances",
    "per_query_curve",
    "retrieval_metrics",
]
