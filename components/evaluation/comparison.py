"""The comparison of every method over seeds: reports/comparison.json, .md and .png.

Input: each seed's metrics.json and curves.json (what the evaluation writes). Output rows are
one per method and backfill order, plus old/old and new/new; each number is a mean, standard
deviation and per-seed values over the seeds. The expectations of the papers (FastFill > FCT >
RACT > BCT, sigma above random, l2+disc above l2) are checked on the data, on the mean and on
every seed, and written down whichever way they come out.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import Any

from fastfill.components.evaluation.seed_report import spread
from fastfill.components.platform.config import AlignConfig, CompatibleConfig

ROW_KEYS = ("top1_auc", "top5_auc", "map_auc", "top1_0", "top1_100", "top5_0", "top5_100", "map_0", "map_100",
            "nfr1_mean", "top1_trapz", "map_trapz")
REFERENCE_KEYS = ("top1_auc", "top5_auc", "map_auc", "top1_0", "top1_100", "top5_0", "top5_100", "map_0", "map_100")
REFERENCES = ("old_old", "new_new")

# (description, better row, worse row, metric): the papers' claims, in the default names
EXPECTATIONS = [
    *[(f"FastFill > FCT in {m}", "fastfill", "fct", m) for m in ("top1_auc", "map_auc")],
    *[(f"FCT > RACT in {m}", "fct", "ract", m) for m in ("top1_auc", "map_auc")],
    *[(f"RACT > BCT in {m}", "ract", "bct", m) for m in ("top1_auc", "map_auc")],
    *[(f"FastFill: sigma order > random order in {m}", "fastfill (sigma)", "fastfill (random)", m)
      for m in ("top1_auc", "map_auc")],
    *[(f"l2+disc > l2 (both random) in {m}", "l2_disc (random)", "fct (random)", m) for m in ("top1_auc", "map_auc")],
]


def describe_method(config: AlignConfig | CompatibleConfig) -> str:
    """What a method is, in the terms of docs/methods.md (the table's second column)."""
    if isinstance(config, CompatibleConfig):
        searched = f"; searched by {config.distance}" if config.distance else ""
        return _describe_compatible(config) + searched
    if config.architecture == "unified":
        return f"unified space, {config.rbt_blocks} RBT blocks per side"
    terms = "+".join(t for t in ("l2", "disc", "uncertainty") if getattr(config, t))
    if config.architecture == "affine":
        return f"map (affine W x + b), {terms} + lambda-orthogonality (lambda {config.orthogonality_weight:g})"
    shape = f"{config.rbt_blocks} RBT blocks" if config.architecture == "rbt" else "MLP"
    return f"map ({shape}), {terms}"


def _describe_compatible(config: CompatibleConfig) -> str:
    if config.loss == "bct":
        return f"new model + BCT influence loss (lambda {config.lam:g}), no map"
    if config.loss == "stationary":
        return (f"old and new model on a fixed d-Simplex classifier, new + HOC term (lambda {config.lam:g}, "
                f"mu {1 / config.tau:g}), no map; its 0% point is its own simplex-trained old model")
    if config.loss == "bt2":
        bt2 = config.bt2
        return (f"new model + {bt2['extra_dims']} extra dims through an orthogonal basis transformation, compatible "
                f"part with BCT influence (lambda {config.lam:g}) and old-feature matching ({bt2['match_old']:g}), "
                "no map; old items meet the compatible part")
    kind = "RACT loss" if config.new_to_new else "vanilla compatible loss (no new-to-new)"
    return f"new model + {kind} (lambda {config.lam:g}, tau {config.tau:g}), no map"


# What each kind of method costs while the upgrade runs: (per query, per gallery item). "switch" is
# the moment queries move to the new model; "backfill" is an item's re-embedding.
COSTS = {
    "map": ("1 embedding, 1 search", "switch: 1 map pass + 1 write; backfill: 1 embedding + 1 write"),
    "unified": ("1 embedding + the new side's transform, 1 search",
                "switch: the old side's transform + 1 write; backfill: 1 embedding + the transform + 1 write"),
    "compatible": ("1 embedding, 1 search", "switch: nothing; backfill: 1 embedding + 1 write"),
    "stationary": ("1 embedding, 1 search", "switch: nothing; backfill: 1 embedding + 1 write; the old model must "
                   "have been trained on the same fixed classifier"),
    "bt2": ("1 embedding, 1 search", "switch: nothing; backfill: 1 embedding + 1 write of the wider feature"),
    "adapter": ("1 embedding + the adapter, 1 search", "switch: nothing; backfill: 1 embedding + the adapter + 1 write"),
    "dual": ("2 embeddings (old and new model), 2 searches", "switch: nothing; backfill: 1 embedding + 1 write"),
    "online": ("1 embedding + the reverse map, 2 searches", "switch: nothing; backfill: 1 embedding + 1 write"),
}


def rerank_cost(depth: int, sync: int) -> tuple[str, str]:
    """(per query, per item) of candidate reranking at ``depth`` with ``sync`` embeddings on the query path."""
    on_path = f", up to {sync} item embeddings (new model) on the query path" if sync else ""
    return (f"2 embeddings (old and new model), 1 search for {depth} candidates, {depth} new-feature lookups{on_path}",
            "switch: nothing; backfill: 1 embedding + 1 write (the misses a query meets are queued for it)")


def describe_rerank(depth: int, sync: int) -> str:
    """A candidate-reranking row's description (docs/methods.md, "Candidate reranking")."""
    budget = f", up to {sync} missing candidates embedded on the query path" if sync else ""
    return (f"candidate reranking, no map: the old query's top {depth} of the old gallery, those with new features "
            f"ranked by the new query{budget}, the rest in old order (EmbedFlow's way)")


def method_cost(config: AlignConfig | CompatibleConfig) -> tuple[str, str]:
    """(per query, per item) of a map or a compatible new model, from ``COSTS``."""
    if isinstance(config, CompatibleConfig):
        return COSTS[config.loss] if config.loss in COSTS else COSTS["compatible"]
    return COSTS["unified"] if config.architecture == "unified" else COSTS["map"]


EARLY = 0.3  # the front of the backfill, reported on its own


def early_area(alphas, values, upto: float = EARLY) -> float:
    """The mean of ``values`` over the curve points with ``alpha <= upto``: the *_auc rule (a plain
    mean over points) restricted to the start of the backfill."""
    alphas, values = list(map(float, alphas)), list(map(float, values))
    if len(alphas) != len(values) or not alphas:
        raise ValueError(f"alphas and values must be of one non-zero length, got {len(alphas)} and {len(values)}")
    chosen = [v for a, v in zip(alphas, values) if a <= upto + 1e-12]
    if not chosen:
        raise ValueError(f"no curve point has alpha <= {upto}")
    return statistics.fmean(chosen)


def describe_adapter(kind: str, rank: int) -> str:
    """A query-side adapter's row description (docs/methods.md, "Query-side adapters")."""
    what = {"procrustes": "orthogonal Procrustes with a scale", "low_rank": f"affine map of rank {rank}",
            "residual_mlp": f"affine map of rank {rank} + residual MLP"}[kind]
    return f"query-side adapter, new -> old space ({what}); the stored gallery untouched"


DUAL_MERGES = {"rrf": "reciprocal rank fusion (an interleave by rank)",
               "score_minmax": "distances min-max normalised per list", "score_zscore": "distances z-scored per list"}


def describe_online(kind: str, rank: int) -> str:
    """An online-backfilling row's description (docs/methods.md, "Online backfilling"), with its cost."""
    what = {"procrustes": "orthogonal Procrustes with a scale", "low_rank": f"affine map of rank {rank}",
            "residual_mlp": f"affine map of rank {rank} + residual MLP",
            "metric_compatible": f"affine map of rank {rank} + residual MLP trained with the metric-compatible "
                                 "contrastive term"}[kind]
    return (f"online backfilling: the new query on the re-embedded items, the same query mapped new -> old ({what}) "
            "on the others, merged by raw distance; costs one query embedding and two searches per query")


def describe_dual(merge: str) -> str:
    """A shadow-index row's description (docs/methods.md, "The shadow index"), with its cost."""
    return (f"shadow index, no map: the old query on the old features of the items not yet re-embedded, the new "
            f"query on the others, merged by {DUAL_MERGES[merge]}; costs two query embeddings and two searches "
            "per query")


def _mean_curve(curves: list[Mapping], key: str) -> list[float]:
    return [statistics.fmean(values) for values in zip(*(c[key] for c in curves))]


def _spread(values_by_seed: Mapping) -> dict:
    """``spread``, or NaN mean and std when a seed's value is NaN (its map diverged)."""
    if all(math.isfinite(v) for v in values_by_seed.values()):
        return spread(values_by_seed)
    return {"mean": math.nan, "std": math.nan, "per_seed": {str(s): v for s, v in values_by_seed.items()}}


def summarize(per_seed_metrics: Mapping[str, Mapping], per_seed_curves: Mapping[str, Mapping],
              descriptions: Mapping[str, str], headline: Mapping[str, str],
              costs: Mapping[str, tuple[str, str]] | None = None) -> dict:
    """``per_seed_metrics[seed]``: a seed's metrics.json; ``per_seed_curves[seed]``: its
    curves.json; ``headline[method]``: the order that stands for the method; ``costs[method]``:
    (per query, per item) while the upgrade runs."""
    seeds = list(per_seed_metrics)
    if not seeds:
        raise ValueError("no seed to summarise; run the comparison's seeds first")
    first = per_seed_metrics[seeds[0]]
    for seed in seeds[1:]:
        if set(per_seed_metrics[seed]) != set(first):
            raise ValueError(f"seed {seed} has rows {sorted(per_seed_metrics[seed])}, seed {seeds[0]} has "
                             f"{sorted(first)}: re-run the seeds with the same configuration")
    rows: dict[str, dict[str, Any]] = {}
    for name in REFERENCES:
        if name in first:
            rows[name.replace("_", "/")] = {
                "method": name, "order": None, "kind": "reference", "headline": True,
                "description": "old model, old gallery" if name == "old_old" else "new model, fully backfilled",
                **{k: spread({s: per_seed_metrics[s][name][k] for s in seeds}) for k in REFERENCE_KEYS}}
    curves = {}
    for method, order in headline.items():
        for each in first[method]["by_order"]:
            label = f"{method} ({each})"
            rows[label] = {
                "method": method, "order": each, "kind": "method", "headline": each == order,
                "description": descriptions.get(method, ""),
                **{k: _spread({s: per_seed_metrics[s][method]["by_order"][each][k] for s in seeds}) for k in ROW_KEYS}}
            by_seed = {s: per_seed_metrics[s][method]["by_order"][each] for s in seeds}
            if all("monotone" in entry for entry in by_seed.values()):  # online backfilling's claim
                rows[label].update({k: _spread({s: entry[k] for s, entry in by_seed.items()})
                                    for k in ("top1_max_drop", "map_max_drop")})
                # 1 where the seed's curve never falls: its mean is the share of seeds where it holds
                rows[label]["monotone"] = _spread({s: float(entry["monotone"]) for s, entry in by_seed.items()})
            diverged = [s for s in seeds
                        if not math.isfinite(per_seed_metrics[s][method]["by_order"][each]["top1_auc"])]
            if diverged:  # the evaluation gives a map whose outputs are not finite NaN numbers
                rows[label]["diverged"] = diverged
            if any("kendall_tau" in per_seed_metrics[s][method] for s in seeds) and each == "sigma":
                rows[label]["kendall_tau"] = _spread({s: per_seed_metrics[s][method].get("kendall_tau", math.nan)
                                                      for s in seeds})
            runs = [per_seed_curves[s]["curves"][method][each] for s in seeds]
            for key in ("top1", "map"):  # the 0-30% area: the start of the backfill
                rows[label][f"{key}_early"] = _spread({s: early_area(run["alpha"], run[key])
                                                       for s, run in zip(seeds, runs)})
            if costs and method in costs:
                rows[label]["cost_per_query"], rows[label]["cost_per_item"] = costs[method]
            curves[label] = {"alpha": runs[0]["alpha"], "top1": _mean_curve(runs, "top1"),
                             "map": _mean_curve(runs, "map"), "headline": each == order}
    references = {name.replace("_", "/"): {k: statistics.fmean(per_seed_curves[s]["reference"][name][k] for s in seeds)
                                           for k in ("top1", "map")}
                  for name in REFERENCES if name in first}
    summary: dict[str, Any] = {"seeds": seeds, "rows": rows, "mean_curves": curves, "reference_points": references}
    summary["expectations"] = check_expectations(summary, headline)
    return summary


def _row(rows: Mapping, name: str, headline: Mapping[str, str]) -> Mapping | None:
    """A row by its label, or by a bare method name (then its headline order)."""
    if name in rows:
        return rows[name]
    if name in headline:
        return rows.get(f"{name} ({headline[name]})")
    return None


def check_expectations(summary: Mapping, headline: Mapping[str, str]) -> list[dict]:
    out = []
    for text, better, worse, metric in EXPECTATIONS:
        a, b = _row(summary["rows"], better, headline), _row(summary["rows"], worse, headline)
        if a is None or b is None:
            out.append({"claim": text, "checked": False, "why": f"no row {better if a is None else worse!r}"})
            continue
        if a.get("diverged") or b.get("diverged"):
            out.append({"claim": text, "checked": False,
                        "why": f"{better if a.get('diverged') else worse!r} diverged"})
            continue
        per_seed = {s: a[metric]["per_seed"][s] > b[metric]["per_seed"][s] for s in a[metric]["per_seed"]}
        gap = a[metric]["mean"] - b[metric]["mean"]
        out.append({"claim": text, "checked": True, "metric": metric, "better": better, "worse": worse,
                    "holds_on_mean": gap > 0, "gap": gap, "holds_per_seed": per_seed,
                    "seeds_holding": sum(per_seed.values()), "seeds": len(per_seed)})
    return out


def ranking(summary: Mapping, metric: str) -> list[tuple[str, float]]:
    """Headline rows (one per method) by descending mean ``metric``; diverged rows are left out."""
    rows = [(label, row[metric]["mean"]) for label, row in summary["rows"].items()
            if row["kind"] == "method" and row["headline"] and not row.get("diverged")]
    return sorted(rows, key=lambda item: -item[1])


def _pct(stat: Mapping) -> str:
    if not math.isfinite(stat["mean"]):
        return "diverged"
    return f"{100 * stat['mean']:.2f} ± {100 * stat['std']:.2f}"


def _diverged_note(row: Mapping) -> str:
    return f" (diverged: seed {', '.join(map(str, row['diverged']))})" if row.get("diverged") else ""


def comparison_markdown(summary: Mapping) -> str:
    seeds = summary["seeds"]
    columns = [("top1_auc", "top-1~"), ("map_auc", "mAP~"), ("top1_early", "top-1 0-30%"), ("map_early", "mAP 0-30%"),
               ("top1_0", "top-1 0%"), ("map_0", "mAP 0%"), ("top1_100", "top-1 100%"), ("map_100", "mAP 100%"),
               ("top5_auc", "top-5~"), ("nfr1_mean", "NFR@1 mean")]
    lines = [
        "# Comparison of the upgrade methods", "",
        f"Seeds: {', '.join(map(str, seeds))}. Numbers in %, mean ± standard deviation over the seeds. "
        "`~` is the mean of the 22-point backfill curve (the papers' tilde metric); 0% and 100% are its ends; "
        "0-30% is the same mean over the points up to 30% backfilled; NFR@1 mean is the negative-flip rate at "
        "top-1 averaged along the curve. Rows in **bold** are each method's headline order; what each costs "
        "while the upgrade runs is in the table after.", "",
        "| row | method | " + " | ".join(title for _, title in columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for label, row in summary["rows"].items():
        name = (f"**{label}**" if row["kind"] == "method" and row["headline"] else label) + _diverged_note(row)
        cells = [_pct(row[key]) if key in row else "" for key, _ in columns]
        lines.append(f"| {name} | {row['description']} | " + " | ".join(cells) + " |")
    priced = [(label, row) for label, row in summary["rows"].items() if row.get("headline") and "cost_per_query" in row]
    if priced:
        lines += ["", "## Cost while the upgrade runs (headline rows)", "",
                  "| row | per query | per gallery item |", "|---|---|---|"]
        lines += [f"| {label} | {row['cost_per_query']} | {row['cost_per_item']} |" for label, row in priced]
    lines += ["", "## Ranking (headline rows)", ""]
    diverged = [label for label, row in summary["rows"].items() if row["kind"] == "method" and row["headline"]
                and row.get("diverged")]
    for metric in ("top1_auc", "map_auc"):
        order = " > ".join(f"{label} {100 * value:.2f}" for label, value in ranking(summary, metric))
        lines.append(f"- {metric}: {order}" + (f" (left out, diverged: {', '.join(diverged)})" if diverged else ""))
    lines += ["", "## What the papers lead us to expect, checked on this data", ""]
    for item in summary["expectations"]:
        if not item["checked"]:
            lines.append(f"- {item['claim']}: not checked ({item['why']})")
            continue
        verdict = "holds" if item["holds_on_mean"] else "does NOT hold"
        lines.append(f"- {item['claim']}: {verdict} on the mean (gap {100 * item['gap']:+.2f} points), "
                     f"on {item['seeds_holding']} of {item['seeds']} seeds")
    taus = [(label, row["kendall_tau"]) for label, row in summary["rows"].items()
            if "kendall_tau" in row and math.isfinite(row["kendall_tau"]["mean"])]
    for label, tau in taus:
        lines.append(f"- Kendall tau between the sigma and oracle orders, {label.split(' ')[0]}: "
                     f"{tau['mean']:.3f} ± {tau['std']:.3f}")
    for label, row in summary["rows"].items():
        if "monotone" in row:  # online backfilling: a curve that never falls (the paper's claim)
            holding = round(sum(row["monotone"]["per_seed"].values()))
            lines.append(f"- Online backfilling, {label}: the curve rises monotonically on {holding} of "
                         f"{len(row['monotone']['per_seed'])} seeds (largest fall from one point to the next: top-1 "
                         f"{100 * row['top1_max_drop']['mean']:.2f}, mAP {100 * row['map_max_drop']['mean']:.2f} "
                         "points, mean over seeds)")
    lines += ["", "## Per seed", "", "| row | " + " | ".join(f"top-1~ s{s}" for s in seeds) + " | "
              + " | ".join(f"mAP~ s{s}" for s in seeds) + " |", "|---|" + "---|" * (2 * len(seeds))]
    for label, row in summary["rows"].items():
        cells = [f"{100 * row[m]['per_seed'][s]:.2f}" if math.isfinite(row[m]["per_seed"][s]) else "diverged"
                 for m in ("top1_auc", "map_auc") for s in seeds]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "Curves (mean over seeds, headline orders): comparison.png.", ""]
    return "\n".join(lines)


# The papers' own methods, drawn thick and on top; every other method gets its own colour, and
# a method's extra orders share its colour with another line style.
LEADING_COLOURS = {"fastfill": "#d62728", "fct": "#1f77b4", "ract": "#2ca02c", "bct": "#9467bd"}
OTHER_COLOURS = ("#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f", "#393b79", "#e7ba52",
                 "#a55194", "#252525", "#637939", "#843c39", "#3182bd", "#e6550d", "#31a354", "#756bb1")
EXTRA_ORDER_STYLES = ("--", ":", "-.", (0, (5, 1, 1, 1)))


def curve_styles(labels: list[str], headline: Mapping[str, bool]) -> dict[str, dict]:
    """Matplotlib styles of the comparison's curves, by label ("method (order)"): a colour per
    method, solid for its headline order and another style for each other order, thick for
    the papers' methods."""
    methods = list(dict.fromkeys(label.split(" (")[0] for label in labels))
    others = iter(OTHER_COLOURS * (1 + len(methods) // len(OTHER_COLOURS)))
    colours = {m: LEADING_COLOURS.get(m) or next(others) for m in methods}
    extra: dict[str, int] = {}
    styles = {}
    for label in labels:
        method = label.split(" (")[0]
        leading = method in LEADING_COLOURS
        linestyle: str | tuple[int, tuple[int, ...]]
        if headline[label]:
            linestyle = "-"
        else:
            linestyle = EXTRA_ORDER_STYLES[extra.get(method, 0) % len(EXTRA_ORDER_STYLES)]
            extra[method] = extra.get(method, 0) + 1
        styles[label] = {"color": colours[method], "linestyle": linestyle,
                         "linewidth": (2.8 if leading else 1.6) if headline[label] else 1.1,
                         "alpha": 1.0 if leading else 0.85, "zorder": 5 if leading else 3,
                         "marker": "o" if leading and headline[label] else None, "markersize": 3}
    return styles


def plot_comparison(path, summary: Mapping) -> None:
    """Top-1 and mAP against the fraction backfilled, mean over seeds: above, the whole range;
    below, the top of it (the 10 points under new/new), where the maps' curves lie. Every method
    its own colour, its headline order solid, the papers' methods (FastFill, FCT, RACT, BCT)
    thick; old/old and new/new as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = summary["mean_curves"]
    styles = curve_styles(list(curves), {label: curve["headline"] for label, curve in curves.items()})
    fig, axes = plt.subplots(2, 2, figsize=(15, 10), sharex=True)
    for column, (key, title) in enumerate((("top1", "Top-1 (%)"), ("map", "mAP (%)"))):
        top = 100 * summary["reference_points"]["new/new"][key] if "new/new" in summary["reference_points"] else None
        for row, ax in enumerate(axes[:, column]):
            for name, point in summary["reference_points"].items():
                ax.axhline(100 * point[key], color="black" if name == "new/new" else "grey",
                           linestyle="--" if name == "new/new" else ":", label=name, zorder=2)
            for label, curve in curves.items():
                ax.plot([100 * a for a in curve["alpha"]], [100 * v for v in curve[key]], label=label,
                        **styles[label])
            ax.set_ylabel(title + (" (the top 10 points)" if row else ""))
            ax.grid(alpha=0.3)
            if row and top is not None:
                highest = max([top] + [100 * v for c in curves.values() for v in c[key] if math.isfinite(v)])
                ax.set_ylim(top - 10, highest + 1)
        axes[1, column].set_xlabel("gallery backfilled (%)")
    handles, names = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, names, fontsize=8, loc="center left", bbox_to_anchor=(0.86, 0.5), frameon=False)
    fig.suptitle(f"Backfill curves of every method, mean over seeds {', '.join(map(str, summary['seeds']))} "
                 "(thick: the papers' methods; solid: each method's headline order)")
    fig.tight_layout(rect=(0, 0, 0.86, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
