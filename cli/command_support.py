"""What every command shares: the options, the exit codes, loading params.yaml, and running a flow
so that its outcome is an exit code and one line, not a traceback (``fail``: the one place that
prints an error and exits; ``outcome``: which known failure is which kind)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from fastfill import cli
from fastfill.cli.json_output import failed
from fastfill.components.experiment.data import DataError
from fastfill.components.gallery.inputs.images import ImageStoreError
from fastfill.components.gallery.layouts.catalog import GalleryError
from fastfill.components.gallery.store import StoreError, StoreUnreachable, configure_s3
from fastfill.components.gallery.store.lock import LeaseLost, UpgradeLocked
from fastfill.components.platform.config import ConfigError, Params, load_params
from fastfill.components.platform.layout import ArrayFileError
from fastfill.components.platform.registry import (
    RegistryError,
    TrackingUnreachable,
    check_tracking_server,
    tracking_uri,
)
from fastfill.components.platform.runtime import cpu_kernels_of, pin_cpu_kernels
from fastfill.components.platform.secrets import redact

ParamsOption = Annotated[Path, typer.Option("--params", "-p", envvar="FASTFILL_PARAMS",
                                             help="the configuration file; default: FASTFILL_PARAMS, else ./params.yaml")]
StoreOption = Annotated[str | None, typer.Option("--store", envvar="FASTFILL_STORE",
                                                 help="a local folder or s3://bucket/prefix; default: FASTFILL_STORE, "
                                                 "else gallery.store in params.yaml")]

# Exit codes (the table in docs/operations.md). 0: done (an upgrade paused by its budget, or with
# nothing to do, included).
FAILED = 1    # the work failed (a map check), or an unexpected error, shown with its traceback
USAGE = 2     # a bad option or params.yaml
REJECTED = 3  # the promotion gate rejected the upgrade
CLAIM = 4     # `sweep`: the claim does not hold at every size
SERVICE = 5   # a service does not answer or refuses: the store, the MLflow server, the Prefect API
INPUT = 6     # bad input: an unknown model, a missing, broken or tampered gallery, wrong data, a held lock

SERVICE_TIMEOUT = 5.0  # seconds a service has to answer the check before a flow starts

# MLflow retries a request 7 times with a backoff that grows to 2 minutes: a server that is down
# takes about 4.5 minutes to be reported. The commands cap that, unless the environment says
# otherwise: 3 retries (about 15 s) and 30 s per request.
MLFLOW_HTTP_LIMITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "2",
                      "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}


def store_uri(config, store: str | None) -> str:
    """--store, or gallery.store of params.yaml."""
    return store or config.gallery.store


def fail(error: Exception | str, code: int = FAILED) -> NoReturn:
    """Print ``error: ...`` in red on stderr and end the command with ``code`` (see the exit
    codes above). With --json, stdout also gets ``{"error": ..., "exit_code": code}``
    (cli/json_output.py). The message goes through ``redact``: no line shows a password, whatever
    an error's text held."""
    message = redact(str(error))
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    failed(message, code)
    exit_within(ANSWERED_EXIT_SECONDS, code)
    raise typer.Exit(code) from None


# Once a command has answered, its exit handlers (a temporary Prefect server stopping, logs still
# queued for an API that is gone) get this long before the process ends anyway.
ANSWERED_EXIT_SECONDS = 10.0
# From SIGTERM or SIGINT to the end of a command doing work: the flow's own shutdown (recording
# its run as crashed where the Prefect API answers) gets this long.
STOP_SECONDS = 5.0
INTERRUPTED = {2: 130, 15: 143}  # SIGINT, SIGTERM -> the shell's exit status for them
stopped_by: int | None = None  # the first of those signals the command received, once it has
_stop_said = threading.Event()  # the watch (``stop_promptly_on_signals``) has printed its stop line


def _stopped(signum: int) -> None:
    global stopped_by
    if stopped_by is None:
        stopped_by = signum


def exit_status(code: object) -> object:
    """The status a command ends with, from the one it exits with: Typer ends any interrupted
    command with 130 (SIGINT's), also one that SIGTERM stopped (``signals_as_ctrl_c`` turns it
    into Ctrl-C's KeyboardInterrupt), which ends with SIGTERM's 143 instead. A command that the
    watch stops first lets it print its line (its thread would be cut short at the exit)."""
    if code == INTERRUPTED[2] and _watching is not None:
        _stop_said.wait(1.0)
    if code == INTERRUPTED[2] and stopped_by in INTERRUPTED:
        return INTERRUPTED[stopped_by]
    return code


