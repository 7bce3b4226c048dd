"""Policies shared by the task wrappers.

Tasks pass paths and small values; the big arrays stay on disk, so no task input is hashed
for caching (DVC decides what re-runs, not Prefect's cache).
"""

from prefect.cache_policies import NO_CACHE

IO_RETRIES = {"retries": 3, "retry_delay_seconds": [1, 5, 15]}
NO_CACHING = {"cache_policy": NO_CACHE}
# Training tasks: a work pool with GPU workers takes them first (tag concurrency limit `gpu`).
GPU_TAGS = ["gpu"]


def log(message: str) -> None:
    """Log through Prefect's run logger inside a run, print outside one."""
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        get_run_logger().info(message)
    except MissingContextError:
        print(message, flush=True)
