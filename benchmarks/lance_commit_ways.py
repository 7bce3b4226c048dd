"""How a backfill chunk should land in a Lance gallery: the ways measured side by side in one run.

    .venv/bin/python benchmarks/lance_commit_ways.py                 # 100,000 x 128, chunks of 2,000
    .venv/bin/python benchmarks/lance_commit_ways.py --items 20000 --where local

Ways, each committing the same chunks (positions in a random order) of new features:

- ``merge_insert``: ``merge_insert("position").when_matched_update_all()`` into the gallery
  table's ``new`` column (idempotent: an update by key);
- ``merge_insert+btree``: the same with a BTREE scalar index on ``position``;
- ``append``: one append per chunk to a second table (what components/gallery/layouts/lance_table.py
  does; made idempotent by reading one commit per chunk).

and, for each, the same chunks from ``--writers`` threads at once. Printed: the median seconds per
commit and the ratio to ``append``; written to reports/lance_commit_ways.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _vectors(array: np.ndarray):
    import pyarrow as pa

    return pa.FixedSizeListArray.from_arrays(pa.array(array.reshape(-1)), array.shape[1])


def measure(where: str, base: str, options: dict | None, items: int, dim: int, chunk: int, chunks: int,
            writers: int) -> dict:
    import lance
    import pyarrow as pa

    rng = np.random.default_rng(0)
    order = rng.permutation(items)
    new = rng.standard_normal((items, dim), dtype=np.float32)
    results = {}
    for way in ("merge_insert", "merge_insert+btree", "append"):
        main = f"{base}/{way.replace('+', '_')}.lance"
        side = f"{base}/{way.replace('+', '_')}_chunks.lance"
        table = pa.table({"position": pa.array(np.arange(items)),
                          "features": _vectors(rng.standard_normal((items, dim), dtype=np.float32))})
        dataset = lance.write_dataset(table, main, storage_options=options)
        dataset.add_columns([pa.field("new", pa.list_(pa.float32(), dim)), pa.field("new_chunk", pa.int32())])
        if way == "merge_insert+btree":
            lance.dataset(main, storage_options=options).create_scalar_index("position", "BTREE")
        schema = pa.schema([pa.field("position", pa.int64()), pa.field("chunk", pa.int32()),
                            pa.field("new", pa.list_(pa.float32(), dim))])
        if way == "append":
            lance.write_dataset(schema.empty_table(), side, storage_options=options)

        def commit(c: int) -> float | None:
            """Seconds, or None when the commit failed (Lance gave up on its conflict retries)."""
            try:
                return attempt(c)
            except OSError as error:
                print(f"{where} {way}: chunk {c} not committed: {' '.join(str(error).split())[:160]}", flush=True)
                return None

        def attempt(c: int) -> float:
            positions = order[c * chunk:(c + 1) * chunk]
            start = time.perf_counter()
            if way == "append":
                rows = pa.table([pa.array(positions), pa.array(np.full(len(positions), c, np.int32)),
                                 _vectors(new[positions])], schema=schema)
                lance.write_dataset(rows, side, mode="append", storage_options=options)
            else:
                rows = pa.table({"position": pa.array(positions), "new": _vectors(new[positions]),
                                 "new_chunk": pa.array(np.full(len(positions), c, np.int32))})
                lance.dataset(main, storage_options=options).merge_insert("position") \
                    .when_matched_update_all().execute(rows)
            return time.perf_counter() - start

        single = [t for t in (commit(c) for c in range(chunks)) if t is not None]
        start = time.perf_counter()
        with ThreadPoolExecutor(writers) as pool:
            concurrent = list(pool.map(commit, range(chunks, 2 * chunks)))
        wall = time.perf_counter() - start
        landed = [t for t in concurrent if t is not None]
        results[way] = {"median_s": statistics.median(single) if single else None,
                        "failed_alone": chunks - len(single), "failed_at_once": chunks - len(landed),
                        "concurrent_median_s": statistics.median(landed) if landed else None,
                        "concurrent_items_per_s": len(landed) * chunk / wall}
        print(f"{where} {way}: {results[way]['median_s']} s per commit alone, "
              f"{results[way]['concurrent_items_per_s']:.0f} items/s by {writers} writers, "
              f"{results[way]['failed_at_once']} of {chunks} commits failed at once", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=2_000)
    parser.add_argument("--chunks", type=int, default=8, help="chunks per way, alone and again at once")
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--where", nargs="+", default=["local", "s3"], choices=["local", "s3"])
    parser.add_argument("--reports", type=Path, default=ROOT / "reports")
    args = parser.parse_args(argv)
    out = {}
    with tempfile.TemporaryDirectory(prefix="lance-ways-") as scratch:
        for where in args.where:
            options = None
            base = scratch
            server = None
            if where == "s3":
                import logging

                import boto3

                logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's access log
                from moto.server import ThreadedMotoServer

                os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                                  AWS_DEFAULT_REGION="us-east-1")
                server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
                server.start()
                host, port = server.get_host_and_port()
                endpoint = f"http://{host}:{port}"
                boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="commit-ways")
                base = "s3://commit-ways/bench"
                options = {"aws_endpoint": endpoint, "allow_http": "true", "aws_access_key_id": "testing",
                           "aws_secret_access_key": "testing", "aws_region": "us-east-1"}
            try:
                out[where] = measure(where, base, options, args.items, args.dim, args.chunk, args.chunks, args.writers)
            finally:
                if server is not None:
                    server.stop()
    lines = ["# How a backfill chunk lands in a Lance gallery", "",
             f"`python benchmarks/lance_commit_ways.py --items {args.items} --dim {args.dim} --chunk {args.chunk} "
             f"--chunks {args.chunks} --writers {args.writers} --where {' '.join(args.where)}`; seconds per commit "
             f"(median of {args.chunks}), and items per second with {args.writers} writers at once.", "",
             "| where | way | s per commit | x append | items/s, writers at once | x append | commits failed at once |",
             "|---|---|---|---|---|---|---|"]
    for where, ways in out.items():
        base = ways["append"]
        for way, r in ways.items():
            alone = "failed" if r["median_s"] is None else f"{r['median_s']:.4f}"
            ratio = "" if r["median_s"] is None or not base["median_s"] else f"{r['median_s'] / base['median_s']:.1f}"
            lines.append(f"| {where} | {way} | {alone} | {ratio} | {r['concurrent_items_per_s']:.0f} | "
                         f"{r['concurrent_items_per_s'] / base['concurrent_items_per_s']:.2f} | "
                         f"{r['failed_at_once']} of {args.chunks} |")
    text = "\n".join(lines) + "\n"
    args.reports.mkdir(parents=True, exist_ok=True)
    (args.reports / "lance_commit_ways.md").write_text(text)
    (args.reports / "lance_commit_ways.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                                    "results": out}, indent=2) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
