"""An upgrade of a stored gallery: plan, chunked backfill, lock, status, finish, garbage collection.

Under ``upgrades/<upgrade-id>/`` (the id joins the two model versions, so re-running the same
command finds the same upgrade)::

    source/part-NNNNN.npy       a sequential upgrade only: each part's features as the unfinished
                                upgrade it starts from left them (its new features or its map's)
    order.npy                   item positions in backfill order
    transformed/part-NNNNN.npy  h(old features) of each part, in the new model's space
    sigma/part-NNNNN.npy        predicted log sigma^2 per item (maps with an uncertainty head)
    eval/positions.npy, eval/queries.npy   the evaluation sample and its new-model features
    plan.json                   models, map, order, chunking; written last: the plan exists once it does
    chunks/chunk-NNNNN.npy      new features of a chunk's items, in order; deterministic key
    done/chunk-NNNNN.json       the chunk's completion marker, written after its features
    finished.json               written when the backfill is complete and the gallery switched
    rejected.json               written when the promotion gate rejects it (reasons and numbers); the
                                same upgrade is then refused until a better version is registered
    superseded.json             written when a sequential upgrade starts from this unfinished one

Chunk c holds the items ``order[c * chunk_size : (c + 1) * chunk_size]``. A chunk is done when
its marker exists; a killed backfill resumes by listing markers, and a chunk redone after a
crash before its marker rewrites the same key with the same features.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from components.gallery.catalog import (
    IMAGE_CACHE, Gallery, GalleryError, ModelRef, check_features, features_key, gather_images, now,
)
from components.gallery.lock import LOCK
from components.gallery.store import ObjectMissing, Store, StoreError
from components.platform.vocabulary import GALLERY_ORDERS

ORDER, FINISHED, REJECTED, SUPERSEDED = "order.npy", "finished.json", "rejected.json", "superseded.json"
ENDINGS = (FINISHED, REJECTED, SUPERSEDED)  # an upgrade with one of these is over


def upgrade_id(old: ModelRef, new: ModelRef) -> str:
    return f"{old.key}-to-{new.key}"


def upgrade_key(upgrade: str, name: str) -> str:
    """An object of the upgrade's working data: ``upgrades/<upgrade>/<name>``."""
    return f"upgrades/{upgrade}/{name}"


def chunk_key(upgrade: str, chunk: int) -> str:
    return upgrade_key(upgrade, f"chunks/chunk-{chunk:05d}.npy")


def marker_key(upgrade: str, chunk: int) -> str:
    return upgrade_key(upgrade, f"done/chunk-{chunk:05d}.json")


def plan_key(upgrade: str) -> str:
    return upgrade_key(upgrade, "plan.json")


def transformed_key(upgrade: str, part: int) -> str:
    return upgrade_key(upgrade, f"transformed/part-{part:05d}.npy")


def source_key(upgrade: str, part: int) -> str:
    """A sequential upgrade's starting point: the superseded upgrade's mixed features of a part."""
    return upgrade_key(upgrade, f"source/part-{part:05d}.npy")


def eval_positions_key(upgrade: str) -> str:
    return upgrade_key(upgrade, "eval/positions.npy")


def eval_queries_key(upgrade: str) -> str:
    return upgrade_key(upgrade, "eval/queries.npy")


def sigma_key(upgrade: str, part: int) -> str:
    return upgrade_key(upgrade, f"sigma/part-{part:05d}.npy")


