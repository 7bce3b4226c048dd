"""Process state a block changes and gives back: environment variables, the working folder."""

import os
from contextlib import contextmanager


@contextmanager
def restored_environ(*keys: str):
    """Whatever the block does to ``keys`` in os.environ is undone afterwards (set, changed or
    removed alike)."""
    saved = {key: os.environ.get(key) for key in keys}
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextmanager
def in_workdir(path):
    """Run the block in ``path`` with no MLFLOW_TRACKING_URI from the caller's environment, so a
    flow uses the MLflow store its params name."""
    previous = os.getcwd()
    with restored_environ("MLFLOW_TRACKING_URI"):
        os.environ.pop("MLFLOW_TRACKING_URI", None)
        os.chdir(path)
        try:
            yield
        finally:
            os.chdir(previous)


def stop_group(process, timeout: float) -> None:
    """End a process started with start_new_session=True and everything in its group: SIGTERM,
    ``timeout`` seconds to exit, then SIGKILL and another ``timeout`` to be reaped."""
    import os
    import signal
    import subprocess

    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=timeout)
