"""The whole experiment as one flow: prepare -> train old, new -> align each method -> evaluate.

It reads like the DAG in dvc.yaml; each step is the same stage flow a DVC stage runs.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from fastfill.components.evaluation.reports import flatten_numbers
from fastfill.components.evaluation.seed_report import seeds_markdown, summarize_seeds
from fastfill.components.platform.config import Params, needs_train
from fastfill.components.platform.layout import write_json
from fastfill.flows.align import align_flow
from fastfill.flows.compatible import compatible_flow
from fastfill.flows.evaluate import evaluate_flow
from fastfill.flows.prepare import prepare_flow
from fastfill.flows.train import train_flow
from fastfill.tasks.tracking import close_run, log_results, open_pipeline_run


@flow(name="fastfill-pipeline", log_prints=True)
def pipeline_flow(params: Params, prepare: bool = True, parent_run_id: str | None = None,
                  aliases: bool = True) -> dict:
    """``aliases=False``: the models are registered without moving champion/challenger."""
    needs_train(params, "the pipeline")  # before any stage runs
    parent = parent_run_id or open_pipeline_run(params, fresh=True)
    try:
        if prepare:
            prepare_flow(params, parent)
        train_flow(params, "old", parent, aliases)
        train_flow(params, "new", parent, aliases)
        for method in params.align:
            align_flow(params, method, parent)
        for method in params.compatible:
            compatible_flow(params, method, parent)
        metrics = evaluate_flow(params, parent)
        log_results(params.mlflow, parent, metrics=flatten_numbers(metrics))
    except BaseException:
        if parent_run_id is None:
            close_run(params.mlflow, parent, ok=False)
        raise
    if parent_run_id is None:
        close_run(params.mlflow, parent, ok=True)
    return metrics


@flow(name="fastfill-seeds", log_prints=True)
def seeds_flow(params: Params, seeds: list[int], out_root: Path = Path("runs")) -> dict:
    """The pipeline once per seed (models, maps and random orders reseeded; the data split is
    shared), each into runs/seed-<s>/, then reports/seeds.json with per-seed numbers and the
    mean and standard deviation."""
    prepare_flow(params)
    per_seed = {}
    for seed in seeds:
        seeded = params.with_seed(seed).with_outputs_under(out_root / f"seed-{seed}")
        per_seed[seed] = pipeline_flow(seeded, prepare=False)
    summary = {"seeds": seeds, "rows": summarize_seeds(per_seed), "per_seed": {str(s): m for s, m in per_seed.items()}}
    write_json(params.paths.reports / "seeds.json", summary)
    (params.paths.reports / "seeds.md").write_text(seeds_markdown(summary))
    return summary
