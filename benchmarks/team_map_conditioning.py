"""FastFill's map on a team's own models: does its loss learn whatever the features' scale, does
it match the l2-only map, does its sigma order beat random, does the mixed gallery mix, and how
long does it train? Side by side on team pairs.

Pairs (old -> new features of one gallery, with hidden labels):

- ``fashion`` and ``bars``: ``benchmarks/team_advisor_map``'s team pair (an ONNX MobileNetV3-Small,
  old, and a torchvision ResNet-18, new, trained briefly here) on two data sets made into photos
  (``team_features``; features cached under ``--cache``): the old model's ONNX graph ends in its
  5 logits, as that benchmark's does;
- ``fashion-1024`` and ``bars-1024``: the same models with the old one exported at its 1,024-d
  penultimate features, as a team exports a MobileNetV3 for retrieval (1,024 -> 512);
- ``wide``: a synthetic pair with another dimension ratio and scale: latent class structure (a
  class centre plus noise in 32 dimensions), old = a random two-layer projection to 256
  dimensions times 30, new = another to 1024 dimensions times 0.05, neither normalized: the new
  model is four times wider than the old one and its features are 600 times smaller.

For each pair and seed, as an upgrade does it without labels: a map sample of ``--map-sample``
gallery items, the product's K-means pseudo-classes of their new features (``cluster_classes``,
K = 50) as the held-out check's classes, and the maps trained on it with align.fastfill /
align.fct of params.yaml: **after**, the FastFill map as an upgrade trains it now
(``AlignConfig.for_upgrade``: conditioned features, early stopping, psi beside the map
(``separate``), the disc term off on pseudo-classes: gallery.upgrade.pseudo_disc false);
**pseudo disc**, the same with the disc term on the pseudo-classes; **before**, the FastFill map as
the pipeline trains it (no conditioning, the joint weighting, the min_steps schedule; only the
``--before-seeds``); **l2-only**, the check's reference. Then the map check (``decide_map``) as the
upgrade runs it between after and l2-only: which map it uses, in which order. Without a disc term
the after map's network trains exactly as the l2-only map (``map_check.shares_reference``, proven
bit for bit by tests/unit/test_map_conditioning.py): the seeds of ``--train-reference`` train the
l2-only map all the same (its numbers must equal after's), the others take after's network.

Measured on the gallery items outside the map sample (queries their new features, the gallery
their h(old), the hidden labels): top-1 and mAP at 0% backfill (%); the backfill's top1_auc and
map_auc in random and (with a head) sigma order; whether the mixed gallery mixes (``mixing``: at
10% to 90% backfilled, the share of mapped items among each query's top-10 answers against their
share among its relevant items); the epochs trained and the kept one; the training's wall time;
the l2 term of the first epochs; whether training diverged.

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
    """The maps' settings: the FastFill map as an upgrade trains it on pairs whose classes are
    pseudo-classes (``AlignConfig.for_upgrade``, the disc term off: gallery.upgrade.pseudo_disc
    false), the same with the disc term on the pseudo-classes, the pipeline's FastFill map
    (before: no conditioning, its joint weighting and min_steps schedule), and the l2-only map the
    check trains."""
    from fastfill.components.experiment.map_check import reference_config

    after = fastfill.for_upgrade()
    return {"FastFill, before": fastfill.model_copy(update={"conditioning": "off"}),
            "FastFill, after": after.model_copy(update={"disc": False}),
            "FastFill, pseudo disc": after, "l2-only": reference_config(after)}


def one_pair(feats: dict, map_sample: int, seed: int, fastfill, fct, before: bool = True,
             train_reference: bool = False, pseudo: bool = True) -> dict:
    """The maps of one pair and seed, each measured on the items outside the map sample, and the
    map check's choice between them as the upgrade makes it."""
    import torch

    from fastfill.components.experiment.inference import apply_alignment
    from fastfill.components.experiment.map_check import decide_map, own_reference
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
    trained = {}
    for name, config in maps_of(fastfill.model_copy(update={"seed": seed}), fct).items():
        if (name.endswith("before") and not before) or (name.endswith("pseudo disc") and not pseudo):
            continue
        lines: list[str] = []
        started = time.perf_counter()
        if name == "l2-only" and not train_reference:  # the after map's network, bit for bit (see the docstring)
            h, history = own_reference(trained["FastFill, after"][1]), trained["FastFill, after"][2]
        else:
            h, history = train_alignment(config, old[sample], new[sample], rows, head, device=cpu,
                                         log=lines.append, method="fastfill")
        seconds = time.perf_counter() - started
        trained[name] = (config, h, history)
        transformed, sigma = apply_alignment(h.eval(), old[rest], device=cpu)
        finite = bool(np.isfinite(transformed).all())
        measured = retrieval_at_zero(transformed, new[rest], labels[rest]) if finite else {"top1": np.nan, "map": np.nan}
        kept = [r["epoch"] for r in history if r.get("best")]
        out["maps"][name] = {
            "top1_0": round(100 * measured["top1"], 2), "map_0": round(100 * measured["map"], 2),
            "epochs": len(history), "kept_epoch": kept[0] if kept else None, "seconds": round(seconds, 2),
            "diverged": next((r["diverged"]["reason"] for r in history if "diverged" in r), None),
            "l2_first_epochs": [round(r["l2"], 4) for r in history[:6]],
            "log_sigma2_first_epochs": [round(r.get("log_sigma2", 0.0), 3) for r in history[:6]],
            "val_top1_kept": round(100 * history[kept[0] - 1]["val_top1"], 2) if kept else None,
            "orders": backfill_orders(new[rest], transformed, labels[rest], sigma, seed) if finite else {}}
    config, candidate, _ = trained["FastFill, after"]
    started = time.perf_counter()
    decision = decide_map("fastfill", config, candidate, (old[sample], new[sample], rows),
                          lambda: trained["l2-only"][1], head, order="sigma", device=cpu)
    transformed, sigma = apply_alignment(decision.map.eval(), old[rest], device=cpu)
    order = "sigma" if decision.order == "sigma" and sigma is not None else "random"
    out["check"] = {"use": decision.use, "order": order, "seconds": round(time.perf_counter() - started, 2),
                    "message": (decision.record or {}).get("message", decision.skipped),
                    **backfill_orders(new[rest], transformed, labels[rest], sigma, seed)[order]}
    return out


