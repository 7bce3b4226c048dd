"""Which failure is which kind (cli/command_support.py ``outcome``), the console filter that keeps
Prefect's tracebacks of known failures off the terminal, and the up-front service checks."""

import logging
import signal
import socket
import subprocess
import sys
import time

import pytest

from fastfill.cli.command_support import (
    FAILED,
    INPUT,
    SERVICE,
    USAGE,
    ServiceUnavailable,
    _KnownFailuresOffTheConsole,
    check_prefect_api,
    outcome,
)
from fastfill.components.experiment.data import DataError
from fastfill.components.experiment.map_check import MapCheckError
from fastfill.components.gallery.inputs.images import ImageStoreError
from fastfill.components.gallery.layouts.catalog import GalleryError
from fastfill.components.gallery.store import ChecksumMismatch, ObjectMissing, StoreError, StoreUnreachable
from fastfill.components.gallery.store.lock import LeaseLost, UpgradeLocked
from fastfill.components.platform.config import ConfigError, MlflowConfig
from fastfill.components.platform.registry import RegistryError, TrackingUnreachable, check_tracking_server


@pytest.mark.parametrize("error, code", [
    (StoreUnreachable("s3://b/g: cannot connect"), SERVICE),
    (ImageStoreError("the image store failed"), SERVICE),
    (LeaseLost("no longer holds the lock"), SERVICE),
    (TrackingUnreachable("cannot reach"), SERVICE),
    (ServiceUnavailable("cannot reach the Prefect API"), SERVICE),
    (ConfigError("params.yaml: invalid configuration"), USAGE),
    (MapCheckError("the map lost"), FAILED),
    (RegistryError("unknown model 'models:/embedder/9'"), INPUT),
    (GalleryError("no gallery at g"), INPUT),
    (ChecksumMismatch("g/items/part-00000.parquet: checksum mismatch"), INPUT),
    (ObjectMissing("g/gallery.json does not exist"), INPUT),
    (StoreError("'ftp://x': unsupported store URI"), INPUT),
    (UpgradeLocked("g is being upgraded"), INPUT),
    (DataError("run the prepare stage first"), INPUT),
    (FileNotFoundError("no such file"), INPUT),
])
def test_each_known_failure_has_its_kind_and_keeps_its_message(error, code):
    assert outcome(error) == (code, str(error))


def test_anything_else_is_not_a_known_failure():
    assert outcome(RuntimeError("a bug")) is None
    assert outcome(KeyError("model")) is None
    assert outcome(ValueError("something")) is None


def test_a_temporary_server_that_does_not_start_in_time_is_one_line_naming_the_setting(monkeypatch):
    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    code, message = outcome(RuntimeError("Timed out while attempting to connect to ephemeral Prefect API server."))
    assert code == SERVICE
    assert "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS higher (now 120 s)" in message
    assert "\n" not in message


def test_mlflow_and_prefect_client_errors_that_say_a_service_is_down_are_service_failures():
    from mlflow.exceptions import MlflowException

    down = MlflowException("API request to http://127.0.0.1:1/api/2.0/mlflow/runs/get failed with exception "
                           "HTTPConnectionPool(host='127.0.0.1', port=1): Max retries exceeded\nwith url")
    code, message = outcome(down)
    assert code == SERVICE and "\n" not in message and "Check that it is up" in message
    from mlflow.protos.databricks_pb2 import UNAUTHENTICATED

    refused = MlflowException("API request to endpoint /api/2.0/mlflow/runs/get failed with error code 401 != 200",
                              error_code=UNAUTHENTICATED)  # as MLflow raises it for a 401 answer
    assert outcome(refused)[0] == SERVICE and "MLFLOW_TRACKING_USERNAME" in outcome(refused)[1]
    assert outcome(MlflowException("RESOURCE_DOES_NOT_EXIST: Run 'x' not found")) is None
    import httpx

    assert outcome(httpx.ConnectError("All connection attempts failed"))[0] == SERVICE
    assert outcome(RuntimeError("Failed to reach API at http://127.0.0.1:9/api/"))[0] == SERVICE


def _record(error: BaseException | None, message: str = "Encountered exception during execution") -> logging.LogRecord:
    exc_info = None
    if error is not None:
        try:
            raise error
        except BaseException:  # noqa: BLE001 - what logger.exception captures
            exc_info = sys.exc_info()
    return logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1, message, (), exc_info)


