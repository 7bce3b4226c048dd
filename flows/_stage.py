"""What every stage flow shares: its MLflow run under the pipeline's parent run."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from fastfill.components.platform.config import Params
from fastfill.components.platform.layout import Layout, read_json
from fastfill.components.platform.runtime import cpu_kernels_level, kernels_in_effect, use_threads
from fastfill.tasks.tracking import close_run, open_pipeline_run, open_stage_run, reopen_run


def registered_version(layout: Layout, output: str) -> str:
    """The registry version a stage gave its output (``models-old``...), from its record."""
    record = layout.registry_record(output)
    if not record.is_file():
        stage = output.replace("models-", "train --role ").replace("align-", "align --method ")
        raise FileNotFoundError(f"{record} is missing: the registry does not know this host's {output} yet; run "
                                f"`fastfill stage {stage}` (or `fastfill run`) to train and register it")
    return read_json(record)["version"]


@contextmanager
def stage_run(params: Params, stage: str, section: Mapping, parent_run_id: str | None) -> Iterator[str]:
    """An MLflow run for one stage; FAILED when the stage raises. Without a parent id (a stage
    run on its own, e.g. by `dvc repro`) the newest pipeline run of the same params and commit
    is the parent, or a new one: RUNNING while the stage runs, then closed as the stage ended
    (FINISHED, or FAILED), so no parent run is left RUNNING after separate stages. The stage
    computes with compute.threads threads and compute.cpu_kernels' kernels (a warning says when this
    process loaded its libraries before they could be pinned: its bytes may then differ)."""
    use_threads(params.compute.threads)
    level = cpu_kernels_level(params.compute.cpu_kernels)
    for problem in kernels_in_effect(level):
        print(f"warning: stage {stage} does not compute with the {level} kernels of compute.cpu_kernels: {problem}; "
              "its outputs may differ from another machine's. Run it as `fastfill stage ...` or `dvc repro`",
              file=sys.stderr, flush=True)
    own_parent = parent_run_id is None
    parent = parent_run_id or open_pipeline_run(params, fresh=False)
    if own_parent:
        reopen_run(params.mlflow, parent)
    run_id = open_stage_run(params.mlflow, parent, stage, section, Layout(params.paths).splits)
    try:
        yield run_id
    except BaseException:
        close_run(params.mlflow, run_id, ok=False)
        if own_parent:
            close_run(params.mlflow, parent, ok=False)
        raise
    close_run(params.mlflow, run_id, ok=True)
    if own_parent:
        close_run(params.mlflow, parent, ok=True)
