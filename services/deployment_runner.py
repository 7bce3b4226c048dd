"""The deployments of `fastfill serve`, served by Prefect's runner until SIGTERM or Ctrl-C, also
when the Prefect server went away first: the runner runs in a thread of its own, so that the
signals stay with the command (in the main thread the runner takes SIGTERM for itself and, with
the server gone, stops with tracebacks), and the runner's console logs say what they must in one
line each."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading

STOP_SECONDS = 3.0  # what the runner gets to stop before the command goes on without it


def serve_until_stopped(found: list) -> str | None:
    """Serve the deployments ``found`` until SIGTERM or Ctrl-C (from the main thread, whose
    signal handlers it sets); the runner's error when it stopped by itself, else None."""
    from prefect.runner import Runner

    # the caller pauses the schedules, once: Prefect's own pause retries for minutes when the
    # server is gone, and the command would not stop
    runner = Runner(pause_on_shutdown=False)
    for deployment in found:
        runner.add_deployment(deployment)
    console = _runner_console()
    serving: dict = {}
    started, stop, failure = threading.Event(), threading.Event(), []

    def loop_error(loop, context: dict) -> None:
        if isinstance(context.get("exception"), asyncio.CancelledError):
            return  # a runner's callback that looked at a task the stop cancelled: nothing went wrong
        loop.default_exception_handler(context)

    async def main() -> None:
        serving.update(loop=asyncio.get_running_loop(), task=asyncio.current_task())
        serving["loop"].set_exception_handler(loop_error)
        started.set()
        await runner.start()

    def run() -> None:
        try:
            asyncio.run(main())
        except asyncio.CancelledError:
            pass  # stopped below
        except Exception as error:  # noqa: BLE001 - said in one line by the command
            failure.append(f"{type(error).__name__}: {error}")

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    if not found:  # every deployment is on a work pool: no runner, the caller's watcher goes on until stopped
        while not stop.wait(0.5):
            pass
        return None
    thread = threading.Thread(target=run, name="prefect-runner", daemon=True)
    thread.start()
    while thread.is_alive() and not stop.wait(0.5):
        pass
    console.stopping = True
    if thread.is_alive() and started.wait(5):
        serving["loop"].call_soon_threadsafe(serving["task"].cancel)
        thread.join(STOP_SECONDS)  # a daemon thread: a runner stuck on a server that hangs does not hold the exit
    return failure[0] if failure else None


class _RunnerConsole(logging.Filter):
    """What of the Prefect runner's own logs reaches the console. With the Prefect server gone its
    loops warn with a traceback each (its events websocket, its polling): each such warning keeps
    one line, its exception's type and message; once the command is stopping, its warnings are
    left out (the command's one line says how it stopped). Errors, and the flow and task runs'
    own logs, are kept whole."""

    stopping = False

    def filter(self, record: logging.LogRecord) -> bool:
        if (not record.name.startswith("prefect.") or record.name.startswith(("prefect.flow_runs", "prefect.task_runs"))
                or record.levelno >= logging.ERROR):
            return True
        if self.stopping and record.levelno >= logging.WARNING:
            return False
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            record.msg, record.args = f"{record.getMessage()} ({type(error).__name__}: {error})", ()
            record.exc_info = record.exc_text = None
        return True


def _runner_console() -> _RunnerConsole:
    """Put the filter on Prefect's console handlers (once Prefect has configured logging)."""
    from prefect.logging.handlers import PrefectConsoleHandler

    console = _RunnerConsole()
    loggers = [logging.getLogger(), *(logger for logger in logging.Logger.manager.loggerDict.values()
                                      if isinstance(logger, logging.Logger))]
    for logger in loggers:
        for handler in logger.handlers:
            if isinstance(handler, PrefectConsoleHandler):
                handler.addFilter(console)
    return console
