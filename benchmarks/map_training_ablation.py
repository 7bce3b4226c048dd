"""Which map training works at every data size? An ablation on held-out feature pairs only.

For each data size (prepare.train_per_class) this trains the old and new models of params.yaml
on that many images per class, stores their features of the new-train split, and trains the
FastFill map of params.yaml with each candidate fix of its schedule and uncertainty weighting,
plus the l2-only map (FCT) on the same pairs. Every number is measured on the map's held-out
pairs (align.fastfill.validation_fraction of the new-train split), never on the test split:
retrieval at 0% backfill and along a simulated 12-point curve (sigma order for maps with an
uncertainty head, random for the l2 map).

    .venv/bin/python benchmarks/map_training_ablation.py --sizes 100 300 1000 all --seeds 0

Writes reports/map_ablation.{json,md}; models and features are cached under runs/ablation/.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastfill.components.experiment.data import load_raw_dataset, make_splits  # noqa: E402
from fastfill.components.experiment.inference import apply_alignment, embed
from fastfill.components.experiment.map_check import SideOutputs, curve_numbers, reference_config  # noqa: E402
from fastfill.components.experiment.map_training import split_pairs, train_alignment  # noqa: E402
from fastfill.components.experiment.map_validation import ValidationPairs  # noqa: E402
from fastfill.components.experiment.models import load_embedder, save_embedder  # noqa: E402
from fastfill.components.experiment.training import TrainingRun, train_embedder  # noqa: E402
from fastfill.components.platform.config import AlignConfig, load_params  # noqa: E402

VARIANTS = {
    "joint, 20 epochs (before)": {"uncertainty_weighting": "joint", "min_steps": 0},
    "joint + min_steps": {"uncertainty_weighting": "joint"},
    "joint + warm-up 0.5": {"uncertainty_weighting": "joint", "uncertainty_warmup": 0.5},
    "normalized": {"uncertainty_weighting": "normalized"},
    "detached": {"uncertainty_weighting": "detached"},
}


def _features(params, size: int | None, seed: int, root: Path) -> dict[str, np.ndarray]:
    """Old and new features of the new-train split at this size, and the new model's rows."""
    cache = root / f"n-{size or 'all'}" / f"seed-{seed}"
    path = cache / "pairs.npz"
    if path.is_file():
        return dict(np.load(path))
    cache.mkdir(parents=True, exist_ok=True)
    prepare = params.prepare.model_copy(update={"train_per_class": size})
    raw = load_raw_dataset(prepare, Path(params.paths.data) / "raw")
    splits, meta = make_splits(raw, prepare)
    models = {}
    for role, split_name, classes in (("old", "old_train", meta["old_classes"]),
                                      ("new", "new_train", meta["new_classes"])):
        config = getattr(params.train, role).model_copy(update={"seed": seed})
        model, _ = train_embedder(config, splits[split_name], classes, (meta["pixel_mean"], meta["pixel_std"]),
                                  run=TrainingRun(log=lambda m: None))
        save_embedder(model, config, cache / f"{role}.pt")
        models[role] = model
    images = splits["new_train"].images
    import torch

    rows = models["new"].class_index(torch.from_numpy(splits["new_train"].labels)).numpy()
    pairs = {"old": embed(models["old"], images), "new": embed(models["new"], images), "rows": rows}
    np.savez(path, **pairs)
    return pairs


def _measure(config: AlignConfig, pairs: dict, classifier, seed: int) -> dict:
    started = time.perf_counter()
    h, history = train_alignment(config, pairs["old"], pairs["new"], pairs["rows"], classifier, log=lambda m: None)
    _, val_index = split_pairs(config, len(pairs["old"]))
    held = ValidationPairs(pairs["old"][val_index], pairs["new"][val_index], pairs["rows"][val_index])
    transformed, log_sigma2 = apply_alignment(h, held.old)
    order = "sigma" if log_sigma2 is not None else "random"
    numbers = curve_numbers(SideOutputs(transformed, held.new, log_sigma2), held.rows, order, seed, "l2")
    best = next(r for r in history if r.get("best"))
    numbers.update({"epochs": len(history), "best_epoch": best["epoch"], "steps": history[-1]["step"],
                    "train_l2_last": history[-1]["l2"], "val_l2_best": best["val_l2"],
                    "log_sigma2_last": history[-1]["log_sigma2"], "seconds": time.perf_counter() - started})
    return numbers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["100", "300", "1000"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--out", default="reports/map_ablation")
    parser.add_argument("--cache", default="runs/ablation")
    args = parser.parse_args()
    params = load_params(args.params)
    base = params.align["fastfill"]
    results: dict = {}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for size_text in args.sizes:
        size = None if size_text == "all" else int(size_text)
        for seed in args.seeds:
            pairs = _features(params, size, seed, Path(args.cache))
            classifier = load_embedder(Path(args.cache) / f"n-{size or 'all'}" / f"seed-{seed}" / "new.pt").classifier
            configs = {"l2 only (FCT)": reference_config(base).model_copy(update={"seed": seed})}
            configs.update({name: base.model_copy(update={**change, "seed": seed}) for name, change in VARIANTS.items()})
            for name, config in configs.items():
                config = AlignConfig.model_validate(config.model_dump())
                numbers = _measure(config, pairs, classifier, seed)
                results.setdefault(size_text, {}).setdefault(name, {})[str(seed)] = numbers
                print(f"n={size_text} seed={seed} {name}: top1_auc {100 * numbers['top1_auc']:.2f} map_auc "
                      f"{100 * numbers['map_auc']:.2f} top1_0 {100 * numbers['top1_0']:.2f} "
                      f"({numbers['steps']} steps, best epoch {numbers['best_epoch']}/{numbers['epochs']}, "
                      f"log sigma^2 {numbers['log_sigma2_last']:.2f}, {numbers['seconds']:.0f} s)", flush=True)
                out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    lines = ["# Map training ablation (held-out feature pairs only)", "",
             "Mean over seeds " + ", ".join(map(str, args.seeds)) + "; in %. Simulated 12-point curve on the held-out "
             "pairs: sigma order for maps with an uncertainty head, random for the l2 map.", "",
             "| train_per_class | variant | top1_auc | map_auc | top-1 at 0% | minus l2: top1_auc | minus l2: map_auc |",
             "|---|---|---|---|---|---|---|"]
    for size_text, rows in results.items():
        ref = rows["l2 only (FCT)"]
        mean = {name: {k: np.mean([r[k] for r in per.values()]) for k in ("top1_auc", "map_auc", "top1_0")}
                for name, per in rows.items()}
        for name, m in mean.items():
            lines.append(f"| {size_text} | {name} | {100 * m['top1_auc']:.2f} | {100 * m['map_auc']:.2f} | "
                         f"{100 * m['top1_0']:.2f} | {100 * (m['top1_auc'] - mean['l2 only (FCT)']['top1_auc']):+.2f} | "
                         f"{100 * (m['map_auc'] - mean['l2 only (FCT)']['map_auc']):+.2f} |")
        del ref
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
