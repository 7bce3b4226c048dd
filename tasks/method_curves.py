"""Tasks of the evaluation stage: each method's backfill curves, the adapters', and the reports."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from prefect import task

from components.evaluation.assessment import MethodOutputs, method_curves, reference_points
from components.platform.config import EvaluateConfig
from components.experiment.data import load_split
from components.platform.layout import Layout, load_array, read_json, write_json
from components.evaluation.reports import build_metrics, plot_curves, write_plot_data, write_summary
from tasks._policy import IO_RETRIES, NO_CACHING, log


@task(name="evaluate-reference", **NO_CACHING)
def evaluate_reference(config: EvaluateConfig, layout: Layout) -> dict[str, dict]:
    labels = load_split(layout.splits, "test").labels
    points = reference_points(load_array(layout.features("old", "test")), load_array(layout.features("new", "test")),
                              labels, config.distance)
    for name, point in points.items():
        log(f"{name}: top-1 {100 * point['top1']:.2f}%, top-5 {100 * point['top5']:.2f}%, mAP {100 * point['map']:.2f}%")
    return points


def _method_outputs(method: str, layout: Layout, compatible: bool) -> MethodOutputs:
    """What the method's stage stored: artifacts/align/<method>/ for a map, or
    artifacts/compatible/<method>/ for a compatible new model (see MethodOutputs)."""
    directory = layout.compatible_dir(method) if compatible else layout.align_dir(method)

    def optional(name: str):
        path = directory / f"{name}.npy"
        return load_array(path) if path.is_file() else None

    check = directory / "check.json"
    order = read_json(check).get("fallback_order", {}).get("order") if check.is_file() else None
    return MethodOutputs(gallery_old=load_array(directory / "gallery_old.npy"), true_loss=optional("true_loss"),
                         log_sigma2=optional("log_sigma2"), query=optional("query"), logits=optional("logits"),
                         sigma_is_random=order == "random")


def diverged_curve(curve_points: int, reason: str) -> dict:
    """The curve of a method whose stored outputs are not finite (a map that diverged, used
    unchecked: check off, as in the comparison): every number NaN, and ``diverged``: why."""
    from components.evaluation import curve_alphas

    alphas = [float(a) for a in curve_alphas(curve_points)]
    keys = ("top1", "top5", "map", "nfr1", "pfr1", "negative_flips", "positive_flips")
    scalars = ("top1_auc", "top5_auc", "map_auc", "top1_trapz", "top5_trapz", "map_trapz", "nfr1_mean")
    return {"alpha": alphas, **{k: [math.nan] * len(alphas) for k in keys}, **dict.fromkeys(scalars, math.nan),
            "diverged": reason}


def _non_finite(outputs: MethodOutputs) -> list[str]:
    from components.experiment.map_check import non_finite_rows

    named = {"gallery_old": outputs.gallery_old, "query": outputs.query, "log_sigma2": outputs.log_sigma2}
    return [f"{name} in {non_finite_rows(values)} of {len(values)} rows" for name, values in named.items()
            if values is not None and non_finite_rows(values)]


@task(name="evaluate-method", **NO_CACHING)
def evaluate_method(config: EvaluateConfig, method: str, orders: Sequence[str], layout: Layout,
                    compatible: bool = False) -> tuple[dict, float | None]:
    """Each order's curve of ``method`` and its Kendall tau; a method whose stored outputs are
    not finite gets ``diverged_curve`` for every order (its rows report NaN, the others go on)."""
    labels = load_split(layout.splits, "test").labels
    outputs = _method_outputs(method, layout, compatible)
    bad = _non_finite(outputs)
    if bad:
        reason = f"diverged: its outputs are not finite ({'; '.join(bad)})"
        log(f"{method}: {reason}, so its rows ({', '.join(orders)}) are reported as diverged, with NaN numbers")
        return {order: diverged_curve(config.curve_points, reason) for order in orders}, None
    if outputs.sigma_is_random and "sigma" in orders:
        log(f"{method} (sigma): its fallback map's sigma order was not shown to help on the held-out pairs, so it "
            "is backfilled, and measured, in random order (see check.json)")
    curves, tau = method_curves(outputs, load_array(layout.features("new", "test")), labels,
                                orders, distance=config.distance, curve_points=config.curve_points, seed=config.seed)
    for order, curve in curves.items():
        log(f"{method} ({order}): top-1 {100 * curve['top1'][0]:.2f}% -> {100 * curve['top1'][-1]:.2f}%, "
            f"top1_auc {100 * curve['top1_auc']:.2f}%, map_auc {100 * curve['map_auc']:.2f}%")
    if tau is not None:
        log(f"{method}: Kendall tau(sigma, oracle) = {tau:.3f}")
    return curves, tau


def adapter_curves(config: EvaluateConfig, kind: str, layout: Layout) -> dict:
    """A query-side adapter as a method (docs/methods.md): fitted on the maps' pairs (the
    new_train split's old and new features), it maps the new model's test features into the old
    space. Queries search the old gallery as stored; a backfilled item's new features go through
    the same adapter, so every distance is in the old space. One order: random. (The evaluation
    stage and benchmarks/query_adapter.py both measure adapters with this.)"""
    from components.experiment.adapters import fit_adapter

    labels = load_split(layout.splits, "test").labels
    adapter = fit_adapter(kind, load_array(layout.features("new", "new_train")),
                          load_array(layout.features("old", "new_train")), rank=config.adapter_rank, seed=config.seed)
    new_test = load_array(layout.features("new", "test"))
    outputs = MethodOutputs(gallery_old=load_array(layout.features("old", "test")), query=adapter(new_test))
    curves, _ = method_curves(outputs, new_test, labels, ["random"], distance=config.distance,
                              curve_points=config.curve_points, seed=config.seed)
    return curves


@task(name="evaluate-adapter", **NO_CACHING)
def evaluate_adapter(config: EvaluateConfig, kind: str, layout: Layout) -> dict:
    """``adapter_curves``, logged."""
    curves = adapter_curves(config, kind, layout)
    curve = curves["random"]
    log(f"adapter {kind}: top-1 {100 * curve['top1'][0]:.2f}% at 0% (the stored gallery untouched) -> "
        f"{100 * curve['top1'][-1]:.2f}%, top1_auc {100 * curve['top1_auc']:.2f}%, map_auc {100 * curve['map_auc']:.2f}%")
    return curves


@task(name="write-reports", **IO_RETRIES, **NO_CACHING)
def write_reports(config: EvaluateConfig, reference: Mapping, curves: Mapping, kendall: Mapping, layout: Layout) -> dict[str, Path]:
    checks = {method: read_json(layout.align_dir(method) / "check.json") for method in curves
              if (layout.align_dir(method) / "check.json").is_file()}
    metrics = build_metrics(reference, curves, config.headlines, kendall, checks)
    write_json(layout.metrics, metrics)
    write_json(layout.curves, {"reference": reference, "curves": curves})
    write_plot_data(layout.plot_data, reference, curves)
    write_summary(layout.paths.reports / "summary", reference, curves)  # what `dvc metrics show` reads
    gaps = ", ".join(f"{k.split('_minus_')[1].removesuffix('_top1_0')} {100 * v:.2f}" for k, v in metrics["headroom"].items())
    plot_curves(layout.plot, reference, curves, title=f"Backfill curves (top-1 headroom at 0%: {gaps})",
                headline=config.headlines)
    return {"metrics": layout.metrics, "curves": layout.curves, "plot": layout.plot}
