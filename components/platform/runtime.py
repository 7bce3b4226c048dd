"""Process-wide defaults set before Prefect is imported (no Prefect import here)."""

import os

_PREFECT_DEFAULTS = {
    # Otherwise the server tries to reach the internet and can hit `database is locked`.
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    # A fresh ephemeral server can take ~15 s to start on 2 cores.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_LOGGING_LEVEL": "INFO",
}


def apply_defaults() -> None:
    for key, value in _PREFECT_DEFAULTS.items():
        os.environ.setdefault(key, value)
    # MLflow's model logging would otherwise time out fetching nothing from the network.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


def use_threads(threads: int | None) -> int:
    """torch's intra-op thread count for a pipeline stage: ``threads`` (compute.threads) unless
    OMP_NUM_THREADS is set, which wins (the comparison sets it per seed process). The stages'
    float sums depend on how work splits across threads, so a fixed count is what makes a rerun
    on another machine of the same kind give the same bytes. Returns the count in use."""
    import torch

    if threads is not None and not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(threads)
    return torch.get_num_threads()
