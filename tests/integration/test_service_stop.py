"""The long-running commands stop on SIGTERM or Ctrl-C (SIGINT) within seconds, with one line and
no traceback, also when the servers they talk to went away first (real servers, killed):
`fastfill serve` and `fastfill webhook serve` with the Prefect server gone, `fastfill watch
--every` with the MLflow and the Prefect server gone."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.unit.test_webhook_receiver import SECRET, _alias_body, _post, _signed

pytestmark = pytest.mark.slow  # a Prefect server of its own: about a minute on 2 cores

BIN = Path(sys.executable).parent
STOPPED_WITHIN = 15  # seconds from the signal to the exit


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class _Server:
    """A server in its own process group, answering ``health_url``: ``kill()`` (SIGKILL) or
    ``hang()`` (SIGSTOP: it accepts connections and answers nothing), the whole group."""

    def __init__(self, command: list[str], env: dict, health_url: str):
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True)
        self.health_url = health_url

    def hang(self) -> None:
        os.killpg(self.process.pid, signal.SIGSTOP)

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)


@contextmanager
def _running(command: list[str], env: dict, health_url: str, name: str):
    server = _Server(command, env, health_url)
    try:
        _wait_for(lambda: _healthy(health_url), 120, f"the {name} server")
        yield server
    finally:
        server.kill()


@contextmanager
def _prefect_server(cli_env: dict, tmp_path: Path):
    """A Prefect server on a free port: yields (the environment that points at it, the server)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {**cli_env, "PREFECT_API_URL": url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_HOME": str(tmp_path / "prefect-server-home")}
    with _running([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)], env, url,
                  "Prefect") as server:
        yield env, server


