"""The upgrade served from the team's index on every layout, side by side in one run: the same
upgrade through the same product functions on a features-only gallery of ``--items`` rows, the
old model's ``--old-dim`` features to the new model's ``--new-dim``.

    .venv/bin/python benchmarks/serving_index.py                    # 100,000 rows, 128-d -> 256-d
    .venv/bin/python benchmarks/serving_index.py --items 1000000
    .venv/bin/python benchmarks/serving_index.py --items 5000 --chunk 1000   # a quick look

Each layout runs in a process of its own (peak RSS is the process's; PostgreSQL's own memory is
reported apart, from its processes), through the product's functions: adopt, commit_plan (the
switch: the new model's vectors written with h(old), the ANN index built, readers moved: the Lance
serving table overwritten, the pgvector view, the Milvus alias, the Qdrant alias), write_chunk with
the layout's chunk commit (Lance: one commit deleting the switch's rows by address and adding the
chunk's fragment; pgvector: the rows appended in one transaction with the chunk's record; Milvus
and Qdrant: an upsert), finish; and searches, half way through the backfill and after the finish:
``--queries`` queries, k = 10, the latency per query and recall@10 against an exact search of the
same mixed gallery (parts: `fastfill search`'s flat faiss index, exact; the others: the index
itself, at the layout's defaults). The bytes each chunk writes: the store's folder's growth (parts,
Lance, the Milvus Lite file and the Qdrant local-mode folder kept in it) and PostgreSQL's WAL; for
the layouts whose index lives in the benchmark's process (parts, Lance, Qdrant's local mode), also
the bytes the process passed to write calls (/proc/self/io wchar), which counts what is rewritten
in place. PostgreSQL is pgserver's (16.2, pgvector 0.6.2) on this machine, over a Unix socket;
Milvus is Milvus Lite; Qdrant is qdrant-client's local mode (``QdrantClient(path=...)``, a folder
in the store's folder: points kept in SQLite a transaction each, exact search in numpy with the
filter on ``model`` in Python, no server and no HNSW: its times are the local mode's, not a Qdrant
server's). ``--layouts`` runs some of them (``--layouts parts,qdrant``: Qdrant beside the parts
layout); ``--suffix`` names the report. With ``--readers 8`` each index layout runs a second time,
read throughout by that many concurrent readers (benchmarks/serving_readers.py: threads, each with
its own connection, querying back to back before the switch, during it, along the backfill and half
way, during the finish and after it): their latency p50/p95/p99 and errors per phase, and the
upgrade's steps against the run without readers. On Lance the seconds of keeping the ANN index
current are timed inside each chunk's commit. Writes
reports/serving_index-<items>[-<suffix>].{json,md}. """

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.serving_readers import readers_table  # noqa: E402

LAYOUTS = ("parts", "lance", "pgvector", "milvus", "qdrant")
IN_PROCESS = ("parts", "lance", "qdrant")  # whose writes are the benchmark process's own (no server)


