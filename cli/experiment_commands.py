"""Commands of the experiment: the pipeline, seeds, the data-size sweep, the comparison, one
stage at a time (what DVC calls). The evaluation of your own features: cli/feature_commands.py."""

from __future__ import annotations

import time
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from fastfill.cli import app
from fastfill.cli.command_support import CLAIM, USAGE, ParamsOption, call, fail, load, record_in_dvc
from fastfill.components.evaluation.comparison import ranking
from fastfill.components.evaluation.seed_report import seeds_markdown
from fastfill.flows.align import align_flow
from fastfill.flows.compare import compare_flow, compare_seed_flow, comparison_outputs, comparison_report_flow
from fastfill.flows.evaluate import evaluate_flow
from fastfill.flows.pipeline import pipeline_flow, seeds_flow
from fastfill.flows.prepare import prepare_flow
from fastfill.flows.sweep import sweep_flow, sweep_outputs
from fastfill.flows.train import train_flow

stage_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Run one pipeline stage (what each DVC stage calls).")
app.add_typer(stage_app, name="stage", short_help="Run one pipeline stage (what DVC calls).")


def _print_summary(metrics: dict) -> None:
    typer.echo("\n                      top-1@0  top-1@100  top1_auc  map_auc")
    for name, entry in metrics.items():
        if name == "headroom":
            continue
        label = name + (f" ({entry['order']})" if "order" in entry else "")
        typer.echo(f"  {label:<20}{100 * entry['top1_0']:8.2f}  {100 * entry['top1_100']:9.2f}"
                   f"  {100 * entry['top1_auc']:8.2f}  {100 * entry['map_auc']:7.2f}")
    for key, gap in metrics.get("headroom", {}).items():
        typer.echo(f"  headroom {key}: {100 * gap:.2f} top-1 points")


@app.command(short_help="Run the whole pipeline on params.yaml.")
def run(params: ParamsOption = Path("params.yaml"),
        dvc_commit: Annotated[bool, typer.Option(help="record the outputs in dvc.lock afterwards")] = True) -> None:
    """Run the whole pipeline: data splits, old and new models, alignment maps, evaluation."""
    config = load(params)

    start = time.perf_counter()
    metrics = call(pipeline_flow, config)
    _print_summary(metrics)
    typer.echo(f"\npipeline finished in {time.perf_counter() - start:.0f} s; "
               f"reports in {config.paths.reports}/ (metrics.json, backfill.png)")
    if dvc_commit:
        record_in_dvc(params, ["--with-deps", "evaluate"],
                      "dvc.lock updated: `dvc status` is clean, `dvc repro` has nothing to redo")


@app.command(short_help="Run the pipeline once per seed; reports/seeds.json.")
def seeds(params: ParamsOption = Path("params.yaml"),
          seed: Annotated[list[int] | None, typer.Option("--seed", help="repeat for several; default: experiment.seeds")] = None,
          out: Annotated[Path, typer.Option(help="per-seed outputs go to OUT/seed-<s>/")] = Path("runs")) -> None:
    """Run the pipeline once per seed and write reports/seeds.json (per-seed numbers, mean, std)."""
    config = load(params)

    chosen = seed or list(config.experiment.seeds)
    start = time.perf_counter()
    summary = call(seeds_flow, config, chosen, out)
    typer.echo(f"\nseeds {chosen}, {time.perf_counter() - start:.0f} s in all\n")
    typer.echo(seeds_markdown(summary))
    typer.echo(f"written: {config.paths.reports / 'seeds.json'} and seeds.md")


@app.command(short_help="FastFill against FCT by data size and seed.")
def sweep(params: ParamsOption = Path("params.yaml"),
          size: Annotated[list[str] | None, typer.Option("--size", help="prepare.train_per_class, or all; repeat for "
                                                         "several (default: 100, 300, 1000, all)")] = None,
          seed: Annotated[list[int] | None, typer.Option("--seed", help="repeat for several; default: experiment.seeds")] = None,
          out: Annotated[Path, typer.Option(help="per-size, per-seed outputs go to OUT/n-<size>/seed-<s>/")] = Path("runs/sweep"),
          resume: Annotated[bool, typer.Option(help="reuse the runs that already have a metrics.json")] = False,
          report_only: Annotated[bool, typer.Option(help="run nothing: report the runs that exist")] = False) -> None:
    """FastFill against FCT by data size: the pipeline at each train_per_class and seed, then
    reports/sweep.{md,json,png}."""
    config = load(params)

    sizes = []
    for text in size or ["100", "300", "1000", "all"]:
        if text != "all" and not (text.isdigit() and int(text) > 0):
            fail(f"--size {text!r} must be a positive number of images per class, or all", USAGE)
        sizes.append(None if text == "all" else int(text))
    chosen = seed or list(config.experiment.seeds)
    start = time.perf_counter()
    summary = call(sweep_flow, config, sizes, chosen, out, resume, report_only)
    outputs = sweep_outputs(config)
    typer.echo(f"\nsweep of sizes {[s or 'all' for s in sizes]} x seeds {chosen}: {time.perf_counter() - start:.0f} s\n")
    typer.echo(outputs["markdown"].read_text())
    typer.echo(f"written: {outputs['markdown']}, {outputs['json'].name}, {outputs['plot'].name}")
    if not summary["holds_everywhere"]:
        raise typer.Exit(CLAIM)


