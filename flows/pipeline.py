"""The whole experiment as one flow: prepare -> train old, new -> align each method -> evaluate.

It reads like the DAG in dvc.yaml; each step is the same stage flow a DVC stage runs.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from prefect import flow

from components.config import Params
from components.layout import write_json
from flows.align import align_flow
from flows.evaluate import _flat_numbers, evaluate_flow
from flows.prepare import prepare_flow
from flows.train import train_flow
from tasks.tracking import close_run, log_results, open_pipeline_run


@flow(name="fastfill-pipeline", log_prints=True)
def pipeline_flow(params: Params, prepare: bool = True, parent_run_id: str | None = None) -> dict:
    parent = parent_run_id or open_pipeline_run(params, fresh=True)
    try:
        if prepare:
            prepare_flow(params, parent)
        train_flow(params, "old", parent)
        train_flow(params, "new", parent)
        for method in params.align:
            align_flow(params, method, parent)
        metrics = evaluate_flow(params, parent)
        log_results(params.mlflow, parent, metrics=_flat_numbers("", metrics, {}))
    except BaseException:
        if parent_run_id is None:
            close_run(params.mlflow, parent, ok=False)
        raise
    if parent_run_id is None:
        close_run(params.mlflow, parent, ok=True)
    return metrics


SEED_KEYS = ("top1_0", "top1_100", "top1_auc", "top5_auc", "map_auc", "nfr1_mean")


def summarize_seeds(per_seed: dict[int, dict]) -> dict:
    """Mean and standard deviation over seeds of each row's headline numbers."""
    first = next(iter(per_seed.values()))
    rows = {}
    for name, entry in first.items():
        if name == "headroom" or not isinstance(entry, dict):
            continue
        row = {}
        for key in SEED_KEYS:
            values = [per_seed[s][name][key] for s in per_seed if key in per_seed[s][name]]
            if len(values) == len(per_seed):
                row[key] = {"mean": statistics.fmean(values),
                            "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                            "per_seed": dict(zip(map(str, per_seed), values))}
        for order, numbers in entry.get("by_order", {}).items():
            row.setdefault("by_order", {})[order] = {
                key: {"mean": statistics.fmean(v), "std": statistics.stdev(v) if len(v) > 1 else 0.0,
                      "per_seed": dict(zip(map(str, per_seed), v))}
                for key in ("top1_auc", "top5_auc", "map_auc")
                for v in [[per_seed[s][name]["by_order"][order][key] for s in per_seed]]
            }
        if "kendall_tau" in entry:
            v = [per_seed[s][name]["kendall_tau"] for s in per_seed]
            row["kendall_tau"] = {"mean": statistics.fmean(v), "std": statistics.stdev(v) if len(v) > 1 else 0.0,
                                  "per_seed": dict(zip(map(str, per_seed), v))}
        rows[name] = row
    return rows


@flow(name="fastfill-seeds", log_prints=True)
def seeds_flow(params: Params, seeds: list[int], out_root: Path = Path("runs")) -> dict:
    """The pipeline once per seed (models, maps and random orders reseeded; the data split is
    shared), each into runs/seed-<s>/, then reports/seeds.json with per-seed numbers and the
    mean and standard deviation."""
    prepare_flow(params)
    per_seed = {}
    for seed in seeds:
        seeded = params.with_seed(seed)
        seeded = seeded.model_copy(update={"paths": seeded.paths.model_copy(update={
            "artifacts": out_root / f"seed-{seed}" / "artifacts", "reports": out_root / f"seed-{seed}" / "reports"})})
        per_seed[seed] = pipeline_flow(seeded, prepare=False)
    summary = {"seeds": seeds, "rows": summarize_seeds(per_seed), "per_seed": {str(s): m for s, m in per_seed.items()}}
    write_json(params.paths.reports / "seeds.json", summary)
    return summary
