"""The data-size sweep: the pipeline at several prepare.train_per_class sizes and seeds, then a
table and a plot of FCT-random against FastFill-sigma and FastFill-random (reports/sweep.*).

Each size has its own data splits under <out>/n-<size>/data; each seed its own models, maps
and reports under <out>/n-<size>/seed-<s>/. Models are registered without moving aliases.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from fastfill.components.evaluation.sweep_report import plot_sweep, size_label, summarize_sweep, sweep_markdown
from fastfill.components.platform.config import Params
from fastfill.components.platform.layout import Layout, read_json, write_json
from fastfill.flows.pipeline import pipeline_flow
from fastfill.flows.prepare import prepare_flow
from fastfill.tasks._policy import log
from fastfill.tasks.tracking import close_run, log_results, open_named_run


def sized(params: Params, size: int | None, out: Path) -> Params:
    """The configuration at one data size: its own splits under ``out``/n-<size>/data."""
    root = out / f"n-{size_label(size)}"
    data = params.model_dump()
    data["prepare"]["train_per_class"] = size
    data["paths"]["data"] = root / "data"
    data["paths"]["artifacts"], data["paths"]["reports"] = root / "artifacts", root / "reports"
    return Params.model_validate(data)


def sweep_outputs(params: Params) -> dict[str, Path]:
    reports = params.paths.reports
    return {"json": reports / "sweep.json", "markdown": reports / "sweep.md", "plot": reports / "sweep.png"}


@flow(name="data-size-sweep", log_prints=True)
def sweep_flow(params: Params, sizes: list[int | None], seeds: list[int], out: Path = Path("runs/sweep"),
               resume: bool = False, report_only: bool = False) -> dict:
    """``resume``: a (size, seed) whose metrics.json exists is read, not re-run. ``report_only``:
    nothing is run; the report covers the (size, seed) runs that exist (each size lists its seeds)."""
    results: dict = {}
    pairs: dict = {}
    for size in sizes:
        base = sized(params, size, out)
        label = size_label(size)
        if report_only:
            meta_path = base.paths.data / "splits" / "meta.json"
            if not meta_path.is_file():
                log(f"train_per_class {label}: no runs yet, left out of the report")
                continue
            meta = read_json(meta_path)
        else:
            meta = prepare_flow(base)
        pairs[label] = meta["sizes"]["new_train"]
        for seed in seeds:
            seeded = base.with_seed(seed).with_outputs_under(out / f"n-{label}" / f"seed-{seed}")
            metrics_path = Layout(seeded.paths).metrics
            if (resume or report_only) and metrics_path.is_file():
                log(f"train_per_class {label}, seed {seed}: reusing {metrics_path}")
                metrics = read_json(metrics_path)
            elif report_only:
                log(f"train_per_class {label}, seed {seed}: not run, left out of the report")
                continue
            else:
                log(f"train_per_class {label}, seed {seed}: {pairs[label]} training images")
                metrics = pipeline_flow(seeded, prepare=False, aliases=False)
            results.setdefault(label, {})[str(seed)] = metrics
    if not results:
        raise FileNotFoundError(f"no sweep runs under {out}; run `fastfill sweep` without --report-only first")
    summary = summarize_sweep(results, {label: pairs[label] for label in results})
    outputs = sweep_outputs(params)
    write_json(outputs["json"], {**summary, "per_run": results})
    outputs["markdown"].write_text(sweep_markdown(summary))
    plot_sweep(outputs["plot"], summary)
    run_id = open_named_run(params.mlflow, "data-size sweep", {"sizes": ",".join(map(size_label, sizes)),
                                                               "seeds": ",".join(map(str, seeds))})
    log_results(params.mlflow, run_id, artifacts=list(outputs.values()),
                metrics={f"n{size}.{row.split(' ')[0]}_{row.split('(')[1].rstrip(')')}.{key}": stat["mean"]
                         for size, entry in summary["sizes"].items() for row, numbers in entry["rows"].items()
                         for key, stat in numbers.items()})
    close_run(params.mlflow, run_id)
    return summary