def _data(items: int, old_dim: int, new_dim: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((64, new_dim), dtype=np.float32)  # clustered, as real features are
    labels = rng.integers(0, 64, items)
    new = centres[labels] + 0.6 * rng.standard_normal((items, new_dim), dtype=np.float32)
    mapped = new + 0.5 * rng.standard_normal((items, new_dim), dtype=np.float32)
    return {"old": rng.standard_normal((items, old_dim), dtype=np.float32), "mapped": mapped, "new": new,
            "sigma": rng.standard_normal(items, dtype=np.float32), "order": rng.permutation(items),
            "queries": centres[rng.integers(0, 64, 1000)] + 0.6 * rng.standard_normal((1000, new_dim), dtype=np.float32)}


def _exact(gallery: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    g2 = (gallery.astype(np.float64) ** 2).sum(1)
    out = []
    for start in range(0, len(queries), 100):
        q = queries[start:start + 100].astype(np.float64)
        d = g2[None] - 2 * q @ gallery.T.astype(np.float64)
        out.append(np.argsort(d, axis=1, kind="stable")[:, :k])
    return np.concatenate(out)


def _search(layout: str, gallery, queries: np.ndarray, mixed: np.ndarray, k: int = 10) -> dict:
    from fastfill.components.gallery.search.served import searcher_for

    searcher = searcher_for(gallery, "l2")
    for query in queries:  # a warm pass: what a serving index answers in steady state, not its first reads
        searcher.search(query[None], k)
    latencies, found = [], []
    for query in queries:
        start = time.perf_counter()
        ids, _ = searcher.search(query[None], k)
        latencies.append(time.perf_counter() - start)
        found.append(np.asarray(ids[0], dtype=np.int64))
    truth = _exact(mixed, queries, k)  # ids are positions here
    recall = float(np.mean([len(set(f.tolist()) & set(t.tolist())) / k for f, t in zip(found, truth)]))
    return {"latency_ms_median": 1000 * statistics.median(latencies),
            "latency_ms_p95": 1000 * float(np.percentile(latencies, 95)), "recall_at_10": recall}


def _server_rss() -> int:
    """The resident bytes of every postgres process on this machine (/proc)."""
    total = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        if text.startswith("Name:\tpostgres"):
            for line in text.splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


def _folder_bytes(root: str) -> int:
    """The bytes of the files under ``root``, each file once (the local store links a verified
    copy of each object beside it: one inode, counted once)."""
    seen = {}
    for entry in Path(root).rglob("*"):
        if entry.is_file():
            stat = entry.stat()
            seen[(stat.st_dev, stat.st_ino)] = stat.st_size
    return sum(seen.values())


def _wchar() -> int:
    """The bytes this process has passed to write calls (/proc/self/io's wchar): what an index kept
    in the process (parts, Lance, Qdrant's local mode) writes, rewrites in place included, which the
    folder's growth does not see."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return 0


def _time_lance_index() -> list[float]:
    """The seconds of each chunk's ANN index upkeep on the Lance serving table (its
    ``_index_chunk``, timed for this process)."""
    from fastfill.components.gallery.layouts.lance_serving import ServingTable

    seconds: list[float] = []
    upkeep = ServingTable._index_chunk

    def timed(self) -> None:
        start = time.perf_counter()
        upkeep(self)
        seconds.append(time.perf_counter() - start)

    ServingTable._index_chunk = timed  # type: ignore[method-assign]
    return seconds


def _wal(pg_uri: str) -> int:
    import psycopg

    with psycopg.connect(pg_uri) as connection:
        return int(connection.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()[0])


def adopt_features(store, old, features: np.ndarray, layout) -> None:
    """A features-only gallery of ``len(features)`` rows adopted into ``store`` in ``layout`` with
    ``old``'s ``features`` (the images' URIs only)."""
    import pyarrow as pa

    from fastfill.components.gallery.inputs.adopt import adopt

    items = len(features)
    table = pa.table({"id": pa.array(np.arange(items, dtype=np.int64)),
                      "uri": pa.array([f"s3://images/{i:08d}.png" for i in range(items)])})
    adopt(store, table, old, (1, 28, 28), features=iter([features]), part_size=10000, layout=layout)


def plan_objects(gallery, plan, data: dict) -> None:
    """What planning leaves in the store before the switch: h(old) and sigma of every part."""
    from fastfill.components.gallery.upgrade.planning import sigma_key, transformed_key

    for part in range(gallery.num_parts):
        lo, hi = gallery.part_bounds(part)
        gallery.store.put_array(transformed_key(plan.upgrade_id, part), data["mapped"][lo:hi])
        gallery.store.put_array(sigma_key(plan.upgrade_id, part), data["sigma"][lo:hi])


def chunk_ranges(items: int, chunk: int) -> list[tuple[int, int, int]]:
    """(chunk, start, stop) of each chunk of the order."""
    return [(c, s, min(s + chunk, items)) for c, s in enumerate(range(0, items, chunk))]


def commit_chunk(gallery, plan, number: int, lo: int, hi: int, positions: np.ndarray, features: np.ndarray,
                 started: float) -> None:
    """Chunk ``number``'s commit as a backfill makes it: its features in the store, its rows in the
    layout's index (every image read), its marker."""
    from fastfill.components.gallery.upgrade.backfill import write_chunk

    write_chunk(gallery.store, plan.upgrade_id, number, lo, hi, features, started,
                serve=functools.partial(gallery.serve_chunk, plan, number, positions, features,
                                        np.ones(len(positions), bool)))