@contextmanager
def _mlflow_server(env: dict, tmp_path: Path):
    """An MLflow tracking server (SQLite) on a free port: yields (its URL, the server)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with _running([str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                   "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow-server.db'}",
                   "--default-artifact-root", str(tmp_path / "mlflow-artifacts")], env, url, "MLflow") as server:
        yield url, server


class _Command:
    """A `fastfill` command in its own process, stdout and stderr each in a file."""

    def __init__(self, args: list[str], cwd: Path, env: dict, name: str):
        self.out, self.err = cwd / f"{name}.out", cwd / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.process = subprocess.Popen([str(BIN / "fastfill"), *args], cwd=cwd, env=env, stdout=out, stderr=err)

    def text(self) -> str:
        return self.out.read_text() + self.err.read_text()

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match:
        _wait_for(lambda: self.process.poll() is not None or re.search(pattern, self.text()), timeout,
                  f"{pattern!r} from `fastfill`")
        found = re.search(pattern, self.text())
        assert found, self.text()[-3000:]
        return found

    def stop(self, signum: int) -> float:
        """Send ``signum``; the seconds until the process ended."""
        self.process.send_signal(signum)
        started = time.monotonic()
        try:
            self.process.wait(timeout=60)
        finally:
            if self.process.poll() is None:
                self.process.kill()
        return time.monotonic() - started

    def assert_stopped_cleanly(self, seconds: float, stop_line: str) -> None:
        text = self.text()
        print(f"stopped {seconds:.1f} s after the signal:\n{text[-2000:]}")
        assert seconds < STOPPED_WITHIN, text[-3000:]
        assert "Traceback" not in text, text[-3000:]
        assert [line for line in text.splitlines() if line.startswith("stopped")] == [
            line for line in text.splitlines() if stop_line in line], text[-3000:]
        assert len([line for line in text.splitlines() if stop_line in line]) == 1, text[-3000:]


def test_serve_stops_on_sigint_and_on_sigterm_after_the_prefect_server_is_gone(tiny_workdir, cli_env, tmp_path):
    args = ["serve", "--store", str(tmp_path / "gallery")]
    with _prefect_server(cli_env, tmp_path) as (env, prefect):
        up = _Command(args, tiny_workdir, env, "serve-up")  # Ctrl-C while the Prefect server is up
        up.wait_for("serving ")
        time.sleep(3)  # its runner polling the server
        up.assert_stopped_cleanly(up.stop(signal.SIGINT), "stopped; the served deployments' schedules are paused")

        gone = _Command(args, tiny_workdir, env, "serve-gone")
        gone.wait_for("serving ")
        time.sleep(3)
        prefect.kill()  # the server goes first
        time.sleep(2)
        seconds = gone.stop(signal.SIGTERM)
    gone.assert_stopped_cleanly(seconds, "stopped; the served deployments' schedules could not be paused")


def _webhook_serve(workdir: Path, env: dict, name: str) -> tuple[_Command, tuple[str, int]]:
    command = _Command(["webhook", "serve", "--port", "0", "--store", str(workdir / "gallery")], workdir,
                       {**env, "FASTFILL_WEBHOOK_SECRET": SECRET}, name)
    port = int(command.wait_for(r"listening on http://127\.0\.0\.1:(\d+)/").group(1))
    return command, ("127.0.0.1", port)


def _deliver_in_background(address, version: str) -> list:
    """A signed delivery for challenger, sent from a thread: the list gets its answer."""
    body = _alias_body(version)
    answers = []
    threading.Thread(target=lambda: answers.append(_post(address, _signed(body, f"delivery-{address[1]}"), body,
                                                         timeout=60)), daemon=True).start()
    return answers


def test_webhook_serve_stops_on_sigint_and_on_sigterm_with_the_prefect_server_hung_or_gone(tiny_workdir, cli_env,
                                                                                          tmp_path):
    from fastfill.services.webhook_receiver import STOP_GRACE_SECONDS

    stop_line = "stopped; the receiver no longer listens on"
    with _prefect_server(cli_env, tmp_path) as (env, prefect):
        up, _ = _webhook_serve(tiny_workdir, env, "webhook-up")  # Ctrl-C while the Prefect server is up
        up.assert_stopped_cleanly(up.stop(signal.SIGINT), stop_line)

        # the Prefect server hangs: a delivery's start waits on it, and SIGTERM does not wait for it
        # longer than the grace period; the delivery is answered 503, which MLflow retries
        hung, address = _webhook_serve(tiny_workdir, env, "webhook-hung")
        prefect.hang()
        in_flight = _deliver_in_background(address, "7")
        time.sleep(2)
        seconds = hung.stop(signal.SIGTERM)
        _wait_for(lambda: in_flight, 10, "the answer to the delivery in flight")
        hung.assert_stopped_cleanly(seconds, stop_line)
        assert seconds < STOP_GRACE_SECONDS + 10, seconds  # the grace period and the process exit; 8.9 s seen on a loaded machine
        assert in_flight[0][0] == 503 and "stopping" in in_flight[0][2]["error"], in_flight

        # the Prefect server is gone: the delivery fails at once (500, retried by MLflow); SIGTERM
        gone, address = _webhook_serve(tiny_workdir, env, "webhook-gone")
        prefect.kill()
        failed = _deliver_in_background(address, "8")
        _wait_for(lambda: failed, 30, "the answer to the delivery")
        assert failed[0][0] == 500 and "could not start the upgrade" in failed[0][2]["error"], failed
        gone.assert_stopped_cleanly(gone.stop(signal.SIGTERM), stop_line)


def test_watch_stops_on_sigterm_and_on_sigint_with_the_registry_and_prefect_servers_gone(tiny_workdir, cli_env,
                                                                                       tmp_path):
    stop_line = "stopped watching embedder@challenger"
    with _prefect_server(cli_env, tmp_path) as (env, prefect), _mlflow_server(env, tmp_path) as (mlflow_url, mlflow):
        env = {**env, "MLFLOW_TRACKING_URI": mlflow_url}
        args = ["watch", "--every", "1", "--store", str(tiny_workdir / "gallery")]
        up = _Command(args, tiny_workdir, env, "watch-up")  # both servers up
        up.wait_for("registry watcher: ")  # a check made (it finds no gallery there: said, and tried again)
        up.assert_stopped_cleanly(up.stop(signal.SIGTERM), stop_line)

        # the MLflow server is gone: a check waits in the MLflow client's retries (minutes), and
        # Ctrl-C ends it
        no_registry = _Command(args, tiny_workdir, env, "watch-no-registry")
        no_registry.wait_for("registry watcher: ")
        mlflow.kill()
        time.sleep(5)
        no_registry.assert_stopped_cleanly(no_registry.stop(signal.SIGINT), stop_line)

        # both are gone: each check fails at once, and SIGTERM ends the watching
        nothing = _Command(args, tiny_workdir, env, "watch-nothing")
        prefect.kill()
        nothing.wait_for("registry watcher: this check failed")
        nothing.assert_stopped_cleanly(nothing.stop(signal.SIGTERM), stop_line)


def test_a_command_doing_work_stops_on_sigterm_with_its_prefect_server_gone_and_resumes(tiny_workdir, cli_env,
                                                                                        tmp_path):
    """`fastfill run` stopped mid-training: by Ctrl-C and by SIGTERM with the Prefect server up, and
    by SIGTERM after the server went away (a service manager stopping everything at once; Prefect's engine
    alone would retry its crash report for minutes): each within seconds, one line naming the
    command that resumes it, the shell's exit status for the signal; then that command finishes."""
    with _prefect_server(cli_env, tmp_path) as (env, prefect):
        up = _Command(["run"], tiny_workdir, env, "run-up")
        up.wait_for(r"training the (old|new) model")
        up.assert_stopped_cleanly(up.stop(signal.SIGINT), "stopped by SIGINT")
        assert up.process.returncode == 130
        assert "`fastfill run` resumes it" in up.text()

        # SIGTERM with the server up: Prefect's engine reports the crash at once and hands the
        # signal on as Ctrl-C's KeyboardInterrupt, which ended the command with 130 before the
        # stop's deadline gave 143
        term = _Command(["run"], tiny_workdir, env, "run-term")
        term.wait_for(r"training the (old|new) model")
        term.assert_stopped_cleanly(term.stop(signal.SIGTERM), "stopped by SIGTERM")
        assert term.process.returncode == 143

        gone = _Command(["run"], tiny_workdir, env, "run-gone")
        gone.wait_for(r"training the (old|new) model")
        prefect.kill()
        time.sleep(2)
        seconds = gone.stop(signal.SIGTERM)
    gone.assert_stopped_cleanly(seconds, "stopped by SIGTERM")
    assert gone.process.returncode == 143
    again = subprocess.run([str(BIN / "fastfill"), "run"], cwd=tiny_workdir, env=cli_env, capture_output=True,
                           text=True, timeout=900)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
