"""Qdrant, the layout's choice measured: a collection per model version switched by an alias (what
``layout: qdrant`` does, components/gallery/layouts/qdrant_collection.py) against named vectors in
one collection, side by side in one run, on Qdrant's local mode (``QdrantClient(path=...)``, a
folder of each design's own under one temporary folder), on ``--items`` clustered synthetic rows
(benchmarks/serving_index.py's data: the old model's ``--old-dim`` features, h(old) and the new
model's ``--new-dim`` features).

    .venv/bin/python benchmarks/qdrant_choice.py                           # 20,000 rows, 128-d -> 256-d
    .venv/bin/python benchmarks/qdrant_choice.py --items 2000 --chunk 500  # a quick look

Each design is written as its product would write it, points in calls of 1,000 waiting for them to
be applied:

- **alias**: a collection per model version (payload ``id``, ``source``, ``model``), queried by the
  alias with a filter on ``model``. The switch: the new model's collection created and filled with
  the mixed gallery (h(old)), then ``update_collection_aliases`` (one call moves every reader
  querying the alias). A chunk upserts its points into the new collection. Rollback: the alias
  moved back. gc: ``delete_collection`` of the old model's collection.
- **named**: one collection, a named vector per model version (``v1``, ``v2``; payload ``id`` and
  each vector's source), queried ``using=`` the vector's name. The switch: ``create_vector_name``
  (a named vector added to a collection that exists), then every point upserted with both vectors
  (an upsert replaces a point's vectors: ``v1`` is written again beside ``v2``), then the name
  readers should use written in the collection's metadata (``serving``). A chunk upserts its points
  (both vectors). Rollback: the metadata's name back to ``v1``. gc: ``delete_vector_name('v1')``.

What a reader sees at the switch, on a gallery of ``--reader-items`` rows of its own (local mode's
exact search, and its filters in Python, grow with the rows: at ``--items`` the readers' queries
would crowd the write out): reader threads query all through each design's switch and ``--grace``
seconds after readers were moved, one query every 20 ms, each query embedded in one model's space
(k = 10); its points are written ``--reader-block`` (100) a call, so that queries fall between the
calls as on a server that answers reads while a write goes on. ``follow`` readers follow what the
index says readers should use, read again every ``--refresh`` seconds (alias: the ``model`` of a
point of the alias's collection, as docs/serving.md tells a service; named: the collection's
metadata ``serving``); ``deploy`` readers change model (and, with named vectors, the vector's name)
each at a moment of its own, drawn uniformly over the time the gallery's first write took (a deploy
that does not know when the switch ends). Each answer is: ``complete`` (recall@10 1.0 against an
exact search of that model's whole gallery), ``incomplete`` (some of the gallery not found: points
whose vector in that space is not written yet), ``empty``, ``refused`` (the call failed: a query of
one dimension against vectors of another), or ``other space`` (a hit from another model's vectors).
Local mode keeps one client per folder and this benchmark one lock around its calls, as the layout
does; readers and the writer take it in the order they ask, as a server would interleave them. The
switch's own time and bytes are measured on the ``--items`` gallery with no reader.

Also measured: the switch's time and bytes (the process's write calls, /proc/self/io wchar, and
the folder's growth), chunks (median time, bytes), searches half way through the backfill and
after it (``--queries`` new-space queries: latency, recall@10 against an exact search of the mixed
gallery; the alias design with the filter on ``model`` a service uses, and without), rollback,
gc, and the folder's size after each step. Local mode's numbers, not a server's: it keeps points
in SQLite, one transaction per point, and searches exactly in numpy, filters evaluated in Python.
Writes reports/qdrant_choice.{json,md} (``--out`` another name).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.serving_index import _data, _exact, _folder_bytes, _wchar  # noqa: E402

OLD, NEW = "models:/embedder/1", "models:/embedder/2"
BLOCK = 1000  # points per call, as the layout writes them
OUTCOMES = ("complete", "incomplete", "empty", "refused", "other space")


class FairLock:
    """A lock taken in the order it was asked for: a writer's next call waits for the readers
    already waiting, as a server interleaves them (a plain Lock lets the writer take it again at
    once, and readers would see nothing of a write in progress)."""

    def __init__(self):
        self._turns = threading.Condition()
        self._next = self._serving = 0

    def __enter__(self) -> None:
        with self._turns:
            ticket, self._next = self._next, self._next + 1
            while ticket != self._serving:
                self._turns.wait()

    def __exit__(self, *exc) -> None:
        with self._turns:
            self._serving += 1
            self._turns.notify_all()


class Design:
    """One design's collection(s) in a local-mode folder of its own; every call under ``lock``."""

    name = ""

    def __init__(self, folder: str, old_dim: int, new_dim: int, block: int = BLOCK):
        from qdrant_client import QdrantClient

        self.folder, self.old_dim, self.new_dim, self.block = folder, old_dim, new_dim, block
        self.client = QdrantClient(path=folder)
        self.lock = FairLock()

    def _upsert(self, collection: str, points: list) -> None:
        for start in range(0, len(points), self.block):
            with self.lock:
                self.client.upsert(collection, points=points[start:start + self.block], wait=True)

    def close(self) -> None:
        self.client.close()


