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
