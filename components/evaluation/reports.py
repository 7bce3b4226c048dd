"""What the evaluation writes: reports/metrics.json, curve data for `dvc plots`, and a PNG.

metrics.json (a DVC metrics file), numbers as fractions in [0, 1]:

    old_old, new_new:  top1_0, top1_100, top5_0, top5_100, map_0, map_100,
                       top1_auc, top5_auc, map_auc            (a fixed gallery: 0% = 100%)
    <method>:          the same keys for the headline order, plus order (its name),
                       nfr1_mean, top1_trapz, top5_trapz, map_trapz, kendall_tau (when the
                       method has sigma and oracle orders), and by_order.<order>.<same keys>
    headroom:          new_new_top1 - <method>_top1_0 for each method (top-1 points left to gain)
"""

from __future__ import annotations

import csv
from collections.abc import Mapping
from pathlib import Path

SUMMARY_KEYS = ("top1", "top5", "map")


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


def plot_curves(path: Path, reference: Mapping[str, Mapping], curves: Mapping[str, Mapping[str, Mapping]],
                title: str = "") -> Path:
    """Top-1 and mAP against the fraction backfilled; one line per method and order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    styles = {"old_old": ("grey", ":"), "new_new": ("black", "--")}
    for ax, key, name in zip(axes, ("top1", "map"), ("Top-1 (%)", "mAP (%)")):
        for ref, point in reference.items():
            color, line = styles.get(ref, ("grey", "-."))
            ax.axhline(100 * point[key], color=color, linestyle=line, label=ref.replace("_", "/"))
        for method, by_order in curves.items():
            for order, curve in by_order.items():
                ax.plot([100 * a for a in curve["alpha"]], [100 * v for v in curve[key]], marker=".",
                        label=f"{method} ({order}), mean {100 * curve[f'{key}_auc']:.2f}")
        ax.set_xlabel("gallery backfilled (%)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