def run_layout(root: str, layout: str, items: int, old_dim: int, new_dim: int, chunk: int, queries: int,
               pg_uri: str, ann: str, readers: int = 0, reader_seconds: float = 10.0) -> dict:
    """One layout's run in a store of its own at ``root`` (the parent removes it once this process
    has ended: Milvus Lite writes its file as the process exits). ``readers``: that many threads
    query the index throughout (benchmarks/serving_readers.py), ``reader_seconds`` before the
    switch and after the finish."""
    from benchmarks.serving_readers import Readers
    from fastfill.components.gallery.layouts.opening import gallery_at, layout_of
    from fastfill.components.gallery.store import open_store
    from fastfill.components.gallery.upgrade import ending
    from fastfill.components.gallery.upgrade.planning import Plan, commit_plan
    from fastfill.components.platform.config import GalleryConfig
    from fastfill.components.platform.registry import ModelRef

    data = _data(items, old_dim, new_dim)
    qs = data["queries"][:queries]
    old, new = ModelRef("embedder", "1", old_dim), ModelRef("embedder", "2", new_dim)
    store = open_store(root)
    table_name = f"bench_{items}_{ann}{'_read' if readers else ''}"  # one PostgreSQL serves both runs
    config = GalleryConfig(layout=layout, pgvector={"uri": pg_uri, "table": table_name, "ann": ann},
                           milvus={"uri": os.path.join(root, "milvus.db"), "alias": f"bench_{items}"},
                           qdrant={"url": os.path.join(root, "qdrant"), "alias": f"bench_{items}"})
    written = (lambda: _wal(pg_uri)) if layout == "pgvector" else (lambda: _folder_bytes(root))
    times: dict = {}
    start = time.perf_counter()
    adopt_features(store, old, data["old"], layout_of(layout, config))
    times["adopt"] = time.perf_counter() - start
    index_seconds = _time_lance_index() if layout == "lance" else []
    rng = np.random.default_rng(7)
    load = Readers(readers, lambda: gallery_at(store), {
        old_dim: rng.standard_normal((1000, old_dim), dtype=np.float32), new_dim: data["queries"]}).start()
    load.set_phase("before the switch")
    time.sleep(reader_seconds if readers else 0)
    load.set_phase("the switch")

    gallery = gallery_at(store)
    plan = Plan("u1", old, new, "models:/map/1", "sigma", chunk, items, 0, "l2")
    start = time.perf_counter()
    plan_objects(gallery, plan, data)
    times["plan_objects"] = time.perf_counter() - start
    start = time.perf_counter()
    commit_plan(gallery, plan, data["order"])  # pgvector: the switch (column, h(old), index, view)
    times["switch"] = time.perf_counter() - start

    writing = gallery_at(store)
    mixed = data["mapped"].copy()
    latencies, sizes, calls = [], [], []
    order = data["order"]
    chunks = chunk_ranges(items, chunk)
    half = len(chunks) // 2
    result: dict = {}
    for number, lo, hi in chunks:
        load.set_phase("half way" if 0.4 <= number / len(chunks) < 0.6 else "the backfill")
        positions = order[lo:hi]
        features = data["new"][positions]
        before, wrote = written(), _wchar()
        start = time.perf_counter()
        commit_chunk(writing, plan, number, lo, hi, positions, features, start)
        latencies.append(time.perf_counter() - start)
        sizes.append(written() - before)
        calls.append(_wchar() - wrote)
        mixed[positions] = features
        if number == half - 1:
            result["search_half_way"] = _search(layout, gallery_at(store), qs, mixed)
    times["chunk_commit_median"] = statistics.median(latencies)
    times["chunk_commit_per_10k_rows"] = statistics.median(latencies) * 10000 / chunk
    result["chunk_bytes_median"] = statistics.median(sizes)
    result["chunk_bytes_mean"], result["chunk_bytes_max"] = statistics.mean(sizes), max(sizes)
    if layout in IN_PROCESS:
        result["chunk_wchar_median"] = statistics.median(calls)
    result["chunk_payload_bytes"] = chunk * new_dim * 4  # the new features alone
    if index_seconds:  # Lance: keeping the ANN index current, inside each chunk's commit
        times["index_per_chunk_median"] = statistics.median(index_seconds)
        times["index_per_chunk_mean"] = statistics.mean(index_seconds)
        commits = [total - upkeep for total, upkeep in zip(latencies, index_seconds)]
        times["chunk_commit_without_index_per_10k_rows"] = statistics.median(commits) * 10000 / chunk
    load.set_phase("the finish")
    start = time.perf_counter()
    ending.finish(gallery_at(store), plan)
    times["finish"] = time.perf_counter() - start
    load.set_phase("after the finish")
    time.sleep(reader_seconds if readers else 0)
    load.close()
    if readers:
        result["readers"] = {"count": readers, "phases": load.summary()}
    result["search_after_finish"] = _search(layout, gallery_at(store), qs, data["new"])
    served = gallery_at(store).all_features(new)
    assert np.array_equal(served, data["new"]), f"the {layout} layout served other features"
    result.update(times=times, peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  postgres_rss_mb=_server_rss() / 2 ** 20 if layout == "pgvector" else None)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=100000)
    parser.add_argument("--old-dim", type=int, default=128)
    parser.add_argument("--new-dim", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=10000)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--worker", choices=LAYOUTS)
    parser.add_argument("--root", help="(a worker's) its store's folder")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="which, comma-separated (parts first)")
    parser.add_argument("--pg-uri", default="")
    parser.add_argument("--ann", choices=("hnsw", "ivfflat"), default="ivfflat", help="gallery.pgvector.ann")
    parser.add_argument("--suffix", default="", help="the report's name: reports/serving_index-<items>-<suffix>")
    parser.add_argument("--readers", type=int, default=0, help="each index layout (not parts) run again with this "
                        "many concurrent readers throughout (benchmarks/serving_readers.py), e.g. 8")
    parser.add_argument("--reader-seconds", type=float, default=10.0, help="the readers' time before the switch "
                        "and after the finish")
    parser.add_argument("--combine", nargs="+", metavar="JSON", help="no run: the report of the layouts in these "
                        "reports' JSON (each its own run; a later file's layout replaces an earlier one's)")
    args = parser.parse_args()
    if args.worker:
        result = run_layout(args.root, args.worker, args.items, args.old_dim, args.new_dim, args.chunk,
                            args.queries, args.pg_uri, args.ann, args.readers, args.reader_seconds)
        kept = Path(tempfile.gettempdir()) / f"serving_index-{args.items}-{args.worker}-readers{args.readers}.json"
        kept.write_text(json.dumps(result) + "\n")  # the whole result, whatever the parent keeps of it
        print(json.dumps(result))
        return
    if args.combine:
        results = {}
        for path in args.combine:
            results.update(json.loads(Path(path).read_text())["results"])
        report(results, args)
        return
    from testkit.local_postgres import start_postgres

    # stopped when this process ends, killed or not
    uri = start_postgres("serving-pg-") if "pgvector" in args.layouts.split(",") else ""
    results = {}
    for layout in args.layouts.split(","):
        results[layout] = _worker(args, layout, uri, 0)
        if args.readers and layout != "parts":  # the same run again, read throughout
            read = _worker(args, layout, uri, args.readers)
            results[layout]["readers"] = {**read["readers"], "times": read["times"],
                                          "search_half_way": read["search_half_way"],
                                          "search_after_finish": read["search_after_finish"]}
        print(layout, json.dumps(results[layout]), flush=True)
    report(results, args)


