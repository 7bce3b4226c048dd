"""The backfill of a planned upgrade: re-embed one chunk (features first, then its completion
marker), which chunks are done, and the gallery as queries see it meanwhile (mixed features).
The objects' keys are in ``components.gallery.upgrade.planning``."""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from fastfill.components.gallery.inputs.images import ImageFailure, readable
from fastfill.components.gallery.layouts.catalog import (
    IMAGE_CACHE,
    Gallery,
    GalleryError,
    check_features,
    fetch_images,
    item_column,
    now,
)
from fastfill.components.gallery.store import ObjectMissing, Store

# the read side of the upgrade's objects (the chunks done, the mixed gallery), named from here too
from fastfill.components.gallery.upgrade.stored import Plan, chunk_key, load_plan, marker_key, order_of, source_key
from fastfill.components.gallery.upgrade.stored import chunk_features as chunk_features
from fastfill.components.gallery.upgrade.stored import done_chunks as done_chunks
from fastfill.components.gallery.upgrade.stored import iter_mixed_parts as iter_mixed_parts
from fastfill.components.gallery.upgrade.stored import mixed_features as mixed_features
from fastfill.components.gallery.upgrade.stored import mixed_rows as mixed_rows
from fastfill.components.gallery.upgrade.stored import transformed_rows as transformed_rows


class _PlanCache:
    """Orders read once per process per plan (chunks of one upgrade share them). The small
    plan.json is read each time: an upgrade aborted and planned again under the same id has a
    new plan, and a process (a Dask worker) that served the old one must not use its order."""

    def __init__(self):
        self._lock = threading.Lock()
        self._items: dict[tuple[str, str], tuple[Plan, np.ndarray]] = {}

    def get(self, store: Store, upgrade_id: str) -> tuple[Plan, np.ndarray]:
        key = (store.uri, upgrade_id)
        plan = load_plan(store, upgrade_id)
        if plan is None:
            raise GalleryError(f"upgrade {upgrade_id} has no plan in {store.uri}; start it with `fastfill upgrade`")
        with self._lock:
            if key not in self._items or self._items[key][0] != plan:
                self._items[key] = (plan, order_of(store, upgrade_id))
            return self._items[key]


PLANS = _PlanCache()


def backfill_chunk(gallery: Gallery, upgrade_id: str, chunk: int, model, *, device=None, batch_size: int = 512,
                   read_workers: int = 16, precision: str = "auto") -> dict:
    """Re-embed one chunk of ``gallery``'s upgrade with the new model: read its images, embed,
    write the features, then the marker. A chunk whose marker exists is not redone. An image that
    cannot be read or decoded (an adopted gallery's) keeps its transformed features; the marker
    lists it (``failed``)."""
    from fastfill.components.experiment.inference import embed

    store = gallery.store
    marker = marker_key(upgrade_id, chunk)
    try:
        return {**store.get_json(marker), "skipped": True}
    except ObjectMissing:
        pass
    started = time.perf_counter()
    plan, order = PLANS.get(store, upgrade_id)
    start, stop = plan.chunk_bounds(chunk)
    positions = order[start:stop]
    preprocessing = getattr(model, "preprocessing", None)
    assert plan.new.dim is not None  # a plan's new model has its dim
    features, failures = embed_streamed(
        lambda rows: fetch_images(gallery, positions[rows], IMAGE_CACHE, workers=read_workers,
                                  preprocessing=preprocessing),
        lambda images: embed(model, images, batch_size=batch_size, device=device, precision=precision),
        len(positions), plan.new.dim, batch_size)
    ok = readable(len(positions), failures)
    if ok.any():
        check_features(features[ok], plan.new.dim, f"new-model features of chunk {chunk}")
    failed = []
    if failures:
        failed_positions = positions[~ok]
        features[~ok] = transformed_rows(gallery, upgrade_id, failed_positions)
        ids = item_column(gallery, failed_positions, "id")
        failed = [{"position": int(positions[f.row]), "id": ids[i], "uri": f.uri, "reason": f.reason}
                  for i, f in enumerate(failures)]
    return {**write_chunk(store, upgrade_id, chunk, start, stop, features, started, failed,
                          serve=lambda: gallery.serve_chunk(plan, chunk, positions, features, ok)),
            "skipped": False}


