"""Tasks of the prepare stage."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from fastfill.components.experiment.data import load_raw_dataset, make_splits, save_splits
from fastfill.components.platform.config import PrepareConfig
from fastfill.tasks._policy import IO_RETRIES, NO_CACHING, log


@task(name="read-dataset", **IO_RETRIES, **NO_CACHING)
def read_dataset(config: PrepareConfig, cache: Path):
    raw = load_raw_dataset(config, cache)
    log(f"read {config.dataset}: {len(raw.train)} train and {len(raw.test)} test images, "
        f"{len(raw.class_names)} classes")
    return raw


@task(name="write-splits", **IO_RETRIES, **NO_CACHING)
def write_splits(raw, config: PrepareConfig, directory: Path) -> dict:
    splits, meta = make_splits(raw, config)
    save_splits(splits, meta, directory)
    log(f"splits in {directory}: " + ", ".join(f"{k} {v}" for k, v in meta["sizes"].items()))
    return meta
