"""Stages 2 and 3: train the old and the new embedding model, store their features, register them."""

from __future__ import annotations

from typing import Literal

from prefect import flow

from fastfill.components.experiment.data import load_meta
from fastfill.components.platform.config import Params, needs_train
from fastfill.components.platform.layout import Layout, write_json
from fastfill.flows._stage import stage_run
from fastfill.tasks.model_training import embed_splits, save_model, train_model
from fastfill.tasks.tracking import log_results, register_embedder


@flow(name="train-model", log_prints=True)
def train_flow(params: Params, role: Literal["old", "new"], parent_run_id: str | None = None,
               aliases: bool = True) -> dict:
    """``aliases=False``: register without moving champion/challenger (the comparison's runs)."""
    layout = Layout(params.paths)
    config = getattr(needs_train(params, f"training the {role} model"), role)
    with stage_run(params, f"train-{role}", {f"train.{role}": config.model_dump(mode="json")}, parent_run_id) as run_id:
        model, history = train_model(config, role, layout)
        embed_splits(model, role, layout)
        save_model(model, config, history, role, layout)
        log_results(params.mlflow, run_id, series={k: [h[k] for h in history] for k in ("loss", "train_accuracy")},
                    metrics={"final_loss": history[-1]["loss"], "final_train_accuracy": history[-1]["train_accuracy"]})
        entry = register_embedder(params.mlflow, run_id, model, role, load_meta(layout.splits)["image_shape"],
                                  alias="" if aliases else None)
        write_json(layout.registry_record(f"models-{role}"), entry)
    return entry
