"""The later methods' own claims, checked on the comparison's stored outputs.

Reads the seeds of a finished comparison (``fastfill compare`` or ``fastfill compare --size N``:
compare.out[/n-N]/seed-<s>/) and its report (reports/comparison[-N].json), and measures what each
paper claims beyond the table's curves:

- lambda-orthogonality (Ricci et al.): the orthogonal map keeps the old space's structure. For
  every map of the comparison, the share of each test item's k nearest neighbours in the old
  space that are still among its k nearest after the map (``neighbours_kept``), and the share of
  its k nearest in the new model's space that the map reaches (``neighbours_reached``).
- stationary representations (Biondi et al.): the fixed d-Simplex classifier gives compatibility,
  i.e. new queries on the old gallery beat old/old (the empirical compatibility criterion). The
  row trains its own old model, so its own old/old is measured here (the table's old/old is the
  shared old model's).
- BT^2 (Zhou et al.): the extra dimensions close the gap between a compatible new model and
  new/new: its 100% point against BCT's and against the independently trained new model's.
- online backfilling (Seo et al.): the curve never drops (from the report: monotone, largest fall).
- stationary and BT^2 are searched by cosine (their losses are angular); the same stored features
  searched by l2 are measured here too.

Writes reports/later_methods[-N].{json,md}. Run after the comparison, e.g.

    .venv/bin/python benchmarks/later_methods.py               # every training image
    .venv/bin/python benchmarks/later_methods.py --size 1000
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastfill.components.evaluation.assessment import MethodOutputs, method_curves, reference_points  # noqa: E402
from fastfill.components.evaluation.retrieval import pairwise_distances  # noqa: E402
from fastfill.components.experiment.data import load_split  # noqa: E402
from fastfill.components.platform.config import load_params  # noqa: E402
from fastfill.components.platform.layout import Layout, load_array  # noqa: E402

K = 10  # neighbours compared


def nearest(queries: np.ndarray, k: int = K, *, block: int = 1024) -> np.ndarray:
    """Each row's ``k`` nearest other rows (squared l2), ``(n, k)``, self excluded; ties by index."""
    n = len(queries)
    if not 0 < k < n:
        raise ValueError(f"k must be in 1..{n - 1}, got {k}")
    out = np.empty((n, k), dtype=np.int64)
    for start in range(0, n, block):
        d = pairwise_distances(queries[start:start + block], queries, "l2").astype(np.float64)
        rows = np.arange(d.shape[0])
        d[rows, start + rows] = np.inf
        part = np.argpartition(d, k, axis=1)[:, :k + 1]
        # the k + 1 candidates sorted by (distance, index), the first k kept
        keys = np.lexsort((part, np.take_along_axis(d, part, axis=1)), axis=1)
        out[start:start + block] = np.take_along_axis(part, keys, axis=1)[:, :k]
    return out


