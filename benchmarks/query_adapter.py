"""The zero-write alternative: query-side adapters (Procrustes, low-rank affine, residual MLP) that
map the new model's queries into the old space, against FCT and FastFill, at 0% backfill and
along a random-order backfill, at several data sizes.

    .venv/bin/python benchmarks/query_adapter.py --size 300 --size 1000 --seed 0
    .venv/bin/python benchmarks/query_adapter.py --default-run --report reports/query_adapter-default

Each (size, seed) is the sweep's run (`fastfill sweep`, under --out; reused when it exists, run
otherwise). The adapters are fitted on the same pairs as the maps (the new_train split's old and
new features) and evaluated on the test split with the evaluation protocol of docs/methods.md:
queries are the new model's test features through the adapter, the gallery is the old model's
test features, untouched. Along a backfill, a backfilled item's new features go through the same
adapter, so every distance is measured in the old space (one space, no merging of two). Writes
reports/query_adapter.{md,json} (--report).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


from fastfill.components.platform.config import load_params  # noqa: E402


def _size(text: str) -> int | None:
    if text == "all":
        return None
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive count or all, got {value}")
    return value


def _point(curve: dict, index: int = 0) -> dict:
    return {"top1": curve["top1"][index], "map": curve["map"][index]}


def evaluate_run(params, rank: int) -> dict:
    """Rows for one (size, seed) run: references, FCT and FastFill from its metrics.json, and each
    adapter measured here."""
    from fastfill.components.experiment.adapters import ADAPTERS
    from fastfill.components.platform.layout import Layout, load_array, read_json
    from fastfill.tasks.method_curves import adapter_curves

    layout = Layout(params.paths)
    metrics = read_json(layout.metrics)
    pairs = load_array(layout.features("new", "new_train")).shape[0]
    curves = read_json(layout.curves)["curves"]
    rows = {
        "old/old": {"top1_0": metrics["old_old"]["top1_0"], "map_0": metrics["old_old"]["map_0"]},
        "new/new": {"top1_0": metrics["new_new"]["top1_0"], "map_0": metrics["new_new"]["map_0"]},
    }
    for method, order in (("fct", "random"), ("fastfill", "sigma"), ("fastfill", "random")):
        curve = curves[method][order]
        rows[f"{method} ({order})"] = {"top1_0": curve["top1"][0], "map_0": curve["map"][0],
                                       "top1_auc": curve["top1_auc"], "map_auc": curve["map_auc"]}
    config = params.evaluate.model_copy(update={"adapter_rank": rank})
    for kind in ADAPTERS:  # as the evaluation stage measures them (the comparison's rows adapter_<kind>)
        started = time.perf_counter()
        curve = adapter_curves(config, kind, layout)["random"]
        rows[f"adapter {kind} (random)"] = {"top1_0": curve["top1"][0], "map_0": curve["map"][0],
                                            "top1_auc": curve["top1_auc"], "map_auc": curve["map_auc"],
                                            "top1_100": curve["top1"][-1],
                                            "seconds": round(time.perf_counter() - started, 2)}  # fit and measure
    return {"pairs": int(pairs), "rows": rows}


def markdown(results: dict, rank: int) -> str:
    lines = ["Query-side adapters against FCT and FastFill (`benchmarks/query_adapter.py`), in %. "
             "`top-1 at 0%` and `mAP at 0%`: new queries against the gallery as stored (adapters: the old "
             "features untouched; FCT and FastFill: the old features through their map). `top1_auc`/`map_auc`: "
             f"along the backfill (adapters: random order, backfilled items through the adapter). Low-rank rank {rank}.",
             ""]
    for label, by_seed in results.items():
        for seed, run in by_seed.items():
            lines += [f"### train_per_class {label}, seed {seed} ({run['pairs']} training pairs)", "",
                      "| row | top-1 at 0% | mAP at 0% | top1_auc | map_auc |", "|---|---|---|---|---|"]
            for name, row in run["rows"].items():
                auc = (f"{100 * row['top1_auc']:.2f} | {100 * row['map_auc']:.2f}" if "top1_auc" in row else " | ")
                lines.append(f"| {name} | {100 * row['top1_0']:.2f} | {100 * row['map_0']:.2f} | {auc} |")
            lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", dest="sizes", action="append", type=_size,
                        help="training images per class (repeatable), or all; default all")
    parser.add_argument("--seed", dest="seeds", action="append", type=int, help="repeatable; default 0")
    parser.add_argument("--rank", type=int, default=32, help="the low-rank adapter's rank (default 32)")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--out", default="runs/sweep", help="the sweep's folder (runs are reused)")
    parser.add_argument("--report", default="reports/query_adapter", help="writes REPORT.md and REPORT.json")
    parser.add_argument("--default-run", action="store_true",
                        help="measure the outputs of `fastfill run` (params.yaml's paths) instead of sweep runs")
    args = parser.parse_args()
    from fastfill.components.evaluation.sweep_report import size_label
    from fastfill.flows.sweep import sized, sweep_flow

    params = load_params(args.params)
    if args.default_run:  # what `fastfill run` left: train_per_class and seed of params.yaml
        label = size_label(params.prepare.train_per_class)
        results = {label: {str(params.evaluate.seed): evaluate_run(params, args.rank)}}
        return _write(results, args.rank, Path(args.report))
    sizes, seeds, out = args.sizes or [None], args.seeds or [0], Path(args.out)
    # runs only the (size, seed) pairs not there yet; its table goes under --out, not over reports/sweep.*
    elsewhere = params.model_copy(update={"paths": params.paths.model_copy(update={"reports": out / "reports"})})
    sweep_flow(elsewhere, sizes, seeds, out, resume=True)
    results = {}
    for size in sizes:
        label = size_label(size)
        for seed in seeds:
            seeded = sized(params, size, out).with_seed(seed).with_outputs_under(out / f"n-{label}" / f"seed-{seed}")
            results.setdefault(label, {})[str(seed)] = evaluate_run(seeded, args.rank)
    _write(results, args.rank, Path(args.report))


def _write(results: dict, rank: int, report: Path) -> None:
    text = markdown(results, rank)
    report.parent.mkdir(parents=True, exist_ok=True)
    report.with_suffix(".md").write_text(text)
    report.with_suffix(".json").write_text(json.dumps({"rank": rank, "results": results}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
