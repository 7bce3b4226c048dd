"""The comparison: every method of docs/methods.md trained and evaluated over seeds, then one table.

compare_seed_flow is what the DVC stage compare@<seed> of comparison/dvc.yaml runs: the whole
pipeline with every method, reseeded, under compare.out/seed-<s>/. Its models and maps are
registered under compare.registered_model and compare.alignment_model, never as versions of
production's registered model, and without aliases. comparison_report_flow (the stage
`comparison`) reads the seeds' metrics and curves and writes reports/comparison.{json,md,png},
also logged to MLflow.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from components.evaluation.comparison import (
    comparison_markdown, describe_adapter, describe_method, plot_comparison, summarize,
)
from components.platform.config import Params, adapter_method
from components.platform.layout import Layout, read_json, write_json
from flows.pipeline import pipeline_flow
from flows.prepare import prepare_flow
from tasks._policy import log
from tasks.tracking import close_run, log_results, open_named_run


def comparison_outputs(params: Params) -> dict[str, Path]:
    reports = params.paths.reports
    return {"json": reports / "comparison.json", "markdown": reports / "comparison.md",
            "plot": reports / "comparison.png"}


@flow(name="compare-seed", log_prints=True)
def compare_seed_flow(params: Params, seed: int) -> dict:
    """Every method for one seed; returns that seed's metrics."""
    seeded = params.for_comparison(seed)
    log(f"comparison seed {seed}: {len(seeded.align)} maps ({', '.join(seeded.align)}), "
        f"{len(seeded.compatible)} compatible models ({', '.join(seeded.compatible)}), outputs in "
        f"{seeded.paths.artifacts.parent}, registered as {seeded.mlflow.registered_model} and "
        f"{seeded.mlflow.alignment_model}")
    return pipeline_flow(seeded, prepare=False, aliases=False)


@flow(name="comparison-report", log_prints=True)
def comparison_report_flow(params: Params, seeds: list[int] | None = None) -> dict:
    seeds = list(seeds if seeds is not None else params.compare.seeds)
    metrics, curves = {}, {}
    for seed in seeds:
        layout = Layout(params.for_comparison(seed).paths)
        try:
            metrics[str(seed)], curves[str(seed)] = read_json(layout.metrics), read_json(layout.curves)
        except FileNotFoundError as error:
            raise FileNotFoundError(f"seed {seed} of the comparison has no results ({error}); "
                                    f"run `fastfill compare --seed {seed}` or `dvc --cd comparison repro compare@{seed}`") from None
    one = params.for_comparison(seeds[0])
    configs = {**one.align, **one.compatible}
    descriptions = {m: describe_method(c) for m, c in configs.items()}
    descriptions.update({adapter_method(kind): describe_adapter(kind, one.evaluate.adapter_rank)
                         for kind in one.evaluate.adapters})
    summary = summarize(metrics, curves, descriptions, one.evaluate.headlines)
    outputs = comparison_outputs(params)
    write_json(outputs["json"], summary)
    outputs["markdown"].write_text(comparison_markdown(summary))
    plot_comparison(outputs["plot"], summary)
    run_id = open_named_run(params.mlflow, "comparison", {"seeds": ",".join(map(str, seeds))})
    means = {f"{label.replace(' (', '.').rstrip(')').replace('/', '_')}.{key}": stat["mean"]
             for label, row in summary["rows"].items() for key, stat in row.items() if isinstance(stat, dict)}
    log_results(params.mlflow, run_id, metrics=means, artifacts=list(outputs.values()))
    close_run(params.mlflow, run_id)
    for item in summary["expectations"]:
        if item["checked"]:
            log(f"{item['claim']}: {'holds' if item['holds_on_mean'] else 'does not hold'} on the mean "
                f"({100 * item['gap']:+.2f}), on {item['seeds_holding']}/{item['seeds']} seeds")
    return summary


@flow(name="compare", log_prints=True)
def compare_flow(params: Params, seeds: list[int] | None = None) -> dict:
    """The data splits, every seed, then the report."""
    seeds = list(seeds if seeds is not None else params.compare.seeds)
    prepare_flow(params)
    for seed in seeds:
        compare_seed_flow(params, seed)
    return comparison_report_flow(params, seeds)