def backfill_orders(new: np.ndarray, transformed: np.ndarray, labels: np.ndarray, sigma, seed: int) -> dict:
    """The backfill's top1_auc and map_auc (%) over the measured items, in random order and, for a
    map with a sigma head, in sigma order (most uncertain first); and whether the mixed gallery
    mixes along each (``mixing``)."""
    from fastfill.components.evaluation.ordering import random_order, sigma_order
    from fastfill.components.evaluation.retrieval import backfill_curve

    orders = {"random": random_order(len(labels), seed)}
    if sigma is not None:
        orders["sigma"] = sigma_order(sigma)
    out = {}
    for name, order in orders.items():
        measured = backfill_curve(new, new, transformed, labels, order)
        out[name] = {"top1_auc": round(100 * measured.top1_auc, 2), "map_auc": round(100 * measured.map_auc, 2),
                     "mixing": mixing(new, transformed, labels, order)}
    return out


MIXING_FRACTIONS = (0.1, 0.25, 0.5, 0.75, 0.9)


def mixing(new: np.ndarray, transformed: np.ndarray, labels: np.ndarray, order: np.ndarray, k: int = 10) -> list:
    """Does the mixed gallery mix? At each backfilled fraction of ``MIXING_FRACTIONS`` (the first
    items of ``order`` re-embedded, the rest h(old)), each item's new features as a query against
    the other items: the share of mapped items among the top-``k`` answers, and among the items
    relevant to the query (its class). A gallery that mixes answers from mapped items about as
    often as they are relevant; where the mapped share of answers is far lower, the queries search
    the re-embedded items alone and h(old) buys nothing."""
    n = len(labels)
    queries = new.astype(np.float64)
    same = labels[:, None] == labels[None, :]
    np.fill_diagonal(same, False)
    out = []
    for fraction in MIXING_FRACTIONS:
        mapped = np.ones(n, dtype=bool)
        mapped[order[:round(fraction * n)]] = False
        gallery = np.where(mapped[:, None], transformed, new).astype(np.float64)
        distances = (queries ** 2).sum(1)[:, None] - 2 * queries @ gallery.T + (gallery ** 2).sum(1)[None, :]
        np.fill_diagonal(distances, np.inf)
        top = np.argpartition(distances, k, axis=1)[:, :k]
        relevant = (same * mapped[None, :]).sum() / max(same.sum(), 1)
        out.append({"backfilled": fraction, "answers": round(100 * float(mapped[top].mean()), 2),
                    "relevant": round(100 * float(relevant), 2)})
    return out