class Alias(Design):
    name = "alias"
    ALIAS = "gallery"

    def collection(self, model: str) -> str:
        return f"gallery_emb_v{model[-1]}"

    def _points(self, model: str, ids: np.ndarray, vectors: np.ndarray, source: str) -> list:
        from qdrant_client import models as qm

        return [qm.PointStruct(id=int(i), vector=v.tolist(), payload={"id": int(i), "source": source, "model": model})
                for i, v in zip(ids, vectors)]

    def _create(self, model: str, dim: int) -> None:
        from qdrant_client import models as qm

        with self.lock:
            self.client.create_collection(self.collection(model),
                                          vectors_config=qm.VectorParams(size=dim, distance=qm.Distance.EUCLID))

    def _move(self, model: str) -> None:
        from qdrant_client import models as qm

        operations: list = []
        with self.lock:
            if any(a.alias_name == self.ALIAS for a in self.client.get_aliases().aliases):
                operations.append(qm.DeleteAliasOperation(delete_alias=qm.DeleteAlias(alias_name=self.ALIAS)))
            operations.append(qm.CreateAliasOperation(create_alias=qm.CreateAlias(
                collection_name=self.collection(model), alias_name=self.ALIAS)))
            self.client.update_collection_aliases(change_aliases_operations=operations)

    def setup(self, ids: np.ndarray, old: np.ndarray) -> None:
        self._create(OLD, self.old_dim)
        self._upsert(self.collection(OLD), self._points(OLD, ids, old, "embedded"))
        self._move(OLD)

    def switch_write(self, ids: np.ndarray, old: np.ndarray, mapped: np.ndarray) -> None:
        self._create(NEW, self.new_dim)
        self._upsert(self.collection(NEW), self._points(NEW, ids, mapped, "mapped"))

    def move_readers(self, model: str) -> None:
        self._move(model)

    def chunk(self, ids: np.ndarray, old: np.ndarray, new: np.ndarray) -> None:
        self._upsert(self.collection(NEW), self._points(NEW, ids, new, "embedded"))

    def pointer(self) -> str:
        with self.lock:
            points, _ = self.client.scroll(self.ALIAS, limit=1, with_payload=["model"], with_vectors=False)
        return points[0].payload["model"]

    def query(self, model: str, query: np.ndarray, k: int, filtered: bool = True) -> tuple[list, list]:
        from qdrant_client import models as qm

        where = qm.Filter(must=[qm.FieldCondition(key="model", match=qm.MatchValue(value=model))]) if filtered else None
        with self.lock:
            hits = self.client.query_points(self.ALIAS, query=query.tolist(), limit=k, query_filter=where,
                                            with_payload=["id", "model"]).points
        return [h.payload["id"] for h in hits], [h.payload["model"] for h in hits]

    def gc(self) -> None:
        with self.lock:
            self.client.delete_collection(self.collection(OLD))


