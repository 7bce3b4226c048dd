"""The read side of an upgrade's stored objects: their keys, the plan record (``Plan``,
``load_plan``), the backfill order, the chunks done and their features, and the gallery as queries
see it meanwhile (the mixed features: new where backfilled, h(old) elsewhere). A leaf: it imports
only the store and the gallery's catalog, so the layouts that serve an upgrade's mixed gallery
(``components.gallery.layouts``) read it at their top, and the upgrade's steps
(``components.gallery.upgrade.planning``, ``backfill``) build on it. What the objects are is in
``components.gallery.upgrade.planning``'s docstring."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field, replace

import numpy as np

from fastfill.components.gallery.layouts.catalog import Gallery, ModelRef, now, rows_at
from fastfill.components.gallery.store import ObjectMissing, Store, StoreError

ORDER = "order.npy"


def upgrade_key(upgrade_id: str, name: str) -> str:
    """An object of the upgrade's working data: ``upgrades/<upgrade>/<name>``."""
    return f"upgrades/{upgrade_id}/{name}"


def chunk_key(upgrade_id: str, chunk: int) -> str:
    return upgrade_key(upgrade_id, f"chunks/chunk-{chunk:05d}.npy")


def marker_key(upgrade_id: str, chunk: int) -> str:
    return upgrade_key(upgrade_id, f"done/chunk-{chunk:05d}.json")


def plan_key(upgrade_id: str) -> str:
    return upgrade_key(upgrade_id, "plan.json")


def transformed_key(upgrade_id: str, part: int) -> str:
    return upgrade_key(upgrade_id, f"transformed/part-{part:05d}.npy")


def source_key(upgrade_id: str, part: int) -> str:
    """A sequential upgrade's starting point: the superseded upgrade's mixed features of a part."""
    return upgrade_key(upgrade_id, f"source/part-{part:05d}.npy")


# ------------------------------------------------------------------------------------------------
# The plan record