def embed_streamed(fetch, embed, count: int, dim: int, batch: int) -> tuple[np.ndarray, list]:
    """Features of ``count`` items read ``batch`` at a time: ``fetch(rows)`` -> (images,
    failures indexing ``rows``) runs on a thread of its own, one batch ahead, so reading and
    decoding the next batch overlap the model's forward pass on this one; ``embed(images)`` ->
    features. Returns (features, failures indexing the ``count`` items); a failed row's features
    are left unset (zeros)."""
    features = np.zeros((count, dim), dtype=np.float32)
    failures: list = []
    slices = [np.arange(start, min(start + batch, count)) for start in range(0, count, max(1, batch))]
    if not slices:
        return features, failures
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="chunk-read-ahead") as reader:
        pending = reader.submit(fetch, slices[0])
        for k, rows in enumerate(slices):
            images, failed = pending.result()
            if k + 1 < len(slices):
                pending = reader.submit(fetch, slices[k + 1])
            ok = readable(len(rows), failed)
            if ok.any():
                features[rows[ok]] = embed(images[ok])
            failures += [ImageFailure(int(rows[f.row]), f.uri, f.reason) for f in failed]
    return features, failures


def write_chunk(store: Store, upgrade_id: str, chunk: int, start: int, stop: int, features: np.ndarray,
                started: float, failed: list | None = None, serve=None, **extra) -> dict:
    """A chunk's new features, then (``serve``) its rows in the index a layout serves queries
    from, then its completion marker (the chunk counts as done from here)."""
    digest = store.put_array(chunk_key(upgrade_id, chunk), features)
    if serve is not None:
        serve()
    record = {"chunk": chunk, "start": start, "stop": stop, "count": stop - start, "sha256": digest,
              "failed": failed or [], "token": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(),
              "finished": now(), "seconds": round(time.perf_counter() - started, 4), **extra}
    store.put_json(marker_key(upgrade_id, chunk), record)
    return record


def write_prefilled(store: Store, plan: Plan, order: np.ndarray, features_at: dict[int, np.ndarray]) -> int:
    """The chunks at the front of the order whose items were embedded while planning (the map
    sample and the evaluation sample, ``features_at``: position -> new features), written as
    done chunks: they are backfilled from the start. Returns the chunks written."""
    written = 0
    for chunk in range(plan.num_chunks):
        start, stop = plan.chunk_bounds(chunk)
        if stop > plan.prefilled:
            break
        rows = np.stack([features_at[int(p)] for p in order[start:stop]]).astype(np.float32)
        write_chunk(store, plan.upgrade_id, chunk, start, stop, rows, time.perf_counter(), prefilled=True)
        written += 1
    return written


def failed_images(store: Store, upgrade_id: str) -> list[dict]:
    """Every item whose image a backfill of ``upgrade_id`` could not read, from the chunk markers."""
    return [entry for chunk in done_chunks(store, upgrade_id)
            for entry in store.get_json(marker_key(upgrade_id, chunk)).get("failed", [])]


@dataclass(frozen=True)
class FailedImages:
    """The items whose image a backfill could not read (they keep the mapped features): how many
    (``count``), and ``items``, the chunk markers' records of them (position, id, uri, reason),
    all of them or the first few. ``to_dict``: ``failed_images`` in finished.json and in
    `fastfill upgrade status`."""

    count: int
    items: list[dict]

    @classmethod
    def of(cls, failed: list[dict], shown: int | None = None) -> FailedImages:
        """Those of ``failed``, the first ``shown`` of them listed (None: all)."""
        return cls(count=len(failed), items=list(failed if shown is None else failed[:shown]))

    @classmethod
    def from_dict(cls, record: dict) -> FailedImages:
        return cls(count=int(record["count"]), items=list(record["items"]))

    def to_dict(self) -> dict:
        return {"count": self.count, "items": list(self.items)}


def landed_since(store: Store, plan, order: np.ndarray, applied: set[int]):
    """The chunks of ``plan``'s backfill done and not in ``applied``, in chunk order, each as
    ``(chunk, positions, features, read)``: its items' places (``order``'s slice), its stored
    rows (the new features; h(old) for an item whose image could not be read) and which items
    were re-embedded (False: the image was unreadable, the row is still h(old))."""
    for chunk in done_chunks(store, plan.upgrade_id):
        if chunk in applied:
            continue
        start, stop = plan.chunk_bounds(chunk)
        positions = np.asarray(order[start:stop])
        failed = {entry["position"] for entry in store.get_json(marker_key(plan.upgrade_id, chunk)).get("failed", [])}
        read = np.array([p not in failed for p in positions.tolist()], dtype=bool)
        yield chunk, positions, chunk_features(store, plan.upgrade_id, chunk), read


def write_sources(gallery: Gallery, upgrade_id: str, base: Plan) -> int:
    """A sequential upgrade starts from the gallery as queries see it in the unfinished ``base``
    upgrade: its new model's features where backfilled, its transformed features elsewhere,
    all in the space of ``base.new`` (the maps compose). Written per part, in bounded memory;
    returns the parts."""
    for part, features, _ in iter_mixed_parts(gallery, base):
        gallery.store.put_array(source_key(upgrade_id, part), features)
    return gallery.num_parts