def _flat(numbers: dict) -> dict:
    """A map's numbers of one run that the summary averages over seeds."""
    out = {key: numbers[key] for key in ("top1_0", "map_0", "epochs", "kept_epoch", "seconds")}
    for order, measured in numbers.get("orders", {}).items():
        out.update({f"{order}_top1_auc": measured["top1_auc"], f"{order}_map_auc": measured["map_auc"]})
    return out


def summary(runs: list[dict]) -> dict:
    """Mean and standard error over seeds of each map's numbers, per pair; the check's choices."""
    table: dict = {}
    for run in runs:
        maps = {**run["maps"], "check's choice": run["check"]}
        for name, numbers in maps.items():
            row = table.setdefault(run["pair"], {}).setdefault(name, {})
            if name == "check's choice":
                flat = {"top1_auc": numbers["top1_auc"], "map_auc": numbers["map_auc"], "seconds": numbers["seconds"]}
                row.setdefault("choices", []).append(f"{numbers['use']} ({numbers['order']})")
            else:
                flat = _flat(numbers)
                row.setdefault("diverged", []).append(numbers["diverged"] is not None)
            for key, value in flat.items():
                row.setdefault(key, []).append(value if value is not None else np.nan)
            row.setdefault("seeds", []).append(run["seed"])
    out: dict = {}
    for pair, maps in table.items():
        for name, row in maps.items():
            entry = {}
            for key, values in row.items():
                if key in ("diverged", "seeds", "choices"):
                    entry[key] = int(sum(values)) if key == "diverged" else list(values)
                    continue
                values = np.asarray(values, dtype=float)
                entry[key] = round(float(np.nanmean(values)), 2)
                entry[f"{key}_se"] = round(float(np.nanstd(values, ddof=1) / np.sqrt(len(values))), 2) \
                    if len(values) > 1 else None
            out.setdefault(pair, {})[name] = entry
    return out


def _with_se(entry: dict, key: str) -> str:
    if key not in entry:
        return "-"
    se = entry.get(f"{key}_se")
    return f"{entry[key]:.2f}" + (f" ± {se:.2f}" if se is not None else "")


