"""`fastfill serve` stops on SIGTERM within seconds, with one line and no traceback, also when the
Prefect server went away first (a real server, killed)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow  # a Prefect server of its own: about a minute on 2 cores

BIN = Path(sys.executable).parent


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


def test_serve_stops_on_sigterm_after_the_prefect_server_is_gone(tiny_workdir, cli_env, tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {**cli_env, "PREFECT_API_URL": url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_HOME": str(tmp_path / "prefect-server-home")}
    server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_for(lambda: _healthy(url), 120, "the Prefect server")
        out = open(tmp_path / "serve.log", "w+")
        serve = subprocess.Popen([str(BIN / "fastfill"), "serve", "--store", str(tmp_path / "gallery")],
                                 cwd=tiny_workdir, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            _wait_for(lambda: "serving " in Path(out.name).read_text(), 120, "`fastfill serve` to start")
            time.sleep(3)  # its runner polling the server
            os.killpg(server.pid, signal.SIGKILL)  # the server goes first
            server.wait(timeout=30)
            time.sleep(2)
            serve.send_signal(signal.SIGTERM)
            started = time.monotonic()
            serve.wait(timeout=30)
            seconds = time.monotonic() - started
        finally:
            if serve.poll() is None:
                serve.kill()
        text = Path(out.name).read_text()
        print(f"`fastfill serve` stopped {seconds:.1f} s after SIGTERM:\n{text[-2000:]}")
        assert seconds < 15, text[-3000:]
        assert "Traceback" not in text, text[-3000:]
        assert "stopped; the served deployments' schedules could not be paused" in text, text[-3000:]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