@dataclass(frozen=True)
class Plan:
    """What one upgrade is, written once as ``upgrades/<id>/plan.json`` before any chunk runs and
    read by every later step and run (``load_plan``): the upgrade from ``old`` (the gallery's
    model when it was planned) to ``new``, through the alignment map ``map_uri``, in the backfill
    order ``order_kind`` (its positions are ``order.npy``), cut into chunks of ``chunk_size``
    places of that order (``bounds`` where a chunk was cut at a budget's stop or the items embedded
    while planning, ``prefilled``, fill the first chunks). ``eval_queries``: the size of the
    evaluation sample the gate and the measured curve use (0: none); ``distance``: the search's.
    ``mlflow_run_id`` is the upgrade's MLflow run; ``base``, for a sequential upgrade, the
    unfinished upgrade whose mixed gallery this one starts from. A chunk is a range of places in
    the order, not of positions: ``chunk_bounds(c)`` gives its places, ``order[start:stop]`` its
    items."""

    upgrade_id: str  # plan.json's key "id" (to_dict, from_dict)
    old: ModelRef
    new: ModelRef
    map_uri: str
    order_kind: str
    chunk_size: int
    num_items: int
    eval_queries: int
    distance: str
    mlflow_run_id: str | None = None
    created: str = field(default_factory=now)
    base: str | None = None  # a sequential upgrade: the unfinished upgrade whose mixed gallery it starts from
    # chunk boundaries (0, ..., num_items) where they are not the plain chunk_size grid; see chunk_grid
    bounds: tuple[int, ...] | None = None
    prefilled: int = 0  # items at the front of the order embedded while planning (done chunks from the start)
    # gallery.upgrade.online when it was planned: it keeps a reverse transformation (None: a plan that does not say)
    online: bool | None = None

    @property
    def num_chunks(self) -> int:
        return len(self.bounds) - 1 if self.bounds else -(-self.num_items // self.chunk_size)

    def chunk_bounds(self, chunk: int) -> tuple[int, int]:
        if not 0 <= chunk < self.num_chunks:
            raise IndexError(f"chunk {chunk} is outside 0..{self.num_chunks - 1}")
        if self.bounds:
            return self.bounds[chunk], self.bounds[chunk + 1]
        start = chunk * self.chunk_size
        return start, min(start + self.chunk_size, self.num_items)

    def chunk_of(self, ranks: np.ndarray) -> np.ndarray:
        """The chunk that holds each place ``ranks`` of the order."""
        ranks = np.asarray(ranks, dtype=np.int64)
        if self.bounds:
            return np.searchsorted(np.asarray(self.bounds), ranks, side="right") - 1
        return ranks // self.chunk_size

    def items_in(self, chunks) -> int:
        """How many items the given chunks hold."""
        return sum(self.chunk_bounds(c)[1] - self.chunk_bounds(c)[0] for c in chunks)

    def cut_at(self, item: int) -> tuple[Plan, int | None]:
        """This plan with a chunk boundary at ``item`` (a place in the order), and the chunk that
        was split in two (None when ``item`` already is a boundary). Chunks after the split one
        move up by one index: only cut where no chunk from the split one on is done."""
        if not 0 < item < self.num_items:
            return self, None
        edges = [self.chunk_bounds(c)[0] for c in range(self.num_chunks)] + [self.num_items]
        if item in edges:
            return self, None
        split = int(np.searchsorted(edges, item, side="right")) - 1
        return replace(self, bounds=tuple(sorted({*edges, item}))), split

    def to_dict(self) -> dict:
        data = {"id": self.upgrade_id, "old": self.old.to_dict(), "new": self.new.to_dict(), "map_uri": self.map_uri,
                "order": self.order_kind, "chunk_size": self.chunk_size, "num_items": self.num_items,
                "num_chunks": self.num_chunks, "eval_queries": self.eval_queries, "distance": self.distance,
                "mlflow_run_id": self.mlflow_run_id, "created": self.created, "base": self.base,
                "prefilled": self.prefilled}
        if self.bounds:
            data["bounds"] = list(self.bounds)
        if self.online is not None:
            data["online"] = self.online
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        bounds = data.get("bounds")
        return cls(data["id"], ModelRef.from_dict(data["old"]), ModelRef.from_dict(data["new"]), data["map_uri"],
                   data["order"], int(data["chunk_size"]), int(data["num_items"]), int(data["eval_queries"]),
                   data["distance"], data.get("mlflow_run_id"), data["created"], data.get("base"),
                   tuple(int(b) for b in bounds) if bounds else None, int(data.get("prefilled", 0)),
                   data.get("online"))


def load_plan(store: Store, upgrade_id: str) -> Plan | None:
    try:
        return Plan.from_dict(store.get_json(plan_key(upgrade_id)))
    except ObjectMissing:
        return None


# ------------------------------------------------------------------------------------------------
# The order, the chunks done, the mixed gallery


def order_of(store: Store, upgrade_id: str) -> np.ndarray:
    return store.get_array(upgrade_key(upgrade_id, ORDER)).astype(np.int64)


def transformed_all(gallery: Gallery, upgrade_id: str) -> np.ndarray:
    return np.concatenate([gallery.part_rows(transformed_key(upgrade_id, p), p) for p in range(gallery.num_parts)])


def done_chunks(store: Store, upgrade_id: str) -> list[int]:
    keys = store.list(upgrade_key(upgrade_id, "done/"))
    return sorted(int(key.rsplit("chunk-", 1)[1].split(".")[0]) for key in keys if key.endswith(".json"))


def chunk_features(store: Store, upgrade_id: str, chunk: int) -> np.ndarray:
    """A finished chunk's features, checked against its marker."""
    marker = store.get_json(marker_key(upgrade_id, chunk))
    features = store.get_array(chunk_key(upgrade_id, chunk))
    if len(features) != marker["count"]:
        raise StoreError(f"{store.describe(chunk_key(upgrade_id, chunk))} has {len(features)} rows; its marker "
                         f"says {marker['count']}")
    return features


def mixed_features(gallery: Gallery, plan: Plan, transformed: np.ndarray | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """The gallery as queries see it now: new features where backfilled, h(old) elsewhere;
    and the backfilled mask. ``transformed``: the upgrade's h(old), when the caller has read it."""
    features = transformed_all(gallery, plan.upgrade_id) if transformed is None else transformed.copy()
    backfilled = np.zeros(plan.num_items, dtype=bool)
    order = order_of(gallery.store, plan.upgrade_id)
    for chunk in done_chunks(gallery.store, plan.upgrade_id):
        start, stop = plan.chunk_bounds(chunk)
        features[order[start:stop]] = chunk_features(gallery.store, plan.upgrade_id, chunk)
        backfilled[order[start:stop]] = True
    return features, backfilled


def iter_mixed_parts(gallery: Gallery, plan: Plan, memory_bytes: int = 256 << 20):
    """(part, features, backfilled mask) of every part in turn, as ``mixed_features`` would give
    them, in bounded memory and linear I/O. Parts are gathered in batches of about
    ``memory_bytes`` of features. When there is more than one batch, the done chunks are first
    read once each and their rows appended to a local scratch file per batch (sigma-ordered
    chunks hold items of every part, so reading them per batch would read each chunk once per
    batch); each batch then starts from its transformed parts and takes its rows from its file."""
    dim = plan.new.dim
    assert dim is not None  # a plan's new model has its dim
    parts_per_batch = max(1, memory_bytes // max(1, gallery.part_size * dim * 4))
    batches = [(first, min(first + parts_per_batch, gallery.num_parts))
               for first in range(0, gallery.num_parts, parts_per_batch)]
    batch_rows = parts_per_batch * gallery.part_size
    done = done_chunks(gallery.store, plan.upgrade_id)
    order = order_of(gallery.store, plan.upgrade_id)
    with tempfile.TemporaryDirectory(prefix="fastfill-finish-") as scratch:
        files = {}
        if len(batches) > 1:  # pass 1: each done chunk read once, its rows sent to their batch's file
            for chunk in done:
                c_start, c_stop = plan.chunk_bounds(chunk)
                positions = order[c_start:c_stop]
                features = chunk_features(gallery.store, plan.upgrade_id, chunk)
                batch_of = positions // batch_rows
                for batch in np.unique(batch_of):
                    rows = batch_of == batch
                    if int(batch) not in files:
                        files[int(batch)] = open(os.path.join(scratch, f"batch-{int(batch)}.bin"), "w+b")
                    record = np.empty(int(rows.sum()), dtype=[("position", np.int64), ("features", np.float32, dim)])
                    record["position"], record["features"] = positions[rows], features[rows]
                    files[int(batch)].write(record.tobytes())
        for index, (first, last) in enumerate(batches):  # pass 2: one batch of parts at a time
            start, stop = gallery.part_bounds(first)[0], gallery.part_bounds(last - 1)[1]
            features = np.empty((stop - start, dim), dtype=np.float32)  # filled in place: no second copy
            for part in range(first, last):
                p_start, p_stop = gallery.part_bounds(part)
                features[p_start - start:p_stop - start] = gallery.part_rows(transformed_key(plan.upgrade_id, part), part)
            backfilled = np.zeros(stop - start, dtype=bool)
            if len(batches) == 1:
                for chunk in done:
                    c_start, c_stop = plan.chunk_bounds(chunk)
                    positions = order[c_start:c_stop]
                    features[positions - start] = chunk_features(gallery.store, plan.upgrade_id, chunk)
                    backfilled[positions - start] = True
            elif index in files:
                handle = files.pop(index)
                handle.seek(0)
                while True:  # in blocks, so the file never sits whole in memory beside the batch
                    record = np.fromfile(handle, dtype=[("position", np.int64), ("features", np.float32, dim)],
                                         count=65536)
                    if not len(record):
                        break
                    features[record["position"] - start] = record["features"]
                    backfilled[record["position"] - start] = True
                handle.close()
            for part in range(first, last):
                p_start, p_stop = gallery.part_bounds(part)
                yield part, features[p_start - start:p_stop - start], backfilled[p_start - start:p_stop - start]
        for handle in files.values():
            handle.close()


def transformed_rows(gallery: Gallery, upgrade_id: str, positions: np.ndarray) -> np.ndarray:
    """h(old) of the items at ``positions`` (the upgrade's transformed parts), part by part."""
    return rows_at(gallery, positions, lambda part: transformed_key(upgrade_id, part)).astype(np.float32, copy=False)


def mixed_rows(gallery: Gallery, plan: Plan, positions: np.ndarray) -> np.ndarray:
    """The features queries see now at ``positions`` only (new where backfilled, h(old)
    elsewhere): each done chunk is read once and only its rows at ``positions`` are kept."""
    positions = np.asarray(positions, dtype=np.int64)
    out = transformed_rows(gallery, plan.upgrade_id, positions)
    order = order_of(gallery.store, plan.upgrade_id)
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    chunk_of = plan.chunk_of(rank[positions])
    done = set(done_chunks(gallery.store, plan.upgrade_id))
    for chunk in np.unique(chunk_of):
        if int(chunk) not in done:
            continue
        rows = np.flatnonzero(chunk_of == chunk)
        features = chunk_features(gallery.store, plan.upgrade_id, int(chunk))
        out[rows] = features[rank[positions[rows]] - plan.chunk_bounds(int(chunk))[0]]
    return out
