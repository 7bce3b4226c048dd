"""MLflow tasks: stage runs, metrics, artifacts, registrations (network I/O, so retried)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
from prefect import task

from fastfill.components.model_store import registered
from fastfill.components.platform import registry
from fastfill.components.platform.config import MlflowConfig, Params
from fastfill.tasks._policy import IO_RETRIES, NO_CACHING, log


def _client(config: MlflowConfig):
    return registry.setup(config)


@task(name="open-pipeline-run", **IO_RETRIES, **NO_CACHING)
def open_pipeline_run(params: Params, fresh: bool) -> str:
    client, experiment = _client(params.mlflow)
    commit = registry.git_commit()
    key = registry.pipeline_key(params.model_dump_json(), commit)
    run_id = registry.pipeline_run(client, experiment, key, fresh=fresh, tags={"git_commit": commit})
    if fresh:  # the parent run carries the whole configuration; each stage's run its own section
        registry.log_params(client, run_id, params.model_dump(mode="json", exclude={"compare"}))
    return run_id


@task(name="open-named-run", **IO_RETRIES, **NO_CACHING)
def open_named_run(config: MlflowConfig, name: str, tags: Mapping[str, str]) -> str:
    """A top-level run of its own (the comparison's report)."""
    client, experiment = _client(config)
    run = client.create_run(experiment, run_name=name, tags={"git_commit": registry.git_commit(), **tags})
    log(f"MLflow run {run.info.run_id} ({name})")
    return run.info.run_id


@task(name="open-stage-run", **IO_RETRIES, **NO_CACHING)
def open_stage_run(config: MlflowConfig, parent_run_id: str, stage: str, section: Mapping,
                   data_folder: Path) -> str:
    client, experiment = _client(config)
    tags = {"git_commit": registry.git_commit(), "data_version": registry.data_version(data_folder)}
    run_id = registry.stage_run(client, experiment, parent_run_id, stage, tags)
    registry.log_params(client, run_id, section)
    log(f"MLflow run {run_id} ({stage}) under pipeline run {parent_run_id}")
    return run_id


@task(name="log-results", **IO_RETRIES, **NO_CACHING)
def log_results(config: MlflowConfig, run_id: str, metrics: Mapping[str, float] | None = None,
                series: Mapping[str, list[float]] | None = None, artifacts: list[Path] | None = None,
                json_artifacts: Mapping[str, object] | None = None, tags: Mapping[str, str] | None = None,
                steps: list[int] | None = None) -> None:
    client, _ = _client(config)
    for key, value in (tags or {}).items():
        client.set_tag(run_id, key, value)
    if metrics:
        registry.log_metrics(client, run_id, metrics)
    if series:
        registry.log_series(client, run_id, series, steps)
    for path in artifacts or []:
        registry.log_artifact(client, run_id, Path(path))
    for name, data in (json_artifacts or {}).items():
        registry.log_json(client, run_id, data, name)


@task(name="close-run", **IO_RETRIES, **NO_CACHING)
def reopen_run(config: MlflowConfig, run_id: str) -> None:
    """A closed run running again (the pipeline's parent run while another stage runs on its own)."""
    client, _ = _client(config)
    client.update_run(run_id, status="RUNNING")


def close_run(config: MlflowConfig, run_id: str, ok: bool = True) -> None:
    client, _ = _client(config)
    registry.end_run(client, run_id, "FINISHED" if ok else "FAILED")


@task(name="register-embedder", **IO_RETRIES, **NO_CACHING)
def register_embedder(config: MlflowConfig, run_id: str, model, role: str, image_shape: list[int],
                      alias: str | None = "", tags: Mapping[str, str] | None = None) -> dict:
    """A version of the embedder; ``alias`` "" = the role's alias (old: champion, new:
    challenger), None = no alias (the comparison's models must not move production's aliases)."""
    client, _ = _client(config)
    alias = registry.ROLE_ALIASES[role] if alias == "" else alias
    example = np.zeros((1, *image_shape), dtype=np.float32)
    version = registered.register_embedder(client, run_id, model, example, config.registered_model, alias,
                                         tags={"role": role, "run_id": run_id, **(tags or {})})
    log(f"registered {config.registered_model} version {version}" + (f" with alias @{alias}" if alias else ""))
    return {"name": config.registered_model, "version": version, "alias": alias, "run_id": run_id}


@task(name="register-alignment", **IO_RETRIES, **NO_CACHING)
def register_alignment(config: MlflowConfig, run_id: str, h, method: str, joins: Mapping[str, str],
                       check_tags: Mapping[str, str] | None = None) -> dict:
    """The map as a version of the alignment model, tagged with the two versions it joins and,
    when it was checked, the map check's outcome."""
    client, _ = _client(config)
    example = np.zeros((2, h.old_dim), dtype=np.float32)
    tags = {"method": method, "run_id": run_id, "from_version": joins["old"], "to_version": joins["new"],
            "registered_model": config.registered_model, **(check_tags or {})}
    version = registered.register_alignment(client, run_id, h, example, config.alignment_model, tags)
    log(f"registered {config.alignment_model} version {version} ({method}: "
        f"{config.registered_model} v{joins['old']} -> v{joins['new']})")
    return {"name": config.alignment_model, "version": version, **tags}