def test_the_console_leaves_out_prefect_s_records_of_known_failures_only():
    quiet = _KnownFailuresOffTheConsole()
    assert not quiet.filter(_record(RegistryError("unknown model")))
    assert not quiet.filter(_record(StoreUnreachable("cannot connect")))
    assert quiet.filter(_record(ZeroDivisionError("a bug")))  # a bug keeps its traceback
    assert quiet.filter(_record(None, "Finished in state Failed('...')"))


def test_a_local_tracking_store_needs_no_server():
    found = check_tracking_server(MlflowConfig(tracking_uri="sqlite:///nowhere/mlflow.db"))
    assert "a local store" in found


def test_a_tracking_server_that_does_not_answer_is_reported_in_the_timeout(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with socket.socket() as silent:  # accepts connections, answers nothing
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        port = silent.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(TrackingUnreachable, match=f"at http://127.0.0.1:{port} did not answer within 1 s"):
            check_tracking_server(MlflowConfig(tracking_uri=f"http://u:secret@127.0.0.1:{port}"), timeout=1)
        assert time.monotonic() - started < 5
    with pytest.raises(TrackingUnreachable, match="cannot reach the MLflow tracking server") as caught:
        check_tracking_server(MlflowConfig(tracking_uri=f"http://u:secret@127.0.0.1:{port}"), timeout=1)
    assert "secret" not in str(caught.value)  # credentials are never shown


def test_the_prefect_api_is_checked_only_when_it_is_set(monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        assert "PREFECT_API_URL is not set" in check_prefect_api()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with temporary_settings(updates={PREFECT_API_URL: f"http://127.0.0.1:{port}/api"}):
        with pytest.raises(ServiceUnavailable, match=f"cannot reach the Prefect API at http://127.0.0.1:{port}/api"
                           ) as offered:
            check_prefect_api(1)
        assert "or unset it" in str(offered.value)  # a flow can run on a temporary server instead
        with pytest.raises(ServiceUnavailable, match="point PREFECT_API_URL at the right one") as needed:
            check_prefect_api(1, needed=True)  # fastfill deploy: no temporary server will do
        assert "unset" not in str(needed.value)


def test_a_status_imports_prefect_only_where_a_server_may_be_named(tmp_path, monkeypatch):
    """`fastfill status` links the Prefect flow run only where PREFECT_API_URL names a server; it
    finds out without importing Prefect (about a second of CPU) when neither the environment nor
    a profiles file names one."""
    from fastfill.cli.doctor_commands import _prefect_may_be_named

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.delenv("PREFECT_PROFILES_PATH", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    assert not _prefect_may_be_named()
    (tmp_path / "profiles.toml").write_text('active = "team"\n[profiles.team]\nPREFECT_API_URL = "http://p:4200/api"\n')
    assert _prefect_may_be_named()
    (tmp_path / "profiles.toml").unlink()
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    assert _prefect_may_be_named()


# A command doing work, as the `fastfill` executable runs it (``cli.run``), that waits until a
# signal stops it: outside a flow, so Prefect's engine plays no part.
_WAITING_COMMAND = """
import sys, time
from fastfill import cli
from fastfill.cli.command_support import call

@cli.app.command("wait-here")
def wait_here() -> None:
    def work():
        print("waiting", flush=True)
        time.sleep(60)
    call(work)

sys.argv = ["fastfill", "wait-here"]
cli.run()
"""


@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_command_stopped_by_a_signal_ends_with_that_signal_s_status(tmp_path, signum, status):
    """docs/operations.md: 130 for SIGINT, 143 for SIGTERM. Typer ends every KeyboardInterrupt with
    130, and SIGTERM stops a command as Ctrl-C does: it used to end with 130 too."""
    command = subprocess.Popen([sys.executable, "-c", _WAITING_COMMAND], cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert command.stdout.readline().strip() == "waiting"
        command.send_signal(signum)
        _, err = command.communicate(timeout=30)
    finally:
        if command.poll() is None:
            command.kill()
    assert command.returncode == status, err
    stopped = [line for line in err.splitlines() if line.startswith("stopped by")]
    assert len(stopped) == 1 and stopped[0].startswith(f"stopped by {signal.Signals(signum).name}: "), err
    assert "Traceback" not in err, err
