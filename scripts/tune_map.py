"""A map row's settings tuned on held-out training pairs, never on the test split
(reports/<method>_grid[-<size>].*): lambda-orthogonality's lambda, or any setting of a row of
compare.align.

A stratified ``--fraction`` of the new_train split's (old, new) feature pairs of the comparison's
first seed is held out. Every point of the grid (the product of the ``--set KEY=v1,v2`` values
over the row's configuration) trains the map on the rest, as the comparison trains it (its own
held-out pairs choosing the best epoch), and is measured on the held-out pairs as the evaluation
measures the test split (query = gallery = the held-out images, the items not yet backfilled
holding their mapped old features, random order). The best point by the mean of top1_auc and
map_auc is printed and written down; nothing in params.yaml is edited.

    python scripts/tune_map.py --method lambda_orth --set orthogonality=0.1,1,10 --size 1000
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SCORES = ("top1_auc", "map_auc", "top1_0", "map_0", "score", "seconds")


def main(argv=None) -> int:
    import torch
    from tune_compatible import grid_points
    from tune_ract import held_out

    from fastfill.components.evaluation.assessment import MethodOutputs, method_curves
    from fastfill.components.experiment.data import load_split
    from fastfill.components.experiment.map_training import train_alignment
    from fastfill.components.experiment.models import load_embedder
    from fastfill.components.platform.config import AlignConfig, load_params
    from fastfill.components.platform.layout import Layout, load_array

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--method", required=True, help="a row of compare.align (lambda_orth, ...)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=V1,V2", help="a grid axis; repeat")
    parser.add_argument("--size", type=int, default=None, help="training images per class (default: all)")
    parser.add_argument("--fraction", type=float, default=0.1, help="of the new_train pairs, held out")
    parser.add_argument("--out", type=Path, default=None, help="default: reports/<method>_grid[-<size>]")
    args = parser.parse_args(argv)

    params = load_params(args.params)
    if args.size is not None:
        params = params.comparison_at_size(args.size)
    if args.method not in params.compare.align:
        parser.error(f"{args.method!r} is not a row of compare.align ({', '.join(params.compare.align)})")
    out = args.out or params.paths.reports / (f"{args.method}_grid" + ("" if args.size is None else f"-{args.size}"))
    params = params.for_comparison(params.compare.seeds[0])
    base = params.align[args.method]
    layout = Layout(params.paths)
    if not layout.features("new", "new_train").is_file():
        parser.error(f"no stored features under {layout.paths.artifacts}: run `fastfill compare"
                     f"{'' if args.size is None else f' --size {args.size}'}` first")
    labels = load_split(layout.splits, "new_train").labels
    old, new = load_array(layout.features("old", "new_train")), load_array(layout.features("new", "new_train"))
    new_model = load_embedder(layout.model_dir("new") / "model.pt")
    rows = new_model.class_index(torch.from_numpy(labels)).numpy()
    validation = held_out(labels, args.fraction, params.evaluate.seed)
    keep = np.setdiff1d(np.arange(len(labels)), validation)
    print(f"{args.method} grid: training on {len(keep)} pairs, measured on {len(validation)} held out", flush=True)
    started, grid = time.perf_counter(), []
    for point in grid_points(args.set) or [{}]:
        config = AlignConfig.model_validate({**base.model_dump(), **point})
        began = time.perf_counter()
        h, _ = train_alignment(config, old[keep], new[keep], rows[keep], new_model.classifier,
                               device=torch.device("cpu"), log=lambda *_: None, method=args.method)
        with torch.no_grad():
            mapped = h.eval()(torch.from_numpy(old[validation])).numpy().astype(np.float32)
        mapped = mapped[0] if isinstance(mapped, tuple) else mapped
        curve = method_curves(MethodOutputs(gallery_old=mapped), new[validation], labels[validation], ["random"],
                              distance=params.evaluate.distance, curve_points=params.evaluate.curve_points,
                              seed=params.evaluate.seed)[0]["random"]
        numbers = {"top1_auc": curve["top1_auc"], "map_auc": curve["map_auc"], "top1_0": curve["top1"][0],
                   "map_0": curve["map"][0]}
        grid.append({**point, **numbers, "score": (numbers["top1_auc"] + numbers["map_auc"]) / 2,
                     "seconds": round(time.perf_counter() - began, 1)})
        print(f"{point}: top1_auc {100 * numbers['top1_auc']:.2f}, map_auc {100 * numbers['map_auc']:.2f}, "
              f"top-1 0% {100 * numbers['top1_0']:.2f} ({grid[-1]['seconds']:.0f} s)", flush=True)
    best = max(grid, key=lambda g: g["score"])
    keys = [k for k in grid[0] if k not in SCORES]
    command = (f"python scripts/tune_map.py --method {args.method} " + " ".join(f"--set {s}" for s in args.set)
               + ("" if args.size is None else f" --size {args.size}"))
    size = "every training image" if args.size is None else f"{args.size} training images per class"
    lines = [f"# {args.method}: its settings tuned on held-out training pairs", "",
             f"{args.method} maps trained on the new_train pairs less a stratified {100 * args.fraction:g}% held out "
             f"({len(validation)} pairs; {size}; the comparison's first seed's features), measured on the held-out "
             "pairs (query = gallery, the items not yet backfilled holding their mapped old features), random order. "
             f"Numbers in %. Best: the highest mean of top1_auc and map_auc (what the row uses is params.yaml's "
             f"compare.align.{args.method}, and docs/results.md says why). Command: `{command}` "
             f"({time.perf_counter() - started:.0f} s).", "",
             "| " + " | ".join(keys) + " | top1_auc | map_auc | top-1 0% | mAP 0% |", "|" + "---|" * (len(keys) + 4)]
    for g in grid:
        mark = "**" if g is best else ""
        lines.append("| " + " | ".join(f"{mark}{g[k]:g}{mark}" for k in keys) + " | " + " | ".join(
            f"{100 * g[k]:.2f}" for k in ("top1_auc", "map_auc", "top1_0", "map_0")) + " |")
    lines += ["", "Best on the held-out pairs: " + ", ".join(f"{k} {best[k]:g}" for k in keys)
              + f" (score {100 * best['score']:.2f})."]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"method": args.method, "grid": grid, "command": command,
                                                    "best": {k: best[k] for k in keys}}, indent=2) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
