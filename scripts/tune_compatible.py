"""A compatible-training row's hyper-parameters tuned on held-out training images, never on the
test split (reports/<loss>_grid.*): stationary representations, BT^2, or any loss of
compare.compatible.

A stratified ``--fraction`` of the new model's training split is held out. Every point of the grid
(the product of the ``--set KEY=v1,v2`` values, over the row's configuration in
compare.compatible.<method>) trains a compatible new model on the rest with train.new's settings,
and is measured on the held-out images as the evaluation measures the test split (query = gallery
= the held-out images, the items not yet backfilled holding their old features, random order, the
row's own distance). Stationary representations' own old model (trained on old_train, which the
held-out images are not part of) and BT^2's reference new model (trained on the same images as the
grid, the held-out ones left out) are trained once. The best point by the mean of top1_auc and
map_auc is printed and written down; nothing in params.yaml is edited.

    python scripts/tune_compatible.py --method stationary --set lam=0.1,0.5,0.9 --set tau=0.1,0.2 --size 1000
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def grid_points(settings: list[str]) -> list[dict]:
    """``["lam=0.1,1", "tau=0.2"]`` -> every combination, as dicts of floats."""
    axes = {}
    for item in settings:
        key, _, values = item.partition("=")
        if not key or not values:
            raise ValueError(f"--set takes KEY=v1,v2,...; got {item!r}")
        axes[key.strip()] = [float(v) for v in values.split(",")]
    return [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())]


def measure(model, old_model, split, *, distance: str, curve_points: int, seed: int) -> dict:
    import torch

    from fastfill.components.evaluation.assessment import MethodOutputs, method_curves
    from fastfill.components.experiment.compatibility import old_items_beside_new_features
    from fastfill.components.experiment.inference import embed

    features = embed(model, split.images)
    old = old_items_beside_new_features(torch.from_numpy(embed(old_model, split.images)), features.shape[1])
    outputs = MethodOutputs(gallery_old=old.numpy().astype(np.float32), query=features)
    curve = method_curves(outputs, features, split.labels, ["random"], distance=distance,
                          curve_points=curve_points, seed=seed)[0]["random"]
    return {"top1_auc": curve["top1_auc"], "map_auc": curve["map_auc"], "top1_0": curve["top1"][0],
            "map_0": curve["map"][0], "top1_100": curve["top1"][-1], "map_100": curve["map"][-1]}


def main(argv=None) -> int:
    from tune_ract import held_out

    from fastfill.components.experiment.basis_transformation import fold_basis_transformation
    from fastfill.components.experiment.compatibility import fix_simplex_classifier
    from fastfill.components.experiment.data import Split, load_meta, load_split
    from fastfill.components.experiment.models import load_embedder
    from fastfill.components.experiment.training import train_embedder
    from fastfill.components.platform.config import CompatibleConfig, load_params
    from fastfill.components.platform.layout import Layout
    from fastfill.tasks.compatible_training import compatibility_term

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--method", required=True, help="a row of compare.compatible (stationary, bt2, ...)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=V1,V2", help="a grid axis; repeat")
    parser.add_argument("--size", type=int, default=None, help="training images per class (default: all)")
    parser.add_argument("--fraction", type=float, default=0.1, help="of the new model's training split, held out")
    parser.add_argument("--out", type=Path, default=None, help="default: reports/<method>_grid[-<size>]")
    parser.add_argument("--reuse-grid", action="store_true", help="keep the points already in OUT.json; train only "
                        "the others")
    args = parser.parse_args(argv)

    params = load_params(args.params)
    if args.size is not None:
        params = params.comparison_at_size(args.size)
    if args.method not in params.compare.compatible:
        parser.error(f"{args.method!r} is not a row of compare.compatible ({', '.join(params.compare.compatible)})")
    out = args.out or params.paths.reports / (f"{args.method}_grid" + ("" if args.size is None else f"-{args.size}"))
    points = grid_points(args.set) or [{}]
    params = params.for_comparison(params.compare.seeds[0])  # its first seed's splits and old model
    base = params.compatible[args.method]
    layout = Layout(params.paths)
    if not (layout.splits / "meta.json").is_file():
        parser.error(f"no data splits under {layout.splits}: run `fastfill compare"
                     f"{'' if args.size is None else f' --size {args.size}'}` (or its prepare stage) first")
    meta = load_meta(layout.splits)
    split = load_split(layout.splits, "new_train")
    validation = held_out(split.labels, args.fraction, params.evaluate.seed)
    keep = np.setdiff1d(np.arange(len(split.labels)), validation)
    train, val = Split(split.images[keep], split.labels[keep]), Split(split.images[validation], split.labels[validation])
    stats = (meta["pixel_mean"], meta["pixel_std"])
    classes = meta.get("new_classes", list(range(meta["num_classes"])))
    distance = base.distance or params.evaluate.distance
    started = time.perf_counter()
    if base.trains_own_old_model:
        old_model, _ = train_embedder(params.train.old, load_split(layout.splits, "old_train"), meta["old_classes"],
                                      stats, prepare=fix_simplex_classifier)
        print(f"own old model trained ({time.perf_counter() - started:.0f} s)", flush=True)
    else:
        old_model = load_embedder(layout.model_dir("old") / "model.pt") if layout.model_dir("old").is_dir() else None
        if old_model is None:
            old_model, _ = train_embedder(params.train.old, load_split(layout.splits, "old_train"),
                                          meta["old_classes"], stats)
            print(f"old model trained ({time.perf_counter() - started:.0f} s)", flush=True)
    reference = train_config = None
    train_config = params.train.new
    if base.loss == "bt2":
        reference, _ = train_embedder(params.train.new, train, classes, stats)
        train_config = train_config.model_copy(update={"embedding_dim": reference.embedding_dim + base.bt2["extra_dims"]})
        print(f"reference new model trained on the grid's images ({time.perf_counter() - started:.0f} s)", flush=True)
    print(f"{args.method} grid: {len(points)} points; training on {len(train)} images, measured on {len(val)} held out "
          f"of new_train, by {distance}", flush=True)
    grid = json.loads(out.with_suffix(".json").read_text())["grid"] if args.reuse_grid else []
    commands = json.loads(out.with_suffix(".json").read_text()).get("commands", []) if args.reuse_grid else []
    command = (f"python scripts/tune_compatible.py --method {args.method} " + " ".join(f"--set {s}" for s in args.set)
               + ("" if args.size is None else f" --size {args.size}") + (" --reuse-grid" if args.reuse_grid else ""))
    commands.append(command)
    for point in points:
        if any(all(g.get(k) == v for k, v in point.items()) for g in grid):
            continue
        config = CompatibleConfig.model_validate({**base.model_dump(), **point})
        began = time.perf_counter()
        model, _ = train_embedder(train_config, train, classes, stats,
                                  compatibility=compatibility_term(config, old_model, train, reference))
        numbers = measure(fold_basis_transformation(model).eval(), old_model.eval(), val, distance=distance,
                          curve_points=params.evaluate.curve_points, seed=params.evaluate.seed)
        grid.append({**point, **numbers, "score": (numbers["top1_auc"] + numbers["map_auc"]) / 2,
                     "seconds": round(time.perf_counter() - began, 1)})
        print(f"{point}: top1_auc {100 * numbers['top1_auc']:.2f}, map_auc {100 * numbers['map_auc']:.2f}, top-1 0% "
              f"{100 * numbers['top1_0']:.2f}, 100% {100 * numbers['top1_100']:.2f} ({grid[-1]['seconds']:.0f} s)",
              flush=True)
    best = max(grid, key=lambda g: g["score"])
    keys = list(dict.fromkeys(k for g in grid for k in g if k not in (
        "top1_auc", "map_auc", "top1_0", "map_0", "top1_100", "map_100", "score", "seconds")))
    size = "every training image" if args.size is None else f"{args.size} training images per class"
    lines = [f"# {args.method}: its hyper-parameters tuned on held-out training images", "",
             f"{args.method} new models ({base.loss}, the rest of compare.compatible.{args.method} as configured) "
             f"trained on new_train less a stratified {100 * args.fraction:g}% held out ({len(val)} images; {size}), "
             "measured on the held-out images (query = gallery, the items not yet backfilled holding their old "
             f"features), random order, by {distance}. Numbers in %. Chosen: the best mean of top1_auc and map_auc. "
             "Commands, in turn: " + "; ".join(f"`{c}`" for c in commands) + ".", "",
             "| " + " | ".join(keys) + " | top1_auc | map_auc | top-1 0% | mAP 0% | top-1 100% | mAP 100% |",
             "|" + "---|" * (len(keys) + 6)]
    for g in grid:
        mark = "**" if g is best else ""
        lines.append("| " + " | ".join(f"{mark}{g[k]:g}{mark}" if k in g else "" for k in keys) + " | " + " | ".join(
            f"{100 * g[k]:.2f}" for k in ("top1_auc", "map_auc", "top1_0", "map_0", "top1_100", "map_100")) + " |")
    lines += ["", "Chosen: " + ", ".join(f"{k} {best[k]:g}" for k in keys if k in best)
              + f" (score {100 * best['score']:.2f})."]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"method": args.method, "grid": grid, "commands": commands,
                                                    "best": {k: best[k] for k in keys if k in best},
                                                    "validation_images": len(val)}, indent=2) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
