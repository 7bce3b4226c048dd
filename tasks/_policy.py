"""Policies shared by the task wrappers.

Tasks pass paths and small values; the big arrays stay on disk, so no task input is hashed
for caching (DVC decides what re-runs, not Prefect's cache).
"""

import time
from collections.abc import Callable
from typing import TypedDict, TypeVar, cast
from uuid import UUID

from prefect.cache_policies import NO_CACHE, CachePolicy

from fastfill.components.gallery.layouts.catalog import GalleryError
from fastfill.components.gallery.store import DamagedObject
from fastfill.components.gallery.store.lock import UpgradeLocked

T = TypeVar("T")
# an upgrade that lost its lock (another process owns the gallery now), or a wrong input:
# retrying cannot fix either
_NOT_RETRIED = (UpgradeLocked, GalleryError, DamagedObject)


def _worth_retrying(task, task_run, state) -> bool:
    """Retry a task that failed on I/O, not one that failed with an error of ``_NOT_RETRIED``."""

    try:
        state.result()
    except _NOT_RETRIED:
        return False
    except BaseException:  # noqa: BLE001 - any other failure: the I/O retries below
        return True
    return True


class _Retries(TypedDict):
    """@task's retry arguments (a TypedDict, so that ``**IO_RETRIES`` is checked against them)."""
    retries: int
    retry_delay_seconds: list[float]
    retry_condition_fn: Callable[..., bool]


class _Caching(TypedDict):
    cache_policy: CachePolicy


IO_RETRIES: _Retries = {"retries": 3, "retry_delay_seconds": [1, 5, 15], "retry_condition_fn": _worth_retrying}
NO_CACHING: _Caching = {"cache_policy": NO_CACHE}
_pause = time.sleep  # between io_retried's tries (the tests' clock)


def io_retried(write: Callable[[], T], what: str, landed: Callable[[], T | None] | None = None) -> T:
    """``write()`` under ``IO_RETRIES`` without a task run of its own (a write made many times in
    one task, as the backfill's progress per chunk, or inside a task that must not run again, as
    the map check): as many tries, the same delays between them, the same errors not retried.
    ``write`` must be safe to try again; one that is not says through ``landed`` what its last
    try wrote before it failed (called before each retry; not None: that write, returned)."""
    delays = IO_RETRIES["retry_delay_seconds"]
    for attempt in range(IO_RETRIES["retries"] + 1):
        if attempt and landed is not None:
            found = landed()
            if found is not None:
                return found
        try:
            return write()
        except _NOT_RETRIED:
            raise
        except Exception as error:  # noqa: BLE001 - any other failure is I/O's until the tries run out
            if attempt == IO_RETRIES["retries"]:
                raise
            delay = delays[min(attempt, len(delays) - 1)]
            log(f"{what} failed ({type(error).__name__}: {error}); trying again in {delay:g} s")
            _pause(delay)
    raise AssertionError("unreachable: the last try returns or raises")


# Training tasks carry the tag `gpu`. A tag routes nothing: Prefect uses it for a tag concurrency
# limit only (`prefect concurrency-limit create gpu 1`: at most one such task runs at a time, on
# whatever machine runs its flow). Which machine runs them is the deployment's work pool:
# `fastfill deploy --gpu-pool NAME` puts the upgrade and the comparison on a pool whose workers
# run on GPU machines (docs/automation.md).
GPU_TAGS = ["gpu"]


def retrying() -> bool:
    """Whether the running task is on a retry: its last try may have written before it failed (the
    answer lost), so a write that is not idempotent by itself looks for its own first."""
    from prefect.runtime import task_run

    return task_run.run_count > 1


def log(message: str) -> None:
    """Log through Prefect's run logger inside a run, print outside one."""
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        get_run_logger().info(message)
    except MissingContextError:
        print(message, flush=True)


def epoch_progress(key: str, description: str):
    """A Prefect progress artifact (0-100%) and the callback that moves it after each epoch."""
    import re

    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    key = re.sub(r"[^a-z0-9-]+", "-", key.lower())  # Prefect's rule for artifact keys
    # called in a sync context: the id itself, not a coroutine
    artifact = cast(UUID, create_progress_artifact(0.0, key=key, description=description))

    def update(done: int, total: int) -> None:
        update_progress_artifact(artifact, 100.0 * done / total)

    return update
