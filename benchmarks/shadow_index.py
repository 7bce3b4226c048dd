"""The shadow index against FastFill, over data sizes and seeds.

    .venv/bin/python benchmarks/shadow_index.py                    # run the sweep, then report
    .venv/bin/python benchmarks/shadow_index.py --resume           # reuse the runs that finished
    .venv/bin/python benchmarks/shadow_index.py --report-only      # run nothing

The runs are the data-size sweep's (`fastfill sweep --size 1000 --size all --seed 0 --seed 1
--seed 2 --out runs/shadow`): each (size, seed) is one pipeline run of the default configuration
under runs/shadow/n-<size>/seed-<s>/, whose evaluation stage measures FCT, FastFill and the
shadow index (evaluate.dual: dual_rrf, in random and sigma order) on the same test features. The
sweep reads a copy of params.yaml, runs/shadow/params.yaml, that differs only where things are
written: the sweep's own summary goes to runs/shadow/reports/ (not over the committed
reports/sweep.*) and its MLflow runs to runs/shadow/mlruns.db. No number depends on those keys.

From every run's reports/curves.json this writes reports/shadow_index.{md,json}: per data size,
for FCT-random, FastFill-sigma, FastFill-random, dual_rrf-random and dual_rrf-sigma, mean ± sample
standard deviation over the seeds of top1_auc and map_auc (the full curve, as metrics.json
defines them), the same two over the first 30% of the backfill (``early_area``), top-1 at 0% and
at 100%, and the paired difference dual_rrf-random minus FastFill-sigma, seed by seed.

The areas follow the product's rule (components/evaluation/retrieval.py, BackfillCurve): *_auc is
the plain mean of the curve's values over its points, every point weighted equally (not a
trapezoid). The 0-30% area is the same mean over the points with alpha <= 0.3; with the default
20 intermediate points (alpha = i/21) those are i = 0..6, alpha 0 to 0.286, seven points.

``--density`` adds a check of why the shadow index's top-1 rises so early: the gallery of one run
is cut to k test images per class (a few random draws), and the shadow index and FastFill-sigma
are measured again on it with the product's curve functions.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from fastfill.components.evaluation.comparison import EARLY, early_area  # noqa: E402  (after the path)

ROWS = {"FCT-random": ("fct", "random"), "FastFill-sigma": ("fastfill", "sigma"),
        "FastFill-random": ("fastfill", "random"), "dual_rrf-random": ("dual_rrf", "random"),
        "dual_rrf-sigma": ("dual_rrf", "sigma")}
DUAL, MAPPED = (2, 2, "old and new, until 100%"), (1, 1, "new (old features mapped once)")
COST = {row: DUAL if row.startswith("dual") else MAPPED for row in ROWS}  # per query: embeddings, searches, models
KEYS = ("top1_auc", "map_auc", "top1_early", "map_early", "top1_0", "top1_100")
HEADERS = {"top1_auc": "top1_auc", "map_auc": "map_auc", "top1_early": "top-1 area 0-30%",
           "map_early": "mAP area 0-30%", "top1_0": "top-1 at 0%", "top1_100": "top-1 at 100%"}
PAIR = ("dual_rrf-random", "FastFill-sigma")
# the README's default run (seed 0, all training images), top1_auc and map_auc in %
README_DEFAULT = {"FCT-random": (86.65, 80.47), "FastFill-sigma": (88.38, 81.78), "FastFill-random": (88.06, 80.53)}
RUN_START = re.compile(r"^(\d\d):(\d\d):(\d\d)\.\d+ .*train_per_class (\S+), seed (\d+): (\d+) training images")
STAMP = re.compile(r"^(\d\d):(\d\d):(\d\d)\.\d+ ")


def curve_numbers(curve: dict, upto: float = EARLY) -> dict[str, float]:
    """One row's numbers from its curve (a curves.json entry)."""
    return {"top1_auc": float(np.mean(curve["top1"])), "map_auc": float(np.mean(curve["map"])),
            "top1_early": early_area(curve["alpha"], curve["top1"], upto),
            "map_early": early_area(curve["alpha"], curve["map"], upto),
            "top1_0": float(curve["top1"][0]), "top1_100": float(curve["top1"][-1])}


