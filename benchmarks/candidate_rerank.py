"""Candidate reranking (EmbedFlow's way) against FastFill, over data sizes and seeds, and G(K).

    .venv/bin/python benchmarks/candidate_rerank.py                 # run the sweep, then measure
    .venv/bin/python benchmarks/candidate_rerank.py --resume        # reuse the runs that finished
    .venv/bin/python benchmarks/candidate_rerank.py --report-only   # run nothing new

The runs are the data-size sweep's, as benchmarks/shadow_index.py makes them (`fastfill sweep
--size 1000 --size all --seed 0 --seed 1 --seed 2 --out runs/rerank`, the default configuration,
its outputs moved under runs/rerank/): each (size, seed) is one pipeline run whose evaluation
measures old/old, new/new, FCT, FastFill and the shadow index on the test split. On the same
run's stored test features (both models) this measures candidate reranking
(components/evaluation/rerank.py) with every depth of --depth and synchronous budget of --sync,
in three backfill orders:

- random: the order of every random row (``random_order(n, evaluate.seed)``);
- sigma: FastFill's sigma order of the same run (its fallback, where its map check fell back);
- query: a query-driven worker's order (``query_driven_order``: the test queries in a random
  order, each queueing its old top-K candidates not queued before), one per depth.

Every number is on the protocol of the other rows (each test image a query against the other
9,999; 22 curve points; areas the plain mean over the points). Per size: each row's mean ± sample
standard deviation over the seeds, the paired difference to FastFill-sigma seed by seed, and the
cost per query. G(K) = M_T - M_{T|S_K} (new/new against the old top-K ranked by the new model),
top-1 and mAP, for all queries and for the classes the old model was and was not trained on,
with a depth advice (``depth_advice``: SAFE / EXPAND / UNSAFE at EmbedFlow's default depth 50,
epsilon 1 point). Writes reports/candidate_rerank.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from shadow_index import run_times, sweep_command, sweep_params  # noqa: E402  (beside this file)

from fastfill.components.evaluation.comparison import EARLY, early_area  # noqa: E402  (after the path)
from fastfill.components.evaluation.rerank import (  # noqa: E402
    RerankVariant,
    candidate_gap,
    depth_advice,
    query_driven_order,
    rerank_curves,
)

# rows the pipeline's own evaluation measured in the same run: (method, order)
STORED = {"fct (random)": ("fct", "random"), "fastfill (sigma)": ("fastfill", "sigma"),
          "fastfill (random)": ("fastfill", "random"), "dual_rrf (random)": ("dual_rrf", "random")}
BASELINE = "fastfill (sigma)"
KEYS = ("top1_auc", "map_auc", "top1_early", "map_early", "top1_0", "map_0", "top1_100", "map_100", "top5_auc",
        "nfr1_mean")
HEADERS = {"top1_auc": "top-1~", "map_auc": "mAP~", "top1_early": "top-1 0-30%", "map_early": "mAP 0-30%",
           "top1_0": "top-1 0%", "map_0": "mAP 0%", "top1_100": "top-1 100%", "map_100": "mAP 100%",
           "top5_auc": "top-5~", "nfr1_mean": "NFR@1 mean"}
GAP_DEPTHS = (10, 20, 50, 100, 200, 500, 1000)
ADVICE_AT, EPSILON = 50, 0.01  # EmbedFlow's default candidate_depth; a gap of at most 1 point
ORDERS = ("random", "sigma", "query")


def curve_numbers(curve: dict) -> dict[str, float]:
    """One row's numbers from its curve (a curves.json entry or ``BackfillCurve.to_dict()``)."""
    top1, mean_ap = curve["top1"], curve["map"]
    return {"top1_auc": float(np.mean(top1)), "map_auc": float(np.mean(mean_ap)),
            "top1_early": early_area(curve["alpha"], top1), "map_early": early_area(curve["alpha"], mean_ap),
            "top1_0": float(top1[0]), "map_0": float(mean_ap[0]), "top1_100": float(top1[-1]),
            "map_100": float(mean_ap[-1]), "top5_auc": float(np.mean(curve["top5"])),
            "nfr1_mean": float(np.mean(curve["nfr1"]))}


def rerank_row(variant: RerankVariant, order: str) -> str:
    return f"rerank_{variant.name} ({order})"


