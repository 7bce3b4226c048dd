"""A PostgreSQL 16 with pgvector started from Python (``pgserver``) for the tests and the
benchmarks, that never outlives the process that started it: stopped and its folder removed at
exit, and, should that process be killed outright (SIGKILL, a process-group kill), by a watchdog
of its own session that notices within half a second and stops the server (fast shutdown)."""

from __future__ import annotations

import atexit
import shutil
import subprocess
import sys
import tempfile
import warnings

WATCHDOG = """
import os, shutil, signal, sys, time
parent, folder = int(sys.argv[1]), sys.argv[2]
while os.getppid() == parent:
    time.sleep(0.5)
try:
    with open(os.path.join(folder, "postmaster.pid")) as handle:
        pid = int(handle.readline())
    os.kill(pid, signal.SIGINT)
    for _ in range(100):
        os.kill(pid, 0)
        time.sleep(0.1)
except (OSError, ValueError):
    pass
shutil.rmtree(folder, ignore_errors=True)
"""


def start_postgres(prefix: str = "fastfill-pg-") -> str:
    """Start a server in a new folder; its ``postgresql://`` URI (a Unix socket in the folder)."""
    import os

    import pgserver

    folder = tempfile.mkdtemp(prefix=prefix)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs: XDG_RUNTIME_DIR is not set
        server = pgserver.get_server(folder, cleanup_mode="stop")
    watchdog = subprocess.Popen([sys.executable, "-c", WATCHDOG, str(os.getpid()), folder],
                                start_new_session=True, stdin=subprocess.DEVNULL)

    def stop() -> None:
        try:
            server.cleanup()
        finally:
            shutil.rmtree(folder, ignore_errors=True)
            watchdog.kill()
            watchdog.wait()

    atexit.register(stop)
    return server.get_uri()
