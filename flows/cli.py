"""The `fastfill` command: every flow and the bring-your-own-features evaluation."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Upgrade an embedding model without re-indexing: FastFill pipeline, backfill and evaluation.")
stage_app = typer.Typer(no_args_is_help=True, help="Run one pipeline stage (what each DVC stage calls).")
app.add_typer(stage_app, name="stage")

ParamsOption = Annotated[Path, typer.Option("--params", "-p", help="the configuration file")]


def _params(path: Path):
    from components.config import ConfigError, load_params

    try:
        return load_params(path)
    except ConfigError as error:
        typer.secho(str(error), fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None


def _call(flow, *args):
    """Run a flow; a missing input ends the command with its message instead of a traceback."""
    from components.data import DataError

    try:
        return flow(*args)
    except (DataError, FileNotFoundError) as error:
        typer.secho(f"error: {error}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None


def _dvc_commit(params_path: Path) -> None:
    """Record what `fastfill run` produced in dvc.lock, so `dvc status` is clean and `dvc repro`
    redoes nothing. Only for the repository's own params.yaml and default paths."""
    if params_path.resolve() != Path("params.yaml").resolve() or not Path("dvc.yaml").is_file():
        return
    dvc = shutil.which("dvc") or str(Path(sys.executable).with_name("dvc"))
    result = subprocess.run([dvc, "commit", "--force", "--quiet"], capture_output=True, text=True)
    if result.returncode != 0:
        typer.secho(f"warning: `dvc commit` failed, DVC does not know about this run:\n{result.stderr}",
                    fg=typer.colors.YELLOW, err=True)
    else:
        typer.echo("dvc.lock updated: `dvc status` is clean, `dvc repro` has nothing to redo")


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


@app.command()
def run(params: ParamsOption = Path("params.yaml"),
        dvc_commit: Annotated[bool, typer.Option(help="record the outputs in dvc.lock afterwards")] = True) -> None:
    """Run the whole pipeline: data splits, old and new models, alignment maps, evaluation."""
    config = _params(params)
    from flows.pipeline import pipeline_flow

    start = time.perf_counter()
    metrics = _call(pipeline_flow, config)
    _print_summary(metrics)
    typer.echo(f"\npipeline finished in {time.perf_counter() - start:.0f} s; "
               f"reports in {config.paths.reports}/ (metrics.json, backfill.png)")
    if dvc_commit:
        _dvc_commit(params)


@app.command()
def seeds(params: ParamsOption = Path("params.yaml"),
          seed: Annotated[list[int] | None, typer.Option("--seed", help="repeat for several; default: experiment.seeds")] = None,
          out: Annotated[Path, typer.Option(help="per-seed outputs go to OUT/seed-<s>/")] = Path("runs")) -> None:
    """Run the pipeline once per seed and write reports/seeds.json (per-seed numbers, mean, std)."""
    config = _params(params)
    from components.seed_report import seeds_markdown
    from flows.pipeline import seeds_flow

    chosen = seed or list(config.experiment.seeds)
    start = time.perf_counter()
    summary = _call(seeds_flow, config, chosen, out)
    typer.echo(f"\nseeds {chosen}, {time.perf_counter() - start:.0f} s in all\n")
    typer.echo(seeds_markdown(summary))
    typer.echo(f"written: {config.paths.reports / 'seeds.json'} and seeds.md")


class Role(str, Enum):
    old = "old"
    new = "new"


@stage_app.command("prepare")
def stage_prepare(params: ParamsOption = Path("params.yaml")) -> None:
    """Write the deterministic splits (old-train, new-train, test)."""
    config = _params(params)
    from flows.prepare import prepare_flow

    _call(prepare_flow, config)


@stage_app.command("train")
def stage_train(role: Annotated[Role, typer.Option(help="which model")],
                params: ParamsOption = Path("params.yaml")) -> None:
    """Train one embedding model, store its features of the splits, register it."""
    config = _params(params)
    from flows.train import train_flow

    _call(train_flow, config, role.value)


@stage_app.command("align")
def stage_align(method: Annotated[str, typer.Option(help="a method under align: in params.yaml")],
                params: ParamsOption = Path("params.yaml")) -> None:
    """Train one alignment method's map on the stored features and transform the gallery."""
    config = _params(params)
    if method not in config.align:
        typer.secho(f"unknown method {method!r}; params.yaml defines {sorted(config.align)}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    from flows.align import align_flow

    _call(align_flow, config, method)


@stage_app.command("evaluate")
def stage_evaluate(params: ParamsOption = Path("params.yaml")) -> None:
    """Backfill curves of every method and order; reports/metrics.json, plot data, PNG."""
    config = _params(params)
    from flows.evaluate import evaluate_flow

    _print_summary(_call(evaluate_flow, config))


class Distance(str, Enum):
    l2 = "l2"
    cosine = "cosine"


@app.command()
def evaluate(features: Annotated[Path, typer.Option(help="folder with query.npy, gallery_new.npy, gallery_old.npy, labels.npy [, order.npy]")],
             distance: Annotated[Distance, typer.Option(help="l2, or cosine on L2-normalised vectors")] = Distance.l2,
             out: Annotated[Path | None, typer.Option(help="JSON file to write; default: print it")] = None,
             points: Annotated[int, typer.Option(help="intermediate curve points B (the curve has B+2)")] = 20) -> None:
    """Evaluate your own features: the backfill curve and its summaries, as JSON."""
    from components.byof import EvaluationInputError, evaluate_feature_folder

    try:
        result = evaluate_feature_folder(features, distance=distance.value, num_intermediate=points)
    except EvaluationInputError as error:
        typer.secho(f"error: {error}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    text = json.dumps(result, indent=2)
    if out is None:
        typer.echo(text)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
        typer.echo(f"top1_auc {result['top1_auc']:.4f}, map_auc {result['map_auc']:.4f}; written to {out}")


if __name__ == "__main__":
    app()
