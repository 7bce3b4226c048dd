"""Prefect's temporary server, tied to the process that started it.

Without PREFECT_API_URL, the first flow run of a command starts Prefect's temporary API server as
a child process (uvicorn, about 250 MB) and stops it at exit. A command killed hard (SIGKILL, the
out-of-memory killer) runs no exit handler, so the server lived on, orphaned, after every such
kill. ``tether_temporary_server()`` makes the server's process hold the read end of a pipe whose
write end only the starting process holds: when that process ends, however it ends, the kernel
closes the write end, the server reads end-of-file and exits. It works whatever thread started
the server (a parent-death signal would follow the thread, not the process) and on any POSIX
system.

Prefect builds the server's command line itself (``SubprocessASGIServer``); the tether replaces
the ``subprocess`` module that Prefect's server module sees with one whose ``Popen`` runs that
command line through this module (``python -m fastfill.tasks.temporary_server FD uvicorn-args...``).
Every other name is the real module's. Where Prefect's server module changes shape, nothing is
replaced and the server runs as before.

This module is also the launcher: run as ``__main__`` it watches the pipe on a daemon thread and
runs uvicorn in-process with the remaining arguments (its exit status is uvicorn's: Prefect reads
3 as "port taken").
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import subprocess
import sys
import threading

_HELD: list[int] = []  # write ends, open for this process's lifetime


class _TetheredSubprocess:
    """The ``subprocess`` module as Prefect's server module sees it: ``Popen`` of the uvicorn
    command runs it tethered; everything else is the real module."""

    def __getattr__(self, name: str):
        return getattr(subprocess, name)

    @staticmethod
    def Popen(args, *rest, **options):  # noqa: N802 - the name Prefect calls
        uvicorn = [sys.executable, "-m", "uvicorn"]
        if isinstance(args, (list, tuple)) and list(args[:3]) == uvicorn and not rest and os.name == "posix":
            read_end, write_end = os.pipe()  # both non-inheritable: only pass_fds hands one over
            _HELD.append(write_end)
            try:
                return subprocess.Popen([sys.executable, "-m", "fastfill.tasks.temporary_server", str(read_end),
                                         *args[3:]], pass_fds=(read_end,), **options)
            finally:
                os.close(read_end)
        return subprocess.Popen(args, *rest, **options)


SERVER_MODULE = "prefect.server.api.server"


def tether_temporary_server() -> None:
    """Tie every temporary Prefect server this process starts from now on to its lifetime
    (idempotent). Cheap: Prefect's server module (3 s to import) is patched when something
    imports it, not imported here."""
    module = sys.modules.get(SERVER_MODULE)
    if module is not None:
        _tether(module)
    elif not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def _tether(server) -> bool:
    """Replace the ``subprocess`` that Prefect's server module sees; False where the module does
    not have the shape this expects (then the server runs as Prefect starts it)."""
    if isinstance(getattr(server, "subprocess", None), _TetheredSubprocess):
        return True
    if getattr(server, "subprocess", None) is not subprocess or not hasattr(server, "SubprocessASGIServer"):
        return False
    server.subprocess = _TetheredSubprocess()
    return True


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when Prefect's server module is imported, its loader runs the module
    as usual and the tether is put in place right after."""

    def find_spec(self, name, path, target=None):
        if name != SERVER_MODULE:
            return None
        sys.meta_path.remove(self)  # the real finders find it; then this one is done
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _tether(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]  # this spec's own loader object
        return spec


def _exit_when_orphaned(read_end: int) -> None:
    """Block until the starting process's write end is closed, then end this process at once."""
    try:
        while os.read(read_end, 1):
            pass
    except OSError:
        pass
    os._exit(0)


def main(argv: list[str]) -> int:
    read_end, uvicorn_args = int(argv[0]), argv[1:]
    threading.Thread(target=_exit_when_orphaned, args=(read_end,), name="tether", daemon=True).start()
    from uvicorn.main import main as uvicorn_main

    return uvicorn_main.main(args=uvicorn_args, prog_name="uvicorn", standalone_mode=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