class Named(Design):
    name = "named"
    COLLECTION = "gallery"
    VECTOR = {OLD: "v1", NEW: "v2"}

    def _points(self, ids: np.ndarray, vectors: dict, sources: dict) -> list:
        from qdrant_client import models as qm

        names = list(vectors)
        return [qm.PointStruct(id=int(i), vector={n: vectors[n][row].tolist() for n in names},
                               payload={"id": int(i), **{f"source_{n}": sources[n] for n in names}})
                for row, i in enumerate(ids)]

    def _serve(self, model: str) -> None:
        with self.lock:
            self.client.update_collection(self.COLLECTION, metadata={"serving": self.VECTOR[model]})

    def setup(self, ids: np.ndarray, old: np.ndarray) -> None:
        from qdrant_client import models as qm

        with self.lock:
            self.client.create_collection(self.COLLECTION, vectors_config={
                "v1": qm.VectorParams(size=self.old_dim, distance=qm.Distance.EUCLID)})
        self._upsert(self.COLLECTION, self._points(ids, {"v1": old}, {"v1": "embedded"}))
        self._serve(OLD)

    def switch_write(self, ids: np.ndarray, old: np.ndarray, mapped: np.ndarray) -> None:
        from qdrant_client import models as qm

        with self.lock:
            self.client.create_vector_name(self.COLLECTION, "v2", qm.DenseVectorNameConfig(
                dense=qm.DenseVectorConfig(size=self.new_dim, distance=qm.Distance.EUCLID)))
        self._upsert(self.COLLECTION, self._points(ids, {"v1": old, "v2": mapped}, {"v1": "embedded", "v2": "mapped"}))

    def move_readers(self, model: str) -> None:
        self._serve(model)

    def chunk(self, ids: np.ndarray, old: np.ndarray, new: np.ndarray) -> None:
        self._upsert(self.COLLECTION, self._points(ids, {"v1": old, "v2": new}, {"v1": "embedded", "v2": "embedded"}))

    def pointer(self) -> str:
        with self.lock:
            name = (self.client.get_collection(self.COLLECTION).config.metadata or {}).get("serving")
        return {v: k for k, v in self.VECTOR.items()}[name]

    def query(self, model: str, query: np.ndarray, k: int, filtered: bool = True) -> tuple[list, list]:
        with self.lock:
            hits = self.client.query_points(self.COLLECTION, query=query.tolist(), using=self.VECTOR[model], limit=k,
                                            with_payload=["id"]).points
        return [h.payload["id"] for h in hits], [model] * len(hits)  # a named vector is one model's space

    def gc(self) -> None:
        with self.lock:
            self.client.delete_vector_name(self.COLLECTION, "v1")


def _measured(design: Design, step) -> dict:
    """The time, the bytes passed to write calls and the folder's growth of ``step()``."""
    size, wrote, start = _folder_bytes(design.folder), _wchar(), time.perf_counter()
    step()
    return {"seconds": time.perf_counter() - start, "wchar_bytes": _wchar() - wrote,
            "folder_growth_bytes": _folder_bytes(design.folder) - size}