def spread(values: dict[str, float]) -> dict:
    """Mean, sample standard deviation (0 for one value) and the values by seed."""
    numbers = list(values.values())
    return {"mean": statistics.fmean(numbers), "std": statistics.stdev(numbers) if len(numbers) > 1 else 0.0,
            "per_seed": dict(values)}


def summarize_size(per_seed: dict[str, dict], checks: dict[str, str] | None = None, upto: float = EARLY) -> dict:
    """``per_seed[seed]``: that run's curves.json; ``checks[seed]``: its FastFill map check. The
    rows' numbers over seeds, and the paired difference of PAIR seed by seed."""
    numbers = {seed: {row: curve_numbers(curves["curves"][m][o], upto) for row, (m, o) in ROWS.items()}
               for seed, curves in per_seed.items()}
    rows = {row: {key: spread({s: numbers[s][row][key] for s in numbers}) for key in KEYS} for row in ROWS}
    first, second = PAIR
    paired = {key: spread({s: numbers[s][first][key] - numbers[s][second][key] for s in numbers}) for key in KEYS}
    reference = {name: spread({s: c["reference"][name]["top1"] for s, c in per_seed.items()})
                 for name in ("old_old", "new_new")}
    return {"seeds": list(numbers), "rows": rows, "paired": paired, "reference_top1": reference,
            "map_check": dict(checks or {})}


def check_outcome(metrics: dict) -> str:
    """FastFill's map check in one run: passed, or fallback with the order the fallback map (and
    every sigma row, the shadow index's included) is backfilled in."""
    check = metrics["fastfill"].get("map_check", {})
    outcome = check.get("outcome", "unchecked")
    return f"{outcome} ({check['fallback_order']} order)" if "fallback_order" in check else outcome


def collect(out: Path, sizes: list[str], seeds: list[int]) -> tuple[dict, dict]:
    """The finished runs' curves.json by size and seed (a run counts once its metrics.json
    exists), and their metrics.json (each row's top1_auc/map_auc is checked against it)."""
    curves, metrics = {}, {}
    for size in sizes:
        for seed in seeds:
            reports = out / f"n-{size}" / f"seed-{seed}" / "reports"
            if not (reports / "metrics.json").is_file():
                continue
            run_curves = json.loads((reports / "curves.json").read_text())
            run_metrics = json.loads((reports / "metrics.json").read_text())
            for row, (method, order) in ROWS.items():
                numbers = curve_numbers(run_curves["curves"][method][order])
                stored = run_metrics[method]["by_order"][order]
                for key in ("top1_auc", "map_auc"):
                    if abs(numbers[key] - stored[key]) > 1e-12:
                        raise ValueError(f"{reports}: {row} {key} from the curve {numbers[key]} differs from "
                                         f"metrics.json's {stored[key]}")
            curves.setdefault(size, {})[str(seed)] = run_curves
            metrics.setdefault(size, {})[str(seed)] = run_metrics
    return curves, metrics


