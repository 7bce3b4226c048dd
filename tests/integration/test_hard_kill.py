"""A command killed hard (SIGKILL to the command alone, as the out-of-memory killer does) leaves
no process of its own behind: the temporary Prefect server it started ends with it."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.helpers import assert_none_outlive, descendants

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads processes from /proc")


def _server_among(pids: list[int]) -> list[int]:
    def command_line(pid: int) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return b""

    return [pid for pid in pids if b"uvicorn" in command_line(pid) or b"temporary_server" in command_line(pid)]


def test_a_command_killed_hard_takes_its_temporary_prefect_server_with_it(tiny_workdir, cli_env, tmp_path):
    env = {key: value for key, value in cli_env.items() if key != "PREFECT_API_URL"}
    with open(tmp_path / "prepare.log", "wb") as log:
        command = subprocess.Popen([str(Path(sys.executable).parent / "fastfill"), "stage", "prepare"],
                                   cwd=tiny_workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline, servers = time.monotonic() + 120, []
        while time.monotonic() < deadline and command.poll() is None and not servers:
            servers = _server_among(descendants(command.pid))
            time.sleep(0.1)
        below = descendants(command.pid)
        assert servers, (tmp_path / "prepare.log").read_text()[-3000:]
        os.kill(command.pid, signal.SIGKILL)  # the command alone, not its process group
        command.wait(timeout=30)
    finally:
        if command.poll() is None:
            command.kill()
    assert command.returncode == -signal.SIGKILL, (tmp_path / "prepare.log").read_text()[-3000:]
    assert_none_outlive(below)
