"""The comparison: every method of docs/methods.md trained and evaluated over seeds, then one table.

compare_seed_flow is what the DVC stage compare@<seed> of comparison/dvc.yaml runs: the whole
pipeline with every method, reseeded, under compare.out/seed-<s>/. Its models and maps are
registered under compare.registered_model and compare.alignment_model, never as versions of
production's registered model, and without aliases. comparison_report_flow (the stage
`comparison`) reads the seeds' metrics and curves and writes reports/comparison.{json,md,png},
also logged to MLflow.

With compare.jobs (or ``--jobs``) above 1, compare_flow runs the seeds side by side, each in a
process of its own (``fastfill stage compare --seed s``, the command DVC runs) with cores/jobs
threads: on a CPU, a few small trainings at once use the cores better than one that has them
all. Each seed's log goes to compare.out/seed-<s>.log; the flow reports the newest line of each.

Either way the flow shows the progress of the comparison as a whole, over every seed's stages:
a bar on a terminal, a line with the rate and the time left in a log (flows/comparison_progress.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from prefect import flow

from fastfill.components.evaluation.comparison import (
    COSTS,
    comparison_markdown,
    describe_adapter,
    describe_dual,
    describe_method,
    describe_online,
    describe_rerank,
    method_cost,
    plot_comparison,
    rerank_cost,
    summarize,
)
from fastfill.components.platform.config import (
    AlignConfig,
    CompatibleConfig,
    Params,
    adapter_method,
    dual_method,
    online_method,
)
from fastfill.components.platform.layout import Layout, read_json, write_json
from fastfill.flows.comparison_progress import comparison_progress
from fastfill.flows.pipeline import pipeline_flow
from fastfill.flows.prepare import prepare_flow
from fastfill.tasks._policy import log
from fastfill.tasks.tracking import close_run, log_results, open_named_run


def comparison_outputs(params: Params) -> dict[str, Path]:
    """reports/comparison.*, or reports/comparison-<n>.* at prepare.train_per_class n."""
    reports, size = params.paths.reports, params.prepare.train_per_class
    stem = "comparison" if size is None else f"comparison-{size}"
    return {"json": reports / f"{stem}.json", "markdown": reports / f"{stem}.md", "plot": reports / f"{stem}.png"}


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
            raise FileNotFoundError(f"seed {seed} of the comparison has no results ({error}); run "
                                    f"`fastfill compare --seed {seed}` or `dvc --cd comparison repro compare@{seed}`"
                                    ) from None
    one = params.for_comparison(seeds[0])
    configs: dict[str, AlignConfig | CompatibleConfig] = {**one.align, **one.compatible}
    descriptions = {m: describe_method(c) for m, c in configs.items()}
    descriptions.update({adapter_method(kind): describe_adapter(kind, one.evaluate.adapter_rank)
                         for kind in one.evaluate.adapters})
    descriptions.update({dual_method(merge): describe_dual(merge) for merge in one.evaluate.dual})
    descriptions.update({online_method(kind): describe_online(kind, one.evaluate.adapter_rank)
                         for kind in one.evaluate.online})
    descriptions.update({spec.method: describe_rerank(spec.depth, spec.sync) for spec in one.evaluate.rerank})
    costs = {m: method_cost(c) for m, c in configs.items()}
    costs.update({adapter_method(kind): COSTS["adapter"] for kind in one.evaluate.adapters})
    costs.update({dual_method(merge): COSTS["dual"] for merge in one.evaluate.dual})
    costs.update({online_method(kind): COSTS["online"] for kind in one.evaluate.online})
    costs.update({spec.method: rerank_cost(spec.depth, spec.sync) for spec in one.evaluate.rerank})
    summary = summarize(metrics, curves, descriptions, one.evaluate.headlines, costs)
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


POLL_SECONDS = 10.0  # how often the seeds' logs are read for progress


def seed_log(params: Params, seed: int) -> Path:
    return Path(params.compare.out) / f"seed-{seed}.log"


def _progress_line(log_file: Path) -> str | None:
    """The newest line of a seed's log that says what it trains, and how far it is."""
    try:
        with log_file.open("rb") as handle:
            handle.seek(max(0, handle.seek(0, os.SEEK_END) - 16384))
            lines = handle.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        message = line.split(" - ", 1)[-1].strip()
        if " - " in line and (message.startswith(("training the", "epoch ", "evaluat", "kept the weights"))
                              or "top1_auc" in message):  # an evaluated row
            return message[:160]
    return None


