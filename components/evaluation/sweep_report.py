"""The data-size sweep's report: FCT-random, FastFill-sigma and FastFill-random at each
prepare.train_per_class over seeds, whether FastFill-sigma >= FCT-random holds, and what the map
check did (reports/sweep.{json,md,png})."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from fastfill.components.evaluation.seed_report import spread

ROWS = {"fct (random)": ("fct", "random"), "fastfill (sigma)": ("fastfill", "sigma"),
        "fastfill (random)": ("fastfill", "random")}
METRICS = ("top1_auc", "map_auc", "top1_0")


def size_label(size: int | None) -> str:
    return "all" if size is None else str(size)


def _check_outcome(check: Mapping) -> str:
    """passed, warned, unchecked, or fallback with the order its map is backfilled in."""
    outcome = check.get("outcome", "unchecked")
    return f"{outcome} ({check['fallback_order']} order)" if "fallback_order" in check else outcome


def summarize_sweep(results: Mapping[str, Mapping[str, dict]], pairs: Mapping[str, int]) -> dict:
    """``results[size][seed]``: that run's metrics.json; ``pairs[size]``: feature pairs the maps had."""
    sizes = {}
    for size, per_seed in results.items():
        rows = {}
        for label, (method, order) in ROWS.items():
            rows[label] = {key: spread({s: m[method]["by_order"][order][key] if key != "top1_0" else m[method]["top1_0"]
                                        for s, m in per_seed.items()}) for key in METRICS}
        checks = {s: _check_outcome(m["fastfill"].get("map_check", {})) for s, m in per_seed.items()}
        gaps = {key: rows["fastfill (sigma)"][key]["mean"] - rows["fct (random)"][key]["mean"]
                for key in ("top1_auc", "map_auc")}
        sizes[size] = {"pairs": pairs[size], "seeds": sorted(per_seed, key=int), "rows": rows, "checks": checks,
                       "sigma_minus_fct": gaps, "holds": all(gap >= 0 for gap in gaps.values())}
    return {"sizes": sizes, "holds_everywhere": all(entry["holds"] for entry in sizes.values())}


def _cell(stat: dict) -> str:
    return f"{100 * stat['mean']:.2f} ± {100 * stat['std']:.2f}"


def sweep_markdown(summary: dict) -> str:
    lines = ["FastFill against FCT by data size (`prepare.train_per_class`), mean ± std over the seeds listed, in %. "
             "The maps train on the new-train split's feature pairs (10% of them held out for validation and the "
             "map check); the evaluation is the full test split.", "",
             "| train_per_class | pairs | seeds | row | top1_auc | map_auc | top-1 at 0% |",
             "|---|---|---|---|---|---|---|"]
    for size, entry in summary["sizes"].items():
        seeds = ",".join(entry["seeds"])
        for label, row in entry["rows"].items():
            lines.append(f"| {size} | {entry['pairs']} | {seeds} | {label} | {_cell(row['top1_auc'])} | "
                         f"{_cell(row['map_auc'])} | {_cell(row['top1_0'])} |")
    lines += ["", "| train_per_class | FastFill-sigma minus FCT-random: top1_auc | map_auc | holds | map check of "
              "FastFill per seed |", "|---|---|---|---|---|"]
    for size, entry in summary["sizes"].items():
        gaps = entry["sigma_minus_fct"]
        checks = ", ".join(f"{s}: {c}" for s, c in sorted(entry["checks"].items(), key=lambda kv: int(kv[0])))
        lines.append(f"| {size} | {100 * gaps['top1_auc']:+.2f} | {100 * gaps['map_auc']:+.2f} | "
                     f"{'yes' if entry['holds'] else 'NO'} | {checks} |")
    lines += ["", "FastFill-sigma >= FCT-random in both top1_auc and map_auc on the mean at every size: "
              + ("**holds**" if summary["holds_everywhere"] else "**does not hold**") + "."]
    return "\n".join(lines) + "\n"


def plot_sweep(path: Path, summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(summary["sizes"])
    pairs = [summary["sizes"][s]["pairs"] for s in sizes]
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for axis, metric in zip(axes, ("top1_auc", "map_auc")):
        for label in ROWS:
            means = [100 * summary["sizes"][s]["rows"][label][metric]["mean"] for s in sizes]
            stds = [100 * summary["sizes"][s]["rows"][label][metric]["std"] for s in sizes]
            axis.errorbar(pairs, means, yerr=stds, marker="o", capsize=3, label=label)
        axis.set_xscale("log")
        axis.set_xticks(pairs, [f"{p}\n({s}/class)" for p, s in zip(pairs, sizes)])
        axis.set_xlabel("feature pairs for the maps (train_per_class)")
        axis.set_ylabel(f"{metric} (%)")
        axis.grid(alpha=0.3)
    axes[0].legend()
    figure.suptitle("FastFill vs FCT by data size (mean ± std over seeds)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
