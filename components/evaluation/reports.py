"""What the evaluation writes: reports/metrics.json, one flat summary per line of the plot
(reports/summary/, what `dvc metrics show` reads), curve data for `dvc plots`, and a PNG.

metrics.json (every number, nested), numbers as fractions in [0, 1]:

    old_old, new_new:  top1_0, top1_100, top5_0, top5_100, map_0, map_100,
                       top1_auc, top5_auc, map_auc            (a fixed gallery: 0% = 100%)
    <method>:          the same keys for the headline order, plus order (its name),
                       nfr1_mean, top1_trapz, top5_trapz, map_trapz, kendall_tau (when the
                       method has sigma and oracle orders), and by_order.<order>.<same keys>;
                       an online-backfilling method (online_<kind>) adds top1_max_drop,
                       map_max_drop and monotone (its curve never falls) to each order
    headroom:          new_new_top1 - <method>_top1_0 for each method (top-1 points left to gain)

summary/<line>.json, one file per line of the plot (old_old, new_new, <method>-<order>), each
with the same flat keys (ROW_KEYS), so `dvc metrics show` prints one row per line and one
column per number instead of one row of a hundred dotted keys.
"""

from __future__ import annotations

import csv
from collections.abc import Mapping
from pathlib import Path

SUMMARY_KEYS = ("top1", "top5", "map")
# the columns of `dvc metrics show`: the curve's ends, its mean (the paper's M~), negative flips
ROW_KEYS = ("top1_0", "top1_100", "top1_auc", "top5_auc", "map_0", "map_100", "map_auc", "nfr1_mean")


def curve_summary(curve: Mapping) -> dict:
    out = {}
    for key in SUMMARY_KEYS:
        out[f"{key}_0"] = curve[key][0]
        out[f"{key}_100"] = curve[key][-1]
    for key in SUMMARY_KEYS:
        out[f"{key}_auc"] = curve[f"{key}_auc"]
    for key in SUMMARY_KEYS:
        out[f"{key}_trapz"] = curve[f"{key}_trapz"]
    out["nfr1_mean"] = curve["nfr1_mean"]
    for key in ("top1_max_drop", "map_max_drop", "monotone"):  # online backfilling's claim, measured
        if key in curve:
            out[key] = curve[key]
    return out


def fixed_gallery_summary(point: Mapping) -> dict:
    """old/old and new/new: one gallery, no backfill, so every point of the curve is the same."""
    out = {}
    for key in SUMMARY_KEYS:
        out[f"{key}_0"] = out[f"{key}_100"] = point[key]
    for key in SUMMARY_KEYS:
        out[f"{key}_auc"] = point[key]
    return out


def check_outcome(record: Mapping) -> str:
    """A map check's outcome: ``passed``, ``fallback`` (the l2 map is used) or ``warned``."""
    return "passed" if record["passed"] else ("fallback" if record["action"] == "fallback" else "warned")


def check_summary(record: Mapping) -> dict:
    """The map check of one method, for metrics.json: its outcome and both maps' numbers."""
    summary = {"outcome": check_outcome(record), "policy": record["policy"],
               **{f"map_{k}": record["candidate"][k] for k in ("top1_0", "top1_auc", "map_auc")},
               **{f"reference_{k}": record["reference"][k] for k in ("top1_0", "top1_auc", "map_auc")}}
    if "fallback_order" in record:  # the order the fallback map is backfilled in: sigma or random
        summary["fallback_order"] = record["fallback_order"]["order"]
    return summary


def build_metrics(reference: Mapping[str, Mapping], curves: Mapping[str, Mapping[str, Mapping]],
                  headline: Mapping[str, str], kendall: Mapping[str, float],
                  checks: Mapping[str, Mapping] | None = None) -> dict:
    """``reference``: old_old/new_new points; ``curves[method][order]``: curve dicts;
    ``checks[method]``: the map check's record (components.experiment.map_check), where a map was checked."""
    metrics: dict = {name: fixed_gallery_summary(point) for name, point in reference.items()}
    for method, by_order in curves.items():
        order = headline[method]
        entry = {"order": order, **curve_summary(by_order[order])}
        if method in kendall:
            entry["kendall_tau"] = kendall[method]
        if checks and method in checks:
            entry["map_check"] = check_summary(checks[method])
        entry["by_order"] = {name: curve_summary(curve) for name, curve in by_order.items()}
        metrics[method] = entry
    if "new_new" in reference:
        metrics["headroom"] = {
            f"new_new_minus_{method}_top1_0": reference["new_new"]["top1"] - metrics[method]["top1_0"]
            for method in curves
        }
    return metrics


