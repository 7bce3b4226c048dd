"""Peak memory and time of a whole upgrade of a gallery of image files, at several sizes.

For each size, one PNG file per item (the Fashion-MNIST test images, repeated, shifted and
flipped) and the current features (synthetic, d = 128: their values do not change what is read
and written) are written first, in a separate process. Then one process runs the whole upgrade
and reports its own peak RSS: adopt (the images stay where they are), plan (transform, sigma
order), the backfill as Prefect tasks reading each chunk's files by URI, finish, and gc.

    .venv/bin/python benchmarks/upgrade_memory.py --sizes 100000 1000000
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastfill.components.platform import runtime  # noqa: E402,F401  (Prefect settings before Prefect loads)

sys.path.insert(0, str(ROOT / "benchmarks"))
from plan_scale import _rss_mb, run_child  # noqa: E402

DIM = 128


def prepare(folder: Path, size: int) -> dict:
    """The image files, a manifest and the current features, in ``folder``."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from backfill_throughput import _augment, _images, _write_files

    started = time.perf_counter()
    base, source = _images(min(size, 10000))
    images = np.concatenate([base] * -(-size // len(base)))[:size]
    images = _augment(images)
    mean_bytes = _write_files(images, str(folder / "images"))
    del images
    pq.write_table(pa.table({"id": np.arange(size, dtype=np.int64),
                             "uri": pa.array([f"{i}.png" for i in range(size)], type=pa.string())}),
                   folder / "items.parquet")
    features = np.lib.format.open_memmap(folder / "features.npy", mode="w+", dtype=np.float32, shape=(size, DIM))
    rng = np.random.default_rng(0)
    for start in range(0, size, 65536):
        features[start:start + 65536] = rng.standard_normal((min(65536, size - start), DIM), dtype=np.float32)
    features.flush()
    return {"seconds": time.perf_counter() - started, "mean_bytes": mean_bytes, "source": source}


def upgrade(folder: Path, chunk_size: int, concurrency: int) -> dict:
    import mlflow
    import torch
    from prefect import flow
    from prefect.task_runners import ThreadPoolTaskRunner

    from fastfill.components.experiment.models import AlignmentMap, Embedder
    from fastfill.components.gallery.inputs.adopt import adopt, npy_rows, read_manifest
    from fastfill.components.gallery.layouts.catalog import PartsGallery
    from fastfill.components.gallery.store import open_store
    from fastfill.components.gallery.upgrade import planning
    from fastfill.components.gallery.upgrade.ending import finish
    from fastfill.components.gallery.upgrade.garbage import collect_garbage
    from fastfill.components.platform.config import load_params, parse_params
    from fastfill.components.platform.registry import ModelRef
    from fastfill.flows.upgrade import backfill_plan

    params = load_params(ROOT / "params.yaml")
    torch.manual_seed(0)
    new_model = Embedder(params.train.new, 1, list(range(10))).eval()
    h = AlignmentMap(DIM, new_model.embedding_dim, [256], uncertainty=True).eval()
    old, new = ModelRef("bench", "1", DIM), ModelRef("bench", "2", new_model.embedding_dim)
    mlflow_uri = f"sqlite:///{folder / 'mlflow.db'}"
    data = params.model_dump(mode="json")
    data["gallery"]["upgrade"].update(chunk_size=chunk_size, max_concurrency=concurrency, eval_queries=0)
    data["mlflow"]["tracking_uri"] = mlflow_uri
    run_params = parse_params(data)
    baseline = _rss_mb()
    times = {}

    started = time.perf_counter()
    store_uri = str(folder / "store")
    adopt(open_store(store_uri), read_manifest(folder / "items.parquet"), old, (1, 28, 28),
          root=str(folder / "images"), features=npy_rows([folder / "features.npy"]), part_size=10000)
    gallery = PartsGallery(open_store(store_uri))
    times["adopt"] = time.perf_counter() - started

    started = time.perf_counter()
    uid = planning.upgrade_id(old, new)
    for part in range(gallery.num_parts):
        planning.transform_part(gallery, uid, h, part)
    client = mlflow.MlflowClient(mlflow_uri)
    run = client.create_run(client.create_experiment("bench"))
    plan = planning.Plan(uid, old, new, "none", "sigma", chunk_size, gallery.num_items, 0, "l2", run.info.run_id)
    planning.commit_plan(gallery, plan, planning.make_order(gallery, uid, "sigma", 0))
    times["plan"] = time.perf_counter() - started

    @flow(name="benchmark-upgrade")
    def backfill():
        return backfill_plan(run_params, gallery, plan, new_model)

    started = time.perf_counter()
    result = backfill.with_options(task_runner=ThreadPoolTaskRunner(max_workers=concurrency + 1))()
    assert result.complete and result.failed_images == 0, result
    times["backfill"] = time.perf_counter() - started

    started = time.perf_counter()
    finish(gallery, plan)
    times["finish"] = time.perf_counter() - started
    started = time.perf_counter()
    collect_garbage(gallery)
    times["gc"] = time.perf_counter() - started
    return {"seconds": times, "peak_rss_mb": _rss_mb(), "baseline_rss_mb": baseline,
            "backfill_items_per_second": gallery.num_items / times["backfill"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--chunk-size", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fastfill-upgrade-memory"))
    parser.add_argument("--child", choices=["prepare", "upgrade"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "prepare":
        print(json.dumps(prepare(args.folder, args.sizes[0])))
        return
    if args.child == "upgrade":
        print(json.dumps(upgrade(args.folder, args.chunk_size, args.concurrency)))
        return

    rows = []
    for size in args.sizes:
        folder = args.workdir / f"n-{size}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        options = ("--sizes", str(size), "--chunk-size", str(args.chunk_size), "--concurrency", str(args.concurrency))
        results = {step: run_child(__file__, step, folder, *options) for step in ("prepare", "upgrade")}
        run = results["upgrade"]
        rows.append((size, run))
        print(f"{size:>9,} items ({results['prepare']['mean_bytes']:.0f}-byte PNGs): peak RSS {run['peak_rss_mb']:.0f} "
              f"MB; " + ", ".join(f"{k} {v:.1f} s" for k, v in run["seconds"].items()), flush=True)
        shutil.rmtree(folder, ignore_errors=True)

    first = rows[0][1]
    print(f"\nchunks of {args.chunk_size}, {args.concurrency} in flight, parts of 10,000; RSS in MB")
    print("| items | adopt s | plan s | backfill s | backfill items/s | finish s | gc s | peak RSS | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size, run in rows:
        s = run["seconds"]
        print(f"| {size:,} | {s['adopt']:.1f} | {s['plan']:.1f} | {s['backfill']:.0f} | "
              f"{run['backfill_items_per_second']:.0f} | {s['finish']:.1f} | {s['gc']:.1f} | {run['peak_rss_mb']:.0f} | "
              f"{run['peak_rss_mb'] / first['peak_rss_mb']:.2f} |")


if __name__ == "__main__":
    main()
