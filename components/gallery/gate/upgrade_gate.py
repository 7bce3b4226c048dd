"""The promotion gate's numbers for an upgrade of a stored gallery, measured on what its backfill
left in the store: the judged queries against the whole gallery along the backfill's own order
when the upgrade has them (``judged_gate.measure_judged_gate``), else the upgrade's evaluation
sample (``promotion.measure_gate``). ``tasks/gallery_store.py`` (``evaluate_gate``) runs it as a
task of the upgrade flow."""

from __future__ import annotations

import numpy as np

from fastfill.components.gallery.gate.promotion import measure_gate
from fastfill.components.gallery.inputs import judgments
from fastfill.components.gallery.layouts.catalog import Gallery
from fastfill.components.gallery.upgrade import backfill, planning
from fastfill.components.gallery.upgrade.planning import Plan


def measure_upgrade_gate(gallery: Gallery, plan: Plan, curve_points: int) -> dict:
    """The gate's numbers of ``plan``'s upgrade, its backfill complete: the champion (the gallery's
    model) against the challenger along the backfill, at ``curve_points`` points of the curve."""
    store = gallery.store
    judged = judgments.stored_judged(store, plan.upgrade_id)
    if judged is not None:  # judged queries come first: the whole gallery along the backfill's own order
        relevant, new_queries, champion_queries = judged
        final, _ = backfill.mixed_features(gallery, plan)
        return judgments.measure_judged_gate(champion_queries, gallery.all_features(gallery.model), new_queries,
                                             final, planning.transformed_all(gallery, plan.upgrade_id), relevant,
                                             planning.order_of(store, plan.upgrade_id), distance=plan.distance,
                                             curve_points=curve_points)
    positions, queries = planning.stored_eval_sample(store, plan.upgrade_id)
    transformed = backfill.transformed_rows(gallery, plan.upgrade_id, positions)
    new = backfill.mixed_rows(gallery, plan, positions)
    champion = gallery.features_at(gallery.model, positions)
    order = np.argsort(planning.eval_ranks(store, plan, positions), kind="stable")  # the sample's places
    labels = gallery.labels()
    assert labels is not None  # without judged queries, the gate measures only a gallery with labels
    return measure_gate(champion, queries, new, transformed, labels[positions], order,
                        distance=plan.distance, curve_points=curve_points)