class Readers:
    """Reader threads querying ``design`` while its switch runs (see the module's docstring)."""

    def __init__(self, design: Design, queries: dict, truth: dict, per_kind: int, refresh: float, window: float,
                 k: int = 10, seed: int = 0):
        self.design, self.queries, self.truth, self.k, self.refresh = design, queries, truth, k, refresh
        rng = np.random.default_rng(seed)
        self.kinds = [("follow", None)] * per_kind + [("deploy", float(d)) for d in rng.uniform(0, window, per_kind)]
        self.answers: list[tuple[float, str, str]] = []  # (answered, kind, outcome)
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def start(self) -> float:
        self.t0 = time.perf_counter()
        for number, (kind, delay) in enumerate(self.kinds):
            thread = threading.Thread(target=self._read, args=(number, kind, delay), daemon=True)
            thread.start()
            self.threads.append(thread)
        return self.t0

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()

    def _outcome(self, model: str, row: int) -> str:
        query = self.queries[model][row]
        try:
            ids, spaces = self.design.query(model, query, self.k)
        except Exception:  # noqa: BLE001 - what a service's call meets: a wrong dimension, a missing vector
            return "refused"
        if any(space != model for space in spaces):
            return "other space"
        if not ids:
            return "empty"
        found = len(set(ids) & set(self.truth[model][row].tolist())) / self.k
        return "complete" if found == 1.0 else "incomplete"

    def _read(self, number: int, kind: str, delay: float | None) -> None:
        model, read_at, row = OLD, -1e9, number
        while not self.stop.is_set():
            now = time.perf_counter()
            if kind == "follow" and now - read_at >= self.refresh:
                model, read_at = self.design.pointer(), now
            elif kind == "deploy":
                model = NEW if delay is not None and now - self.t0 >= delay else OLD
            row = (row + 1) % len(self.queries[model])
            outcome = self._outcome(model, row)
            self.answers.append((time.perf_counter(), kind, outcome))  # when it was answered
            time.sleep(0.02)

    def shares(self, since: float, until: float) -> dict:
        out = {}
        for kind in ("follow", "deploy"):
            seen = [outcome for answered, k, outcome in self.answers if k == kind and since <= answered <= until]
            out[kind] = {"answers": len(seen), **{o: seen.count(o) / len(seen) if seen else 0.0 for o in OUTCOMES}}
        return out


def _search(design: Design, queries: np.ndarray, gallery: np.ndarray, filtered: bool = True, k: int = 10) -> dict:
    truth = _exact(gallery, queries, k)
    design.query(NEW, queries[0], k, filtered)  # warm
    latencies, recalls = [], []
    for query, row in zip(queries, truth):
        start = time.perf_counter()
        ids, _ = design.query(NEW, query, k, filtered)
        latencies.append(time.perf_counter() - start)
        recalls.append(len(set(ids) & set(row.tolist())) / k)
    return {"latency_ms_median": 1000 * statistics.median(latencies),
            "latency_ms_p95": 1000 * float(np.percentile(latencies, 95)), "recall_at_10": float(np.mean(recalls))}


def readers_at_switch(design: Design, data: dict, args) -> dict:
    """The switch of a gallery of ``len(data["old"])`` rows with reader threads querying all
    through it (the module's docstring): the share of each outcome while the mixed gallery is
    written, and after readers were moved."""
    ids = np.arange(len(data["old"]))
    started = time.perf_counter()
    design.setup(ids, data["old"])
    window = time.perf_counter() - started  # the deploy readers' moments are drawn over this
    queries = {OLD: data["old_queries"], NEW: data["queries"][:len(data["old_queries"])]}
    truth = {OLD: _exact(data["old"], queries[OLD], 10), NEW: _exact(data["mapped"], queries[NEW], 10)}
    readers = Readers(design, queries, truth, args.readers, args.refresh, window, seed=args.seed)
    t0 = readers.start()
    design.switch_write(ids, data["old"], data["mapped"])
    moving = time.perf_counter()
    design.move_readers(NEW)
    moved = time.perf_counter()
    time.sleep(args.grace)
    readers.finish()
    return {"rows": len(ids), "switch_write_seconds": moving - t0, "deploy_window_seconds": window,
            "during_write": readers.shares(t0, moving), "after_move": readers.shares(moved, moved + args.grace)}