def reproduction(metrics: dict) -> dict | None:
    """Seed 0 at size all against the README's default run (in %, to two decimals) and against
    the committed reports/metrics.json (every digit)."""
    run = metrics.get("all", {}).get("0")
    if run is None:
        return None
    ours = {row: (run[ROWS[row][0]]["by_order"][ROWS[row][1]]["top1_auc"],
                  run[ROWS[row][0]]["by_order"][ROWS[row][1]]["map_auc"]) for row in README_DEFAULT}
    readme = {row: {"readme": list(README_DEFAULT[row]), "run": [round(100 * v, 2) for v in ours[row]],
                    "same": [round(100 * v, 2) for v in ours[row]] == list(README_DEFAULT[row])}
              for row in README_DEFAULT}
    committed = None
    try:
        text = subprocess.run(["git", "show", "HEAD:reports/metrics.json"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
        stored = json.loads(text)
        committed = {row: {"committed": [stored[m]["by_order"][o][k] for k in ("top1_auc", "map_auc")],
                           "run": list(ours[row]),
                           "identical": [stored[m]["by_order"][o][k] for k in ("top1_auc", "map_auc")] == list(ours[row])}
                     for row, (m, o) in ROWS.items() if row in README_DEFAULT}
        committed["old_old_top1"] = {"committed": stored["old_old"]["top1_0"], "run": run["old_old"]["top1_0"],
                                     "identical": stored["old_old"]["top1_0"] == run["old_old"]["top1_0"]}
    except (subprocess.CalledProcessError, FileNotFoundError, KeyError, json.JSONDecodeError):
        pass
    return {"readme": readme, "committed_metrics": committed,
            "reproduced": all(entry["same"] for entry in readme.values())}


def run_times(log: Path) -> dict[str, float]:
    """Seconds per (size, seed) run, from the timestamps of a sweep log: a run lasts from its
    "train_per_class <size>, seed <s>" line to the next such line (the last one to the log's
    last timestamp); a size's data preparation, before its first run, is not counted. Clock
    times only; a run past midnight is counted across it."""
    if not log.is_file():
        return {}
    starts, last = [], None
    for line in log.read_text(errors="replace").splitlines():
        stamp = STAMP.match(line)
        if stamp:
            last = int(stamp[1]) * 3600 + int(stamp[2]) * 60 + int(stamp[3])
        start = RUN_START.match(line)
        if start:
            starts.append((f"n-{start[4]}/seed-{start[5]}", last))
    times = {}
    for (name, begin), end in zip(starts, [s for _, s in starts[1:]] + [last]):
        times[name] = float((end - begin) % 86400)
    return times


def density_check(out: Path, size: str, seed: int, per_class: list[int], draws: int, config) -> dict:
    """The shadow index and FastFill-sigma on a gallery cut to k test images per class: the
    run's stored test features (both models) and FastFill's stored map outputs, restricted to a
    random k per class, measured with the product's curve functions."""
    from fastfill.components.evaluation import backfill_curve, dual_curves
    from fastfill.components.evaluation.ordering import random_order, sigma_order

    run = out / f"n-{size}" / f"seed-{seed}" / "artifacts"
    labels = np.load(out / f"n-{size}" / "data" / "splits" / "test_labels.npy")
    old, new = np.load(run / "features" / "old" / "test.npy"), np.load(run / "features" / "new" / "test.npy")
    mapped, log_sigma2 = np.load(run / "align" / "fastfill" / "gallery_old.npy"), None
    if (run / "align" / "fastfill" / "log_sigma2.npy").is_file():
        log_sigma2 = np.load(run / "align" / "fastfill" / "log_sigma2.npy")
    check = run / "align" / "fastfill" / "check.json"
    fallback = check.is_file() and json.loads(check.read_text()).get("fallback_order", {}).get("order") == "random"
    points = config.evaluate.curve_points
    results = {}
    for k in per_class:
        rows: dict[str, list[dict]] = {"dual_rrf-random": [], "dual_rrf-sigma": [], "FastFill-sigma": []}
        if k >= np.bincount(labels).max():  # the whole gallery: the run's own curves
            stored = json.loads((out / f"n-{size}" / f"seed-{seed}" / "reports" / "curves.json").read_text())["curves"]
            for row in rows:
                curve = stored[ROWS[row][0]][ROWS[row][1]]
                rows[row].append(curve_numbers(curve) | {"top1_1": float(curve["top1"][1])})
            k = int(np.bincount(labels).max())
        for draw in range(draws if not rows["FastFill-sigma"] else 0):
            rng = np.random.default_rng(1000 * k + draw)
            keep = np.sort(np.concatenate([rng.permutation(np.flatnonzero(labels == c))[:k] for c in np.unique(labels)]))
            n, sub_labels = len(keep), labels[keep]
            sigma = random_order(n, config.evaluate.seed) if fallback or log_sigma2 is None else sigma_order(log_sigma2[keep])
            for name, order in (("random", random_order(n, config.evaluate.seed)), ("sigma", sigma)):
                curve = dual_curves(old[keep], new[keep], old[keep], new[keep], sub_labels, order, merges=["rrf"],
                                    distance=config.evaluate.distance, num_intermediate=points)["rrf"]
                rows[f"dual_rrf-{name}"].append(curve_numbers(curve.to_dict()) | {"top1_1": float(curve.top1[1])})
            curve = backfill_curve(new[keep], new[keep], mapped[keep], sub_labels, sigma,
                                   distance=config.evaluate.distance, num_intermediate=points)
            rows["FastFill-sigma"].append(curve_numbers(curve.to_dict()) | {"top1_1": float(curve.top1[1])})
        first_alpha = 1 / (points + 1)
        results[str(k)] = {
            "gallery": int(k * len(np.unique(labels))), "draws": len(rows["FastFill-sigma"]),
            "re_embedded_per_class_at_first_point": k * first_alpha,
            "rows": {row: {key: statistics.fmean(d[key] for d in values) for key in (*KEYS, "top1_1")}
                     for row, values in rows.items()}}
    return {"size": size, "seed": seed, "first_alpha": 1 / (points + 1), "per_class": results}


def _cell(stat: dict, signed: bool = False) -> str:
    mean = f"{100 * stat['mean']:{'+' if signed else ''}.2f}"
    return mean if len(stat["per_seed"]) == 1 else f"{mean} ± {100 * stat['std']:.2f}"


def markdown(summary: dict) -> str:
    lines = ["# The shadow index against FastFill", "",
             f"Every run is one pipeline run of the default configuration (`{summary['command']}`); "
             "mean ± sample standard deviation over the seeds, in %. top1_auc and map_auc are the "
             "product's: the plain mean of the curve's values over its 22 points (alpha = i/21). The "
             f"0-{int(100 * EARLY)}% areas are the same mean over the points with alpha <= {EARLY} "
             "(i = 0..6, seven points). Cost is per query while the upgrade runs: query embeddings, "
             "index searches, and the models that must be served. One seed: no spread shown. The curves: "
             "reports/shadow_index.png.", ""]
    for size, entry in summary["sizes"].items():
        ref = entry["reference_top1"]
        lines += [f"## Training images per class: {size} (seeds {', '.join(entry['seeds'])})", "",
                  f"old/old top-1 {_cell(ref['old_old'])}, new/new top-1 {_cell(ref['new_new'])}.", "",
                  "| row | " + " | ".join(HEADERS[k] for k in KEYS) + " | cost per query |",
                  "|---|" + "---|" * len(KEYS) + "---|"]
        for row, numbers in entry["rows"].items():
            embeddings, searches, served = COST[row]
            cost = f"{embeddings} embedding{'s' * (embeddings > 1)}, {searches} search{'es' * (searches > 1)}; {served}"
            lines.append(f"| {row} | " + " | ".join(_cell(numbers[k]) for k in KEYS) + f" | {cost} |")
        lines.append(f"| {PAIR[0]} minus {PAIR[1]} (paired by seed) | "
                     + " | ".join(_cell(entry["paired"][k], signed=True) for k in KEYS) + " | |")
        lines.append("")
        per_seed = entry["paired"]
        lines.append("Paired difference by seed: top1_auc "
                     + ", ".join(f"{100 * v:+.2f}" for v in per_seed["top1_auc"]["per_seed"].values())
                     + "; map_auc " + ", ".join(f"{100 * v:+.2f}" for v in per_seed["map_auc"]["per_seed"].values())
                     + "; top-1 area 0-30% "
                     + ", ".join(f"{100 * v:+.2f}" for v in per_seed["top1_early"]["per_seed"].values()) + ".")
        checks = entry.get("map_check", {})
        if checks:
            fell_back = any("random order" in outcome for outcome in checks.values())
            lines.append("FastFill's map check by seed: " + ", ".join(f"{s} {o}" for s, o in checks.items()) + "."
                         + (" Where it fell back to random order, FastFill-sigma is FastFill-random (the l2-only "
                            "map) and dual_rrf-sigma is dual_rrf-random." if fell_back else ""))
        lines.append("")
    repro = summary.get("reproduction")
    if repro:
        cells = "; ".join(f"{row} {r['run'][0]:.2f} / {r['run'][1]:.2f} (README {r['readme'][0]:.2f} / "
                          f"{r['readme'][1]:.2f})" for row, r in repro["readme"].items())
        lines += ["## Seed 0, all training images, against the README's default run", "",
                  f"top1_auc / map_auc: {cells}. Reproduced: {'yes' if repro['reproduced'] else 'no'}."]
        committed = repro.get("committed_metrics")
        if committed:
            same = all(v["identical"] for v in committed.values())
            lines.append(f"Against the committed reports/metrics.json, every digit of these numbers and of "
                         f"old/old top-1: {'identical' if same else 'not identical'}.")
        lines.append("")
    density = summary.get("density")
    if density:
        lines += [f"## The gallery cut to k test images per class (n-{density['size']}, seed {density['seed']})", "",
                  f"top-1 at the first point after 0% (alpha = 1/21 = {100 * density['first_alpha']:.1f}%), the "
                  "top-1 area 0-30% and top1_auc, in %; each k the mean of its draws.", "",
                  "| k per class | gallery | re-embedded per class at 4.8% | row | top-1 at 4.8% | top-1 area 0-30% "
                  "| top1_auc | map_auc |",
                  "|---|---|---|---|---|---|---|---|"]
        for k, entry in density["per_class"].items():
            for row, numbers in entry["rows"].items():
                lines.append(f"| {k} | {entry['gallery']} | {entry['re_embedded_per_class_at_first_point']:.1f} | {row} | "
                             f"{100 * numbers['top1_1']:.2f} | {100 * numbers['top1_early']:.2f} | "
                             f"{100 * numbers['top1_auc']:.2f} | {100 * numbers['map_auc']:.2f} |")
        lines.append("")
    times = summary.get("run_seconds")
    if times:
        lines += ["Wall time per run (from the sweep log): "
                  + ", ".join(f"{name} {seconds / 60:.1f} min" for name, seconds in times.items()) + ".", ""]
    return "\n".join(lines)


def sweep_params(params_path: Path, out: Path) -> Path:
    """params.yaml with only the outputs moved under ``out``: the sweep's summary (paths.reports)
    and the MLflow store. Every number the runs compute is the default configuration's."""
    import yaml

    from fastfill.components.platform.config import parse_params

    data = yaml.safe_load(params_path.read_text())
    data["paths"]["reports"] = str(out / "reports")
    data["mlflow"]["tracking_uri"] = f"sqlite:///{out / 'mlruns.db'}"
    data["mlflow"]["artifact_location"] = str(out / "mlartifacts")
    parse_params(data, params_path)  # the copy must validate as the original does
    out.mkdir(parents=True, exist_ok=True)
    target = out / "params.yaml"
    target.write_text(yaml.safe_dump(data, sort_keys=False))
    return target


def sweep_command(params: Path, sizes: list[str], seeds: list[int], out: Path, resume: bool) -> list[str]:
    command = [str(ROOT / ".venv" / "bin" / "fastfill"), "sweep", "--params", str(params)]
    for size in sizes:
        command += ["--size", size]
    for seed in seeds:
        command += ["--seed", str(seed)]
    return command + ["--out", str(out)] + (["--resume"] if resume else [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    parser.add_argument("--size", action="append", dest="sizes", help="repeat; default: 1000 and all")
    parser.add_argument("--seed", action="append", type=int, dest="seeds", help="repeat; default: 0, 1, 2")
    parser.add_argument("--out", type=Path, default=Path("runs/shadow"))
    parser.add_argument("--resume", action="store_true", help="run only the (size, seed) runs without a metrics.json")
    parser.add_argument("--report-only", action="store_true", help="run nothing: report the runs that exist")
    parser.add_argument("--density", type=int, nargs="*", default=None, metavar="K",
                        help="also cut the gallery of seed 0's largest size to K images per class (e.g. 1000 100 30 10)")
    parser.add_argument("--draws", type=int, default=3, help="random cuts per K below the full gallery")
    parser.add_argument("--reports", type=Path, default=ROOT / "reports")
    args = parser.parse_args(argv)
    sizes = args.sizes or ["1000", "all"]
    seeds = args.seeds or [0, 1, 2]
    for size in sizes:
        if size != "all" and not (size.isdigit() and int(size) > 0):
            parser.error(f"--size {size!r}: a positive number of images per class, or all")
    out = args.out
    params = sweep_params(args.params, out) if not args.report_only else out / "params.yaml"
    command = sweep_command(params, sizes, seeds, out, args.resume)
    shown = " ".join(["fastfill", *command[1:]])
    wall = None
    if not args.report_only:
        print(f"running: {shown}", flush=True)
        start = time.perf_counter()
        with (out / "sweep.log").open("a") as log:
            result = subprocess.run(command, cwd=Path.cwd(), stdout=log, stderr=subprocess.STDOUT)
        wall = time.perf_counter() - start
        # 4: the sweep's own claim (FastFill-sigma >= FCT-random everywhere) does not hold somewhere
        if result.returncode not in (0, 4):
            print(f"the sweep failed with exit status {result.returncode}; see {out / 'sweep.log'}", file=sys.stderr)
            return result.returncode
    recorded = args.reports / "shadow_index.json"  # --report-only keeps the recorded run's time
    wall = wall if wall is not None or not recorded.is_file() else json.loads(recorded.read_text()).get("sweep_wall_s")
    curves, metrics = collect(out, sizes, seeds)
    if not curves:
        print(f"no finished runs under {out}", file=sys.stderr)
        return 1
    summary = {"command": shown.replace(" --resume", ""), "sweep_wall_s": wall, "early_upto": EARLY,
               "area_rule": "plain mean of the curve's values over its points (as *_auc); early: points with alpha <= 0.3",
               "cost": {row: {"query_embeddings": c[0], "searches": c[1], "models_served": c[2]} for row, c in COST.items()},
               "sizes": {size: summarize_size(per_seed, {s: check_outcome(m) for s, m in metrics[size].items()})
                         for size, per_seed in curves.items()},
               "reproduction": reproduction(metrics),
               "run_seconds": {name: seconds for name, seconds in run_times(out / "sweep.log").items()
                               if name.split("/")[1].removeprefix("seed-") in curves.get(name.split("/")[0][2:], {})}}
    if args.density is not None:
        from fastfill.components.platform.config import load_params

        size = "all" if "all" in curves else list(curves)[-1]
        if "0" in curves[size]:
            summary["density"] = density_check(out, size, 0, sorted(args.density or [1000, 100, 30, 10], reverse=True),
                                               args.draws, load_params(params if params.is_file() else args.params))
    args.reports.mkdir(parents=True, exist_ok=True)
    (args.reports / "shadow_index.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.reports / "shadow_index.md").write_text(markdown(summary))
    from shadow_index_plot import plot  # beside this file
    plot(curves, ROWS, EARLY, args.reports / "shadow_index.png")
    print(markdown(summary))
    print(f"written: {args.reports / 'shadow_index.md'}, shadow_index.json and shadow_index.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