# ------------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True)
class Plan:
    id: str
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

    @property
    def num_chunks(self) -> int:
        return -(-self.num_items // self.chunk_size)

    def chunk_bounds(self, chunk: int) -> tuple[int, int]:
        if not 0 <= chunk < self.num_chunks:
            raise IndexError(f"chunk {chunk} is outside 0..{self.num_chunks - 1}")
        start = chunk * self.chunk_size
        return start, min(start + self.chunk_size, self.num_items)

    def items_in(self, chunks) -> int:
        """How many items the given chunks hold."""
        return sum(self.chunk_bounds(c)[1] - self.chunk_bounds(c)[0] for c in chunks)

    def to_dict(self) -> dict:
        return {"id": self.id, "old": self.old.to_dict(), "new": self.new.to_dict(), "map_uri": self.map_uri,
                "order": self.order_kind, "chunk_size": self.chunk_size, "num_items": self.num_items,
                "num_chunks": self.num_chunks, "eval_queries": self.eval_queries, "distance": self.distance,
                "mlflow_run_id": self.mlflow_run_id, "created": self.created, "base": self.base}

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        return cls(data["id"], ModelRef.from_dict(data["old"]), ModelRef.from_dict(data["new"]), data["map_uri"],
                   data["order"], int(data["chunk_size"]), int(data["num_items"]), int(data["eval_queries"]),
                   data["distance"], data.get("mlflow_run_id"), data["created"], data.get("base"))


def load_plan(store: Store, upgrade: str) -> Plan | None:
    try:
        return Plan.from_dict(store.get_json(plan_key(upgrade)))
    except ObjectMissing:
        return None


def write_plan(store: Store, plan: Plan) -> None:
    store.put_json(plan_key(plan.id), plan.to_dict())


def write_sources(gallery: Gallery, upgrade: str, base: Plan) -> int:
    """A sequential upgrade starts from the gallery as queries see it in the unfinished ``base``
    upgrade: its new model's features where backfilled, its transformed features elsewhere,
    all in the space of ``base.new`` (the maps compose). Written per part; returns the parts."""
    features, _ = mixed_features(gallery, base)
    for part in range(gallery.num_parts):
        start, stop = gallery.part_bounds(part)
        gallery.store.put_array(source_key(upgrade, part), features[start:stop])
    return gallery.num_parts


def transform_part(gallery: Gallery, upgrade: str, alignment_map, part: int, *, device=None,
                   sequential: bool = False) -> int:
    """h(old) and log sigma^2 of one part's stored features (``sequential``: of its source
    features, see write_sources); returns the part's item count."""
    from components.experiment.inference import apply_alignment

    old = gallery.store.get_array(source_key(upgrade, part)) if sequential else gallery.features(gallery.model, part)
    transformed, log_sigma2 = apply_alignment(alignment_map, old, device=device)
    check_features(transformed, None, f"transformed features of part {part}")
    gallery.store.put_array(transformed_key(upgrade, part), transformed)
    if log_sigma2 is not None:
        gallery.store.put_array(sigma_key(upgrade, part), log_sigma2)
    return len(old)


def make_order(gallery: Gallery, upgrade: str, kind: str, seed: int) -> np.ndarray:
    from components.evaluation.ordering import random_order, sigma_order

    if kind == "random":
        return random_order(gallery.num_items, seed)
    if kind not in GALLERY_ORDERS:
        raise GalleryError(f"unknown backfill order {kind!r}; use one of {', '.join(GALLERY_ORDERS)}")
    try:
        sigma = np.concatenate([gallery.store.get_array(sigma_key(upgrade, p)) for p in range(gallery.num_parts)])
    except ObjectMissing:
        raise GalleryError("the sigma order needs an alignment map with an uncertainty head (FastFill); this map "
                           "has none: use order random, or a map trained with uncertainty: true") from None
    return sigma_order(sigma)


def commit_plan(gallery: Gallery, plan: Plan, order: np.ndarray, eval_positions: np.ndarray | None = None,
                eval_queries: np.ndarray | None = None) -> None:
    """Write the order (and evaluation sample), then plan.json, then point the gallery at the
    upgrade: from here on queries use the new model against the mixed gallery. Needs the
    transformed parts written first."""
    store = gallery.store
    from components.evaluation.ordering import check_permutation

    try:
        order = check_permutation(order, plan.num_items)
    except ValueError as error:
        raise GalleryError(f"the order of {plan.id}: {error}") from None
    store.put_array(upgrade_key(plan.id, ORDER), order.astype(np.int64))
    if eval_positions is not None and len(eval_positions) >= 2:
        store.put_array(eval_positions_key(plan.id), eval_positions)
        store.put_array(eval_queries_key(plan.id), eval_queries)
    write_plan(store, plan)
    gallery.write_manifest({**gallery.manifest(refresh=True), "upgrade": plan.id})
    if plan.base:
        store.put_json(upgrade_key(plan.base, SUPERSEDED), {"by": plan.id, "at": now()})


def eval_sample(labels: np.ndarray | None, size: int | None, seed: int) -> np.ndarray:
    """Positions of the labeled items that serve as queries (and their own gallery) while the
    backfill is measured; ``size`` None = all of them, 0 = none."""
    if labels is None or size == 0:
        return np.zeros(0, dtype=np.int64)
    n = len(labels)
    if size is None or size >= n:
        return np.arange(n, dtype=np.int64)
    return np.sort(np.random.default_rng(seed).choice(n, size=size, replace=False)).astype(np.int64)


def order_of(store: Store, upgrade: str) -> np.ndarray:
    return store.get_array(upgrade_key(upgrade, ORDER)).astype(np.int64)


def transformed_all(gallery: Gallery, upgrade: str) -> np.ndarray:
    return np.concatenate([gallery.store.get_array(transformed_key(upgrade, p)) for p in range(gallery.num_parts)])


# ------------------------------------------------------------------------------------------------
# The lock


class _PlanCache:
    """Plans and orders read once per process (chunks of one upgrade share them)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._items: dict[tuple[str, str], tuple[Plan, np.ndarray]] = {}

    def get(self, store: Store, upgrade: str) -> tuple[Plan, np.ndarray]:
        key = (store.uri, upgrade)
        with self._lock:
            if key not in self._items:
                plan = load_plan(store, upgrade)
                if plan is None:
                    raise GalleryError(f"upgrade {upgrade} has no plan in {store.uri}; start it with `fastfill upgrade`")
                self._items[key] = (plan, order_of(store, upgrade))
            return self._items[key]


PLANS = _PlanCache()


def backfill_chunk(store: Store, upgrade: str, chunk: int, model, *, device=None, batch_size: int = 512) -> dict:
    """Re-embed one chunk's images with the new model: read, embed, write the features, then the
    marker. A chunk whose marker exists is not redone."""
    from components.experiment.inference import embed

    marker = marker_key(upgrade, chunk)
    try:
        return {**store.get_json(marker), "skipped": True}
    except ObjectMissing:
        pass
    started = time.perf_counter()
    plan, order = PLANS.get(store, upgrade)
    start, stop = plan.chunk_bounds(chunk)
    positions = order[start:stop]
    images = gather_images(Gallery(store), positions, IMAGE_CACHE)
    features = check_features(embed(model, images, batch_size=batch_size, device=device), plan.new.dim,
                              f"new-model features of chunk {chunk}")
    digest = store.put_array(chunk_key(upgrade, chunk), features)
    record = {"chunk": chunk, "start": start, "stop": stop, "count": stop - start, "sha256": digest,
              "token": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(), "finished": now(),
              "seconds": round(time.perf_counter() - started, 4)}
    store.put_json(marker, record)
    return {**record, "skipped": False}


def done_chunks(store: Store, upgrade: str) -> list[int]:
    keys = store.list(upgrade_key(upgrade, "done/"))
    return sorted(int(key.rsplit("chunk-", 1)[1].split(".")[0]) for key in keys if key.endswith(".json"))


def chunk_features(store: Store, upgrade: str, chunk: int) -> np.ndarray:
    """A finished chunk's features, checked against its marker."""
    marker = store.get_json(marker_key(upgrade, chunk))
    features = store.get_array(chunk_key(upgrade, chunk))
    if len(features) != marker["count"]:
        raise StoreError(f"{store.describe(chunk_key(upgrade, chunk))} has {len(features)} rows; its marker "
                         f"says {marker['count']}")
    return features


def mixed_features(gallery: Gallery, plan: Plan, transformed: np.ndarray | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """The gallery as queries see it now: new features where backfilled, h(old) elsewhere;
    and the backfilled mask. ``transformed``: the upgrade's h(old), when the caller has read it."""
    features = transformed_all(gallery, plan.id) if transformed is None else transformed.copy()
    backfilled = np.zeros(plan.num_items, dtype=bool)
    order = order_of(gallery.store, plan.id)
    for chunk in done_chunks(gallery.store, plan.id):
        start, stop = plan.chunk_bounds(chunk)
        features[order[start:stop]] = chunk_features(gallery.store, plan.id, chunk)
        backfilled[order[start:stop]] = True
    return features, backfilled


# ------------------------------------------------------------------------------------------------
# Finish, status, garbage collection


def finish(gallery: Gallery, plan: Plan) -> dict:
    """All chunks done: write the new model's features part by part, then switch the gallery."""
    missing = sorted(set(range(plan.num_chunks)) - set(done_chunks(gallery.store, plan.id)))
    if missing:
        raise GalleryError(f"upgrade {plan.id} is not complete: {len(missing)} chunks left (first: {missing[0]})")
    features, backfilled = mixed_features(gallery, plan)
    assert backfilled.all()
    for part in range(gallery.num_parts):
        start, stop = gallery.part_bounds(part)
        gallery.store.put_array(features_key(plan.new, part), features[start:stop])
    record = {"upgrade": plan.id, "finished": now(), "model": plan.new.to_dict()}
    gallery.store.put_json(upgrade_key(plan.id, FINISHED), record)
    manifest = dict(gallery.manifest(refresh=True))
    manifest["model"] = plan.new.to_dict()
    manifest["upgrade"] = None
    manifest["history"] = [*manifest.get("history", []), {"model": plan.new.to_dict(), "since": now(), "by": plan.id}]
    gallery.write_manifest(manifest)
    return record


def reject(gallery: Gallery, plan: Plan, decision: dict) -> dict:
    """The promotion gate failed: the gallery goes back to serving its own model's features (the
    champion's); the upgrade's record says why, and its working data is garbage."""
    record = {"upgrade": plan.id, "rejected": now(), "model": plan.new.to_dict(), **decision}
    gallery.store.put_json(upgrade_key(plan.id, REJECTED), record)
    manifest = dict(gallery.manifest(refresh=True))
    if manifest.get("upgrade") == plan.id:
        manifest["upgrade"] = None
        gallery.write_manifest(manifest)
    return record


def rejection(store: Store, upgrade: str) -> dict | None:
    try:
        return store.get_json(upgrade_key(upgrade, REJECTED))
    except ObjectMissing:
        return None


def status(gallery: Gallery) -> dict:
    manifest = gallery.manifest(refresh=True)
    result = {"store": gallery.store.uri, "items": manifest["num_items"], "model": manifest["model"]["uri"],
              "state": "idle", "upgrade": None}
    try:
        result["lock"] = gallery.store.get_json(LOCK)
        result["lock"].pop("token", None)
    except ObjectMissing:
        result["lock"] = None
    upgrade = manifest.get("upgrade")
    if upgrade:
        plan = load_plan(gallery.store, upgrade)
        done = done_chunks(gallery.store, upgrade)
        items = plan.items_in(done) if plan else 0
        result.update(state="running" if result["lock"] else "paused", upgrade={
            "id": upgrade, "from": plan.old.uri if plan else None, "to": plan.new.uri if plan else None,
            "order": plan.order_kind if plan else None,
            "chunks_done": len(done), "chunks": plan.num_chunks if plan else None,
            "items_done": items, "fraction": items / manifest["num_items"],
            "mlflow_run_id": plan.mlflow_run_id if plan else None})
    return result


def collect_garbage(gallery: Gallery) -> dict:
    """Delete features of models other than the gallery's own, and the working data of finished
    upgrades (their plan.json and finished.json stay as the record)."""
    manifest = gallery.manifest(refresh=True)
    if manifest.get("upgrade"):
        raise GalleryError(f"upgrade {manifest['upgrade']} is in progress; finish it before collecting garbage "
                           "(its queries still use the old features)")
    current = ModelRef.from_dict(manifest["model"]).key
    deleted = {"features": 0, "upgrade_objects": 0}
    for key in gallery.store.list("features/"):
        if key.split("/")[1] != current:
            gallery.store.delete(key)
            deleted["features"] += 1
    for key in gallery.store.list("upgrades/"):
        parts = key.split("/")
        if len(parts) < 3 or parts[2] in ("plan.json", *ENDINGS):
            continue
        if any(gallery.store.exists(upgrade_key(parts[1], end)) for end in ENDINGS):
            gallery.store.delete(key)
            deleted["upgrade_objects"] += 1
    return deleted
