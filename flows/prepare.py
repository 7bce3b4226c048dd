"""Stage 1: the dataset's deterministic splits."""

from __future__ import annotations

from prefect import flow

from fastfill.components.platform.config import Params
from fastfill.components.platform.layout import Layout
from fastfill.flows._stage import stage_run
from fastfill.tasks.splits import read_dataset, write_splits
from fastfill.tasks.tracking import log_results


@flow(name="prepare-data", log_prints=True)
def prepare_flow(params: Params, parent_run_id: str | None = None) -> dict:
    layout = Layout(params.paths)
    config = params.prepare
    raw = read_dataset(config, layout.raw_cache)
    meta = write_splits(raw, config, layout.splits)
    with stage_run(params, "prepare", {"prepare": config.model_dump(mode="json")}, parent_run_id) as run_id:
        log_results(params.mlflow, run_id, metrics={f"size_{k}": v for k, v in meta["sizes"].items()},
                    json_artifacts={"meta.json": meta})
    return meta