@app.command(short_help="Every method over seeds; reports/comparison.*.")
def compare(params: ParamsOption = Path("params.yaml"),
            seed: Annotated[list[int] | None, typer.Option("--seed", help="repeat for several; default: compare.seeds")] = None,
            dvc_commit: Annotated[bool, typer.Option(
                help="record the outputs in dvc.lock and comparison/dvc.lock afterwards")] = True,
            jobs: Annotated[int | None, typer.Option(min=1, help="seeds trained side by side, each in its own process "
                                                     "(logs in compare.out/seed-<s>.log); default: compare.jobs")] = None,
            size: Annotated[int | None, typer.Option(min=1, help="training images per class (prepare.train_per_class); "
                                                     "its splits and seeds under compare.out/n-<size>/, its report "
                                                     "reports/comparison-<size>.*; not recorded in DVC")] = None) -> None:
    """Train and evaluate every method (FCT, FastFill and its ablations, RBT, unified, BCT, RACT,
    the later methods) over seeds; write reports/comparison.{md,json,png} and log them to MLflow.
    The same as 'dvc --cd comparison repro' (the stages of comparison/dvc.yaml); the models are
    registered as compare.registered_model, never as versions of production's model."""
    config = load(params)
    if size is not None:
        config, dvc_commit = config.comparison_at_size(size), False

    chosen = seed or list(config.compare.seeds)
    start = time.perf_counter()
    summary = call(compare_flow, config, chosen, jobs)
    typer.echo(f"\ncomparison of seeds {chosen} finished in {time.perf_counter() - start:.0f} s")
    for metric in ("top1_auc", "map_auc"):
        typer.echo(f"  {metric}: " + " > ".join(f"{label} {100 * v:.2f}" for label, v in ranking(summary, metric)))
    outputs = comparison_outputs(config)
    typer.echo(f"written: {outputs['markdown']}, {outputs['json'].name}, {outputs['plot'].name}")
    if dvc_commit:
        # the splits in the pipeline's project; the seeds (and, when every seed of compare.seeds
        # ran, the report) in the comparison's own project, comparison/
        record_in_dvc(params, ["prepare"])
        every_seed = sorted(chosen) == sorted(config.compare.seeds)
        stages = [f"compare@{s}" for s in chosen if s in config.compare.seeds] + (["comparison"] if every_seed else [])
        record_in_dvc(params, stages, "comparison/dvc.lock updated: `dvc --cd comparison repro` has nothing to redo"
                      if every_seed else None, project=Path("comparison"))


class Role(str, Enum):
    old = "old"
    new = "new"


@stage_app.command("prepare", short_help="The deterministic splits.")
def stage_prepare(params: ParamsOption = Path("params.yaml")) -> None:
    """Write the deterministic splits (old-train, new-train, test)."""
    config = load(params)

    call(prepare_flow, config)


@stage_app.command("train", short_help="Train, embed and register one model.")
def stage_train(role: Annotated[Role, typer.Option(help="which model")],
                params: ParamsOption = Path("params.yaml")) -> None:
    """Train one embedding model, store its features of the splits, register it."""
    config = load(params)

    call(train_flow, config, role.value)


@stage_app.command("align", short_help="Train one method's map; transform the gallery.")
def stage_align(method: Annotated[str, typer.Option(help="a method under align: in params.yaml")],
                params: ParamsOption = Path("params.yaml")) -> None:
    """Train one alignment method's map on the stored features and transform the gallery."""
    config = load(params)
    if method not in config.align:
        fail(f"unknown method {method!r}; params.yaml defines {sorted(config.align)}", USAGE)

    call(align_flow, config, method)


@stage_app.command("evaluate", short_help="Every method's backfill curves and reports.")
def stage_evaluate(params: ParamsOption = Path("params.yaml")) -> None:
    """Backfill curves of every method and order; reports/metrics.json, plot data, PNG."""
    config = load(params)

    _print_summary(call(evaluate_flow, config))


@stage_app.command("compare", short_help="The comparison's methods for one seed.")
def stage_compare(seed: Annotated[int, typer.Option(help="one of compare.seeds")],
                  params: ParamsOption = Path("params.yaml")) -> None:
    """Every method of the comparison for one seed, under compare.out/seed-<s>/."""
    config = load(params)

    _print_summary(call(compare_seed_flow, config, seed))


@stage_app.command("comparison", short_help="The comparison's report from its seeds.")
def stage_comparison(params: ParamsOption = Path("params.yaml")) -> None:
    """reports/comparison.{md,json,png} from the seeds' results."""
    config = load(params)

    call(comparison_report_flow, config)
    typer.echo((config.paths.reports / "comparison.md").read_text())

