"""Nearest-neighbour search over a gallery: faiss (what `fastfill search` uses) against LanceDB on
the same vectors, side by side in one run.

    .venv/bin/python benchmarks/lance_search_speed.py                       # 1,000,000 x 128, 200 queries
    .venv/bin/python benchmarks/lance_search_speed.py --items 100000

The vectors are clustered (a seeded mixture of 1,000 Gaussian clusters, unit spread around
centres of norm about 3), so inverted-list indexes behave as on real features rather than on
uniform noise. The queries are held-out draws of the same mixture. Every way answers the same
queries with k = 10, one query at a time; recall@10 is measured against faiss's exact answer.

- faiss flat: exact (gallery.index.kind flat);
- faiss IVF-PQ: gallery.index.kind ivfpq (nlist, pq_m, nprobe as params.yaml's defaults);
- faiss IVF: gallery.index.kind ivf (inverted lists of full vectors; nlist, nprobe as the defaults);
- LanceDB exact: the table searched without an index;
- LanceDB IVF-PQ: an index on the table (num_partitions = sqrt(N), num_sub_vectors = dim / 8),
  searched with nprobes 20 and refine_factor 10.

Printed and written to reports/lance_search.{json,md}: the build time of each index, the median
and 95th-percentile latency per query, recall@10, and the ratios to faiss.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def mixture(items: int, queries: int, dim: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((1000, dim), dtype=np.float32)
    centres *= 3.0 / np.linalg.norm(centres, axis=1, keepdims=True)

    def draw(n: int) -> np.ndarray:
        return centres[rng.integers(0, len(centres), n)] + rng.standard_normal((n, dim), dtype=np.float32) * 0.35

    return draw(items), draw(queries)


def timed(search, queries: np.ndarray) -> tuple[list[list[int]], list[float]]:
    answers, latencies = [], []
    for query in queries:
        start = time.perf_counter()
        answers.append(search(query))
        latencies.append(time.perf_counter() - start)
    return answers, latencies


def recall(answers: list[list[int]], exact: list[list[int]]) -> float:
    return float(np.mean([len(set(a) & set(e)) / len(e) for a, e in zip(answers, exact, strict=True)]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--reports", type=Path, default=ROOT / "reports")
    args = parser.parse_args(argv)
    import faiss
    import lancedb
    import pyarrow as pa

    from components.platform.config import IndexConfig

    gallery, queries = mixture(args.items, args.queries, args.dim)
    k, rows = args.k, {}

    flat = faiss.IndexFlatL2(args.dim)
    start = time.perf_counter()
    flat.add(gallery)
    built = time.perf_counter() - start
    exact, latencies = timed(lambda q: flat.search(q[None], k)[1][0].tolist(), queries)
    rows["faiss flat"] = {"build_s": built, "latencies": latencies, "recall": 1.0}
    print(f"faiss flat: {statistics.median(latencies) * 1e3:.2f} ms per query", flush=True)

    defaults = IndexConfig()
    nlist = min(defaults.nlist, max(1, args.items // 39))
    quantizer = faiss.IndexFlatL2(args.dim)
    ivfpq = faiss.IndexIVFPQ(quantizer, args.dim, nlist, defaults.pq_m, 8)
    start = time.perf_counter()
    ivfpq.train(gallery[np.random.default_rng(1).choice(args.items, min(args.items, 256 * nlist), replace=False)])
    ivfpq.add(gallery)
    built = time.perf_counter() - start
    ivfpq.nprobe = defaults.nprobe
    answers, latencies = timed(lambda q: ivfpq.search(q[None], k)[1][0].tolist(), queries)
    rows["faiss IVF-PQ"] = {"build_s": built, "latencies": latencies, "recall": recall(answers, exact),
                            "settings": f"nlist {nlist}, pq_m {defaults.pq_m}, nprobe {defaults.nprobe} "
                                        "(gallery.index.kind ivfpq, no re-ranking)"}
    print(f"faiss IVF-PQ: built in {built:.1f} s, recall@10 {rows['faiss IVF-PQ']['recall']:.3f}", flush=True)

    ivf = faiss.IndexIVFFlat(faiss.IndexFlatL2(args.dim), args.dim, nlist)
    start = time.perf_counter()
    ivf.train(gallery[np.random.default_rng(1).choice(args.items, min(args.items, defaults.train_size), replace=False)])
    ivf.add(gallery)
    built = time.perf_counter() - start
    ivf.nprobe = defaults.nprobe
    answers, latencies = timed(lambda q: ivf.search(q[None], k)[1][0].tolist(), queries)
    rows["faiss IVF"] = {"build_s": built, "latencies": latencies, "recall": recall(answers, exact),
                         "settings": f"nlist {nlist}, nprobe {defaults.nprobe} (gallery.index.kind ivf)"}
    print(f"faiss IVF: built in {built:.1f} s, recall@10 {rows['faiss IVF']['recall']:.3f}", flush=True)

    with tempfile.TemporaryDirectory(prefix="lance-search-") as scratch:
        table_data = pa.table({"position": pa.array(np.arange(args.items)),
                               "features": pa.FixedSizeListArray.from_arrays(pa.array(gallery.reshape(-1)), args.dim)})
        db = lancedb.connect(scratch)
        start = time.perf_counter()
        table = db.create_table("gallery", table_data)
        written = time.perf_counter() - start

        def lance_search(query, **options):
            search = table.search(query, vector_column_name="features").limit(k).select(["position"])
            if options.get("exact"):
                search = search.bypass_vector_index()
            if "nprobes" in options:
                search = search.nprobes(options["nprobes"]).refine_factor(options["refine_factor"])
            return search.to_arrow().column("position").to_pylist()

        answers, latencies = timed(lambda q: lance_search(q, exact=True), queries[: max(10, args.queries // 4)])
        rows["LanceDB exact"] = {"build_s": written, "latencies": latencies,
                                 "recall": recall(answers, exact[: len(answers)]), "settings": "no index (write time as build)"}
        print(f"LanceDB exact: {statistics.median(latencies) * 1e3:.2f} ms per query", flush=True)

        from lancedb.index import IvfPq

        partitions = max(1, int(np.sqrt(args.items)))
        start = time.perf_counter()
        table.create_index("features", config=IvfPq(distance_type="l2", num_partitions=partitions,
                                                    num_sub_vectors=args.dim // 8))
        built = time.perf_counter() - start
        answers, latencies = timed(lambda q: lance_search(q, nprobes=20, refine_factor=10), queries)
        rows["LanceDB IVF-PQ"] = {"build_s": built, "latencies": latencies, "recall": recall(answers, exact),
                                  "settings": f"{partitions} partitions, {args.dim // 8} sub-vectors, nprobes 20, "
                                              "refine_factor 10"}
        print(f"LanceDB IVF-PQ: built in {built:.1f} s, recall@10 {rows['LanceDB IVF-PQ']['recall']:.3f}", flush=True)

    base = statistics.median(rows["faiss flat"]["latencies"])
    lines = ["# Search: faiss against LanceDB on the same vectors", "",
             f"`python benchmarks/lance_search_speed.py --items {args.items} --dim {args.dim} --queries {args.queries}`: "
             f"{args.items:,} clustered vectors of dimension {args.dim}, one query at a time, k = {k}; recall@10 "
             "against faiss's exact answer. Latency ratio: to faiss flat.", "",
             "| way | build (s) | median ms per query | p95 ms | x faiss flat | recall@10 | settings |",
             "|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        latencies = sorted(row["latencies"])
        median = statistics.median(latencies)
        p95 = latencies[int(0.95 * (len(latencies) - 1))]
        lines.append(f"| {name} | {row['build_s']:.1f} | {median * 1e3:.2f} | {p95 * 1e3:.2f} | {median / base:.3f} | "
                     f"{row['recall']:.3f} | {row.get('settings', '')} |")
        row.update(median_ms=median * 1e3, p95_ms=p95 * 1e3)
        del row["latencies"]
    text = "\n".join(lines) + "\n"
    args.reports.mkdir(parents=True, exist_ok=True)
    name = "lance_search" if args.items == 1_000_000 else f"lance_search-{args.items}"
    (args.reports / f"{name}.md").write_text(text)
    (args.reports / f"{name}.json").write_text(json.dumps({"args": vars(args) | {"reports": str(args.reports)},
                                                            "rows": rows}, indent=2) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
