"""How many pairs the upgrade's map needs: the map's quality and its check's resolution against
the map sample's size, for a team's pair of models (``benchmarks/disc_term_study``'s: an ONNX
MobileNetV3-Small, old, and a torchvision ResNet-18, new, trained briefly here), on Fashion-MNIST
photos and on the synthetic bars.

For each sample size, these maps train on that many pairs:

- ``fastfill``: FastFill's map (``align.fastfill``), the disc term on the new head's predicted
  classes, as an upgrade without labels trains it;
- ``pseudo``: the same as if the new model had no head: the disc term on the product's K-means
  pseudo-classes (``components.gallery.upgrade.pseudo_classes``, K = gallery.upgrade.pseudo_classes) with
  the head fitted on them;
- ``off``: the same without a head and with the disc term off (what ``pseudo_classes: 0`` does);
- ``fct``: the l2-only map (``align.fct``).

Each is measured on ``--gallery`` test photos against their labels (FastFill in sigma order, the
l2-only map in random order: top1_auc and map_auc, in %). The check's resolution is the standard
error of a top-1 measured on the held-out pairs (``validation_fraction`` of the sample):
sqrt(p (1 - p) / held-out), in points.

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
    parser.add_argument("--variants", default="fastfill,pseudo,off,fct")
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "map_sample")
    args = parser.parse_args(argv)
    import torch

    fastfill, fct = study_configs()
    from fastfill.components.gallery.upgrade.pseudo_classes import cluster_classes
    from fastfill.components.platform.config import UpgradeConfig

    wanted = UpgradeConfig().pseudo_classes
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
            for name in args.variants.split(","):
                rows, kappa, config = predicted[take], head, fastfill
                if name == "pseudo":
                    rows, kappa, k = cluster_classes(pair_new[take], wanted, args.seed)
                    row["pseudo_k"] = k
                elif name == "off":
                    config = fastfill.model_copy(update={"disc": False})
                elif name == "fct":
                    config = fct
                started_map = time.perf_counter()
                row[name] = curve(config, pair_old[take], pair_new[take], rows, kappa, gallery_old, gallery_new,
                                  gallery_y)
                row[name]["seconds"] = round(time.perf_counter() - started_map, 1)
            held = int(round(fastfill.validation_fraction * size))
            p = row[args.variants.split(",")[0]]["top1_0"] / 100
            row["held_out"] = held
            row["check_se_points"] = round(100 * math.sqrt(max(p * (1 - p), 1e-9) / max(held, 1)), 2)
            print(json.dumps(row), flush=True)
            results["rows"].append(row)
    results["wall_seconds"] = round(time.perf_counter() - started, 1)
    write_report(args.out, markdown(results), results)
    return 0


def markdown(results: dict) -> str:
    names = [n for n in ("fastfill", "pseudo", "off", "fct") if results["rows"] and n in results["rows"][0]]
    titles = {"fastfill": "FastFill, predicted classes", "pseudo": "FastFill, no head: pseudo-classes",
              "off": "FastFill, no head: disc off", "fct": "l2-only map, random"}
    lines = ["# The map sample's size", "",
             f"`benchmarks/map_sample_study.py` ({results['wall_seconds']:.0f} s). Measured on the test photos against "
             "their labels, top1_auc / map_auc in %; FastFill in sigma order, the l2-only map in random order. The "
             "check's s.e.: the standard error of a top-1 on the held-out pairs.", "",
             "| data set | pairs | held out | check's s.e. (points) | " + " | ".join(titles[n] for n in names) + " |",
             "|---|---|---|---|" + "---|" * len(names)]
    for row in results["rows"]:
        cells = [f"{row[n]['top1_auc']} / {row[n]['map_auc']}" for n in names]
        lines.append(f"| {row['dataset']} | {row['pairs']:,} | {row['held_out']} | {row['check_se_points']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