def cost(variant: RerankVariant) -> str:
    sync = (f"up to {variant.sync} item embeddings (new model) on the query path" if variant.sync
            else "no item embedding on the query path")
    return (f"2 query embeddings (old and new model), 1 old-index search for {variant.depth} candidates, "
            f"{variant.depth} new-feature lookups and distances; {sync}; the misses queued for a worker")


def sync_spent(first_point: np.ndarray, candidates: np.ndarray, variant: RerankVariant, points: int) -> float:
    """Item embeddings on the query path per query, the mean over the curve's points: at a point,
    min(budget, the query's candidates without new features)."""
    if not variant.sync:
        return 0.0
    ready = first_point[candidates[:, :variant.depth]]
    return float(np.mean([np.minimum((ready > p).sum(axis=1), variant.sync).mean() for p in range(points)]))


def measure_run(run: Path, size_dir: Path, config, variants: list[RerankVariant], old_classes) -> dict:
    """Candidate reranking's curves and G(K) in one (size, seed) run, and its stored rows."""
    from fastfill.components.evaluation.rerank import candidate_lists
    from fastfill.components.experiment.data import load_split
    from fastfill.components.platform.config import PathsConfig
    from fastfill.components.platform.layout import Layout
    from fastfill.tasks.method_curves import dual_order

    layout = Layout(PathsConfig(data=size_dir / "data", artifacts=run / "artifacts", reports=run / "reports"))
    labels = load_split(layout.splits, "test").labels
    old = np.load(layout.features("old", "test"))
    new = np.load(layout.features("new", "test"))
    n, ev = len(labels), config.evaluate
    stored = json.loads((run / "reports" / "curves.json").read_text())
    rows = {row: curve_numbers(stored["curves"][m][o]) for row, (m, o) in STORED.items()}
    rows["old/old"] = {"top1_0": stored["reference"]["old_old"]["top1"], "map_0": stored["reference"]["old_old"]["map"]}
    rows["new/new"] = {"top1_0": stored["reference"]["new_new"]["top1"], "map_0": stored["reference"]["new_new"]["map"]}
    curves = {row: stored["curves"][m][o] for row, (m, o) in STORED.items()}
    random, _ = dual_order(ev, "random", layout, n)
    sigma, diverged = dual_order(ev, "sigma", layout, n)
    if sigma is None:
        raise ValueError(f"{run}: FastFill's sigma {diverged}")
    candidates = candidate_lists(old, old, max(v.depth for v in variants), labels=labels, distance=ev.distance)
    orders = {"random": {None: random}, "sigma": {None: sigma},
              "query": {k: query_driven_order(candidates[:, :k], seed=ev.seed) for k in sorted({v.depth for v in variants})}}
    spent: dict[str, float] = {}
    seconds = {}
    for name, by_depth in orders.items():
        for depth, order in by_depth.items():
            chosen = [v for v in variants if depth is None or v.depth == depth]
            start = time.perf_counter()
            measured = rerank_curves(old, new, old, new, labels, order, variants=chosen, distance=ev.distance,
                                     num_intermediate=ev.curve_points)
            seconds[f"{name}/{depth or 'all'}"] = time.perf_counter() - start
            place = np.empty(n, dtype=np.int64)
            place[order] = np.arange(n)
            cuts = np.array([(i * n) // (ev.curve_points + 1) for i in range(ev.curve_points + 2)])
            first_point = np.searchsorted(cuts, place, side="right")
            for variant, curve in measured.items():  # type: ignore[union-attr]
                row = rerank_row(variant, name)
                curves[row] = curve.to_dict()
                rows[row] = curve_numbers(curves[row])
                spent[row] = sync_spent(first_point, candidates, variant, ev.curve_points + 2)
    unseen = ~np.isin(labels, list(old_classes)) if old_classes else None
    groups = {"seen": ~unseen, "unseen": unseen} if unseen is not None and unseen.any() and (~unseen).any() else {}
    depths = [k for k in GAP_DEPTHS if k < n]
    start = time.perf_counter()
    gap = candidate_gap(old, new, old, new, labels, depths, distance=ev.distance, groups=groups)
    seconds["gap"] = time.perf_counter() - start
    return {"rows": rows, "curves": curves, "sync_spent": spent, "gap": gap, "seconds": seconds}


def measured_run(run: Path, size_dir: Path, config, variants: list[RerankVariant]) -> dict:
    """``measure_run``, kept in the run's folder (candidate_rerank.json) and reused while the run's
    test features and the variants measured are the same."""
    import hashlib

    stamp = {"version": 2, "variants": [[v.depth, v.sync] for v in variants], "gap_depths": list(GAP_DEPTHS),
             "features": {role: hashlib.md5((run / "artifacts" / "features" / role / "test.npy").read_bytes()).hexdigest()
                          for role in ("old", "new")}}
    kept = run / "candidate_rerank.json"
    if kept.is_file():
        data = json.loads(kept.read_text())
        if data.get("stamp") == stamp:
            print(f"reused the measurement of {run} ({kept.name})", flush=True)
            result = data["result"]
            for group in result["gap"].values():  # JSON keys are strings
                group["by_depth"] = {int(k): v for k, v in group["by_depth"].items()}
            return result
    start = time.perf_counter()
    result = measure_run(run, size_dir, config, variants, config.prepare.old_classes)
    print(f"measured {run} in {time.perf_counter() - start:.0f} s", flush=True)
    kept.write_text(json.dumps({"stamp": stamp, "result": result}) + "\n")
    return result


def spread(values: dict[str, float]) -> dict:
    numbers = list(values.values())
    return {"mean": statistics.fmean(numbers), "std": statistics.stdev(numbers) if len(numbers) > 1 else 0.0,
            "per_seed": dict(values)}


def summarize_size(per_seed: dict[str, dict], variants: list[RerankVariant]) -> dict:
    seeds = list(per_seed)
    first = per_seed[seeds[0]]
    rows = {}
    for row, numbers in first["rows"].items():
        rows[row] = {k: spread({s: per_seed[s]["rows"][row][k] for s in seeds}) for k in numbers}
        if row.startswith("rerank_"):
            rows[row]["paired_minus_fastfill_sigma"] = {
                k: spread({s: per_seed[s]["rows"][row][k] - per_seed[s]["rows"][BASELINE][k] for s in seeds})
                for k in ("top1_auc", "map_auc", "top1_early", "map_early")}
            rows[row]["sync_embeddings_per_query"] = spread({s: per_seed[s]["sync_spent"][row] for s in seeds})
    gap: dict = {}
    for group in first["gap"]:
        entry = {"queries": first["gap"][group]["queries"],
                 "native": {m: spread({s: per_seed[s]["gap"][group]["native"][m] for s in seeds}) for m in ("top1", "map")},
                 "by_depth": {}}
        for k in first["gap"][group]["by_depth"]:
            at = {s: per_seed[s]["gap"][group]["by_depth"][k] for s in seeds}
            entry["by_depth"][k] = {"gap": {m: spread({s: at[s]["gap"][m] for s in seeds}) for m in ("top1", "map")},
                                    "recall": spread({s: at[s]["recall"] for s in seeds}),
                                    "precision": spread({s: at[s]["precision"] for s in seeds})}
        entry["advice"] = {m: depth_advice({int(k): v["gap"][m]["mean"] for k, v in entry["by_depth"].items()},
                                           at=ADVICE_AT, epsilon=EPSILON) for m in ("top1", "map")}
        gap[group] = entry
    mean_curves = {row: {key: [statistics.fmean(v) for v in zip(*(per_seed[s]["curves"][row][key] for s in seeds))]
                         for key in ("alpha", "top1", "map")} for row in first["curves"]}
    return {"seeds": seeds, "rows": rows, "gap": gap, "mean_curves": mean_curves,
            "costs": {rerank_row(v, o): cost(v) for v in variants for o in ORDERS},
            "seconds": {s: per_seed[s]["seconds"] for s in seeds}}


def _cell(stat: dict, signed: bool = False) -> str:
    mean = f"{100 * stat['mean']:{'+' if signed else ''}.2f}"
    return mean if len(stat["per_seed"]) == 1 else f"{mean} ± {100 * stat['std']:.2f}"


def wins(entry: dict) -> list[str]:
    """The figures (of top1_auc, map_auc and the 0-30% areas) on which a reranking row's mean is
    above FastFill-sigma's, with the paired difference."""
    out = []
    for row, numbers in entry["rows"].items():
        paired = numbers.get("paired_minus_fastfill_sigma")
        for key, stat in (paired or {}).items():
            if stat["mean"] > 0:
                out.append(f"{row} {HEADERS[key]} {_cell(stat, signed=True)}")
    return out


def markdown(summary: dict) -> str:
    lines = ["# Candidate reranking (EmbedFlow's way) against FastFill", "",
             f"Runs: `{summary['command']}` (the default configuration; each (size, seed) one pipeline run). "
             "Candidate reranking is measured on each run's stored test features with "
             "components/evaluation/rerank.py; the other rows are the run's own evaluation. Numbers in %, mean ± "
             "sample standard deviation over the seeds; `~` is the mean over the 22 curve points, 0-30% the same mean "
             "over the points with alpha <= 0.3. Row names: `rerank_k<K>[_sync<M>] (<order>)`, K the candidate depth, "
             "M the synchronous budget (EmbedFlow's max_sync_misses; its default is 4), the order the one the "
             "gallery is backfilled in (query: a query-driven worker's).", ""]
    for size, entry in summary["sizes"].items():
        lines += [f"## Training images per class: {size} (seeds {', '.join(entry['seeds'])})", ""]
        old_old, new_new = entry["rows"]["old/old"], entry["rows"]["new/new"]
        lines += [f"old/old top-1 {_cell(old_old['top1_0'])}, mAP {_cell(old_old['map_0'])}; new/new top-1 "
                  f"{_cell(new_new['top1_0'])}, mAP {_cell(new_new['map_0'])}.", "",
                  "| row | " + " | ".join(HEADERS[k] for k in KEYS) + " | minus FastFill-sigma: top-1~ | mAP~ "
                  "| top-1 0-30% | item embeddings per query on the query path |",
                  "|---|" + "---|" * (len(KEYS) + 4)]
        for row, numbers in entry["rows"].items():
            if row in ("old/old", "new/new"):
                continue
            paired = numbers.get("paired_minus_fastfill_sigma")
            extra = (" | ".join(_cell(paired[k], signed=True) for k in ("top1_auc", "map_auc", "top1_early"))
                     + f" | {numbers['sync_embeddings_per_query']['mean']:.2f}") if paired else " |  |  | "
            lines.append(f"| {row} | " + " | ".join(_cell(numbers[k]) for k in KEYS) + f" | {extra} |")
        lines += ["", "Where a reranking row's mean is above FastFill-sigma's (paired by seed): "
                  + ("; ".join(wins(entry)) or "nowhere") + ".", ""]
        lines += ["### G(K): what the old model's top-K keeps of the new model's retrieval", "",
                  "G(K) = M_T - M_{T|S_K}: new/new minus the old top-K ranked by the new model (every item backfilled), "
                  "in points; precision is the share of a query's old top-K that is relevant, recall the share of its relevant "
                  "items inside its old top-K (at most K / 999 here). Groups: every "
                  "query, the classes the old model was trained on (seen), the others (unseen: open classes).", "",
                  "| group | queries | new/new top-1 | new/new mAP | " + " | ".join(f"G({k}) top-1 / mAP / precision / recall"
                                                                         for k in next(iter(entry['gap'].values()))['by_depth'])
                  + " | advice (top-1) | advice (mAP) |",
                  "|---|---|---|---|" + "---|" * len(next(iter(entry['gap'].values()))['by_depth']) + "---|---|"]
        for group, g in entry["gap"].items():
            cells = [f"{100 * d['gap']['top1']['mean']:.2f} / {100 * d['gap']['map']['mean']:.2f} / "
                     f"{100 * d['precision']['mean']:.1f} / {100 * d['recall']['mean']:.1f}"
                     for d in g["by_depth"].values()]
            advice = [f"{a['label']}" + (f" (K {a['depth']})" if a["depth"] else "") for a in g["advice"].values()]
            lines.append(f"| {group} | {g['queries']} | {_cell(g['native']['top1'])} | {_cell(g['native']['map'])} | "
                         + " | ".join(cells) + " | " + " | ".join(advice) + " |")
        lines += ["", f"Advice at K = {ADVICE_AT} (EmbedFlow's default depth), epsilon {100 * EPSILON:g} point: SAFE "
                  "where G(50) is within it, EXPAND where a deeper measured K is, UNSAFE where none is.", ""]
        lines += ["Cost per query while the upgrade runs: " + "; ".join(
            f"`rerank_{name}`: {text}" for name, text in sorted({r.split(' ')[0].removeprefix('rerank_'): c
                                                                  for r, c in entry["costs"].items()}.items()))
                  + ". FastFill: 1 query embedding (new model), 1 search; the shadow index (dual_rrf): 2 query "
                  "embeddings, 2 searches.", ""]
    times = summary.get("run_seconds")
    if times:
        lines += ["Wall time per pipeline run (from the sweep log): "
                  + ", ".join(f"{name} {seconds / 60:.1f} min" for name, seconds in times.items()) + ".", ""]
    return "\n".join(lines)


MARK_START, MARK_END = "<!-- candidate-rerank: benchmarks/candidate_rerank.py -->", "<!-- /candidate-rerank -->"
HEADLINE_ROWS = ("fastfill (sigma)", "fct (random)", "dual_rrf (random)")


def comparison_section(size: str, entry: dict, command: str) -> str:
    """The comparison report's section of candidate reranking at one size (markdown)."""
    lines = [MARK_START, "", "## Candidate reranking (EmbedFlow's way), in runs of its own", "",
             f"Measured by `benchmarks/candidate_rerank.py` on the runs of `{command}` (seeds "
             f"{', '.join(entry['seeds'])}, this size): the default configuration, each seed one pipeline run, on the "
             "protocol of the rows above. Those runs train the models of this configuration again (in float32, under "
             "the pinned kernels: not this comparison's own models), so the rows are set beside that run's own "
             "FastFill-sigma, FCT and shadow index, and the difference to FastFill-sigma is paired by seed. "
             "reports/candidate_rerank.md has every row, G(K) and the plot.", "",
             "| row | top-1~ | mAP~ | top-1 0-30% | mAP 0-30% | top-1 0% | top-1 100% | mAP 100% | minus FastFill-sigma: "
             "top-1~ | mAP~ | per query |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row, numbers in entry["rows"].items():
        if row in ("old/old", "new/new") or (not row.startswith("rerank_") and row not in HEADLINE_ROWS):
            continue
        paired = numbers.get("paired_minus_fastfill_sigma")
        diff = (f"{_cell(paired['top1_auc'], True)} | {_cell(paired['map_auc'], True)}" if paired else " | ")
        per_query = entry["costs"].get(row, "1 embedding, 1 search" if not row.startswith("dual") else
                                        "2 embeddings, 2 searches")
        lines.append(f"| {row} | " + " | ".join(_cell(numbers[k]) for k in ("top1_auc", "map_auc", "top1_early",
                                                                                "map_early", "top1_0", "top1_100",
                                                                                "map_100"))
                     + f" | {diff} | {per_query} |")
    lines += ["", "Above FastFill-sigma (mean of the paired difference): " + ("; ".join(wins(entry)) or "nowhere") + ".",
              "", MARK_END, ""]
    return "\n".join(lines)


def attach_to_comparison(summary: dict, reports: Path) -> list[Path]:
    """The rows into reports/comparison.{md,json} (every image) and comparison-<size>.* (the
    others), where those reports exist: the markdown section between its marks replaced or
    appended, the JSON's ``candidate_reranking`` key."""
    written = []
    for size, entry in summary["sizes"].items():
        stem = "comparison" if size == "all" else f"comparison-{size}"
        md, js = reports / f"{stem}.md", reports / f"{stem}.json"
        if not (md.is_file() and js.is_file()):
            continue
        section = comparison_section(size, entry, summary["command"])
        text = md.read_text()
        if MARK_START in text:
            text = text[:text.index(MARK_START)] + section + text[text.index(MARK_END) + len(MARK_END):].lstrip("\n")
        else:
            text = text.rstrip("\n") + "\n\n" + section
        md.write_text(text)
        data = json.loads(js.read_text())
        data["candidate_reranking"] = {
            "source": "benchmarks/candidate_rerank.py", "command": summary["command"], "seeds": entry["seeds"],
            "note": "runs of their own (the default configuration, float32 under the pinned kernels), not this "
                    "comparison's models: each row beside the same runs' fastfill (sigma), paired by seed",
            "rows": {row: numbers for row, numbers in entry["rows"].items()
                     if row.startswith("rerank_") or row in HEADLINE_ROWS or row in ("old/old", "new/new")},
            "costs": entry["costs"], "gap": entry["gap"]}
        js.write_text(json.dumps(data, indent=2) + "\n")
        written += [md, js]
    return written


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(summary["sizes"])
    shown = ["fct (random)", "fastfill (sigma)", "dual_rrf (random)", "rerank_k50 (random)", "rerank_k200 (random)",
             "rerank_k200 (sigma)", "rerank_k200_sync4 (query)"]
    figure, axes = plt.subplots(2, len(sizes), figsize=(6 * len(sizes), 8), squeeze=False)
    for column, size in enumerate(sizes):
        curves = summary["sizes"][size]["mean_curves"]
        for r, metric in enumerate(("top1", "map")):
            axis = axes[r][column]
            for row in shown:
                if row in curves:
                    axis.plot(np.array(curves[row]["alpha"]) * 100, np.array(curves[row][metric]) * 100, marker=".",
                              label=row, linestyle="--" if row.startswith("rerank") else "-")
            axis.set_xlabel("gallery backfilled (%)")
            axis.set_ylabel("top-1 (%)" if metric == "top1" else "mAP (%)")
            axis.set_title(f"{size} training images per class: {'top-1' if metric == 'top1' else 'mAP'}")
            axis.grid(alpha=0.3)
            axis.legend(loc="lower right", fontsize=7)
    figure.suptitle("Candidate reranking (dashed) against FastFill, FCT and the shadow index; mean over seeds",
                    fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    parser.add_argument("--size", action="append", dest="sizes", help="repeat; default: 1000 and all")
    parser.add_argument("--seed", action="append", type=int, dest="seeds", help="repeat; default: 0, 1, 2")
    parser.add_argument("--depth", action="append", type=int, dest="depths", help="repeat; default: 50 and 200")
    parser.add_argument("--sync", action="append", type=int, dest="syncs", help="repeat; default: 0 and 4")
    parser.add_argument("--out", type=Path, default=Path("runs/rerank"))
    parser.add_argument("--resume", action="store_true", help="run only the (size, seed) runs without a metrics.json")
    parser.add_argument("--report-only", action="store_true", help="run no pipeline: measure the runs that exist")
    parser.add_argument("--reports", type=Path, default=ROOT / "reports")
    args = parser.parse_args(argv)
    sizes, seeds = args.sizes or ["1000", "all"], args.seeds or [0, 1, 2]
    variants = [RerankVariant(k, m) for k in (args.depths or [50, 200]) for m in (args.syncs or [0, 4])]
    out = args.out
    params = sweep_params(args.params, out) if not args.report_only else out / "params.yaml"
    command = sweep_command(params, sizes, seeds, out, args.resume)
    shown = " ".join(["fastfill", *command[1:]]).replace(" --resume", "")
    if not args.report_only:
        print(f"running: {shown}", flush=True)
        with (out / "sweep.log").open("a") as log:
            result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
        if result.returncode not in (0, 4):  # 4: the sweep's own FastFill >= FCT claim failed somewhere
            print(f"the sweep failed with exit status {result.returncode}; see {out / 'sweep.log'}", file=sys.stderr)
            return result.returncode
    from fastfill.components.platform.config import load_params

    config = load_params(params)
    per_size: dict[str, dict] = {}
    for size in sizes:
        for seed in seeds:
            run = out / f"n-{size}" / f"seed-{seed}"
            if not (run / "reports" / "metrics.json").is_file():
                print(f"skipped: {run} has no reports/metrics.json (not finished)", flush=True)
                continue
            per_size.setdefault(size, {})[str(seed)] = measured_run(run, out / f"n-{size}", config, variants)
    if not per_size:
        print(f"no finished runs under {out}", file=sys.stderr)
        return 1
    summary = {"command": shown, "variants": [{"depth": v.depth, "sync": v.sync} for v in variants],
               "orders": list(ORDERS), "early_upto": EARLY, "advice": {"at": ADVICE_AT, "epsilon": EPSILON},
               "sizes": {size: summarize_size(runs, variants) for size, runs in per_size.items()},
               "run_seconds": run_times(out / "sweep.log")}
    args.reports.mkdir(parents=True, exist_ok=True)
    (args.reports / "candidate_rerank.json").write_text(json.dumps(summary, indent=1) + "\n")
    (args.reports / "candidate_rerank.md").write_text(markdown(summary))
    plot(summary, args.reports / "candidate_rerank.png")
    attached = attach_to_comparison(summary, args.reports)
    print(markdown(summary))
    if attached:
        print("the rows added to: " + ", ".join(str(p) for p in attached))
    print(f"written: {args.reports / 'candidate_rerank.md'}, .json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
