"""A team's upgrade between two models of its own, without labels: is the advisor's stated error
right, and why does the map check fall back? Measured on three data sets.

The team's pair is ``benchmarks/disc_term_study``'s (an ONNX MobileNetV3-Small, old, trained on
classes 0-4 only; a torchvision ResNet-18, new, all classes; both trained briefly here and run
through the product's embedders) on two data sets made into RGB photos: ``fashion``
(Fashion-MNIST) and ``bars`` (the synthetic bars). A third data set has a pair of its own:
``shapes`` (``benchmarks/team_shapes``: ten kinds of shape drawn in random colours, positions,
sizes and tilts on random backgrounds), old a ShuffleNetV2 x0.5 as ONNX at its 1,024-d pooled
features, new an EfficientNet-B0 through the product's torchvision embedder (1,280-d).
``--pipeline ARTIFACTS:DATA`` adds another: the pipeline's own two models on the Fashion-MNIST
test split (a ``fastfill run``'s output).

For each data set, the gallery is ``--gallery`` items and the upgrade is carried out as the
product does without labels, at the array level (no server, no store):

1. **The map.** The map sample is ``gallery.upgrade.map_sample`` items of the gallery
   (``map_sample_size``: the whole of a gallery under 5,000); the disc term's classes are the
   product's K-means pseudo-classes of their new features (``cluster_classes``, K = 50); the
   FastFill map trains on them (``align.fastfill``) and the product's map check
   (``decide_map``) trains its l2-only reference on the same pairs and decides which map the
   upgrade uses, and in which order. Beside it, measured against the hidden labels over the
   whole gallery (top1_auc / map_auc, %): the l2-only map in random order, the FastFill map in
   random and in sigma order, and the map the check chose, so the check's choice can be read
   against what each map is worth (its map quality and its order separately) and against the
   check's own resolution (the standard error of its top-1 on the held-out pairs).
2. **The advisor against the gate.** For ``--draws`` draws, each of ``--judged`` judged queries
   (gallery items, judged relevant to every other item of their class: class-level judgments)
   and an evaluation sample of ``--eval`` items: the advisor's predicted top-1 every 5%
   (``predict_judged``, the judged queries against the sample) against the gate's measured curve
   (``measure_judged_gate``, the judged queries against the whole mixed gallery at the same
   fractions), for the map and order the check chose. Reported: the mean miss (predicted minus
   measured, points), the mean absolute miss, the stated standard error, and how often the miss
   is within one and two stated standard errors (nominal 68% and 95%).

Writes ``<out>.md`` and ``<out>.json`` (default ``reports/team_advisor_map``).

    .venv/bin/python benchmarks/team_advisor_map.py
    .venv/bin/python benchmarks/team_advisor_map.py --datasets fashion --draws 4 --eval 500   # quicker
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.disc_term_study import ROOT, arguments, data, embedders, features, study_configs  # noqa: E402
from benchmarks.team_own_models import NEW, OLD  # noqa: E402
from benchmarks.team_shapes import NEW as SHAPES_NEW  # noqa: E402
from benchmarks.team_shapes import OLD as SHAPES_OLD  # noqa: E402
from benchmarks.team_shapes import embedders as shapes_embedders  # noqa: E402

Z = {"1 s.e.": 1.0, "2 s.e.": 2.0}
PAIRS = {"shapes": (f"{SHAPES_OLD['architecture']} (ONNX)", f"{SHAPES_NEW['architecture']} (torchvision)")}
TEAM_PAIR = (f"{OLD['architecture']} (ONNX, classes 0-4)", f"{NEW['architecture']} (torchvision)")


def team_features(name: str, train_items: int, gallery: int, epochs: int, seed: int, cache: Path | None,
                  penultimate: bool = False) -> dict:
    """The team's pair on ``name``'s photos: old and new features of the gallery, and its hidden
    labels; with ``penultimate``, the old model's 1,024-d features instead of its 5 logits."""
    tag = "-1024" if penultimate else ""
    path = cache / f"{name}-{train_items}-{gallery}-{epochs}-{seed}{tag}.npz" if cache else None
    if path is not None and path.is_file():
        with np.load(path) as arrays:
            return {k: arrays[k] for k in arrays.files}
    (train_images, train_labels), _, (gallery_images, labels) = data(name, train_items, 0, gallery, seed)
    if name == "shapes":  # its own pair (team_shapes), the old model's penultimate features
        old_model, new_model, accuracy = shapes_embedders(train_images, train_labels, epochs, seed)
    else:
        old_model, new_model, accuracy = embedders(train_images, train_labels, epochs, seed, penultimate)
    result = {"old": features(old_model, gallery_images, seed + 1), "new": features(new_model, gallery_images, seed + 1),
              "labels": labels, "old_accuracy": np.float64(accuracy["old_accuracy"]),
              "new_accuracy": np.float64(accuracy["new_accuracy"])}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, **result)
    return result


