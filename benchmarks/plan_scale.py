"""How the upgrade's plan and finish scale with the gallery: time and peak memory per size.

For each size, a features-only gallery of synthetic features (d = 128) is adopted into a local
folder (its images are never read). Then, each in its own process so that its peak RSS is its
own:

- plan: every part's features through a FastFill-shaped map (h and its uncertainty head), the
  sigma order over all items, plan.json; what ``fastfill upgrade`` does before the backfill;
- finish: every chunk's new features written as the backfill would (synthetic), then the
  finish writes the new model's features part by part.

Printed side by side: seconds, seconds per million items, peak RSS, and the peak above the
process's RSS after its imports (what the work itself holds), with ratios to the smallest size.

    .venv/bin/python benchmarks/plan_scale.py --sizes 100000 1000000
    .venv/bin/python benchmarks/plan_scale.py --sizes 100000 1000000 10000000 --workdir /big/disk
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DIM = 128


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _refs():
    from fastfill.components.platform.registry import ModelRef

    return ModelRef("embedder", "1", DIM), ModelRef("embedder", "2", DIM)


def make(folder: Path, size: int, part_size: int) -> dict:
    import pyarrow as pa

    from fastfill.components.gallery.inputs.adopt import adopt
    from fastfill.components.gallery.store import open_store

    old, _ = _refs()
    table = pa.table({"id": np.arange(size, dtype=np.int64),
                      "uri": pa.array([f"images/{i}.png" for i in range(size)], type=pa.string())})

    def rows():
        rng = np.random.default_rng(0)
        for start in range(0, size, 65536):
            yield rng.standard_normal((min(65536, size - start), DIM), dtype=np.float32)

    started = time.perf_counter()
    adopt(open_store(folder), table, old, (1, 28, 28), root="/nowhere", features=rows(), part_size=part_size)
    return {"seconds": time.perf_counter() - started}


def plan(folder: Path, chunk_size: int) -> dict:
    import torch

    from fastfill.components.experiment.models import AlignmentMap
    from fastfill.components.gallery.layouts.catalog import PartsGallery
    from fastfill.components.gallery.store import open_store
    from fastfill.components.gallery.upgrade import planning

    old, new = _refs()
    torch.manual_seed(0)
    h = AlignmentMap(DIM, DIM, [256], uncertainty=True).eval()
    gallery = PartsGallery(open_store(folder))
    gallery.manifest()
    baseline = _rss_mb()
    started = time.perf_counter()
    uid = planning.upgrade_id(old, new)
    for part in range(gallery.num_parts):
        planning.transform_part(gallery, uid, h, part)
    order = planning.make_order(gallery, uid, "sigma", 0)
    record = planning.Plan(uid, old, new, "models:/embedder-alignment/1", "sigma", chunk_size, gallery.num_items, 0, "l2")
    planning.commit_plan(gallery, record, order)
    return {"seconds": time.perf_counter() - started, "peak_rss_mb": _rss_mb(), "baseline_rss_mb": baseline}


def finish(folder: Path) -> dict:
    import json as _json

    from fastfill.components.gallery.layouts.catalog import PartsGallery
    from fastfill.components.gallery.store import open_store
    from fastfill.components.gallery.upgrade import planning
    from fastfill.components.gallery.upgrade.ending import finish

    gallery = PartsGallery(open_store(folder))
    record = planning.load_plan(gallery.store, gallery.manifest()["upgrade"])
    rng = np.random.default_rng(1)
    for chunk in range(record.num_chunks):  # what the backfill leaves: each chunk's features, then its marker
        start, stop = record.chunk_bounds(chunk)
        gallery.store.put_array(planning.chunk_key(record.upgrade_id, chunk), rng.standard_normal((stop - start, DIM),
                                                                                    dtype=np.float32))
        gallery.store.put(planning.marker_key(record.upgrade_id, chunk), _json.dumps({"count": stop - start}).encode())
    baseline = _rss_mb()
    started = time.perf_counter()
    finish(gallery, record)
    return {"seconds": time.perf_counter() - started, "peak_rss_mb": _rss_mb(), "baseline_rss_mb": baseline}


def run_child(script: str, step: str, folder: Path, *options: str) -> dict:
    """Run ``script --child step --folder folder options`` in its own process (so its peak RSS is
    its own) and return the JSON of its last line."""
    command = [sys.executable, script, "--child", step, "--folder", str(folder), *options]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(f"{step} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--part-size", type=int, default=10_000)
    parser.add_argument("--chunk-size", type=int, default=1000)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fastfill-plan-scale"))
    parser.add_argument("--keep", action="store_true", help="keep each size's gallery")
    parser.add_argument("--child", choices=["make", "plan", "finish"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = {"make": lambda: make(args.folder, args.sizes[0], args.part_size),
                  "plan": lambda: plan(args.folder, args.chunk_size), "finish": lambda: finish(args.folder)}[args.child]()
        print(json.dumps(result))
        return

    rows = []
    for size in args.sizes:
        folder = args.workdir / f"n-{size}"
        shutil.rmtree(folder, ignore_errors=True)
        options = ("--sizes", str(size), "--part-size", str(args.part_size), "--chunk-size", str(args.chunk_size))
        run_child(__file__, "make", folder, *options)
        planned = run_child(__file__, "plan", folder, *options)
        finished = run_child(__file__, "finish", folder, *options)
        rows.append({"items": size, "features_gb": size * DIM * 4 / 1e9, "plan": planned, "finish": finished})
        print(f"{size:>11,} items: plan {planned['seconds']:.1f} s, peak RSS {planned['peak_rss_mb']:.0f} MB; "
              f"finish {finished['seconds']:.1f} s, peak RSS {finished['peak_rss_mb']:.0f} MB", flush=True)
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)

    first = rows[0]
    print(f"\nd = {DIM}, parts of {args.part_size:,}, chunks of {args.chunk_size:,}; RSS in MB; 'work' = peak RSS "
          "above the process's RSS after its imports; ratios to the smallest size")
    print("| items | features | step | seconds | s per 1M items | time/item ratio | peak RSS | work | work ratio |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        for step in ("plan", "finish"):
            r, f = row[step], first[step]
            work, first_work = r["peak_rss_mb"] - r["baseline_rss_mb"], f["peak_rss_mb"] - f["baseline_rss_mb"]
            per_item = (r["seconds"] / row["items"]) / (f["seconds"] / first["items"])
            print(f"| {row['items']:,} | {row['features_gb']:.2f} GB | {step} | {r['seconds']:.1f} | "
                  f"{1e6 * r['seconds'] / row['items']:.1f} | {per_item:.2f} | {r['peak_rss_mb']:.0f} | {work:.0f} | "
                  f"{work / max(first_work, 1):.2f} |")


if __name__ == "__main__":
    main()
