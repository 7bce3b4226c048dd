"""Does bfloat16 training change a map's results? FCT's and FastFill's maps trained in float32 and
in bfloat16 autocast on the same stored features, evaluated on the test split, side by side.

`fastfill compare` trains every method at compare.precision (auto: bfloat16 on a CPU with
avx512_bf16/AMX), for time; the pipeline trains in float32. This takes a finished comparison
seed's stored features and new model (runs/compare/seed-<s>/artifacts), trains each map of
params.yaml's align section twice, once per precision, with the same seed and threads, and runs
the evaluation protocol on both (FastFill in sigma order, FCT in random order). The difference
between the two is what the precision changes; the seeds' spread is what it should be set
against.

    .venv/bin/python benchmarks/training_precision.py --seed 0 --seed 1

Writes reports/training_precision.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastfill.components.evaluation.assessment import MethodOutputs, build_order  # noqa: E402
from fastfill.components.evaluation.retrieval import backfill_curve  # noqa: E402
from fastfill.components.experiment.data import load_split  # noqa: E402
from fastfill.components.experiment.inference import apply_alignment  # noqa: E402
from fastfill.components.experiment.map_training import train_alignment  # noqa: E402
from fastfill.components.experiment.models import load_embedder  # noqa: E402
from fastfill.components.platform.config import load_params  # noqa: E402
from fastfill.components.platform.layout import Layout, load_array  # noqa: E402

METHODS = {"fct": "random", "fastfill": "sigma"}
PRECISIONS = ("fp32", "bf16")


def _class_rows(model, labels: np.ndarray) -> np.ndarray:
    return model.class_index(torch.from_numpy(labels)).numpy()


def measure(params, seed: int, methods: list[str], precisions: list[str]) -> list[dict]:
    seeded = params.for_comparison(seed)
    layout = Layout(seeded.paths)
    new_model = load_embedder(layout.model_dir("new") / "model.pt")
    train_labels = load_split(layout.splits, "new_train").labels
    test_labels = load_split(layout.splits, "test").labels
    old_train, new_train = load_array(layout.features("old", "new_train")), load_array(layout.features("new", "new_train"))
    old_test, new_test = load_array(layout.features("old", "test")), load_array(layout.features("new", "test"))
    rows = _class_rows(new_model, train_labels)
    results = []
    for method in methods:
        order_name = METHODS[method]
        for precision in precisions:
            config = seeded.align[method].model_copy(update={"precision": precision})
            started = time.perf_counter()
            h, _ = train_alignment(config, old_train, new_train, rows, new_model.classifier, log=lambda m: None,
                                   method=method)
            seconds = time.perf_counter() - started
            transformed, log_sigma2 = apply_alignment(h, old_test)
            outputs = MethodOutputs(gallery_old=transformed, log_sigma2=log_sigma2)
            order = build_order(order_name, outputs, new_test, seeded.evaluate.seed)
            curve = backfill_curve(new_test, new_test, transformed, test_labels, order,
                                   distance=seeded.evaluate.distance, num_intermediate=seeded.evaluate.curve_points)
            numbers = curve.to_dict()
            row = {"seed": seed, "method": method, "order": order_name, "precision": precision,
                   "threads": torch.get_num_threads(),
                   "train_seconds": round(seconds, 1), "top1_auc": numbers["top1_auc"], "map_auc": numbers["map_auc"],
                   "top1_0": numbers["top1"][0], "map_0": numbers["map"][0]}
            print(json.dumps(row), flush=True)
            results.append(row)
    return results


def markdown(rows: list[dict]) -> str:
    lines = ["# Map training in float32 and in bfloat16 autocast, on the same features", "",
             "`.venv/bin/python benchmarks/training_precision.py " + " ".join(
                 f"--seed {s}" for s in sorted({r['seed'] for r in rows})) + "`, in %; train s: seconds to train.", "",
             "| seed | map (order) | precision | threads | top1_auc | map_auc | top-1 0% | mAP 0% | train s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['seed']} | {r['method']} ({r['order']}) | {r['precision']} | {r.get('threads', '')} | "
                     f"{100 * r['top1_auc']:.2f} | "
                     f"{100 * r['map_auc']:.2f} | {100 * r['top1_0']:.2f} | {100 * r['map_0']:.2f} | "
                     f"{r['train_seconds']:.0f} |")
    if {r["precision"] for r in rows} != set(PRECISIONS):
        return "\n".join(lines) + "\n"
    lines += ["", "bf16 minus fp32, per seed (points):", ""]
    for method in sorted({r["method"] for r in rows}, key=list(METHODS).index):
        for key in ("top1_auc", "map_auc"):
            gaps = []
            for seed in sorted({r["seed"] for r in rows}):
                pick = {r["precision"]: r[key] for r in rows if r["seed"] == seed and r["method"] == method}
                gaps.append(100 * (pick["bf16"] - pick["fp32"]))
            lines.append(f"- {method} {key}: " + ", ".join(f"{g:+.2f}" for g in gaps)
                         + f" (mean {statistics.mean(gaps):+.2f})")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, action="append", help="a finished comparison seed (repeat)")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--method", action="append", choices=sorted(METHODS), help="default: both")
    parser.add_argument("--precision", action="append", choices=PRECISIONS, help="default: both")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's, one per core)")
    parser.add_argument("--out", default="reports/training_precision")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    params = load_params(args.params)
    rows = []
    for seed in args.seed or [0]:
        rows += measure(params, seed, args.method or list(METHODS), args.precision or list(PRECISIONS))
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=2))
    out.with_suffix(".md").write_text(markdown(rows))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
