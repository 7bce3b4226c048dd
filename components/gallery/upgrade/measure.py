"""Retrieval measured during a real backfill, with the protocol of the simulated evaluation.

A sample S of the labeled items is both the queries (their new-model features, computed when
the upgrade is planned) and the gallery searched (self excluded). When the chunks done form a
prefix of the order, the first ``p`` items are backfilled; within S that is the S-items among
them, and the metrics equal ``curve_at_counts`` on S with the order restricted to S: exactly
the simulated curve of the same features at the same fractions.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from fastfill.components.evaluation import curve_at_counts
from fastfill.components.gallery.upgrade.backfill import chunk_features, transformed_rows
from fastfill.components.gallery.upgrade.lifecycle import done_prefix
from fastfill.components.gallery.upgrade.planning import eval_positions_key, eval_queries_key, eval_ranks, order_of


class BackfillMeter:
    def __init__(self, positions: np.ndarray, labels: np.ndarray, queries: np.ndarray, transformed: np.ndarray,
                 order: np.ndarray, distance: str = "l2", ranks: np.ndarray | None = None):
        """``positions``: the sample S; ``labels``: of the whole gallery; ``transformed``: h(old)
        of S (its rows in the order of ``positions``); ``queries``: new-model features of S;
        ``order``: the full backfill order; ``ranks``: each S item's place in the backfill when it
        is not its place in ``order`` (``plan.stand_in_ranks``: S was embedded while planning)."""
        self.positions, self.order, self.distance = positions, order, distance
        self.labels = labels[positions]
        self.queries = queries
        self.old = np.asarray(transformed)
        self.new = self.old.copy()  # rows are replaced as their chunks land
        if ranks is None:
            rank = np.empty(len(order), dtype=np.int64)
            rank[order] = np.arange(len(order))
            ranks = rank[positions]
        self.local_order = np.argsort(ranks, kind="stable")
        self.sorted_ranks = np.sort(np.asarray(ranks, dtype=np.float64))
        self.slot = np.full(len(order), -1, dtype=np.int64)
        self.slot[positions] = np.arange(len(positions))

    def land(self, start: int, stop: int, features: np.ndarray) -> None:
        slots = self.slot[self.order[start:stop]]
        keep = slots >= 0
        self.new[slots[keep]] = features[keep]

    def measure(self, backfilled: int) -> dict:
        count = int(np.searchsorted(self.sorted_ranks, backfilled, side="left"))  # S items placed before it
        curve = curve_at_counts(self.queries, self.new, self.old, self.labels, self.local_order, [count],
                                distance=self.distance)
        return {"top1": float(curve.top1[0]), "top5": float(curve.top5[0]), "map": float(curve.map[0])}


def meter_for(gallery, plan, done: list[int]) -> BackfillMeter | None:
    """The meter of a planned upgrade, with the chunks already ``done`` landed; None when the
    plan has no evaluation sample."""

    labels = gallery.labels()
    if plan.eval_queries < 2 or labels is None:  # nothing to measure retrieval against
        return None
    store = gallery.store
    positions = store.get_array(eval_positions_key(plan.upgrade_id))
    meter = BackfillMeter(positions, labels, store.get_array(eval_queries_key(plan.upgrade_id)),
                          transformed_rows(gallery, plan.upgrade_id, positions), order_of(store, plan.upgrade_id), plan.distance,
                          eval_ranks(store, plan, positions))
    for chunk in done:
        start, stop = plan.chunk_bounds(chunk)
        meter.land(start, stop, chunk_features(store, plan.upgrade_id, chunk))
    return meter


class BackfillMeasure:
    """Retrieval measured as a backfill's chunks land: each landed chunk's features, read back from
    the store, go into the upgrade's meter (``meter_for``, the chunks already ``done`` landed), and
    ``points`` measures where the done chunks form a longer prefix of the order than before.
    Without an evaluation sample (``meter`` None) it measures nothing."""

    def __init__(self, gallery, plan, done: set[int]):
        self.store, self.plan = gallery.store, plan
        self.meter = meter_for(gallery, plan, sorted(done))

    def land(self, chunk: int, start: int, stop: int) -> None:
        """Chunk ``chunk`` (items ``start:stop`` of the order) landed."""
        if self.meter is not None:
            self.meter.land(start, stop, chunk_features(self.store, self.plan.upgrade_id, chunk))

    def points(self, done: set[int], measured: set[int]) -> Iterator[tuple[int, dict]]:
        """(items backfilled, metrics) at the done prefix of the order, and at 0 before it (the
        curve starts at 0%, also when items were embedded while planning), each unless it is in
        ``measured`` (the counts recorded before: the caller adds each one it records)."""
        if self.meter is None:
            return
        prefix = done_prefix(done, self.plan.num_chunks)
        items = self.plan.chunk_bounds(prefix - 1)[1] if prefix else 0
        for at in ([0] if items else []) + [items]:
            if at not in measured:
                yield at, self.meter.measure(at)