def exit_within(seconds: float, code: int = 0) -> None:
    """If the interpreter's own exit has not ended the process ``seconds`` from now, end it then
    with ``code``, output flushed (a daemon timer: it never keeps the process alive). Only in the
    `fastfill` executable's own process (``cli.owns_process``)."""
    if not cli.owns_process:
        return

    def force() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    timer = threading.Timer(seconds, force)
    timer.daemon = True
    timer.start()


signals_owned = False  # a service command stops on signals its own way (service_commands)
_watching: tuple | None = None  # the wakeup socket pair, held for the process's life (its fd is the interpreter's)


def stop_promptly_on_signals() -> None:
    """SIGTERM or SIGINT ends a command doing work within seconds, resumable: one line on stderr
    says what stopped it and the command that resumes it; the flow's own shutdown gets
    STOP_SECONDS, then the process ends with 128 + the signal's number (its temporary Prefect
    server is tethered to it and goes too). Prefect's engine holds SIGTERM while a flow runs and
    reports the run as crashed, retrying for minutes when the signal took its server down with
    it: the watch does not wait for that. It learns of the signal through ``signal.set_wakeup_fd``,
    which the interpreter writes at the signal itself, whoever's Python handler then runs. What
    finished is kept: every write of a gallery, a stage or a map's checkpoint is whole or absent.
    Once per process, from the main thread; not for the service commands (``signals_owned``)."""
    import shlex
    import signal
    import socket

    global _watching
    if _watching or signals_owned or not cli.owns_process or threading.current_thread() is not threading.main_thread():
        return
    receiver, sender = socket.socketpair()
    sender.setblocking(False)
    try:
        signal.set_wakeup_fd(sender.fileno(), warn_on_full_buffer=False)
    except ValueError:
        return
    _watching = (receiver, sender)

    signals_as_ctrl_c()  # before and after a flow (during one, Prefect's engine holds SIGTERM)
    resume = shlex.join(["fastfill", *sys.argv[1:]])

    def watch() -> None:
        while True:
            try:
                received = receiver.recv(64)
            except OSError:
                return
            caught = [number for number in received if number in INTERRUPTED]
            if caught:
                _stopped(caught[0])  # also where Prefect's engine held the signal (its handler, not ours, ran)
                name = signal.Signals(caught[0]).name
                typer.secho(f"stopped by {name}: what finished is kept; `{resume}` resumes it", fg=typer.colors.YELLOW,
                            err=True)
                _stop_said.set()
                exit_within(STOP_SECONDS, INTERRUPTED[caught[0]])
                return

    threading.Thread(target=watch, name="fastfill-signal-watch", daemon=True).start()


def params_file(path: Path) -> str:
    """The configuration file as an absolute path: what the deployments' flow runs read."""
    return str(Path(path).resolve())


def stop_on_sigterm() -> None:
    """SIGTERM or SIGINT ends a long-running service as Ctrl-C does (``signals_as_ctrl_c``), and
    the service prints its own stop line: not the work commands' watch, which would add its own."""
    global signals_owned
    signals_owned = True
    signals_as_ctrl_c()