def _seed_environment(threads: int, prefect_home: Path) -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    server = PREFECT_API_URL.value()
    if server:  # the seeds' flows on the server this flow reports to
        env["PREFECT_API_URL"] = server
    else:
        # without a Prefect server each process starts a temporary one; on one SQLite file they
        # would wait on each other's locks, so each gets its own
        env["PREFECT_HOME"] = str(prefect_home)
        env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)
    return env


def run_seeds_side_by_side(params: Params, seeds: list[int], jobs: int) -> None:
    """Each seed in a process of its own (the stage command), ``jobs`` at a time, cores/jobs
    threads each; its output in ``seed_log``. Raises, naming the seeds that failed and their
    logs, once the others are done (what finished is kept: a rerun resumes from checkpoints)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // jobs)
    log(f"comparison: seeds {seeds}, {jobs} at a time, each in its own process with {threads} thread"
        f"{'s' if threads > 1 else ''} ({cores} cores); logs in {seed_log(params, seeds[0]).parent}/seed-<s>.log")
    Path(params.compare.out).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fastfill-compare-") as scratch:
        config_file = Path(scratch) / "params.yaml"
        config_file.write_text(yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False))
        running: dict
        said: dict
        pending, running, failed, said = list(seeds), {}, [], {}
        started = time.monotonic()
        while pending or running:
            while pending and len(running) < jobs:
                seed = pending.pop(0)
                handle = seed_log(params, seed).open("w")
                command = [sys.executable, "-m", "fastfill.cli", "stage", "compare", "--seed", str(seed),
                           "--params", str(config_file)]
                process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, cwd=Path.cwd(),
                                           env=_seed_environment(threads, Path(scratch) / f"prefect-{seed}"))
                running[seed] = (process, handle)
                log(f"seed {seed}: started (process {process.pid})")
            time.sleep(POLL_SECONDS if running else 0)
            for seed, (process, handle) in list(running.items()):
                line = _progress_line(seed_log(params, seed))
                if line and line != said.get(seed):
                    said[seed] = line
                    log(f"seed {seed} ({time.monotonic() - started:.0f} s): {line}")
                if process.poll() is None:
                    continue
                handle.close()
                del running[seed]
                if process.returncode == 0:
                    log(f"seed {seed}: done after {time.monotonic() - started:.0f} s")
                else:
                    failed.append(seed)
                    log(f"seed {seed}: failed (exit {process.returncode}); its log: {seed_log(params, seed)}")
    if failed:
        failed.sort()
        tails = "\n".join(f"--- {seed_log(params, seed)} (last lines)\n"
                           + "\n".join(seed_log(params, seed).read_text(errors="replace").splitlines()[-15:])
                           for seed in failed)
        raise RuntimeError(f"seeds {failed} of the comparison failed (the others finished and are kept); run "
                           f"`fastfill compare --seed {failed[0]}` again to resume from its checkpoints\n{tails}")


@flow(name="compare", log_prints=True)
def compare_flow(params: Params, seeds: list[int] | None = None, jobs: int | None = None) -> dict:
    """The data splits, every seed (``jobs`` side by side; default compare.jobs), then the report."""
    seeds = list(seeds if seeds is not None else params.compare.seeds)
    jobs = min(jobs or params.compare.jobs, len(seeds))
    prepare_flow(params)
    with comparison_progress(params, seeds, poll=POLL_SECONDS):
        if jobs > 1:
            run_seeds_side_by_side(params, seeds, jobs)
        else:
            for seed in seeds:
                compare_seed_flow(params, seed)
    return comparison_report_flow(params, seeds)
