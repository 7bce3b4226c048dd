"""reports/shadow_index.png for benchmarks/shadow_index.py: top-1 and mAP along the backfill per
data size, the mean over seeds with a band of one standard deviation."""

from __future__ import annotations

from pathlib import Path

import numpy as np

PLOTTED = ("FCT-random", "FastFill-sigma", "dual_rrf-random")


def plot(curves: dict, rows: dict, early: float, path: Path) -> None:
    """Top-1 and mAP against the backfilled fraction for PLOTTED, per data size: the mean over the
    seeds, and a band of one standard deviation where there are several."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(curves)
    figure, axes = plt.subplots(2, len(sizes), figsize=(5.5 * len(sizes), 7.5), squeeze=False)
    for column, size in enumerate(sizes):
        per_seed = curves[size]
        for metric, row in (("top1", 0), ("map", 1)):
            axis = axes[row][column]
            for name in PLOTTED:
                method, order = rows[name]
                series = np.array([run["curves"][method][order][metric] for run in per_seed.values()]) * 100
                alpha = np.array(next(iter(per_seed.values()))["curves"][method][order]["alpha"]) * 100
                mean = series.mean(axis=0)
                line, = axis.plot(alpha, mean, marker=".", label=name)
                if len(series) > 1:
                    sd = series.std(axis=0, ddof=1)
                    axis.fill_between(alpha, mean - sd, mean + sd, color=line.get_color(), alpha=0.2)
            axis.axvline(early * 100, color="grey", linestyle=":", linewidth=1)
            axis.set_xlabel("gallery backfilled (%)")
            axis.set_ylabel("top-1 (%)" if metric == "top1" else "mAP (%)")
            axis.set_title(f"{'all' if size == 'all' else size} training images per class, seeds "
                           f"{', '.join(per_seed)}: {'top-1' if metric == 'top1' else 'mAP'}")
            axis.grid(alpha=0.3)
            axis.legend(loc="lower right", fontsize=8)
    figure.suptitle("The shadow index (dual_rrf) against FastFill and FCT\nmean over seeds, band = 1 sd; "
                    "dotted: the 30% mark of the early area", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
