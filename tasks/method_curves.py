"""Tasks of the evaluation stage: each method's backfill curves, the adapters', the shadow
index's, online backfilling's, and the reports."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from prefect import task

from fastfill.components.evaluation import curve_alphas, dual_curves
from fastfill.components.evaluation.assessment import MethodOutputs, method_curves, reference_points
from fastfill.components.evaluation.online_backfill import monotonicity, online_curve
from fastfill.components.evaluation.ordering import random_order, sigma_order
from fastfill.components.evaluation.reports import build_metrics, plot_curves, write_plot_data, write_summary
from fastfill.components.evaluation.rerank import RerankVariant, candidate_lists, query_driven_order, rerank_curves
from fastfill.components.experiment.adapters import fit_adapter
from fastfill.components.experiment.data import load_split
from fastfill.components.experiment.map_check import non_finite_rows
from fastfill.components.platform.config import EvaluateConfig, dual_method, online_method
from fastfill.components.platform.layout import Layout, load_array, read_json, write_json
from fastfill.tasks._policy import IO_RETRIES, NO_CACHING, log


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

    alphas = [float(a) for a in curve_alphas(curve_points)]
    keys = ("top1", "top5", "map", "nfr1", "pfr1", "negative_flips", "positive_flips")
    scalars = ("top1_auc", "top5_auc", "map_auc", "top1_trapz", "top5_trapz", "map_trapz", "nfr1_mean")
    return {"alpha": alphas, **{k: [math.nan] * len(alphas) for k in keys}, **dict.fromkeys(scalars, math.nan),
            "diverged": reason}


def _non_finite(outputs: MethodOutputs) -> list[str]:

    named = {"gallery_old": outputs.gallery_old, "query": outputs.query, "log_sigma2": outputs.log_sigma2}
    return [f"{name} in {non_finite_rows(values)} of {len(values)} rows" for name, values in named.items()
            if values is not None and non_finite_rows(values)]


@task(name="evaluate-method", **NO_CACHING)
def evaluate_method(config: EvaluateConfig, method: str, orders: Sequence[str], layout: Layout,
                    compatible: bool = False, distance: str | None = None) -> tuple[dict, float | None]:
    """Each order's curve of ``method`` and its Kendall tau, searched with ``distance`` (default
    config.distance); a method whose stored outputs are not finite gets ``diverged_curve`` for
    every order (its rows report NaN, the others go on)."""
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
                                orders, distance=distance or config.distance, curve_points=config.curve_points,
                                seed=config.seed)
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


def dual_order(config: EvaluateConfig, name: str, layout: Layout, n: int):
    """The backfill order ``name`` of the shadow-index methods: random (``evaluate.seed``, as the
    other methods), or sigma, built from ``evaluate.dual_sigma_from``'s stored log_sigma2 as that
    map's own sigma order is. Returns ``(order, None)``, or ``(None, reason)`` when the map's
    sigma is not finite (those rows are reported as diverged)."""

    if name == "random":
        return random_order(n, config.seed), None
    source, directory = config.dual_sigma_from, layout.align_dir(config.dual_sigma_from)
    path, check = directory / "log_sigma2.npy", directory / "check.json"
    log_sigma2 = load_array(path) if path.is_file() else None
    fallback = check.is_file() and read_json(check).get("fallback_order", {}).get("order") == "random"
    if log_sigma2 is None and not fallback:
        raise FileNotFoundError(f"{path} does not exist: the dual methods' sigma order is {source}'s; run "
                                f"`fastfill stage align --method {source}`, or drop sigma from evaluate.dual_orders")
    if log_sigma2 is not None and non_finite_rows(log_sigma2):
        return None, f"diverged: {source}'s log_sigma2 is not finite in {non_finite_rows(log_sigma2)} of {n} rows"
    if log_sigma2 is None:  # the map is a fallback (checked above): its sigma order is random
        log(f"dual methods (sigma): {source}'s fallback map has no sigma shown to help, so the sigma order is "
            "random (see its check.json)")
        return random_order(n, config.seed), None
    return sigma_order(log_sigma2), None


def dual_curves_of(config: EvaluateConfig, layout: Layout) -> dict[str, dict]:
    """The shadow-index playbook as methods ``dual_<merge>`` (docs/methods.md): no map; the new
    query searches the re-embedded items' new features, the old query the other items' old
    features (the old model's raw test features), the two lists merged. Every merge of
    ``evaluate.dual`` in one pass per order of ``evaluate.dual_orders``."""

    labels = load_split(layout.splits, "test").labels
    old, new = load_array(layout.features("old", "test")), load_array(layout.features("new", "test"))
    curves: dict[str, dict] = {dual_method(merge): {} for merge in config.dual}
    for name in config.dual_orders:
        order, diverged = dual_order(config, name, layout, len(labels))
        if diverged:
            log(f"dual methods ({name}): {diverged}, so those rows are reported as diverged, with NaN numbers")
            for by_order in curves.values():
                by_order[name] = diverged_curve(config.curve_points, diverged)
            continue
        by_merge = dual_curves(old, new, old, new, labels, order, merges=config.dual, distance=config.distance,
                               num_intermediate=config.curve_points)
        for merge, curve in by_merge.items():
            curves[dual_method(merge)][name] = curve.to_dict()
    return curves


@task(name="evaluate-dual", **NO_CACHING)
def evaluate_dual(config: EvaluateConfig, layout: Layout) -> dict[str, dict]:
    """``dual_curves_of``, logged, with its cost: two query embeddings and two searches per query."""
    start = time.perf_counter()
    curves = dual_curves_of(config, layout)
    for method, by_order in curves.items():
        for order, curve in by_order.items():
            log(f"{method} ({order}): top-1 {100 * curve['top1'][0]:.2f}% at 0% (old/old) -> "
                f"{100 * curve['top1'][-1]:.2f}%, top1_auc {100 * curve['top1_auc']:.2f}%, "
                f"map_auc {100 * curve['map_auc']:.2f}%")
    log(f"shadow index ({', '.join(config.dual)} x {', '.join(config.dual_orders)}) measured in "
        f"{time.perf_counter() - start:.0f} s; serving it costs two query embeddings and two searches per query")
    return curves


def rerank_curves_of(config: EvaluateConfig, layout: Layout) -> dict[str, dict]:
    """Candidate reranking as methods ``rerank_k<depth>[_sync<sync>]`` (docs/methods.md): no map,
    no write; the old query's top ``depth`` of the old gallery (the old model's raw test
    features), those with new features ranked by the new query. Every spec of
    ``evaluate.rerank`` in one pass per order of ``evaluate.rerank_orders`` (query: one order per
    depth, a query-driven worker's)."""

    labels = load_split(layout.splits, "test").labels
    old, new = load_array(layout.features("old", "test")), load_array(layout.features("new", "test"))
    # a depth past the gallery (n - 1 items besides the query's own) makes every item a candidate:
    # measured at n - 1, which is the same method exactly
    variants: dict[RerankVariant, list[str]] = {}
    for spec in config.rerank:
        variants.setdefault(RerankVariant(min(spec.depth, len(labels) - 1), spec.sync), []).append(spec.method)
        if spec.depth > len(labels) - 1:
            log(f"{spec.method}: the test split has {len(labels)} images, so every other item is a candidate "
                f"(depth {len(labels) - 1})")
    curves: dict[str, dict] = {method: {} for methods in variants.values() for method in methods}
    depths = sorted({v.depth for v in variants})
    # the query-driven worker's candidates: one sort for every depth (a shallower one is their first columns)
    deepest = candidate_lists(old, old, depths[-1], labels=labels, distance=config.distance) \
        if "query" in config.rerank_orders and depths else None
    for name in config.rerank_orders:
        orders: dict[int | None, tuple]
        if name == "query":  # each depth's own worker
            assert deepest is not None
            orders = {depth: (query_driven_order(deepest[:, :depth], seed=config.seed), None) for depth in depths}
        else:
            orders = {None: dual_order(config, name, layout, len(labels))}
        for depth, (order, diverged) in orders.items():
            chosen = [v for v in variants if depth is None or v.depth == depth]
            if diverged:
                log(f"rerank methods ({name}): {diverged}, so those rows are reported as diverged, with NaN numbers")
                for v in chosen:
                    for method in variants[v]:
                        curves[method][name] = diverged_curve(config.curve_points, diverged)
                continue
            measured = rerank_curves(old, new, old, new, labels, order, variants=chosen, distance=config.distance,
                                     num_intermediate=config.curve_points)
            for v, curve in measured.items():
                assert not isinstance(curve, tuple)  # not per_query
                for method in variants[v]:
                    curves[method][name] = curve.to_dict()
    return curves


@task(name="evaluate-rerank", **NO_CACHING)
def evaluate_rerank(config: EvaluateConfig, layout: Layout) -> dict[str, dict]:
    """``rerank_curves_of``, logged, with its cost: two query embeddings and one search per query,
    up to ``sync`` item embeddings on the query path."""
    start = time.perf_counter()
    curves = rerank_curves_of(config, layout)
    for method, by_order in curves.items():
        for order, curve in by_order.items():
            log(f"{method} ({order}): top-1 {100 * curve['top1'][0]:.2f}% at 0% -> {100 * curve['top1'][-1]:.2f}%, "
                f"top1_auc {100 * curve['top1_auc']:.2f}%, map_auc {100 * curve['map_auc']:.2f}%")
    log(f"candidate reranking ({', '.join(curves)} x {', '.join(config.rerank_orders)}) measured in "
        f"{time.perf_counter() - start:.0f} s; serving it costs two query embeddings and one search per query")
    return curves


def online_curves_of(config: EvaluateConfig, layout: Layout) -> dict[str, dict]:
    """Online backfilling as methods ``online_<kind>`` (docs/methods.md): the reverse
    transformation is the paper's metric-compatible one (``kind`` metric_compatible, which also
    reads the pairs' classes) or the query-side adapter ``kind``, fitted on the maps' pairs (the
    new_train split's new and old features); the new query searches the re-embedded items, its reverse
    transform the others' stored old features, merged by raw distance. Each order of
    ``evaluate.dual_orders``, each curve with its ``monotonicity``."""

    labels = load_split(layout.splits, "test").labels
    old, new = load_array(layout.features("old", "test")), load_array(layout.features("new", "test"))
    pairs = load_array(layout.features("new", "new_train")), load_array(layout.features("old", "new_train"))
    pair_labels = load_split(layout.splits, "new_train").labels if "metric_compatible" in config.online else None
    orders = {name: dual_order(config, name, layout, len(labels)) for name in config.dual_orders}
    curves: dict[str, dict] = {}
    for kind in config.online:
        adapter = fit_adapter(kind, *pairs, rank=config.adapter_rank, seed=config.seed, labels=pair_labels)
        # the metric-compatible transformation also scales the new space (its ranking unchanged)
        reverse, new_side = adapter(new), new * np.float32(getattr(adapter, "new_scale", 1.0))
        by_order = curves[online_method(kind)] = {}
        for name, (order, diverged) in orders.items():
            if diverged:
                log(f"{online_method(kind)} ({name}): {diverged}, so this row is reported as diverged, with NaN numbers")
                by_order[name] = diverged_curve(config.curve_points, diverged)
                continue
            curve = online_curve(reverse, new_side, old, new_side, labels, order, distance=config.distance,
                                 num_intermediate=config.curve_points).to_dict()
            by_order[name] = {**curve, **monotonicity(curve)}
    return curves


@task(name="evaluate-online", **NO_CACHING)
def evaluate_online(config: EvaluateConfig, layout: Layout) -> dict[str, dict]:
    """``online_curves_of``, logged, with whether each curve rises monotonically (the paper's claim)."""
    curves = online_curves_of(config, layout)
    for method, by_order in curves.items():
        for order, curve in by_order.items():
            if "monotone" not in curve:
                continue
            log(f"{method} ({order}): top-1 {100 * curve['top1'][0]:.2f}% at 0% -> {100 * curve['top1'][-1]:.2f}%, "
                f"top1_auc {100 * curve['top1_auc']:.2f}%, map_auc {100 * curve['map_auc']:.2f}%; "
                + ("monotone" if curve["monotone"] else
                   f"not monotone (largest fall: top-1 {100 * curve['top1_max_drop']:.2f}, "
                   f"mAP {100 * curve['map_max_drop']:.2f} points)"))
    return curves


@task(name="write-reports", **IO_RETRIES, **NO_CACHING)
def write_reports(config: EvaluateConfig, reference: Mapping, curves: Mapping, kendall: Mapping,
                  layout: Layout) -> dict[str, Path]:
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
