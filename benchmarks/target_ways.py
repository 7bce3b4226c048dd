"""The budget advisor's ways without a map against their measured curves (docs/results.md).

`fastfill upgrade --dry-run --target-top1` predicts, from an evaluation sample S, the top-1 curve
of the shadow index (rrf) and of online backfilling (the metric-compatible reverse
transformation, merged by distance) along a random backfill, and scales each to the whole
gallery by its own error rate at 0%. This measures those predictions against the curves the
evaluation protocol measures over every item, on a comparison run's stored features: the test
split is the gallery, the reverse transformation is fitted as an upgrade fits it (on a seeded
map sample of ``--map-sample`` gallery items, with their labels), S is ``--sample`` labeled
items (``--samples`` draws). Printed and written: per way, the largest gap between predicted
and measured top-1 at every 10% (points), over the draws.

    python benchmarks/target_ways.py --run runs/compare/seed-0 --run runs/compare/n-1000/seed-0 \
        --out reports/target_ways
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastfill.components.evaluation.dual_curve import dual_curve  # noqa: E402
from fastfill.components.evaluation.online_backfill import online_curve  # noqa: E402
from fastfill.components.evaluation.ordering import random_order  # noqa: E402
from fastfill.components.experiment.adapters import fit_metric_compatible  # noqa: E402
from fastfill.components.experiment.data import load_split  # noqa: E402
from fastfill.components.gallery.advice.advisor import NearestLabel, fractions, ranks_of  # noqa: E402
from fastfill.components.gallery.advice.target_advice import online_top1, shadow_top1  # noqa: E402
from fastfill.components.gallery.upgrade.pairs import sample_positions  # noqa: E402
from fastfill.components.gallery.upgrade.planning import eval_sample  # noqa: E402


def _hits(queries: np.ndarray, positions: np.ndarray, labels: np.ndarray, gallery: np.ndarray) -> np.ndarray:
    """Whether each S query's nearest item of the whole stored gallery (itself excluded) has its label."""
    anchor = NearestLabel(queries, positions, labels)
    for start in range(0, len(gallery), 1000):
        anchor.add(start, gallery[start:start + 1000])
    return anchor.hits()


def measure_run(run: Path, data: Path, sample: int, samples: int, map_sample: int, seed: int) -> dict:
    labels = load_split(data / "splits", "test").labels
    old = np.load(run / "artifacts" / "features" / "old" / "test.npy")
    new = np.load(run / "artifacts" / "features" / "new" / "test.npy")
    n = len(labels)
    started = time.perf_counter()
    fit = sample_positions(n, min(map_sample, n), seed)
    reverse = fit_metric_compatible(new[fit], old[fit], labels[fit], seed=seed)
    fit_seconds = time.perf_counter() - started
    gain = float(reverse.new_scale) ** 2
    twins = reverse(new)
    order = random_order(n, seed)
    steps = len(fractions()) - 2
    side = new * np.float32(reverse.new_scale)
    measured = {
        "shadow index (rrf)": dual_curve(old, new, old, new, labels, order, merge="rrf", num_intermediate=steps).top1,
        "online backfilling (metric-compatible)": online_curve(twins, side, old, side, labels, order,
                                                               num_intermediate=steps).top1,
    }
    every10 = np.arange(0, len(fractions()), 2)
    gaps: dict[str, list[float]] = {way: [] for way in measured}
    for s in range(samples):
        positions = eval_sample(labels, sample, s)
        ranks = ranks_of(order, positions)
        predicted = {
            "shadow index (rrf)": shadow_top1(old[positions], new[positions], labels[positions], ranks, n,
                                              _hits(old[positions], positions, labels, old))["top1"],
            "online backfilling (metric-compatible)": online_top1(
                old[positions], new[positions], twins[positions], labels[positions], ranks, n,
                _hits(twins[positions], positions, labels, old), gain=gain)["top1"],
        }
        for way, curve in predicted.items():
            gaps[way].append(float(np.max(np.abs(np.asarray(curve)[every10] - measured[way][every10]))))
    return {"run": str(run), "items": n, "sample": sample, "samples": samples, "map_sample": len(fit),
            "fit_seconds": round(fit_seconds, 1), "gain": gain,
            "measured_top1": {way: [round(100 * float(v), 2) for v in curve[every10]] for way, curve in measured.items()},
            "largest_gap_points": {way: {"mean": round(100 * float(np.mean(g)), 2), "max": round(100 * float(np.max(g)), 2)}
                                   for way, g in gaps.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="append", required=True, type=Path,
                        help="a comparison seed's folder (artifacts/ inside; its data: the folder's parent's data/, "
                             "else data/)")
    parser.add_argument("--sample", type=int, default=2000, help="the evaluation sample S (gallery.upgrade.eval_queries)")
    parser.add_argument("--samples", type=int, default=5, help="draws of S")
    parser.add_argument("--map-sample", type=int, default=5000, help="gallery items the reverse transformation fits on")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write <out>.json and <out>.md")
    args = parser.parse_args(argv)
    rows = []
    for run in args.run:
        data = run.parent / "data" if (run.parent / "data" / "splits").is_dir() else Path("data")
        row = measure_run(run, data, args.sample, args.samples, args.map_sample, args.seed)
        rows.append(row)
        print(json.dumps(row))
    lines = ["# The advisor's ways without a map against their measured curves", "",
             f"`python benchmarks/target_ways.py {' '.join(sys.argv[1:] if argv is None else argv)}`", "",
             "Largest gap between the predicted and the measured top-1 at every 10% of a random backfill "
             f"(points; mean and max over {args.samples} draws of S = {args.sample} items).", "",
             "| run | items | way | gap mean | gap max | measured top-1 at 0, 50, 100% |", "|---|---|---|---|---|---|"]
    for row in rows:
        for way, gap in row["largest_gap_points"].items():
            top1 = row["measured_top1"][way]
            lines.append(f"| {row['run']} | {row['items']} | {way} | {gap['mean']:.2f} | {gap['max']:.2f} | "
                         f"{top1[0]:.2f}, {top1[len(top1) // 2]:.2f}, {top1[-1]:.2f} |")
    print("\n".join(lines))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
        args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