def _worker(args, layout: str, uri: str, readers: int) -> dict:
    """One run of ``layout`` in a process of its own, in a store of its own that is removed after."""
    root = tempfile.mkdtemp(prefix=f"serving-{layout}-")
    command = [sys.executable, __file__, "--worker", layout, "--root", root, "--items", str(args.items), "--old-dim",
               str(args.old_dim), "--new-dim", str(args.new_dim), "--chunk", str(args.chunk), "--queries",
               str(args.queries), "--pg-uri", uri, "--ann", args.ann, "--readers", str(readers), "--reader-seconds",
               str(args.reader_seconds)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if done.returncode:
        raise SystemExit(f"{layout}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(results: dict, args) -> None:
    layouts = list(results)
    parts = results.get("parts", {"times": {}})  # the ratios are to the parts layout's, when it ran
    lines = [f"# The upgrade served from each layout's index: {args.items:,} rows, {args.old_dim}-d -> "
             f"{args.new_dim}-d, chunks of {args.chunk:,}", "",
             f"`python benchmarks/serving_index.py --items {args.items} --chunk {args.chunk} --queries {args.queries} "
             f"--layouts {args.layouts} --ann {args.ann}{f' --suffix {args.suffix}' if args.suffix else ''}` on "
             f"{os.cpu_count()} cores, each layout in a process of its own, one after the other. "
             + " ".join(text for layout, text in (
                 ("lance", "Lance: the serving table, IVF_FLAT (partitions = sqrt(rows), nprobes 20)."),
                 ("pgvector", "pgvector: PostgreSQL 16.2 + pgvector 0.6.2 (pgserver), Unix socket; "
                  + ("HNSW m=16, ef_construction=64, ef_search=100." if args.ann == "hnsw"
                     else "IVFFlat, lists = sqrt(rows), probes = 10.")),
                 ("milvus", "Milvus: Milvus Lite, HNSW m=16, ef_construction=64, ef=100."),
                 ("qdrant", "Qdrant: qdrant-client's local mode (a folder in the store's; exact search in numpy, "
                  "the filter on `model` in Python, no HNSW), in the layout's process."))
                 if layout in layouts), "",
             "| step (s) | " + " | ".join(layouts) + " |", "|---|" + "---|" * len(layouts)]
    if args.combine:  # the command above did not run: say which runs the figures come from
        lines[2:3] = [f"Combined (`--combine`) from {', '.join(f'`{path}`' for path in args.combine)}: each layout's "
                      "figures are those of the run its file records, on this machine's "
                      f"{os.cpu_count()} cores; the runs' commands are in those files."]
    for step in ("adopt", "switch", "chunk_commit_per_10k_rows", "finish"):
        cells = []
        for layout in layouts:
            value = results[layout]["times"].get(step)
            ratio = f" ({value / parts['times'][step]:.1f}x)" if layout != "parts" and parts["times"].get(step) else ""
            cells.append(f"{value:.3f}{ratio}")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    if any("chunk_bytes_mean" in results[layout] for layout in layouts):
        lines.append("| bytes written per chunk, mean / worst, x the new features' | " + " | ".join(
            f"{results[layout]['chunk_bytes_mean'] / results[layout]['chunk_payload_bytes']:.2f}x / "
            f"{results[layout]['chunk_bytes_max'] / results[layout]['chunk_payload_bytes']:.2f}x"
            if "chunk_bytes_mean" in results[layout] else "-" for layout in layouts) + " |")
    lines.append("| bytes written per chunk (median), x the new features' | " + " | ".join(
        f"{results[layout]['chunk_bytes_median'] / 2 ** 20:.1f} MB "
        f"({results[layout]['chunk_bytes_median'] / results[layout]['chunk_payload_bytes']:.2f}x)"
        for layout in layouts) + " |")
    if any("chunk_wchar_median" in results[layout] for layout in layouts):
        lines.append("| bytes the process passed to write calls per chunk (median; in-process layouts) | " + " | ".join(
            f"{results[layout]['chunk_wchar_median'] / 2 ** 20:.1f} MB "
            f"({results[layout]['chunk_wchar_median'] / results[layout]['chunk_payload_bytes']:.2f}x)"
            if "chunk_wchar_median" in results[layout] else "-" for layout in layouts) + " |")
    lines += ["", "| search (k = 10): latency ms median / p95, recall@10 | " + " | ".join(layouts) + " |",
              "|---|" + "---|" * len(layouts)]
    for when in ("search_half_way", "search_after_finish"):
        lines.append(f"| {when.removeprefix('search_').replace('_', ' ')} | " + " | ".join(
            f"{results[layout][when]['latency_ms_median']:.2f} / {results[layout][when]['latency_ms_p95']:.2f}, "
            f"{results[layout][when]['recall_at_10']:.3f}" for layout in layouts) + " |")
    if any("index_per_chunk_median" in results[layout]["times"] for layout in layouts):
        lines += ["", "Lance: keeping the ANN index current, inside each chunk's commit (the chunk's fragment added as "
                  "a delta, deltas merged two by two at equal size): " + "; ".join(
                      f"median {results[layout]['times']['index_per_chunk_median']:.3f} s, mean "
                      f"{results[layout]['times']['index_per_chunk_mean']:.3f} s per chunk; the commit without it "
                      f"{results[layout]['times']['chunk_commit_without_index_per_10k_rows']:.3f} s per 10,000 rows "
                      "(median)" for layout in layouts
                      if "index_per_chunk_median" in results[layout]["times"]) + "."]
    lines += readers_table(results, layouts)
    lines += ["", "Peak RSS of the process: " + ", ".join(f"{layout} {results[layout]['peak_rss_mb']:.0f} MB"
                                                          for layout in layouts) + "."]
    if "pgvector" in results:
        lines.append(f"PostgreSQL's processes at the end: {results['pgvector']['postgres_rss_mb']:.0f} MB.")
    lines.append("The switch per million rows (the new model's vectors written with h(old), the index built, "
                 "readers moved): " + ", ".join(f"{layout} {results[layout]['times']['switch'] / args.items * 1e6:.1f} s"
                                                for layout in layouts) + ".")
    out = ROOT / "reports" / f"serving_index-{args.items}{f'-{args.suffix}' if args.suffix else ''}"
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "results": results}, indent=2) + "\n")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
