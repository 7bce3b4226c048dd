"""RACT's lambda and tau tuned on a validation split, never on the test split (reports/ract_grid.*).

A stratified ``--fraction`` of the new model's training split is held out: RACT new models
are trained on the rest (train.new's settings, the pipeline's old model frozen) for every
(lambda, tau) of the grid, and each is measured on the held-out images as the evaluation
measures the test split (query = gallery = the held-out images, the old gallery side its old
features, backfilled in RACT's headline order, entropy, and in random order). The best point
by the mean of top1_auc and map_auc in the headline order is the one to put in
compare.compatible.ract; this script prints it and writes the grid, it edits nothing.

    python scripts/tune_ract.py --lam 0.3 1 3 --tau 0.05 0.1 --out reports/ract_grid

``--test``: then the chosen point, trained on the whole new_train split as the comparison trains
it (its seed 0), measured once on the test split, beside the comparison's rows of that seed
(reports/comparison.json): the numbers that say where a tuned RACT ranks.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def held_out(labels: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """A stratified ``fraction`` of the positions, per class."""
    rng = np.random.default_rng(seed)
    chosen = []
    for label in np.unique(labels):
        rows = np.flatnonzero(labels == label)
        chosen.append(rng.choice(rows, size=max(2, int(round(fraction * len(rows)))), replace=False))
    return np.sort(np.concatenate(chosen))


def _command(grid: list[dict], test: bool) -> str:
    """The command that measures these points: one when they are every pair of their lambdas and
    taus; otherwise the points are the union of several runs with --reuse-grid."""
    pairs = {(g["lam"], g["tau"]) for g in grid}
    lams, taus = sorted({g["lam"] for g in grid}), sorted({g["tau"] for g in grid})
    flags = " --test" if test else ""
    if len(pairs) == len(lams) * len(taus):
        return (f"Command: `python scripts/tune_ract.py --lam {' '.join(f'{v:g}' for v in lams)} "
                f"--tau {' '.join(f'{v:g}' for v in taus)}{flags}`.")
    return (f"{len(pairs)} points, measured by several runs of `python scripts/tune_ract.py --lam ... --tau ... "
            f"--reuse-grid{flags}` (each trains every lambda x tau pair it is given and keeps those already measured).")


def measure(model, old_model, split, *, distance: str, curve_points: int, seed: int) -> dict:
    import torch

    from fastfill.components.evaluation.assessment import MethodOutputs, method_curves
    from fastfill.components.experiment.inference import embed
    from fastfill.components.experiment.losses import match_dimension

    features = embed(model, split.images)
    old = match_dimension(torch.from_numpy(embed(old_model, split.images)), features.shape[1])
    with torch.no_grad():
        logits = model.cpu().classify(old).numpy().astype(np.float32)
    outputs = MethodOutputs(gallery_old=old.numpy().astype(np.float32), query=features, logits=logits)
    curves, _ = method_curves(outputs, features, split.labels, ["entropy", "random"], distance=distance,
                              curve_points=curve_points, seed=seed)
    return {order: {key: curve[key] for key in ("top1_auc", "map_auc")} | {"top1_0": curve["top1"][0],
                                                                         "top1_1": curve["top1"][-1]}
            for order, curve in curves.items()}


def main(argv=None) -> int:
    from fastfill.components.experiment.compatibility import RACTCompatibility
    from fastfill.components.experiment.data import Split, load_meta, load_split
    from fastfill.components.experiment.models import load_embedder
    from fastfill.components.experiment.training import train_embedder
    from fastfill.components.platform.config import load_params
    from fastfill.components.platform.layout import Layout

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--lam", type=float, nargs="+", default=[0.3, 1.0, 3.0])
    parser.add_argument("--tau", type=float, nargs="+", default=[0.05, 0.1])
    parser.add_argument("--fraction", type=float, default=0.1, help="of the new model's training split, held out")
    parser.add_argument("--out", type=Path, default=Path("reports/ract_grid"))
    parser.add_argument("--test", action="store_true", help="then train the chosen point on all of new_train and "
                        "measure it on the test split")
    parser.add_argument("--comparison", type=Path, default=Path("reports/comparison.json"))
    parser.add_argument("--reuse-grid", action="store_true", help="keep the points already in OUT.json; train only the others")
    args = parser.parse_args(argv)

    params = load_params(args.params)
    layout = Layout(params.paths)
    meta = load_meta(layout.splits)
    split = load_split(layout.splits, "new_train")
    validation = held_out(split.labels, args.fraction, params.evaluate.seed)
    keep = np.setdiff1d(np.arange(len(split.labels)), validation)
    train, val = Split(split.images[keep], split.labels[keep]), Split(split.images[validation], split.labels[validation])
    old_model = load_embedder(layout.model_dir("old") / "model.pt")
    classes = meta.get("new_classes", list(range(meta["num_classes"])))
    print(f"RACT grid: lambda {args.lam} x tau {args.tau}; training on {len(train)} images, measured on {len(val)} "
          f"held out of new_train", flush=True)
    grid = json.loads(args.out.with_suffix(".json").read_text())["grid"] if args.reuse_grid else []
    for lam in args.lam:
        for tau in args.tau:
            if any(g["lam"] == lam and g["tau"] == tau for g in grid):
                continue
            started = time.perf_counter()
            model, _ = train_embedder(params.train.new, train, classes, (meta["pixel_mean"], meta["pixel_std"]),
                                      compatibility=RACTCompatibility(old_model, tau=tau, lam=lam))
            numbers = measure(model.eval(), old_model.eval(), val, distance=params.evaluate.distance,
                              curve_points=params.evaluate.curve_points, seed=params.evaluate.seed)
            headline = numbers["entropy"]
            grid.append({"lam": lam, "tau": tau, **numbers, "score": (headline["top1_auc"] + headline["map_auc"]) / 2,
                         "seconds": round(time.perf_counter() - started, 1)})
            print(f"lambda {lam:g}, tau {tau:g}: entropy top1_auc {100 * headline['top1_auc']:.2f}, map_auc "
                  f"{100 * headline['map_auc']:.2f}; random top1_auc {100 * numbers['random']['top1_auc']:.2f} "
                  f"({grid[-1]['seconds']:.0f} s)", flush=True)
    best = max(grid, key=lambda g: g["score"])
    lines = ["# RACT's lambda and tau, tuned on a validation split", "",
             f"RACT new models trained on new_train less a stratified {100 * args.fraction:g}% held out ({len(val)} "
             "images), measured on the held-out images (query = gallery, the old side their old features), in RACT's "
             "headline order (entropy) and in random order. Numbers in %. Chosen: the best mean of top1_auc and "
             f"map_auc in the entropy order. {_command(grid, args.test)}", "",
             "| lambda | tau | top1_auc (entropy) | map_auc (entropy) | top-1 0% | top-1 100% | top1_auc (random) "
             "| map_auc (random) |", "|---|---|---|---|---|---|---|---|"]
    for g in grid:
        mark = "**" if g is best else ""
        lines.append(f"| {mark}{g['lam']:g}{mark} | {mark}{g['tau']:g}{mark} | {100 * g['entropy']['top1_auc']:.2f} | "
                     f"{100 * g['entropy']['map_auc']:.2f} | {100 * g['entropy']['top1_0']:.2f} | "
                     f"{100 * g['entropy']['top1_1']:.2f} | {100 * g['random']['top1_auc']:.2f} | "
                     f"{100 * g['random']['map_auc']:.2f} |")
    lines += ["", f"Chosen: lambda {best['lam']:g}, tau {best['tau']:g} (compare.compatible.ract in params.yaml)."]
    result = {"grid": grid, "best": {"lam": best["lam"], "tau": best["tau"]}, "validation_images": len(val)}
    if args.test:
        started = time.perf_counter()
        model, _ = train_embedder(params.train.new, split, classes, (meta["pixel_mean"], meta["pixel_std"]),
                                  compatibility=RACTCompatibility(old_model, tau=best["tau"], lam=best["lam"]))
        test = measure(model.eval(), old_model.eval(), load_split(layout.splits, "test"),
                       distance=params.evaluate.distance, curve_points=params.evaluate.curve_points,
                       seed=params.evaluate.seed)
        result["test"] = {**test, "seconds": round(time.perf_counter() - started, 1)}
        lines += ["", f"On the test split (trained on all of new_train, seed {params.train.new.seed}), beside the "
                  f"comparison's headline rows of {args.comparison} (seed 0), top1_auc / map_auc:", ""]
        rows = json.loads(args.comparison.read_text())["rows"] if args.comparison.is_file() else {}
        shown = [(f"ract tuned (lambda {best['lam']:g}, tau {best['tau']:g}) (entropy)", test["entropy"]),
                 (f"ract tuned (lambda {best['lam']:g}, tau {best['tau']:g}) (random)", test["random"])]
        for label, row in rows.items():
            if row.get("headline") or label in ("old/old", "new/new"):
                shown.append((label, {k: row[k]["per_seed"]["0"] for k in ("top1_auc", "map_auc")}))
        for label, numbers in sorted(shown, key=lambda item: -(item[1]["top1_auc"] or 0)):
            lines.append(f"- {label}: {100 * numbers['top1_auc']:.2f} / {100 * numbers['map_auc']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