def signals_as_ctrl_c() -> None:
    """SIGTERM (a service manager's stop, `docker stop`, `kill`) ends the command as Ctrl-C does,
    through its shutdown and the exit handlers, so a temporary Prefect server it started is
    stopped with it; and SIGINT does, even where it was inherited ignored (a command started in
    the background by a non-interactive shell). SIGTERM is kept (``stopped_by``): the command
    ends with its status, not Ctrl-C's (``exit_status``)."""
    import signal

    def interrupt(signum, frame):
        _stopped(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # itself: asyncio.run knows it (and cancels its task)


class ServiceUnavailable(RuntimeError):
    """A service a command needs (the Prefect API) does not answer; the message says what to do."""


def load(path: Path):
    """params.yaml, validated; a bad file ends the command with every problem listed. The CPU
    kernels are pinned (compute.cpu_kernels; the `fastfill` command pinned them from the same
    file before loading the command's module, cli/__init__.py)."""
    pin_cpu_kernels(cpu_kernels_of(path))  # a file that is not UTF-8: load_params says so in one line
    try:
        params = load_params(path)
    except ConfigError as error:
        fail(error, USAGE)
    configure_s3(params.gallery.s3)  # every command's S3 clients retry as gallery.s3 says
    for key, value in MLFLOW_HTTP_LIMITS.items():  # read by MLflow at each request
        os.environ.setdefault(key, value)
    return params


def outcome(error: BaseException) -> tuple[int, str] | None:
    """(exit code, message) of a known failure, or None for anything else (a bug: it keeps its
    traceback). The message is the error's own: it names the problem and what to do."""
    # a lost lease comes from a store that could not be reached in time, or from a takeover
    if isinstance(error, (StoreUnreachable, ImageStoreError, LeaseLost, TrackingUnreachable, ServiceUnavailable)):
        return SERVICE, str(error)
    deployments = sys.modules.get("fastfill.flows.deployments")  # loaded wherever one of its errors can come from
    if deployments is not None and isinstance(error, deployments.DeploymentMissing):
        return SERVICE, str(error)
    service = _service_problem(error)
    if service is not None:
        return SERVICE, service
    if isinstance(error, ConfigError):
        return USAGE, str(error)
    map_check = sys.modules.get("fastfill.components.experiment.map_check")  # loaded wherever a check can fail (scipy: slow)
    if map_check is not None and isinstance(error, map_check.MapCheckError):
        return FAILED, str(error)
    if isinstance(error, (GalleryError, RegistryError, StoreError, UpgradeLocked, DataError, ArrayFileError,
                          FileNotFoundError)):
        return INPUT, str(error)
    return None


def _one_line(text: object, limit: int = 400) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + " ..."


def _service_problem(error: BaseException) -> str | None:
    """The message of an MLflow or Prefect client error that says the service did not answer or
    refused the credentials; None for any other error."""
    mlflow_errors = sys.modules.get("mlflow.exceptions")
    if mlflow_errors is not None and isinstance(error, mlflow_errors.MlflowException):
        code = getattr(error, "error_code", "")
        text = _one_line(getattr(error, "message", error))
        if code in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
            return (f"the MLflow tracking server refused the request ({code}: {text}); check MLFLOW_TRACKING_USERNAME "
                    "and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN")
        if text.startswith("API request to "):  # the server did not answer, or answered an HTTP error
            return (f"the MLflow tracking server failed: {text}. Check that it is up and that MLFLOW_TRACKING_URI "
                    "names it, then run the same command again: finished work is kept")
        return None
    if isinstance(error, RuntimeError) and "connect to ephemeral Prefect API server" in str(error):
        return (f"Prefect's temporary server did not start in time ({_one_line(error)}); on a loaded machine set "
                f"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS higher (now "
                f"{os.environ.get('PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS', 'unset')} s), or start a server "
                "(`prefect server start`) and set PREFECT_API_URL, then run the same command again")
    httpx = sys.modules.get("httpx")
    if (httpx is not None and isinstance(error, httpx.TransportError)) or (
            isinstance(error, RuntimeError) and str(error).startswith("Failed to reach API at")):
        return (f"the Prefect API did not answer ({_one_line(error)}); check that the server PREFECT_API_URL names "
                "is up, then run the same command again: finished work is kept")
    return None


def check_prefect_api(timeout: float = SERVICE_TIMEOUT, *, needed: bool = False) -> str:
    """When PREFECT_API_URL is set, its ``/health`` must answer within ``timeout`` seconds (with
    the API key or auth string Prefect's client would send); raises ServiceUnavailable otherwise.
    Without it, a flow runs on a temporary server of its own and there is nothing to check.
    ``needed``: the command needs that server (deploying to its work pools), so the advice does
    not offer a temporary one. Returns what was found, for a report."""
    import time

    import httpx
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    url = settings.api.url
    if not url:
        return "PREFECT_API_URL is not set: each command runs its flows on a temporary local Prefect server"
    headers = {}
    key, auth = settings.api.key, settings.api.auth_string
    if key:
        headers["Authorization"] = f"Bearer {getattr(key, 'get_secret_value', lambda: key)()}"
    elif auth:
        import base64

        secret = str(getattr(auth, "get_secret_value", lambda: auth)())
        headers["Authorization"] = "Basic " + base64.b64encode(secret.encode()).decode()
    todo = ("start it (`prefect server start`) or point PREFECT_API_URL at the right one" if needed else
            "start it (`prefect server start`), point PREFECT_API_URL at the right one, or unset it to run flows on "
            "a temporary local server")
    started = time.monotonic()
    try:
        answer = httpx.get(url.rstrip("/") + "/health", headers=headers, timeout=timeout)
    except httpx.TimeoutException:
        raise ServiceUnavailable(f"the Prefect API at {url} did not answer within {timeout:g} s; {todo}") from None
    except httpx.HTTPError as error:
        raise ServiceUnavailable(f"cannot reach the Prefect API at {url} ({type(error).__name__}); {todo}") from None
    if answer.status_code in (401, 403):
        raise ServiceUnavailable(f"the Prefect API at {url} refused the credentials (HTTP {answer.status_code}); "
                                 "check PREFECT_API_KEY or PREFECT_API_AUTH_STRING")
    if answer.status_code >= 500:
        raise ServiceUnavailable(f"the Prefect API at {url} answered HTTP {answer.status_code}; {todo}")
    return f"{url} answered in {time.monotonic() - started:.2f} s"


_answered: set[tuple] = set()  # the services found answering in this process


def require_services(config) -> None:
    """Before a flow starts: the MLflow tracking server (for an http(s) URI) and the Prefect API
    (when PREFECT_API_URL is set) answer within a few seconds; raises otherwise. Once per
    process and pair of services."""
    from prefect.settings import get_current_settings

    services = (tracking_uri(config.mlflow), get_current_settings().api.url)
    if services in _answered:
        return
    check_tracking_server(config.mlflow, timeout=SERVICE_TIMEOUT)
    check_prefect_api(SERVICE_TIMEOUT)
    _answered.add(services)


def need_services(config) -> None:
    """``require_services``, ending the command with exit code 5 and one line when one does not
    answer."""
    call(require_services, config)


class _KnownFailuresOffTheConsole(logging.Filter):
    """Prefect logs the exception that ends a task or flow run with its traceback. For a known
    failure the command prints one line of its own, so the console leaves those records out.
    The filter sits on the console handler only: the run's logs sent to the Prefect API (the
    flow-run and task-run loggers' own handler, which sees each record first) keep them whole."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return error is None or outcome(error) is None


_QUIET = _KnownFailuresOffTheConsole()


class _PasswordsOffTheRecord(logging.Filter):
    """A record's message and traceback without a password (``redact``), before a handler writes
    it: the console, and the run logs Prefect's API keeps. The product's own messages hold none
    (the configuration has none once read); this is for a library's text that might."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


_REDACTED = _PasswordsOffTheRecord()


def quiet_known_failures() -> None:
    """Put the filter on Prefect's console handlers, and the redaction on every handler (once
    Prefect has configured logging)."""
    if "prefect" not in sys.modules:
        return  # no Prefect, no Prefect logs
    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = [logging.getLogger(), *(logger for logger in logging.Logger.manager.loggerDict.values()
                                      if isinstance(logger, logging.Logger))]
    for logger in loggers:
        for handler in logger.handlers:
            if isinstance(handler, PrefectConsoleHandler) and _QUIET not in handler.filters:
                handler.addFilter(_QUIET)
            if _REDACTED not in handler.filters:
                handler.addFilter(_REDACTED)


def call(flow, *args, **kwargs):
    """Run a flow (or any function of the store). With the configuration among its arguments, the
    services it needs are checked first. A known failure ends the command with its kind's exit
    code and its message on one line; anything else keeps its traceback."""
    try:
        config = next((arg for arg in args if isinstance(arg, Params)), None)
        stop_promptly_on_signals()
        if config is not None:
            require_services(config)
        quiet_known_failures()
        return flow(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - re-raised unless it is a known failure
        known = outcome(error)
        if known is None:
            raise
        code, message = known
        fail(message, code)


def record_in_dvc(params_path: Path, targets: list[str], done: str | None = None, project: Path = Path(".")) -> None:
    """Record what a command produced in dvc.lock (``targets``: `dvc commit` arguments), so
    `dvc repro` of those stages redoes nothing. Only for the repository's own params.yaml.
    ``project``: the folder of the DVC project (comparison/ is one of its own)."""
    if params_path.resolve() != Path("params.yaml").resolve() or not (project / "dvc.yaml").is_file():
        return
    dvc = shutil.which("dvc") or str(Path(sys.executable).with_name("dvc"))
    result = subprocess.run([dvc, "commit", "--force", "--quiet", *targets], capture_output=True, text=True,
                            cwd=project)
    if result.returncode != 0:
        typer.secho(f"warning: `dvc commit` failed, DVC does not know about this run:\n{result.stderr}",
                    fg=typer.colors.YELLOW, err=True)
    elif done:
        typer.echo(done)
