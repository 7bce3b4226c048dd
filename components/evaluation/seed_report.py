"""Numbers over several seeds: per-seed values, mean and standard deviation, and a table."""

from __future__ import annotations

import statistics
from collections.abc import Mapping

SEED_KEYS = ("top1_0", "top1_100", "top1_auc", "top5_auc", "map_auc", "nfr1_mean")
ORDER_KEYS = ("top1_auc", "top5_auc", "map_auc")


def spread(values_by_seed: Mapping) -> dict:
    """Mean, sample standard deviation (0 for one seed) and the values keyed by str(seed)."""
    values = list(values_by_seed.values())
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "per_seed": {str(seed): value for seed, value in values_by_seed.items()}}


def summarize_seeds(per_seed: dict[int, dict]) -> dict:
    """Mean, standard deviation and per-seed values of each row's numbers (and of each order's)."""
    first = next(iter(per_seed.values()))
    rows = {}
    for name, entry in first.items():
        if name == "headroom":
            continue
        row = {key: spread({s: m[name][key] for s, m in per_seed.items()})
               for key in (*SEED_KEYS, "kendall_tau") if key in entry}
        if "by_order" in entry:
            row["by_order"] = {order: {key: spread({s: m[name]["by_order"][order][key] for s, m in per_seed.items()})
                                       for key in ORDER_KEYS}
                               for order in entry["by_order"]}
        rows[name] = row
    rows["headroom"] = {key: spread({s: m["headroom"][key] for s, m in per_seed.items()}) for key in first["headroom"]}
    return rows


def _cell(stat: dict) -> str:
    seeds = ", ".join(f"{100 * v:.2f}" for v in stat["per_seed"].values())
    return f"{100 * stat['mean']:.2f} ± {100 * stat['std']:.2f} ({seeds})"


def seeds_markdown(summary: dict) -> str:
    """reports/seeds.md: one line per method and order, mean ± std (per-seed values), in %."""
    columns = ("top1_0", "top1_auc", "top5_auc", "map_auc")
    lines = [f"Seeds: {', '.join(map(str, summary['seeds']))}. Mean ± standard deviation over seeds, "
             "each seed's value in brackets, in %.", "",
             "| row | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for name, row in summary["rows"].items():
        if name == "headroom":
            continue
        lines.append(f"| {name} | " + " | ".join(_cell(row[c]) if c in row else "" for c in columns) + " |")
        for order, numbers in row.get("by_order", {}).items():
            lines.append(f"| {name} ({order}) | | " + " | ".join(_cell(numbers[c]) for c in columns[1:]) + " |")
    lines.append("")
    for key, stat in summary["rows"].get("headroom", {}).items():
        lines.append(f"- headroom {key}: {_cell(stat)} top-1 points")
    if "kendall_tau" in summary["rows"].get("fastfill", {}):
        tau = summary["rows"]["fastfill"]["kendall_tau"]
        lines.append(f"- FastFill Kendall tau(sigma, oracle): {tau['mean']:.3f} ± {tau['std']:.3f}")
    return "\n".join(lines) + "\n"
