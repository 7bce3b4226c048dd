"""Where should an upgrade's map learn from: the pipeline's training split, or the gallery itself?

For a finished pipeline run (its old and new models' features of the new-train and test
splits), the test split plays the gallery (query = gallery, self excluded, as the evaluation
protocol). For each seed and each source of pairs this does what `fastfill upgrade` does:

- ``splits``: the FastFill map trains on the new-train split's pairs (labels as the disc
  term's targets) and is checked on its held-out pairs;
- ``gallery f (targets)``: a seeded sample of a fraction f of the gallery (map_sample f,
  map_sample_min 0), old features and new ones; the disc term's targets are the labels, the
  new model's predicted classes, or none (disc off); the check holds out pairs of the same
  sample (its truth: the labels, or the predicted classes without labels). The sampled items'
  new features are kept as backfilled: the backfill starts with them, then goes on in the
  map's order.

Each row reports the map check's verdict and the map the upgrade would use (the FastFill map
when it is kept, the check's fallback otherwise), and FastFill-sigma minus FCT-random on the
gallery: top1_auc and map_auc of the used map in its order against the l2-only map (trained on
the same pairs) in random order, both with the same sampled items backfilled first.

    .venv/bin/python benchmarks/map_source.py --seeds 0 1 2
    .venv/bin/python benchmarks/open_class.py --unseen 6 7 8 9 --train-per-class all --seed 0
    .venv/bin/python benchmarks/map_source.py --run runs/open-class/nall/seed-0 --data runs/open-class/nall/data \
        --name open-class --seeds 0

Writes reports/map_source[-<name>].{md,json}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastfill.components.evaluation import backfill_curve  # noqa: E402
from fastfill.components.evaluation.ordering import random_order, sigma_order  # noqa: E402
from fastfill.components.experiment.data import load_split  # noqa: E402
from fastfill.components.experiment.inference import apply_alignment  # noqa: E402
from fastfill.components.experiment.map_check import check_map, fallback_map, held_out, reference_config  # noqa: E402
from fastfill.components.experiment.map_training import train_alignment  # noqa: E402
from fastfill.components.experiment.models import load_embedder  # noqa: E402
from fastfill.components.gallery.upgrade.pairs import class_targets, sample_positions  # noqa: E402
from fastfill.components.gallery.upgrade.planning import front_loaded  # noqa: E402
from fastfill.components.platform.config import load_params  # noqa: E402
from fastfill.components.platform.layout import Layout, load_array  # noqa: E402


def _quiet(_: str) -> None:
    pass


def used_map(method_config, pairs_training, pairs_checking, classifier, seed: int, distance: str):
    """Train the FastFill map and its l2-only reference on the pairs, check it as the upgrade
    does (policy fallback); returns (the map to use, its order, the reference, the verdict)."""
    config = method_config.model_copy(update={"seed": seed, "check": "fallback"})
    h, _ = train_alignment(config, *pairs_training, classifier, log=_quiet)
    reference, _ = train_alignment(reference_config(config), *pairs_training, classifier, log=_quiet)
    held = held_out(config, *pairs_checking, "fastfill")
    if held is None:
        return h.eval(), "sigma", reference.eval(), {"action": "unchecked", "message": "nothing held out"}
    result = check_map("fastfill", config, h, reference, held, distance=distance).to_dict()
    if result["action"] != "fallback":
        return h.eval(), "sigma", reference.eval(), result
    fitted, _, decision = fallback_map("fastfill", config, reference, pairs_training, held, classifier,
                                       distance=distance)
    order = decision["order"] if decision else "random"
    return fitted.eval(), order, reference.eval(), result


def curve(h, order_kind: str, old: np.ndarray, new: np.ndarray, labels: np.ndarray, prefilled: np.ndarray,
          seed: int, distance: str, points: int) -> dict:
    transformed, log_sigma2 = apply_alignment(h, old)
    order = sigma_order(log_sigma2) if order_kind == "sigma" and log_sigma2 is not None else random_order(len(old), seed)
    if len(prefilled):
        order = front_loaded(order, prefilled)
    c = backfill_curve(new, new, transformed, labels, order, distance=distance, num_intermediate=points)
    return {"top1_auc": float(c.top1_auc), "map_auc": float(c.map_auc), "top1_0": float(c.top1[0]),
            "order": order_kind}


def write_report(rows_out: list[dict], args, n: int) -> list[str]:
    """The table so far (written after every row, so a long run that is stopped keeps its rows)."""
    suffix = f"-{args.name}" if args.name else ""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"map_source{suffix}.json").write_text(json.dumps(rows_out, indent=1))
    lines = [f"Map source{f' ({args.name})' if args.name else ''}: FastFill-sigma minus FCT-random (top1_auc / "
             f"map_auc, points) on the {n}-item gallery, by where the map's pairs come from; `used`: the map the "
             "upgrade uses after its check (fallback: the l2-only map, with a fitted head when its sigma order "
             "helps). Command: `.venv/bin/python benchmarks/map_source.py " + " ".join(sys.argv[1:]) + "`", "",
             "| seed | source | disc targets | pairs | check | used | top1_auc gain | map_auc gain | FastFill top1_auc "
             "| FCT top1_auc | s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows_out:
        lines.append(f"| {r['seed']} | {r['source']} | {r['targets']} | {r['pairs']} | {r['check']} | {r['used']} | "
                     f"{100 * r['gain_top1_auc']:+.2f} | {100 * r['gain_map_auc']:+.2f} | "
                     f"{100 * r['fastfill']['top1_auc']:.2f} | {100 * r['fct']['top1_auc']:.2f} | {r['seconds']} |")
    losing = [r for r in rows_out if (r["gain_top1_auc"] < 0 or r["gain_map_auc"] < 0) and r["check"] != "fallback"]
    lines += ["", f"Rows where the kept FastFill map trails FCT-random in either metric: {len(losing)} of "
              f"{len(rows_out)}" + ("" if not losing else ": " + "; ".join(
                  f"seed {r['seed']} {r['source']} ({r['targets']})" for r in losing))]
    (out / f"map_source{suffix}.md").write_text("\n".join(lines) + "\n")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--run", default=None, help="a pipeline run's root (data/ and artifacts/ under it); "
                                                     "default: the paths of params.yaml")
    parser.add_argument("--data", default=None, help="the run's prepared data folder (default: <run>/data if it "
                                                      "exists, else params.yaml's)")
    parser.add_argument("--name", default="", help="suffix of the report's file names")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.3])
    parser.add_argument("--no-disc-at", type=float, default=0.1, help="the fraction that also gets a no-disc row")
    parser.add_argument("--out", default="reports")
    args = parser.parse_args()

    params = load_params(args.params)
    paths = params.paths
    if args.run:
        root = Path(args.run)
        data = Path(args.data) if args.data else root / "data" if (root / "data").is_dir() else paths.data
        paths = paths.model_copy(update={"data": data, "artifacts": root / "artifacts"})
    layout = Layout(paths)
    distance, points = params.evaluate.distance, params.evaluate.curve_points
    method_config = params.upgrade_map
    new_model = load_embedder(layout.model_dir("new") / "model.pt")
    classifier = new_model.classifier
    import torch

    train_labels = load_split(layout.splits, "new_train").labels
    rows = new_model.class_index(torch.from_numpy(train_labels)).numpy()
    keep = rows >= 0
    split_old = load_array(layout.features("old", "new_train"))[keep]
    split_new = load_array(layout.features("new", "new_train"))[keep]
    gallery_old = load_array(layout.features("old", "test"))
    gallery_new = load_array(layout.features("new", "test"))
    labels = load_split(layout.splits, "test").labels
    n = len(labels)
    print(f"gallery: {n} items; split pairs: {int(keep.sum())}", flush=True)

    rows_out = []
    for seed in args.seeds:
        sources = [("splits", None, "labels")]
        for fraction in args.fractions:
            sources += [(f"gallery {fraction:g}", fraction, "labels"), (f"gallery {fraction:g}", fraction, "predicted")]
            if abs(fraction - args.no_disc_at) < 1e-9:
                sources.append((f"gallery {fraction:g}", fraction, "none"))
        for name, fraction, targets in sources:
            started = time.perf_counter()
            if fraction is None:
                training = checking = (split_old, split_new, rows[keep])
                prefilled = np.zeros(0, dtype=np.int64)
                config = method_config
            else:
                prefilled = sample_positions(n, int(np.ceil(fraction * n)), seed)
                old, new = gallery_old[prefilled], gallery_new[prefilled]
                truth = labels[prefilled] if targets == "labels" else None
                found, targets_from = class_targets(new_model, truth, new)
                disc_rows = found if found is not None else np.zeros(len(old), dtype=np.int64)
                training = (old, new, disc_rows)
                checking = (old, new, labels[prefilled] if targets == "labels" else disc_rows)
                config = method_config.model_copy(update={"disc": False}) if targets == "none" else method_config
            h, order_kind, reference, verdict = used_map(config, training, checking, classifier, seed, distance)
            fastfill = curve(h, order_kind, gallery_old, gallery_new, labels, prefilled, seed, distance, points)
            fct = curve(reference, "random", gallery_old, gallery_new, labels, prefilled, seed, distance, points)
            row = {"seed": seed, "source": name, "targets": targets, "pairs": len(training[0]),
                   "check": verdict["action"], "used": "fastfill" if verdict["action"] != "fallback" else
                   f"fallback ({order_kind} order)", "fastfill": fastfill, "fct": fct,
                   "gain_top1_auc": fastfill["top1_auc"] - fct["top1_auc"],
                   "gain_map_auc": fastfill["map_auc"] - fct["map_auc"],
                   "seconds": round(time.perf_counter() - started, 1), "check_message": verdict.get("message", "")}
            rows_out.append(row)
            write_report(rows_out, args, n)
            print(f"seed {seed} {name} ({targets}): check {row['check']}, used {row['used']}; FastFill-sigma minus "
                  f"FCT-random {100 * row['gain_top1_auc']:+.2f} / {100 * row['gain_map_auc']:+.2f} "
                  f"({row['seconds']} s)", flush=True)

    print("\n".join(write_report(rows_out, args, n)))


if __name__ == "__main__":
    main()