def neighbours_shared(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over rows of |a_i ∩ b_i| / k for two ``(n, k)`` neighbour lists."""
    if a.shape != b.shape:
        raise ValueError(f"neighbour lists of shapes {a.shape} and {b.shape}")
    k = a.shape[1]
    return float(np.mean([len(np.intersect1d(x, y, assume_unique=True)) / k for x, y in zip(a, b)]))


def _pct(value: float) -> str:
    return f"{100 * value:.2f}"


def _stat(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "per_seed": values}


def _show(stat: dict) -> str:
    return f"{100 * stat['mean']:.2f} ± {100 * stat['std']:.2f}"


def seed_numbers(params, seed: int) -> dict:
    """Every measured number of one seed of the comparison."""
    seeded = params.for_comparison(seed)
    layout = Layout(seeded.paths)
    labels = load_split(layout.splits, "test").labels
    old, new = load_array(layout.features("old", "test")), load_array(layout.features("new", "test"))
    near_old, near_new = nearest(old), nearest(new)
    maps = {}
    for method, config in seeded.align.items():
        if config.architecture == "unified":
            continue  # its gallery lives in a third space, not the new model's
        mapped = nearest(load_array(layout.align_dir(method) / "gallery_old.npy"))
        maps[method] = {"neighbours_kept": neighbours_shared(near_old, mapped),
                        "neighbours_reached": neighbours_shared(near_new, mapped)}
    out = {"maps": maps, "new_model_keeps": neighbours_shared(near_old, near_new)}
    compatible = {}
    for method, config in seeded.compatible.items():
        if config.loss not in ("stationary", "bt2"):
            continue
        directory = layout.compatible_dir(method)
        outputs = MethodOutputs(gallery_old=load_array(directory / "gallery_old.npy"),
                                query=load_array(directory / "query.npy"))
        entry = {}
        for distance in ("cosine", "l2"):
            curves, _ = method_curves(outputs, new, labels, ["random"], distance=distance,
                                      curve_points=seeded.evaluate.curve_points, seed=seeded.evaluate.seed)
            curve = curves["random"]
            entry[distance] = {"top1_auc": curve["top1_auc"], "map_auc": curve["map_auc"],
                               "top1_0": curve["top1"][0], "map_0": curve["map"][0],
                               "top1_100": curve["top1"][-1], "map_100": curve["map"][-1]}
            if config.trains_own_old_model:
                own = reference_points(outputs.gallery_old, outputs.query, labels, distance)["old_old"]
                entry[distance]["own_old_old_top1"], entry[distance]["own_old_old_map"] = own["top1"], own["map"]
        compatible[method] = entry
    out["compatible"] = compatible
    return out


def summarize(per_seed: dict[int, dict], report: dict) -> dict:
    seeds = sorted(per_seed)
    first = per_seed[seeds[0]]
    maps = {m: {key: _stat([per_seed[s]["maps"][m][key] for s in seeds]) for key in first["maps"][m]}
            for m in first["maps"]}
    compatible = {m: {d: {key: _stat([per_seed[s]["compatible"][m][d][key] for s in seeds])
                          for key in first["compatible"][m][d]} for d in first["compatible"][m]}
                  for m in first["compatible"]}
    return {"seeds": seeds, "k": K, "maps": maps, "compatible": compatible,
            "new_model_keeps": _stat([per_seed[s]["new_model_keeps"] for s in seeds]),
            "claims": claims(maps, compatible, report), "above_fastfill": above_fastfill(report)}


LATER = ("lambda_orth", "stationary", "bt2", "online_metric_compatible", "online_residual_mlp")


def above_fastfill(report: dict, reference: str = "fastfill (sigma)") -> dict[str, list[str]]:
    """Each later method's rows (every order), and the figures where its mean is above
    FastFill-sigma's (NFR@1: below), with both means; what the upgrade would have to offer."""
    rows, out = report["rows"], {}
    base = rows.get(reference)
    if base is None:
        return out
    for label, row in rows.items():
        if row.get("method") not in LATER:
            continue
        better = [f"{key} {100 * row[key]['mean']:.2f} vs {100 * base[key]['mean']:.2f}" for key in (*TABLE_KEYS, "nfr1_mean")
                  if key in row and key in base and
                  ((row[key]["mean"] < base[key]["mean"]) if key == "nfr1_mean" else (row[key]["mean"] > base[key]["mean"]))]
        out[label] = better
    return out


def _row(report: dict, method: str) -> dict | None:
    rows = report["rows"]
    return next((row for label, row in rows.items() if row.get("method") == method and row.get("headline")), None)


def claims(maps: dict, compatible: dict, report: dict) -> list[dict]:
    """One verdict per paper, with its numbers (means over seeds)."""
    out = []
    rows = report["rows"]
    if "lambda_orth" in maps:
        kept = {m: v["neighbours_kept"]["mean"] for m, v in maps.items()}
        others = {m: v for m, v in kept.items() if m != "lambda_orth"}
        best_other = max(others, key=others.get) if others else None
        holds = best_other is None or kept["lambda_orth"] > others[best_other]
        out.append({"paper": "lambda-orthogonality", "claim": f"the orthogonal map keeps more of the old space's {K} "
                    "nearest neighbours than the free maps", "holds": holds,
                    "numbers": {m: round(100 * v, 2) for m, v in sorted(kept.items(), key=lambda kv: -kv[1])}})
    for label, row in rows.items():
        if "monotone" in row and row.get("headline"):
            holding = round(sum(row["monotone"]["per_seed"].values()))
            out.append({"paper": "online backfilling", "claim": f"{label}: the curve never drops",
                        "holds": holding == len(row["monotone"]["per_seed"]),
                        "numbers": {"seeds_monotone": holding, "seeds": len(row["monotone"]["per_seed"]),
                                    "top1_max_drop": round(100 * row["top1_max_drop"]["mean"], 2),
                                    "map_max_drop": round(100 * row["map_max_drop"]["mean"], 2)}})
    for method, by_distance in compatible.items():
        cos = by_distance["cosine"]
        if "own_old_old_top1" in cos:
            gains = {k: cos[f"{k}_0"]["mean"] - cos[f"own_old_old_{k}"]["mean"] for k in ("top1", "map")}
            out.append({"paper": "stationary representations", "claim": f"{method}: new queries on its own old "
                        "gallery beat its old/old (compatibility)", "holds": all(g > 0 for g in gains.values()),
                        "numbers": {"top1_0": round(100 * cos["top1_0"]["mean"], 2),
                                    "own_old_old_top1": round(100 * cos["own_old_old_top1"]["mean"], 2),
                                    "map_0": round(100 * cos["map_0"]["mean"], 2),
                                    "own_old_old_map": round(100 * cos["own_old_old_map"]["mean"], 2)}})
        else:
            new_new, bct = rows.get("new/new"), _row(report, "bct")
            if new_new is None or bct is None:
                continue
            numbers = {"bt2_map_100": cos["map_100"]["mean"], "bct_map_100": bct["map_100"]["mean"],
                       "new_new_map": new_new["map_100"]["mean"], "bt2_top1_100": cos["top1_100"]["mean"],
                       "bct_top1_100": bct["top1_100"]["mean"], "new_new_top1": new_new["top1_100"]["mean"]}
            gap = numbers["new_new_map"] - numbers["bct_map_100"]
            closed = (numbers["bt2_map_100"] - numbers["bct_map_100"]) / gap if gap > 0 else float("nan")
            out.append({"paper": "BT^2", "claim": f"{method}: the extra dimensions close BCT's gap to new/new at 100% "
                        "(mAP)", "holds": closed > 0.5,
                        "numbers": {**{k: round(100 * v, 2) for k, v in numbers.items()},
                                    "share_of_gap_closed": round(closed, 3)}})
    return out


# the rows shown beside the later methods: FastFill's headline, FCT, the shadow index
TABLE_ROWS = ("old/old", "new/new", "fastfill (sigma)", "fct (random)", "dual_rrf (random)", "lambda_orth (random)",
              "stationary (random)", "bt2 (random)", "online_metric_compatible (random)",
              "online_residual_mlp (random)")
TABLE_KEYS = ("top1_auc", "map_auc", "top1_early", "map_early", "top1_0", "map_0")


def rows_table(report: dict) -> list[str]:
    """The comparison's rows of TABLE_ROWS that it has: the numbers and the costs."""
    lines = ["| row | top-1~ | mAP~ | top-1 0-30% | mAP 0-30% | top-1 0% | mAP 0% | per query | per gallery item |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label in TABLE_ROWS:
        row = report["rows"].get(label)
        if row is None:
            continue
        cells = [_show(row[k]) if k in row else "" for k in TABLE_KEYS]
        lines.append(f"| {label} | " + " | ".join(cells)
                     + f" | {row.get('cost_per_query', '')} | {row.get('cost_per_item', '')} |")
    return lines


def markdown(summary: dict, command: str, wall: float, report: dict | None = None) -> str:
    lines = ["# The later methods' claims, checked", "",
             f"`{command}` ({wall:.0f} s), on the comparison's stored outputs, seeds "
             f"{', '.join(map(str, summary['seeds']))}; mean ± standard deviation, in %.", ""]
    if report is not None:
        lines += ["## The rows (from the comparison's report)", "", *rows_table(report), ""]
    lines += [f"## Neighbourhoods: the share of each test item's {summary['k']} nearest neighbours kept", "",
             "`kept`: of its neighbours in the old space, after the map; `reached`: of its neighbours in the new "
             f"model's space, after the map. The new model's own features keep {_show(summary['new_model_keeps'])}.",
             "", "| map | kept (old space) | reached (new space) |", "|---|---|---|"]
    for method, v in sorted(summary["maps"].items(), key=lambda kv: -kv[1]["neighbours_kept"]["mean"]):
        lines.append(f"| {method} | {_show(v['neighbours_kept'])} | {_show(v['neighbours_reached'])} |")
    lines += ["", "## Stationary representations and BT^2 by distance", "",
              "| row | distance | top-1~ | mAP~ | top-1 0% | mAP 0% | top-1 100% | mAP 100% | own old/old top-1 | "
              "own old/old mAP |", "|---|---|---|---|---|---|---|---|---|---|"]
    for method, by_distance in summary["compatible"].items():
        for distance, v in by_distance.items():
            own = [_show(v[k]) if k in v else "" for k in ("own_old_old_top1", "own_old_old_map")]
            lines.append(f"| {method} | {distance} | " + " | ".join(_show(v[k]) for k in (
                "top1_auc", "map_auc", "top1_0", "map_0", "top1_100", "map_100")) + f" | {own[0]} | {own[1]} |")
    lines += ["", "## Where a later method is above FastFill-sigma (means over the seeds)", ""]
    for label, figures in summary["above_fastfill"].items():
        lines.append(f"- {label}: " + ("; ".join(figures) if figures else "on no figure"))
    lines += ["", "## Each paper's claim", ""]
    for item in summary["claims"]:
        numbers = ", ".join(f"{k} {v}" for k, v in item["numbers"].items())
        lines.append(f"- {item['paper']}: {item['claim']}: **{'holds' if item['holds'] else 'does not hold'}** "
                     f"({numbers})")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    parser.add_argument("--size", type=int, default=None, help="the comparison of `fastfill compare --size N`")
    parser.add_argument("--seed", type=int, action="append", help="default: compare.seeds")
    args = parser.parse_args(argv)
    params = load_params(args.params)
    if args.size is not None:
        params = params.comparison_at_size(args.size)
    stem = "comparison" if args.size is None else f"comparison-{args.size}"
    report_path = params.paths.reports / f"{stem}.json"
    if not report_path.is_file():
        parser.error(f"{report_path} is missing: run `fastfill compare"
                     f"{'' if args.size is None else f' --size {args.size}'}` first")
    report = json.loads(report_path.read_text())
    started = time.perf_counter()
    per_seed = {}
    for seed in args.seed or list(params.compare.seeds):
        print(f"seed {seed}: neighbourhoods and distances ...", flush=True)
        per_seed[seed] = seed_numbers(params, seed)
    summary = summarize(per_seed, report)
    wall = time.perf_counter() - started
    command = "python benchmarks/later_methods.py" + ("" if args.size is None else f" --size {args.size}")
    out = params.paths.reports / ("later_methods" + ("" if args.size is None else f"-{args.size}"))
    out.with_suffix(".json").write_text(json.dumps({"command": command, "wall_s": wall, **summary}, indent=2) + "\n")
    text = markdown(summary, command, wall, report)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