def flatten_numbers(data: Mapping, prefix: str = "") -> dict[str, float]:
    """Every number of a nested mapping under its dotted key (for MLflow metrics)."""
    out: dict[str, float] = {}
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flatten_numbers(value, name))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = value
    return out


def curve_label(method: str, order: str) -> str:
    return f"{method}-{order}"


def summary_rows(reference: Mapping[str, Mapping], curves: Mapping[str, Mapping[str, Mapping]]) -> dict[str, dict]:
    """One flat row per line of the plot (the same names as the plot data's columns): ROW_KEYS
    for each method and order; the fixed galleries have no flips, so no nfr1_mean."""
    rows: dict[str, dict] = {}
    for name, point in reference.items():
        fixed = fixed_gallery_summary(point)
        rows[name] = {key: fixed[key] for key in ROW_KEYS if key in fixed}
    for method, by_order in curves.items():
        for order, curve in by_order.items():
            summary = curve_summary(curve)
            rows[curve_label(method, order)] = {key: summary[key] for key in ROW_KEYS}
    return rows


def write_summary(directory: Path, reference: Mapping[str, Mapping],
                  curves: Mapping[str, Mapping[str, Mapping]]) -> list[Path]:
    """summary/<line>.json for `dvc metrics show`; rows of lines no longer evaluated are removed."""
    import json

    rows = summary_rows(reference, curves)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.json"):
        if stale.stem not in rows:
            stale.unlink()
    written = []
    for name, row in rows.items():
        path = directory / f"{name}.json"
        path.write_text(json.dumps(row, indent=2) + "\n")
        written.append(path)
    return written


def write_plot_data(directory: Path, reference: Mapping[str, Mapping], curves: Mapping[str, Mapping[str, Mapping]]) -> list[Path]:
    """One wide CSV per metric (alpha, then one column per line) for `dvc plots`."""
    directory.mkdir(parents=True, exist_ok=True)
    any_curve = next(iter(next(iter(curves.values())).values()))
    alphas = any_curve["alpha"]
    written = []
    for key in SUMMARY_KEYS:
        columns = {name: [point[key]] * len(alphas) for name, point in reference.items()}
        for method, by_order in curves.items():
            for order, curve in by_order.items():
                columns[curve_label(method, order)] = curve[key]
        path = directory / f"{key}.csv"
        with open(path, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["alpha", *columns])
            for i, alpha in enumerate(alphas):
                writer.writerow([f"{alpha:.6f}", *(f"{values[i]:.6f}" for values in columns.values())])
        written.append(path)
    return written


def method_colours(methods) -> dict[str, tuple]:
    """One colour per method, none of them the grey or black of the reference lines: tab10's
    hues (its grey left out), then tab20's lighter ones when there are more methods."""
    import matplotlib

    tab10, tab20 = matplotlib.colormaps["tab10"], matplotlib.colormaps["tab20"]
    palette = [tab10(i) for i in range(10) if i != 7] + [tab20(i) for i in range(1, 20, 2) if i != 15]
    return {method: palette[i % len(palette)] for i, method in enumerate(methods)}


ORDER_STYLES = ("-", "--", ":", "-.")


def plot_curves(path: Path, reference: Mapping[str, Mapping], curves: Mapping[str, Mapping[str, Mapping]],
                title: str = "", headline: Mapping[str, str] | None = None) -> Path:
    """Top-1 and mAP against the fraction backfilled: one colour per method, one line style per
    order (the headline order, else the first, solid with markers); old/old and new/new as
    horizontal reference lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    styles = {"old_old": ("grey", ":"), "new_new": ("black", "--")}
    colours = method_colours(curves)
    for ax, key, name in zip(axes, ("top1", "map"), ("Top-1", "mAP")):
        for ref, point in reference.items():
            color, line = styles.get(ref, ("grey", "-."))
            ax.axhline(100 * point[key], color=color, linestyle=line, label=f"{ref.replace('_', '/')} {100 * point[key]:.2f}")
        for method, by_order in curves.items():
            first = (headline or {}).get(method, next(iter(by_order)))
            others = iter(ORDER_STYLES[1:] * len(by_order))
            for order, curve in by_order.items():
                main = order == first
                ax.plot([100 * a for a in curve["alpha"]], [100 * v for v in curve[key]], color=colours[method],
                        linestyle="-" if main else next(others), linewidth=2 if main else 1.4,
                        marker="." if main else None, label=f"{method} ({order}), mean {100 * curve[f'{key}_auc']:.2f}")
        ax.set_title(f"{name} along the backfill")
        ax.set_xlabel("gallery backfilled with the new model (%)")
        ax.set_ylabel(f"{name} (%)")
        ax.set_xlim(-2, 102)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