def pipeline_features(spec: str, gallery: int, seed: int) -> dict:
    """The pipeline's old and new models on its test split (ARTIFACTS:DATA), ``gallery`` items of it."""
    from fastfill.components.experiment.data import load_split

    artifacts, folder = (Path(p) for p in spec.split(":"))
    labels = load_split(folder / "splits", "test").labels
    chosen = np.sort(np.random.default_rng(seed).choice(len(labels), size=min(gallery, len(labels)), replace=False))
    return {"old": np.load(artifacts / "features" / "old" / "test.npy")[chosen],
            "new": np.load(artifacts / "features" / "new" / "test.npy")[chosen], "labels": labels[chosen]}


def curve_of(new: np.ndarray, transformed: np.ndarray, labels: np.ndarray, order: np.ndarray) -> dict:
    from fastfill.components.evaluation.retrieval import backfill_curve

    measured = backfill_curve(new, new, transformed, labels, order)
    return {"top1_auc": round(100 * measured.top1_auc, 2), "map_auc": round(100 * measured.map_auc, 2),
            "top1_0": round(100 * float(measured.top1[0]), 2), "top1_100": round(100 * float(measured.top1[-1]), 2)}


def upgrade_map(feats: dict, map_sample: int, seed: int) -> dict:
    """The map the upgrade trains and checks on the gallery's own pairs, and every map's worth."""
    import torch

    from fastfill.components.evaluation.ordering import random_order, sigma_order
    from fastfill.components.experiment.inference import apply_alignment
    from fastfill.components.experiment.map_check import decide_map, held_out
    from fastfill.components.experiment.map_training import train_alignment
    from fastfill.components.gallery.upgrade.pairs import map_sample_size, sample_positions
    from fastfill.components.gallery.upgrade.pseudo_classes import cluster_classes

    fastfill, _ = study_configs()
    old, new, labels = feats["old"], feats["new"], feats["labels"]
    n = len(labels)
    sample = sample_positions(n, map_sample_size(map_sample, map_sample, n), seed)
    rows, head, k = cluster_classes(new[sample], 50, seed)
    cpu = torch.device("cpu")
    training = (old[sample], new[sample], rows)
    started = time.perf_counter()
    candidate, _ = train_alignment(fastfill, *training, head, device=cpu, log=lambda *_: None, method="fastfill")
    decision = decide_map("fastfill", fastfill, candidate, training, lambda: None, head, order="sigma", device=cpu)
    seconds = time.perf_counter() - started
    held = held_out(fastfill, *training, "fastfill")
    maps = {}
    ff_transformed, ff_sigma = apply_alignment(candidate.eval(), old, device=cpu)
    ref_transformed, _ = apply_alignment(decision.reference.eval(), old, device=cpu)
    random = random_order(n, seed)
    maps["l2-only map, random"] = curve_of(new, ref_transformed, labels, random)
    maps["FastFill map, random"] = curve_of(new, ff_transformed, labels, random)
    maps["FastFill map, sigma"] = curve_of(new, ff_transformed, labels, sigma_order(ff_sigma))
    used_transformed, used_sigma = apply_alignment(decision.map.eval(), old, device=cpu)
    used_order = sigma_order(used_sigma) if decision.order == "sigma" and used_sigma is not None else random
    used = f"{decision.use} ({decision.order})"
    maps[f"used: {used}"] = curve_of(new, used_transformed, labels, used_order)
    record = decision.record or {}
    held_items = len(held.rows) if held is not None else 0
    return {"map_sample": int(len(sample)), "pseudo_classes": int(k), "held_out": held_items, "seconds": seconds,
            "check": record.get("message", decision.skipped), "used": used, "maps": maps,
            "transformed": used_transformed, "order": used_order}


def cached_upgrade(feats: dict, map_sample: int, seed: int, path: Path | None) -> dict:
    """``upgrade_map``'s result, kept at ``path`` between runs (the maps take minutes to train)."""
    import pickle

    if path is not None and path.is_file():
        return pickle.loads(path.read_bytes())
    upgrade = upgrade_map(feats, map_sample, seed)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pickle.dumps(upgrade))
    return upgrade


