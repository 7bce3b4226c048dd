"""How many pairs the upgrade's map needs: the map's quality and its check's resolution against
the map sample's size, for a team's pair of models (``benchmarks/disc_term_study``'s: an ONNX
MobileNetV3-Small, old, and a torchvision ResNet-18, new, trained briefly here), on Fashion-MNIST
photos and on the synthetic bars.

For each sample size, FastFill's map (``align.fastfill``; the disc term on the new head's
predicted classes, as an upgrade without labels trains it) and the l2-only map (``align.fct``)
train on that many pairs; each is measured on ``--gallery`` test photos against their labels
(FastFill in sigma order, the l2-only map in random order: top1_auc and map_auc, in %). The
check's resolution is the standard error of a top-1 measured on the held-out pairs
(``validation_fraction`` of the sample): sqrt(p (1 - p) / held-out), in points.

    .venv/bin/python benchmarks/map_sample_study.py
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.disc_term_study import ROOT, arguments, curve, data, embedders, features, study_configs  # noqa: E402
from benchmarks.team_own_models import write_report  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", default="fashion,bars")
    parser.add_argument("--sizes", type=int, nargs="+", default=[500, 1000, 2000, 5000, 10000, 20000])
    parser.add_argument("--train-items", type=int, default=12000)
    parser.add_argument("--gallery", type=int, default=3000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "map_sample")
    args = parser.parse_args(argv)
    import torch

    fastfill, fct = study_configs()
    started = time.perf_counter()
    results: dict = {"config": arguments(args), "rows": []}
    for dataset in args.datasets.split(","):
        (train_x, train_y), (pair_x, pair_y), (gallery_x, gallery_y) = data(
            dataset, args.train_items, max(args.sizes), args.gallery, args.seed)
        old, new, accuracy = embedders(train_x, train_y, args.epochs, args.seed)
        pair_old, pair_new = features(old, pair_x, args.seed + 11), features(new, pair_x, args.seed + 11)
        gallery_old, gallery_new = features(old, gallery_x, args.seed + 12), features(new, gallery_x, args.seed + 12)
        head = new.classifier.eval().requires_grad_(False)
        with torch.no_grad():
            predicted = head(torch.from_numpy(pair_new)).argmax(1).numpy().astype(np.int64)
        for size in args.sizes:
            take = np.random.default_rng([args.seed, size]).permutation(len(pair_old))[:size]
            row = {"dataset": dataset, "pairs": size, **accuracy}
            for name, config in (("fastfill", fastfill), ("fct", fct)):
                row[name] = curve(config, pair_old[take], pair_new[take], predicted[take], head, gallery_old,
                                  gallery_new, gallery_y)
            held = int(round(fastfill.validation_fraction * size))
            p = row["fastfill"]["top1_0"] / 100
            row["held_out"] = held
            row["check_se_points"] = round(100 * math.sqrt(max(p * (1 - p), 1e-9) / max(held, 1)), 2)
            print(json.dumps(row), flush=True)
            results["rows"].append(row)
    results["wall_seconds"] = round(time.perf_counter() - started, 1)
    write_report(args.out, markdown(results), results)
    return 0


def markdown(results: dict) -> str:
    lines = ["# The map sample's size", "",
             f"`benchmarks/map_sample_study.py` ({results['wall_seconds']:.0f} s). Measured on the test photos against "
             "their labels, %: FastFill (predicted classes, sigma order) and the l2-only map (random order).", "",
             "| data set | pairs | held out | check's s.e. (points) | FastFill top1_auc / map_auc | l2-only top1_auc / map_auc "
             "| FastFill minus l2-only (top1 / mAP) |", "|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        ff, l2 = row["fastfill"], row["fct"]
        lines.append(f"| {row['dataset']} | {row['pairs']:,} | {row['held_out']} | {row['check_se_points']} | "
                     f"{ff['top1_auc']} / {ff['map_auc']} | {l2['top1_auc']} / {l2['map_auc']} | "
                     f"{ff['top1_auc'] - l2['top1_auc']:+.2f} / {ff['map_auc'] - l2['map_auc']:+.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
