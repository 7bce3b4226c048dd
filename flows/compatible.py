"""A compatible new model (BCT, RACT, stationary representations, BT^2): trained with train.new's
settings plus its compatibility term against the frozen old model (stationary representations:
its own old model, trained first with train.old's settings), evaluated without a map, registered
as its own version."""

from __future__ import annotations

from prefect import flow

from fastfill.components.experiment.data import load_meta
from fastfill.components.platform.config import Params, needs_train
from fastfill.components.platform.layout import Layout, write_json
from fastfill.flows._stage import registered_version, stage_run
from fastfill.tasks.compatible_training import embed_compatible, save_compatible, train_compatible
from fastfill.tasks.tracking import log_results, register_embedder


@flow(name="train-compatible", log_prints=True)
def compatible_flow(params: Params, method: str, parent_run_id: str | None = None) -> dict:
    if method not in params.compatible:
        raise ValueError(f"unknown compatible method {method!r}; params.yaml defines {sorted(params.compatible)}")
    layout = Layout(params.paths)
    config, train = params.compatible[method], needs_train(params, f"training {method}")
    train_config, own_old = train.new, config.trains_own_old_model
    section = {f"compatible.{method}": config.model_dump(mode="json"), "train.new": train_config.model_dump(mode="json")}
    if own_old:
        section["train.old"] = train.old.model_dump(mode="json")
    with stage_run(params, f"compatible-{method}", section, parent_run_id) as run_id:
        model, history = train_compatible(config, train_config, method, layout, train.old)
        embed_compatible(model, method, layout, own_old)
        save_compatible(model, train_config, history, method, layout)
        series = {k: [h[k] for h in history] for k in ("loss", "train_accuracy", "compatibility")}
        log_results(params.mlflow, run_id, series=series, metrics={f"final_{k}": v[-1] for k, v in series.items()})
        old_version = "its own old model" if own_old else str(registered_version(layout, "models-old"))
        entry = register_embedder(params.mlflow, run_id, model, "new", load_meta(layout.splits)["image_shape"],
                                  alias=None, tags={"method": method, "compatible_with": old_version})
        write_json(layout.registry_record(f"compatible-{method}"), entry)
    return entry
