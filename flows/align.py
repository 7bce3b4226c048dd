"""Stage 4: train one alignment method's map on stored features, transform the gallery, register."""

from __future__ import annotations

from prefect import flow

from fastfill.components.experiment.map_check import check_metrics, check_tags
from fastfill.components.platform.config import Params
from fastfill.components.platform.layout import Layout, write_json
from fastfill.flows._stage import registered_version, stage_run
from fastfill.tasks.alignment import check_trained_map, save_map, train_map, transform_gallery
from fastfill.tasks.tracking import log_results, register_alignment


@flow(name="train-alignment", log_prints=True)
def align_flow(params: Params, method: str, parent_run_id: str | None = None) -> dict:
    if method not in params.align:
        raise ValueError(f"unknown alignment method {method!r}; params.yaml defines {sorted(params.align)}")
    layout = Layout(params.paths)
    config = params.align[method]
    with stage_run(params, f"align-{method}", {f"align.{method}": config.model_dump(mode="json")}, parent_run_id) as run_id:
        h, history = train_map(config, method, layout)
        h, used, check = check_trained_map(h, config, method, layout, params.evaluate.distance)
        transform_gallery(h, used, method, layout)
        save_map(h, used, history, method, layout)
        series = {k: [e.get(k, float("nan")) for e in history] for k in history[-1]
                  if k not in ("epoch", "best") and isinstance(history[-1][k], (int, float))}
        metrics = {f"final_{k}": v[-1] for k, v in series.items()}
        best = [e for e in history if e.get("best")]
        if best:
            metrics.update({f"best_{k}": best[0][k] for k in best[0] if k.startswith("val_")} | {
                "best_epoch": best[0]["epoch"]})
        tags = {}
        if check is not None:
            metrics.update(check_metrics(check))
            tags = check_tags(check)
        log_results(params.mlflow, run_id, series=series, metrics=metrics, tags=tags)
        joins = {role: registered_version(layout, f"models-{role}") for role in ("old", "new")}
        entry = register_alignment(params.mlflow, run_id, h, method, joins, tags)
        write_json(layout.registry_record(f"align-{method}"), entry)
    return entry
