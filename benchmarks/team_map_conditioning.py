"""FastFill's map on a team's own models: does its loss learn whatever the features' scale, and
how long does it train? Side by side on team pairs, before and after conditioning.

Pairs (old -> new features of one gallery, with hidden labels):

- ``fashion`` and ``bars``: ``benchmarks/team_advisor_map``'s team pair (an ONNX MobileNetV3-Small,
  old, and a torchvision ResNet-18, new, trained briefly here) on two data sets made into photos
  (``team_features``; features cached under ``--cache``);
- ``wide``: a synthetic pair with another dimension ratio and scale: latent class structure (a
  class centre plus noise in 32 dimensions), old = a random two-layer projection to 256
  dimensions times 30, new = another to 1024 dimensions times 0.05, neither normalized: the new
  model is four times wider than the old one and its features are 600 times smaller.

For each pair and seed, as an upgrade does it without labels: a map sample of ``--map-sample``
gallery items, the disc term's classes the product's K-means pseudo-classes of their new features
(``cluster_classes``, K = 50), and three maps trained on it with align.fastfill / align.fct of
params.yaml: the FastFill map as the pipeline trains it (``before``: no conditioning, the
min_steps schedule), the FastFill map as an upgrade trains it now (``after``:
``AlignConfig.for_upgrade``, conditioned features and early stopping), and the l2-only map as the
upgrade's check trains it now (``l2-only``, the same schedule as ``after``). Measured on the
gallery items outside the map sample (queries their new features, the gallery their h(old), the
hidden labels): top-1 and mAP at 0% backfill (%); the epochs trained and the kept one; the
training's wall time; the l2 term of the first epochs (does it fall?) and whether training
diverged.

Writes ``<out>.md`` and ``<out>.json`` (default ``reports/team_map_conditioning``).

    .venv/bin/python benchmarks/team_map_conditioning.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.disc_term_study import ROOT, arguments, study_configs  # noqa: E402
from benchmarks.team_advisor_map import team_features  # noqa: E402


def wide_features(items: int, seed: int, classes: int = 20, latent: int = 32) -> dict:
    """The synthetic ``wide`` pair: old 256-d at scale 30, new 1024-d at scale 0.05, labels from
    the latent classes. The new side sees the latent space with less noise than the old one."""
    rng = np.random.default_rng([seed, 65])
    centres = rng.normal(size=(classes, latent))
    labels = rng.integers(0, classes, size=items)
    z = centres[labels] + 0.9 * rng.normal(size=(items, latent))

    def project(x: np.ndarray, width: int, noise: float, scale: float) -> np.ndarray:
        first = rng.normal(size=(latent, 4 * latent)) / np.sqrt(latent)
        second = rng.normal(size=(4 * latent, width)) / np.sqrt(4 * latent)
        seen = x + noise * rng.normal(size=x.shape)
        return (scale * np.maximum(seen @ first, 0) @ second).astype(np.float32)

    return {"old": project(z, 256, 1.2, 30.0), "new": project(z, 1024, 0.3, 0.05), "labels": labels}


def maps_of(fastfill, fct) -> dict:
    """The three maps' settings: before (the pipeline's FastFill), after (the upgrade's), l2-only."""
    from fastfill.components.experiment.map_check import reference_config

    after = fastfill.for_upgrade()
    return {"FastFill, before": fastfill.model_copy(update={"conditioning": "off"}),
            "FastFill, after": after, "l2-only": reference_config(after)}


def one_pair(feats: dict, map_sample: int, seed: int, fastfill, fct, before: bool = True) -> dict:
    """The maps of one pair and seed, each measured on the items outside the map sample."""
    import torch

    from fastfill.components.experiment.inference import apply_alignment
    from fastfill.components.experiment.map_training import train_alignment
    from fastfill.components.experiment.map_validation import retrieval_at_zero
    from fastfill.components.gallery.upgrade.pairs import sample_positions
    from fastfill.components.gallery.upgrade.pseudo_classes import cluster_classes

    old, new, labels = feats["old"], feats["new"], feats["labels"]
    sample = sample_positions(len(labels), min(map_sample, len(labels) - 200), seed)
    rest = np.setdiff1d(np.arange(len(labels)), sample)
    rows, head, k = cluster_classes(new[sample], 50, seed)
    cpu = torch.device("cpu")
    out = {"old_dim": int(old.shape[1]), "new_dim": int(new.shape[1]), "map_sample": int(len(sample)),
           "measured_on": int(len(rest)), "pseudo_classes": int(k),
           "new_squared_norm": float(np.mean(np.square(new[sample]).sum(axis=1))),
           "old_squared_norm": float(np.mean(np.square(old[sample]).sum(axis=1))), "maps": {}}
    for name, config in maps_of(fastfill.model_copy(update={"seed": seed}), fct).items():
        if name.endswith("before") and not before:
            continue
        lines: list[str] = []
        started = time.perf_counter()
        h, history = train_alignment(config, old[sample], new[sample], rows, head, device=cpu, log=lines.append,
                                     method="fastfill")
        seconds = time.perf_counter() - started
        transformed, sigma = apply_alignment(h.eval(), old[rest], device=cpu)
        finite = bool(np.isfinite(transformed).all())
        measured = retrieval_at_zero(transformed, new[rest], labels[rest]) if finite else {"top1": np.nan, "map": np.nan}
        kept = [r["epoch"] for r in history if r.get("best")]
        out["maps"][name] = {
            "top1_0": round(100 * measured["top1"], 2), "map_0": round(100 * measured["map"], 2),
            "epochs": len(history), "kept_epoch": kept[0] if kept else None, "seconds": round(seconds, 2),
            "diverged": next((r["diverged"]["reason"] for r in history if "diverged" in r), None),
            "l2_first_epochs": [round(r["l2"], 4) for r in history[:6]],
            "log_sigma2_first_epochs": [round(r["log_sigma2"], 3) for r in history[:6]],
            "val_top1_kept": round(100 * history[kept[0] - 1]["val_top1"], 2) if kept else None,
            "orders": backfill_orders(new[rest], transformed, labels[rest], sigma, seed) if finite else {}}
    return out


def backfill_orders(new: np.ndarray, transformed: np.ndarray, labels: np.ndarray, sigma, seed: int) -> dict:
    """The backfill's top1_auc and map_auc (%) over the measured items, in random order and, for a
    map with a sigma head, in sigma order (most uncertain first)."""
    from fastfill.components.evaluation.ordering import random_order, sigma_order
    from fastfill.components.evaluation.retrieval import backfill_curve

    orders = {"random": random_order(len(labels), seed)}
    if sigma is not None:
        orders["sigma"] = sigma_order(sigma)
    out = {}
    for name, order in orders.items():
        measured = backfill_curve(new, new, transformed, labels, order)
        out[name] = {"top1_auc": round(100 * measured.top1_auc, 2), "map_auc": round(100 * measured.map_auc, 2)}
    return out


def summary(runs: list[dict]) -> dict:
    """Mean and standard error over seeds of each map's numbers, per pair."""
    table: dict = {}
    for run in runs:
        for name, numbers in run["maps"].items():
            row = table.setdefault(run["pair"], {}).setdefault(name, {})
            for key in ("top1_0", "map_0", "epochs", "kept_epoch", "seconds"):
                row.setdefault(key, []).append(numbers[key] if numbers[key] is not None else np.nan)
            row.setdefault("diverged", []).append(numbers["diverged"] is not None)
            row.setdefault("seeds", []).append(run["seed"])
    out: dict = {}
    for pair, maps in table.items():
        for name, row in maps.items():
            entry = {}
            for key, values in row.items():
                if key in ("diverged", "seeds"):
                    entry[key] = int(sum(values)) if key == "diverged" else list(values)
                    continue
                values = np.asarray(values, dtype=float)
                entry[key] = round(float(np.nanmean(values)), 2)
                entry[f"{key}_se"] = round(float(np.nanstd(values, ddof=1) / np.sqrt(len(values))), 2) \
                    if len(values) > 1 else None
            out.setdefault(pair, {})[name] = entry
    return out


def write_report(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    args = report["arguments"]
    lines = ["# FastFill's map on team pairs: conditioning and early stopping", "",
             f"`.venv/bin/python benchmarks/team_map_conditioning.py {report['command']}` "
             f"({report['seconds']:.0f} s on 2 shared CPU cores); seeds {args['seeds']}; map sample "
             f"{args['map_sample']} gallery items, pseudo-classes K-means K = 50; measured on the gallery items outside "
             "the map sample (queries: their new features; gallery: h(old); hidden labels). Wall times are of a "
             "machine shared with other work: compare them side by side.", "",
             "Maps: **before** = align.fastfill as the pipeline trains it (no conditioning, the min_steps schedule); "
             "**after** = align.fastfill as an upgrade trains it now (`AlignConfig.for_upgrade`: conditioning scale, "
             "patience 10, the detached weighting); **l2-only** = the upgrade check's reference, trained the same "
             "way as after.", "",
             "Means over the seeds (± standard error over seeds where more than one).", "",
             "| pair (old -> new dims, mean squared norm new) | map | top-1 at 0% | mAP at 0% | epochs (kept) | "
             "train s | diverged |", "|---|---|---|---|---|---|---|"]

    def with_se(entry: dict, key: str) -> str:
        se = entry.get(f"{key}_se")
        return f"{entry[key]:.2f}" + (f" ± {se:.2f}" if se is not None else "")

    shapes = {run["pair"]: run for run in report["runs"]}
    for pair, maps in report["summary"].items():
        run = shapes[pair]
        label = f"{pair} ({run['old_dim']} -> {run['new_dim']}, {run['new_squared_norm']:.3g})"
        for name, entry in maps.items():
            lines.append(f"| {label} | {name} | {with_se(entry, 'top1_0')} | {with_se(entry, 'map_0')} | "
                         f"{entry['epochs']:.0f} ({entry['kept_epoch']:.0f}) | {entry['seconds']:.1f} | "
                         f"{entry['diverged']}/{len(entry['seeds'])} |")
    lines += ["", "## The l2 term and mean log sigma^2 of the first epochs (seed " + str(args["seeds"][0]) + ")", "",
              "l2 is the training loss's term: in the features' own units before, in the scaled units after "
              "(mean squared norm of the scaled new features: 16).", "",
              "| pair | map | l2, epochs 1-6 | mean log sigma^2, epochs 1-6 |", "|---|---|---|---|"]
    for run in report["runs"]:
        if run["seed"] != args["seeds"][0]:
            continue
        for name, numbers in run["maps"].items():
            sigma = numbers["log_sigma2_first_epochs"] if name != "l2-only" else "-"
            lines.append(f"| {run['pair']} | {name} | {numbers['l2_first_epochs']} | {sigma} |")
    lines += ["", "## The backfill: top1_auc / map_auc (%) by order, per seed", "",
              "Over the measured items (each is a query; the gallery is h(old), re-embedded in the order).", "",
              "| pair | seed | map | random order | sigma order |", "|---|---|---|---|---|"]
    for run in report["runs"]:
        for name, numbers in run["maps"].items():
            cells = [f"{o['top1_auc']:.2f} / {o['map_auc']:.2f}" if (o := numbers.get("orders", {}).get(order))
                     else "-" for order in ("random", "sigma")]
            lines.append(f"| {run['pair']} | {run['seed']} | {name} | {cells[0]} | {cells[1]} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", default="fashion,bars,wide")
    parser.add_argument("--train-items", type=int, default=4000, help="team_features: images the team's models train on")
    parser.add_argument("--gallery", type=int, default=2000, help="gallery items of each pair")
    parser.add_argument("--epochs", type=int, default=2, help="team_features: the team's models' training epochs")
    parser.add_argument("--map-sample", type=int, default=1000, help="gallery.upgrade.map_sample")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--before-seeds", type=int, nargs="*", default=[0],
                        help="the seeds that also train the map as before (its 500-epoch schedule is the slow part)")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/fastfill-team-features"),
                        help="team_features' cache of the team pairs' features")
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "team_map_conditioning")
    args = parser.parse_args(argv)
    fastfill, fct = study_configs()
    started = time.perf_counter()
    runs = []
    for pair in args.pairs.split(","):
        # the team's models are trained once (seed 0); the seeds vary the map sample and the maps
        feats = (wide_features(args.gallery, 0) if pair == "wide" else
                 team_features(pair, args.train_items, args.gallery, args.epochs, 0, args.cache))
        for seed in args.seeds:
            result = one_pair(feats, args.map_sample, seed, fastfill, fct, before=seed in args.before_seeds)
            runs.append({"pair": pair, "seed": seed, **result})
            print(pair, seed, json.dumps({k: (v["top1_0"], v["map_0"], v["epochs"], v["kept_epoch"], v["seconds"],
                                              v["diverged"]) for k, v in result["maps"].items()}), flush=True)
    report = {"arguments": arguments(args), "command": " ".join(sys.argv[1:] if argv is None else argv),
              "seconds": time.perf_counter() - started, "runs": runs, "summary": summary(runs)}
    write_report(report, args.out)
    print(f"wrote {args.out}.md and {args.out}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
