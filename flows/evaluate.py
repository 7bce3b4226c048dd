"""Stage 5: backfill curves of every method and order (the maps, the compatible models, the
query-side adapters, the shadow index, online backfilling, candidate reranking), metrics.json, plot data and the PNG."""

from __future__ import annotations

from prefect import flow

from fastfill.components.evaluation.reports import flatten_numbers
from fastfill.components.platform.config import Params, adapter_method
from fastfill.components.platform.layout import Layout, read_json
from fastfill.flows._stage import stage_run
from fastfill.tasks.method_curves import (
    evaluate_adapter,
    evaluate_dual,
    evaluate_method,
    evaluate_online,
    evaluate_reference,
    evaluate_rerank,
    write_reports,
)
from fastfill.tasks.tracking import log_results


@flow(name="evaluate", log_prints=True)
def evaluate_flow(params: Params, parent_run_id: str | None = None) -> dict:
    layout = Layout(params.paths)
    config = params.evaluate
    with stage_run(params, "evaluate", {"evaluate": config.model_dump(mode="json")}, parent_run_id) as run_id:
        reference = evaluate_reference(config, layout)
        curves, kendall = {}, {}
        for method, orders in config.orders.items():
            compatible = params.compatible.get(method)
            distance = compatible.distance if compatible is not None and compatible.distance else config.distance
            curves[method], tau = evaluate_method(config, method, orders, layout, compatible is not None, distance)
            if tau is not None:
                kendall[method] = tau
        for kind in config.adapters:  # the zero-write alternative (the comparison lists them)
            curves[adapter_method(kind)] = evaluate_adapter(config, kind, layout)
        if config.dual:  # the shadow-index playbook, no map (the comparison lists it)
            curves.update(evaluate_dual(config, layout))
        if config.online:  # new query only, reverse-transformed for the old part (the comparison lists it)
            curves.update(evaluate_online(config, layout))
        if config.rerank:  # the old index's candidates ranked by the new model, no map (the comparison lists it)
            curves.update(evaluate_rerank(config, layout))
        outputs = write_reports(config, reference, curves, kendall, layout)
        metrics = read_json(outputs["metrics"])
        series = {f"{method}.{order}.{key}": curve[key] for method, by_order in curves.items()
                  for order, curve in by_order.items() for key in ("top1", "top5", "map", "nfr1")}
        alphas = next(curve["alpha"] for by_order in curves.values() for curve in by_order.values())
        # step = the backfilled fraction in per mille: the MLflow chart's x axis is the backfill
        log_results(params.mlflow, run_id, metrics=flatten_numbers(metrics), series=series,
                    steps=[round(1000 * float(a)) for a in alphas],
                    artifacts=[outputs["plot"], outputs["metrics"], outputs["curves"]])
    return metrics