def write_report(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    args = report["arguments"]
    lines = ["# FastFill's map on team pairs", "",
             f"`.venv/bin/python benchmarks/team_map_conditioning.py {report['command']}` "
             f"({report['seconds']:.0f} s on 2 CPU cores); seeds {args['seeds']}; map sample "
             f"{args['map_sample']} gallery items, pseudo-classes K-means K = 50; measured on the gallery items outside "
             "the map sample (queries: their new features; gallery: h(old); hidden labels).", "",
             "Maps: **after** = align.fastfill as an upgrade trains it now (`AlignConfig.for_upgrade`: conditioning "
             "scale, patience 10, psi beside the map (`separate`), the disc term off on pseudo-classes); **pseudo "
             "disc** = the same with the disc term on the pseudo-classes; **before** = align.fastfill as the "
             "pipeline trains it (no conditioning, joint weighting, the min_steps schedule); **l2-only** = the "
             "upgrade check's reference, trained as after; **check's choice** = what the map check "
             "(`decide_map`) uses between after and l2-only, in its order.", "",
             "Means over the seeds (± standard error over seeds where more than one); AUCs of the backfill curve "
             "(top1_auc / map_auc) in random and sigma order.", "",
             "| pair (old -> new dims, mean squared norm new) | map | top-1 at 0% | mAP at 0% | top1_auc random | "
             "top1_auc sigma | map_auc random | map_auc sigma | epochs (kept) | train s | diverged |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    shapes = {run["pair"]: run for run in report["runs"]}
    for pair, maps in report["summary"].items():
        run = shapes[pair]
        label = f"{pair} ({run['old_dim']} -> {run['new_dim']}, {run['new_squared_norm']:.3g})"
        for name, entry in maps.items():
            if name == "check's choice":
                lines.append(f"| {label} | check's choice: {', '.join(entry['choices'])} | - | - | "
                             f"{_with_se(entry, 'top1_auc')} (its order) | | {_with_se(entry, 'map_auc')} (its order) "
                             f"| | - | {entry['seconds']:.1f} (check) | - |")
                continue
            lines.append(f"| {label} | {name} | {_with_se(entry, 'top1_0')} | {_with_se(entry, 'map_0')} | "
                         f"{_with_se(entry, 'random_top1_auc')} | {_with_se(entry, 'sigma_top1_auc')} | "
                         f"{_with_se(entry, 'random_map_auc')} | {_with_se(entry, 'sigma_map_auc')} | "
                         f"{entry['epochs']:.0f} ({entry['kept_epoch']:.0f}) | {entry['seconds']:.1f} | "
                         f"{entry['diverged']}/{len(entry['seeds'])} |")
    lines += ["", "## Does the mixed gallery mix? (seed " + str(args["seeds"][0]) + ")", "",
              "At each backfilled share, the share (%) of mapped items among the queries' top-10 answers, against "
              "their share among the queries' relevant items (answers / relevant).", "",
              "| pair | map, order | " + " | ".join(f"{round(100 * f)}% backfilled" for f in MIXING_FRACTIONS) + " |",
              "|---|---|" + "---|" * len(MIXING_FRACTIONS)]
    for run in report["runs"]:
        if run["seed"] != args["seeds"][0]:
            continue
        for name, numbers in run["maps"].items():
            for order, measured in numbers.get("orders", {}).items():
                cells = [f"{m['answers']:.1f} / {m['relevant']:.1f}" for m in measured["mixing"]]
                lines.append(f"| {run['pair']} | {name}, {order} | " + " | ".join(cells) + " |")
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
    lines += ["", "## The check's decisions", "", "| pair | seed | uses | its message |", "|---|---|---|---|"]
    for run in report["runs"]:
        check = run["check"]
        lines.append(f"| {run['pair']} | {run['seed']} | {check['use']} ({check['order']}) | "
                     f"{str(check['message']).replace('|', '/')[:300]} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", default="fashion,fashion-1024,bars,bars-1024,wide")
    parser.add_argument("--train-items", type=int, default=4000, help="team_features: images the team's models train on")
    parser.add_argument("--gallery", type=int, default=2000, help="gallery items of each pair")
    parser.add_argument("--epochs", type=int, default=2, help="team_features: the team's models' training epochs")
    parser.add_argument("--map-sample", type=int, default=1000, help="gallery.upgrade.map_sample")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--before-seeds", type=int, nargs="*", default=[0],
                        help="the seeds that also train the map as before (its 500-epoch schedule is the slow part)")
    parser.add_argument("--pseudo-seeds", type=int, nargs="*", default=[0, 1, 2],
                        help="the seeds that also train the map with the disc term on pseudo-classes")
    parser.add_argument("--train-reference", type=int, nargs="*", default=[0],
                        help="the seeds that train the l2-only map (the others take the after map's network, which "
                             "is the same bit for bit)")
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
                 team_features(pair.removesuffix("-1024"), args.train_items, args.gallery, args.epochs, 0, args.cache,
                               penultimate=pair.endswith("-1024")))
        for seed in args.seeds:
            result = one_pair(feats, args.map_sample, seed, fastfill, fct, before=seed in args.before_seeds,
                              train_reference=seed in args.train_reference, pseudo=seed in args.pseudo_seeds)
            runs.append({"pair": pair, "seed": seed, **result})
            print(pair, seed, json.dumps({k: (v["top1_0"], v["map_0"], v["epochs"], v["kept_epoch"], v["seconds"],
                                              v["diverged"]) for k, v in result["maps"].items()}),
                  result["check"]["use"], result["check"]["order"], flush=True)
    report = {"arguments": arguments(args), "command": " ".join(sys.argv[1:] if argv is None else argv),
              "seconds": time.perf_counter() - started, "runs": runs, "summary": summary(runs)}
    write_report(report, args.out)
    print(f"wrote {args.out}.md and {args.out}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