def run_design(design: Design, data: dict, args) -> dict:
    items = args.items
    ids = np.arange(items)
    out: dict = {"steps": {}, "folder_bytes": {}}
    steps, sizes = out["steps"], out["folder_bytes"]
    steps["setup"] = _measured(design, lambda: design.setup(ids, data["old"]))
    sizes["after_setup"] = _folder_bytes(design.folder)

    queries = {OLD: data["old_queries"][:args.queries], NEW: data["queries"][:args.queries]}
    steps["switch_write"] = _measured(design, lambda: design.switch_write(ids, data["old"], data["mapped"]))
    steps["switch_move"] = _measured(design, lambda: design.move_readers(NEW))
    sizes["after_switch"] = _folder_bytes(design.folder)

    mixed, chunks = data["mapped"].copy(), []
    order = data["order"]
    bounds = list(range(0, items, args.chunk))
    for number, lo in enumerate(bounds):
        positions = np.sort(order[lo:lo + args.chunk])
        chunks.append(_measured(design, lambda p=positions: design.chunk(ids[p], data["old"][p], data["new"][p])))
        mixed[positions] = data["new"][positions]
        if number == len(bounds) // 2 - 1:
            out["search_half_way"] = _search(design, queries[NEW], mixed)
            if isinstance(design, Alias):
                out["search_half_way_no_filter"] = _search(design, queries[NEW], mixed, filtered=False)
    out["chunk_median"] = {key: statistics.median(c[key] for c in chunks) for key in chunks[0]}
    out["search_after_backfill"] = _search(design, queries[NEW], data["new"])
    if isinstance(design, Alias):
        out["search_after_backfill_no_filter"] = _search(design, queries[NEW], data["new"], filtered=False)
    sizes["after_backfill"] = _folder_bytes(design.folder)
    steps["rollback"] = _measured(design, lambda: design.move_readers(OLD))
    steps["forward_again"] = _measured(design, lambda: design.move_readers(NEW))
    steps["gc"] = _measured(design, design.gc)
    sizes["after_gc"] = _folder_bytes(design.folder)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=20000)
    parser.add_argument("--old-dim", type=int, default=128)
    parser.add_argument("--new-dim", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=2000)
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--readers", type=int, default=4, help="reader threads of each kind (follow, deploy)")
    parser.add_argument("--reader-items", type=int, default=2000,
                        help="rows of the gallery whose switch the readers query through (a gallery of its own)")
    parser.add_argument("--reader-block", type=int, default=100, help="points per call in that gallery's writes")
    parser.add_argument("--refresh", type=float, default=0.5, help="seconds a follow reader keeps what it read")
    parser.add_argument("--grace", type=float, default=2.0, help="seconds readers go on after they were moved")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="qdrant_choice", help="reports/<out>.{json,md}")
    args = parser.parse_args()
    from importlib.metadata import version

    data = _data(args.items, args.old_dim, args.new_dim, args.seed)
    rng = np.random.default_rng(args.seed + 1)
    picked = rng.integers(0, args.items, args.queries)
    data["old_queries"] = data["old"][picked] + 0.3 * rng.standard_normal((args.queries, args.old_dim), dtype=np.float32)
    results = {}
    small = _data(args.reader_items, args.old_dim, args.new_dim, args.seed + 2)
    picked = rng.integers(0, args.reader_items, args.queries)
    small["old_queries"] = small["old"][picked] + 0.3 * rng.standard_normal((args.queries, args.old_dim),
                                                                             dtype=np.float32)
    base = tempfile.mkdtemp(prefix="qdrant-choice-")
    try:
        for kind in (Alias, Named):
            design = kind(os.path.join(base, kind.name), args.old_dim, args.new_dim)
            try:
                results[kind.name] = run_design(design, data, args)
            finally:
                design.close()
            design = kind(os.path.join(base, f"{kind.name}-readers"), args.old_dim, args.new_dim, args.reader_block)
            try:
                results[kind.name]["readers_at_switch"] = readers_at_switch(design, small, args)
            finally:
                design.close()
            print(kind.name, json.dumps(results[kind.name]), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report(results, args, version("qdrant-client"))


def _mb(value: float) -> str:
    return f"{value / 2 ** 20:.1f} MB"


def report(results: dict, args, client_version: str) -> None:
    designs = list(results)
    command = (f"python benchmarks/qdrant_choice.py --items {args.items} --old-dim {args.old_dim} --new-dim "
               f"{args.new_dim} --chunk {args.chunk} --queries {args.queries} --readers {args.readers} --reader-items "
               f"{args.reader_items} --reader-block {args.reader_block} --refresh "
               f"{args.refresh} --grace {args.grace} --seed {args.seed}")
    lines = [f"# Qdrant: a collection per model behind an alias, or named vectors in one collection: {args.items:,} "
             f"rows, {args.old_dim}-d -> {args.new_dim}-d, chunks of {args.chunk:,}", "",
             f"`{command}` on {os.cpu_count()} cores; qdrant-client {client_version}, local mode (a folder per "
             "design on this machine's disk: points kept in SQLite one transaction per point, exact search in numpy, "
             "filters in Python; a server's times differ). alias: what `layout: qdrant` does; named: named vectors "
             "`v1`, `v2` in one collection. Bytes: what the process passed to write calls (/proc/self/io wchar), "
             "and the folder's growth.", "",
             "| step | " + " | ".join(designs) + " |", "|---|" + "---|" * len(designs)]

    def step_row(title: str, step: str) -> str:
        return f"| {title} | " + " | ".join(
            f"{results[d]['steps'][step]['seconds']:.3f} s, {_mb(results[d]['steps'][step]['wchar_bytes'])} written, "
            f"folder {_mb(results[d]['steps'][step]['folder_growth_bytes'])}" for d in designs) + " |"

    lines += [step_row("the gallery's first write (the old model's vectors)", "setup"),
              step_row("the switch: the mixed gallery written", "switch_write"),
              step_row("the switch: readers moved (alias: one update_collection_aliases; named: the metadata's name)",
                       "switch_move"),
              "| a chunk (median) | " + " | ".join(
                  f"{results[d]['chunk_median']['seconds']:.3f} s, {_mb(results[d]['chunk_median']['wchar_bytes'])} "
                  f"written, folder {_mb(results[d]['chunk_median']['folder_growth_bytes'])}" for d in designs) + " |",
              step_row("rollback (readers moved back)", "rollback"),
              step_row("gc (alias: delete_collection; named: delete_vector_name)", "gc")]
    lines += ["", "| folder size | " + " | ".join(designs) + " |", "|---|" + "---|" * len(designs)]
    for when in ("after_setup", "after_switch", "after_backfill", "after_gc"):
        lines.append(f"| {when.replace('_', ' ')} | " + " | ".join(_mb(results[d]["folder_bytes"][when])
                                                                   for d in designs) + " |")
    lines += ["", "| search (k = 10, new model's queries): latency ms median / p95, recall@10 | "
              + " | ".join(designs) + " |", "|---|" + "---|" * len(designs)]
    for when in ("search_half_way", "search_after_backfill"):
        cells = []
        for d in designs:
            found = results[d][when]
            cell = f"{found['latency_ms_median']:.1f} / {found['latency_ms_p95']:.1f}, {found['recall_at_10']:.3f}"
            bare = results[d].get(f"{when}_no_filter")
            if bare:
                cell += (f" (without the filter on model: {bare['latency_ms_median']:.1f} / "
                         f"{bare['latency_ms_p95']:.1f}, {bare['recall_at_10']:.3f})")
            cells.append(cell)
        lines.append(f"| {when.removeprefix('search_').replace('_', ' ')} | " + " | ".join(cells) + " |")
    lines += ["", f"What readers saw at the switch of a gallery of {args.reader_items:,} rows of its own, "
              f"written {args.reader_block} points a call ({args.readers} follow and {args.readers} deploy readers "
              "per design, a query every 20 ms each, "
              f"follow readers re-reading every {args.refresh} s, deploy readers moving at moments drawn over the "
              "gallery's first write's time; the readers and the writer take turns in the order they ask): the "
              "share of answers. The mixed gallery's write took " + ", ".join(
                  f"{d} {results[d]['readers_at_switch']['switch_write_seconds']:.1f} s" for d in designs)
              + f"; after move: the {args.grace} s after readers were moved.", "",
              "| design, readers, when | answers | " + " | ".join(OUTCOMES) + " |",
              "|---|---|" + "---|" * len(OUTCOMES)]
    for d in designs:
        for when in ("during_write", "after_move"):
            for kind, seen in results[d]["readers_at_switch"][when].items():
                lines.append(f"| {d}, {kind}, {when.replace('_', ' ')} | {seen['answers']} | "
                             + " | ".join(f"{100 * seen[o]:.1f}%" for o in OUTCOMES) + " |")
    out = ROOT / "reports" / args.out
    out.with_suffix(".json").write_text(json.dumps({"command": command, "qdrant_client": client_version,
                                                    "args": vars(args), "results": results}, indent=2) + "\n")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
