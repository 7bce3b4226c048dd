"""The budget advisor's candidate-reranking way against the curve it predicts.

    .venv/bin/python benchmarks/rerank_advisor_check.py [--run runs/rerank/n-all/seed-0] [--sample 2000] [--draws 3]

On one run's test features (10,000 items: the gallery), the advisor predicts candidate
reranking's top-1 at every 5% of a random backfill from a random sample S of the items
(``target_advice.rerank_top1``: K scaled to the sample, the error rate scaled to the whole gallery
by the old model's at 0%), and the evaluation measures the curve over the whole gallery
(``rerank_curves`` at the same numbers of backfilled items). Prints the largest and mean gap per
depth, over a few draws of S and of the order; writes reports/rerank_advisor_check.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    from fastfill.components.evaluation.rerank import RerankVariant, rerank_curves
    from fastfill.components.experiment.data import load_split
    from fastfill.components.gallery.advice.advisor import NearestLabel
    from fastfill.components.gallery.advice.target_advice import rerank_top1

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, default=Path("runs/rerank/n-all/seed-0"))
    parser.add_argument("--sample", type=int, default=2000)
    parser.add_argument("--draws", type=int, default=3)
    parser.add_argument("--depth", type=int, action="append", dest="depths", help="repeat; default 50 and 200")
    parser.add_argument("--reports", type=Path, default=ROOT / "reports")
    args = parser.parse_args(argv)
    labels = load_split(args.run.parent / "data" / "splits", "test").labels
    old = np.load(args.run / "artifacts" / "features" / "old" / "test.npy")
    new = np.load(args.run / "artifacts" / "features" / "new" / "test.npy")
    n = len(labels)
    rows = []
    for depth in args.depths or [50, 200]:
        gaps = []
        for draw in range(args.draws):
            rng = np.random.default_rng(100 + draw)
            order = rng.permutation(n)
            ranks = np.empty(n, dtype=np.int64)
            ranks[order] = np.arange(n)
            sample = np.sort(rng.choice(n, args.sample, replace=False))
            anchor = NearestLabel(old[sample], sample, labels)  # the old queries against the whole gallery
            anchor.add(0, old)
            predicted = rerank_top1(old[sample], new[sample], labels[sample], ranks[sample], n,
                                    anchor.hits(), depth=depth)
            counts = [int(np.floor(f * n + 1e-9)) for f in predicted["fractions"]]
            v = RerankVariant(depth)
            measured = rerank_curves(old, new, old, new, labels, order, variants=[v], counts=counts)[v]
            gap = np.abs(np.asarray(predicted["top1"]) - measured.top1)
            gaps.append((float(gap.max()), float(gap.mean())))
            print(f"K {depth}, draw {draw}: largest gap {100 * gap.max():.2f} points, mean {100 * gap.mean():.2f}",
                  flush=True)
        rows.append((depth, gaps))
    lines = ["# The advisor's candidate-reranking way against its measured curve", "",
             f"`benchmarks/rerank_advisor_check.py --run {args.run} --sample {args.sample} --draws {args.draws}`: "
             f"predicted from {args.sample} sampled items of {n} (random backfill order, a new draw of the sample and "
             "the order each time), against the curve over the whole gallery at the same 21 points; top-1 gaps in "
             "points.", "", "| K | largest gap (each draw) | mean gap (each draw) |", "|---|---|---|"]
    for depth, gaps in rows:
        lines.append(f"| {depth} | {', '.join(f'{100 * g[0]:.2f}' for g in gaps)} | "
                     f"{', '.join(f'{100 * g[1]:.2f}' for g in gaps)} (mean {100 * statistics.fmean(g[1] for g in gaps):.2f}) |")
    (args.reports / "rerank_advisor_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