def judgments_of(labels: np.ndarray, queries: int, rng) -> object:
    """``queries`` gallery items as judged queries, each relevant to every other item of its class."""
    from fastfill.components.gallery.inputs.judgments import Judgments

    positions = np.sort(rng.choice(len(labels), size=queries, replace=False))
    relevant = [np.setdiff1d(np.flatnonzero(labels == labels[p]), [p]) for p in positions]
    return Judgments("class-level", positions, [None] * queries, relevant)


def calibration(feats: dict, transformed: np.ndarray, order: np.ndarray, judged: int, eval_size: int,
                draws: int) -> dict:
    """The advisor's judged prediction against the gate's measured curve, ``draws`` times."""
    from fastfill.components.gallery.advice.advisor import judged_anchor, predict_judged, ranks_of
    from fastfill.components.gallery.gate.judged_gate import measure_judged_gate
    from fastfill.components.gallery.upgrade.planning import eval_sample

    old, new, labels = feats["old"], feats["new"], feats["labels"]
    n = len(labels)
    misses, errors, rows = [], [], []
    for draw in range(draws):
        rng = np.random.default_rng([draw, 50])
        judgments = judgments_of(labels, judged, rng)
        q = judgments.query_positions
        gate = measure_judged_gate(old[q], old, new[q], new, transformed, judgments, order, curve_points=19)
        positions = eval_sample(None, eval_size, draw, n)
        anchor = judged_anchor(new[q], judgments, [(0, transformed)])
        predicted = predict_judged(new[q], judgments, positions, new[positions], transformed[positions],
                                   ranks_of(order, positions), n, anchor)
        measured = 100 * np.asarray(gate["top1"])
        top1, se = 100 * np.asarray(predicted["top1"]), 100 * np.asarray(predicted["top1_se"])
        queries_se = 100 * np.asarray(predicted["top1_se_queries"])
        misses.append((top1 - measured)[1:])  # 0% is measured exactly (the anchor): not a prediction
        errors.append((se[1:], queries_se[1:]))
        rows.append({"draw": draw, "measured": measured.round(2).tolist(), "predicted": top1.round(2).tolist(),
                     "se": se.round(2).tolist(), "se_queries": queries_se.round(2).tolist(),
                     "error_scale": predicted["error_scale"]})
    miss = np.asarray(misses)
    se, queries_se = (np.asarray([e[i] for e in errors]) for i in (0, 1))
    return {"eval": eval_size, "judged": judged, "draws": draws, "mean_miss": float(miss.mean()),
            "mean_abs_miss": float(np.abs(miss).mean()), "worst_miss": float(miss.flat[np.abs(miss).argmax()]),
            "mean_se": float(se.mean()), "mean_se_queries": float(queries_se.mean()),
            "within": {name: float(np.mean(np.abs(miss) <= z * se)) for name, z in Z.items()},
            "within_queries_only": {name: float(np.mean(np.abs(miss) <= z * queries_se)) for name, z in Z.items()},
            "draws_detail": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", default="fashion,bars,shapes")
    parser.add_argument("--pipeline", default=None, help="ARTIFACTS:DATA of a fastfill run: its models as a data set")
    parser.add_argument("--train-items", type=int, default=6000)
    parser.add_argument("--gallery", type=int, default=3000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--map-sample", type=int, default=5000, help="gallery.upgrade.map_sample")
    parser.add_argument("--judged", type=int, default=200)
    parser.add_argument("--eval", type=int, nargs="+", default=[500, 2000], help="gallery.upgrade.eval_queries")
    parser.add_argument("--draws", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/fastfill-team-features"),
                        help="where the team's features are kept between runs")
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "team_advisor_map")
    args = parser.parse_args(argv)
    study_configs()
    results, started = [], time.perf_counter()
    sets = [(name, None) for name in args.datasets.split(",") if name] + ([("pipeline", args.pipeline)]
                                                                          if args.pipeline else [])
    for name, spec in sets:
        feats = (pipeline_features(spec, args.gallery, args.seed) if spec else
                 team_features(name, args.train_items, args.gallery, args.epochs, args.seed, args.cache))
        cache = args.cache / f"{name}-map-{args.map_sample}-{args.seed}.pkl" if args.cache and not spec else None
        upgrade = cached_upgrade(feats, args.map_sample, args.seed, cache)
        print(f"{name}: map sample {upgrade['map_sample']}, check: {upgrade['check']}; used {upgrade['used']}", flush=True)
        for label, worth in upgrade["maps"].items():
            print(f"  {label}: top1_auc {worth['top1_auc']} map_auc {worth['map_auc']}", flush=True)
        runs = []
        for eval_size in args.eval:
            result = calibration(feats, upgrade["transformed"], upgrade["order"], args.judged, eval_size, args.draws)
            print(f"  advisor, eval {eval_size}: mean miss {result['mean_miss']:+.2f}, |miss| "
                  f"{result['mean_abs_miss']:.2f}, s.e. {result['mean_se']:.2f}, within 1/2 s.e. "
                  f"{100 * result['within']['1 s.e.']:.0f}% / {100 * result['within']['2 s.e.']:.0f}% (queries-only "
                  f"s.e. {result['mean_se_queries']:.2f}: {100 * result['within_queries_only']['1 s.e.']:.0f}% / "
                  f"{100 * result['within_queries_only']['2 s.e.']:.0f}%)", flush=True)
            runs.append(result)
        results.append({"dataset": name, "items": int(len(feats["labels"])),
                        **{k: v for k, v in upgrade.items() if k not in ("transformed", "order")},
                        "accuracy": {k: float(feats[k]) for k in ("old_accuracy", "new_accuracy") if k in feats},
                        "models": list(PAIRS.get(name, TEAM_PAIR)) if not spec else ["pipeline old", "pipeline new"],
                        "dims": [int(feats["old"].shape[1]), int(feats["new"].shape[1])],
                        "advisor": runs})
    report = {"arguments": arguments(args), "seconds": time.perf_counter() - started, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0


def markdown(report: dict) -> str:
    args = report["arguments"]
    lines = ["# A team's upgrade without labels: the map check's choice and the advisor's error", "",
             f"`benchmarks/team_advisor_map.py` ({report['seconds']:.0f} s on 2 CPU cores); gallery "
             f"{args['gallery']} items, map sample `gallery.upgrade.map_sample` {args['map_sample']}, K-means "
             f"pseudo-classes, {args['judged']} judged queries (class-level), {args['draws']} draws.", "",
             "## The team's models (held-out accuracy: 10% of the training photos, %)", "",
             "| data set | old model | new model | dims, old -> new | old accuracy | new accuracy |",
             "|---|---|---|---|---|---|"]
    for r in report["results"]:
        models, dims, accuracy = r.get("models", ["", ""]), r.get("dims", ["", ""]), r.get("accuracy", {})
        lines.append(f"| {r['dataset']} | {models[0]} | {models[1]} | {dims[0]} -> {dims[1]} | "
                     f"{accuracy.get('old_accuracy', '')} | {accuracy.get('new_accuracy', '')} |")
    lines += ["",
             "## What each map is worth (hidden labels, whole gallery; top1_auc / map_auc, top-1 at 0% and 100%, %)", "",
             "| data set | map sample | held out | check | used | l2-only, random | FastFill, random | FastFill, sigma | used |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        cells = []
        for worth in r["maps"].values():
            cells.append(f"{worth['top1_auc']:.2f} / {worth['map_auc']:.2f} ({worth['top1_0']:.1f} -> {worth['top1_100']:.1f})")
        lines.append(f"| {r['dataset']} | {r['map_sample']} | {r['held_out']} | {r['check']} | {r['used']} | "
                     + " | ".join(cells) + " |")
    lines += ["", "## The advisor's judged top-1 against the gate's measured curve (every 5% from 5%, points)", "",
              "Stated s.e.: the advisor's (the queries' sampling and the sample's own draw, measured on its halves); "
              "queries only: without the sample's draw (the previous release's). Within: the share of (draw, point) "
              "pairs whose miss is within 1 or 2 of that s.e. (nominal 68% and 95%).", "",
              "| data set | eval sample | mean miss | mean abs miss | worst miss | stated s.e. | within 1 / 2 s.e. | "
              "queries-only s.e. | within 1 / 2 of it |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        for a in r["advisor"]:
            lines.append(f"| {r['dataset']} | {a['eval']} | {a['mean_miss']:+.2f} | {a['mean_abs_miss']:.2f} | "
                         f"{a['worst_miss']:+.2f} | {a['mean_se']:.2f} | {100 * a['within']['1 s.e.']:.0f}% / "
                         f"{100 * a['within']['2 s.e.']:.0f}% | {a['mean_se_queries']:.2f} | "
                         f"{100 * a['within_queries_only']['1 s.e.']:.0f}% / "
                         f"{100 * a['within_queries_only']['2 s.e.']:.0f}% |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
