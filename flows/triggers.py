"""Upgrades that run themselves: the deployments, the registry watcher, the webhook receiver.

Every path ends in the same Prefect deployment, ``upgrade-gallery/upgrade``:

- the registry watcher (``RegistryWatcher``, a thread of `fastfill serve` polling every
  ``triggers.poll_seconds``; any MLflow backend) starts it when `challenger` names a version the
  gallery is not on or moving to. Each check is a plain alias read and manifest read: no flow
  run unless there is an upgrade to start. Pausing the deployment ``registry-watcher/poll``
  (which has no schedule) pauses it;
- ``registry-watcher/nightly`` (cron) does the same check and also resumes a paused upgrade;
- the webhook receiver (`fastfill webhook serve`) starts it on a signed
  ``model_version_alias.created`` delivery for `challenger` from an MLflow server;
- ``comparison/weekly`` (cron) re-runs the comparison of methods.

A version is claimed in the gallery's store (create-only) before its upgrade starts, and the
flow run carries an idempotency key, so no version starts two upgrades.

The receiver answers every request, malformed ones included: a body over
``triggers.webhook_max_body_bytes`` (413), without a usable Content-Length (400/411) or chunked
(411) is refused before it is read; more POSTs from one address than the token bucket allows get
429 with Retry-After; a delivery id it accepted before gets a 200 that says "duplicate" and starts
nothing; a missing upgrade deployment gets a 503 that says how to create it.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prefect import flow

from components.platform import registry
from components.platform.config import Params, load_params
from components.gallery import plan as pl, upgrade as up
from components.gallery.catalog import Gallery
from components.gallery.triggers import (
    DeliveryLog, RateLimiter, WebhookRejected, alias_event, body_length, claim, release, verify,
    wants_upgrade,
)
from flows.parameters import run_parameters, store_of
from tasks._policy import log
from tasks.gallery import store_at

UPGRADE_DEPLOYMENT = "upgrade-gallery/upgrade"
POLL_DEPLOYMENT = "registry-watcher/poll"  # no schedule: pausing it pauses the RegistryWatcher


class DeploymentMissing(RuntimeError):
    """The Prefect server has no upgrade deployment to start; the message says how to create it."""


def missing_deployment_message() -> str:
    """What to do when the Prefect server this process talks to has no upgrade deployment."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if url:
        return (f"the deployment {UPGRADE_DEPLOYMENT} does not exist on the Prefect server at {url}; create it by "
                f"running `fastfill serve` with PREFECT_API_URL={url} (it serves every deployment; keep it running)")
    return (f"the deployment {UPGRADE_DEPLOYMENT} does not exist on the temporary Prefect server this process "
            "started for itself, because PREFECT_API_URL is not set; set PREFECT_API_URL to the Prefect server "
            "where `fastfill serve` runs (it serves every deployment) and restart this process")


def run_upgrade_deployment(parameters: dict, idempotency_key: str | None = None):
    """Start ``upgrade-gallery/upgrade`` without waiting, its run named after what it does
    (``upgrade <store> to <model>``); DeploymentMissing when the Prefect server does not have it
    (Prefect's own error for that says only "None")."""
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    name = f"upgrade {parameters.get('store') or 'gallery.store'} to {parameters.get('to') or 'challenger'}"
    try:
        return run_deployment(UPGRADE_DEPLOYMENT, timeout=0, idempotency_key=idempotency_key, parameters=parameters,
                              flow_run_name=name)
    except ObjectNotFound as error:
        request = getattr(getattr(error, "http_exc", None), "request", None)
        if request is not None and "/deployments/name/" not in str(request.url):
            raise
        raise DeploymentMissing(missing_deployment_message()) from None


def _entry_run_name() -> str:
    parameters = run_parameters()
    return f"upgrade {store_of(parameters)} to {parameters.get('to') or 'challenger'}"


@flow(name="upgrade-gallery", flow_run_name=_entry_run_name, log_prints=True)
def upgrade_entry(params_path: str = "params.yaml", store: str | None = None, to: str = "",
                  gate: bool | None = None, budget: float | None = None) -> dict:
    """What the upgrade deployment runs: the gallery upgrade with params.yaml's settings, as a
    ``gallery-upgrade`` run on the task runner they name, with the same small parameters."""
    from flows.upgrade import run_upgrade_file

    params = load_params(params_path)
    return run_upgrade_file(params, params_path, store or params.gallery.store, to, budget=budget, gate=gate)


@flow(name="comparison", log_prints=True)
def comparison_entry(params_path: str = "params.yaml") -> dict:
    """What the scheduled comparison runs: every method over compare.seeds."""
    from flows.compare import compare_flow

    summary = compare_flow(load_params(params_path))
    return {"seeds": summary["seeds"], "expectations": summary["expectations"]}


def start_upgrade(params: Params, store_uri: str, version: str, source: str, params_path: str) -> dict:
    """Claim ``version`` for this gallery and start the upgrade deployment (without waiting).
    A version claimed before is not started again."""
    name = params.mlflow.registered_model
    store = store_at(store_uri)
    if not claim(store, name, version, source):
        log(f"{name} version {version} was already claimed for {store.uri}; not starting it again")
        return {"started": False, "reason": f"version {version} was already claimed for this gallery"}
    try:
        run = run_upgrade_deployment({"params_path": params_path, "store": store_uri, "to": f"models:/{name}/{version}"},
                                     idempotency_key=f"upgrade:{store.uri}:{name}:{version}")
    except BaseException:
        release(store, name, version)  # let a later trigger try again
        raise
    log(f"{source}: started {UPGRADE_DEPLOYMENT} for {name} version {version} on {store.uri}: flow run {run.id}")
    return {"started": True, "flow_run_id": str(run.id), "version": version}


def check_registry(params: Params, store_uri: str) -> tuple[str | None, str | None]:
    """(the challenger's version, why it should not start an upgrade or None)."""
    client, _ = registry.setup(params.mlflow)
    candidate = registry.alias_version(client, params.mlflow.registered_model, registry.CHALLENGER)
    gallery = Gallery(store_at(store_uri))
    manifest = gallery.manifest(refresh=True)
    plan = pl.load_plan(gallery.store, manifest["upgrade"]) if manifest.get("upgrade") else None
    return candidate, wants_upgrade(gallery.model, plan.new if plan else None, candidate)


def watch_once(params: Params, store_uri: str, params_path: str, resume: bool = False,
               say=log) -> dict:
    """One check of the registry and the gallery, with plain MLflow and store reads: the upgrade
    deployment is started (its one flow run) only when `challenger` is new to the gallery, or,
    with ``resume``, when an upgrade is paused. Nothing changed: no flow run, nothing written."""
    candidate, why_not = check_registry(params, store_uri)
    if why_not is None:
        return start_upgrade(params, store_uri, candidate, "registry-watcher", params_path)
    if resume:
        gallery = Gallery(store_at(store_uri))
        state = up.status(gallery)
        if state["state"] == "paused":
            run = run_upgrade_deployment({"params_path": params_path, "store": store_uri, "to": state["upgrade"]["to"]})
            say(f"resuming the paused upgrade {state['upgrade']['id']}: flow run {run.id}")
            return {"started": False, "resumed": True, "flow_run_id": str(run.id), "reason": why_not}
    return {"started": False, "reason": why_not}


def _watch_run_name() -> str:
    return f"registry check for {store_of(run_parameters())}"


@flow(name="registry-watcher", flow_run_name=_watch_run_name, log_prints=True)
def watch_flow(params_path: str = "params.yaml", store: str | None = None, resume: bool = False) -> dict:
    """One registry check as a flow run (``registry-watcher/nightly`` on its cron, with ``resume``;
    ``registry-watcher/poll`` when run by hand): ``watch_once``. The polling itself is
    ``RegistryWatcher``'s, which starts no run when nothing changed."""
    params = load_params(params_path)
    result = watch_once(params, store or params.gallery.store, params_path, resume)
    if not result.get("started") and not result.get("resumed"):
        log(f"registry watcher: nothing to start ({result['reason']})")
    return result


class RegistryWatcher:
    """Polls the registry every ``interval`` seconds in a thread of `fastfill serve` (or `fastfill
    watch --every`): each tick is ``watch_once``, plain client calls, so a registry where nothing
    changed costs one alias read and one manifest read a minute and no Prefect flow run. While the
    deployment ``registry-watcher/poll`` is paused (in the Prefect UI), the ticks check nothing.
    A tick that fails (the registry or the store unreachable, no upgrade deployment) is logged and
    the next one tries again."""

    def __init__(self, params: Params, params_path: str, store_uri: str, interval: float, *,
                 pause_deployment: str | None = POLL_DEPLOYMENT, say=None):
        self.params, self.params_path, self.store_uri, self.interval = params, params_path, store_uri, interval
        self.pause_deployment = pause_deployment
        self.say = say or _print
        self.ticks = 0  # checks made (paused ticks are not counted)
        self.last: dict | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._said: str | None = None

    def paused(self) -> bool:
        """Whether the poll deployment is paused; a Prefect API without it counts as not paused."""
        if not self.pause_deployment:
            return False
        from prefect.client.orchestration import get_client
        from prefect.exceptions import ObjectNotFound

        try:
            with get_client(sync_client=True) as client:
                return bool(client.read_deployment_by_name(self.pause_deployment).paused)
        except ObjectNotFound:
            return False

    def tick(self) -> dict:
        """One check now (nothing when paused)."""
        if self.paused():
            return {"started": False, "paused": True, "reason": f"the deployment {self.pause_deployment} is paused"}
        result = watch_once(self.params, self.store_uri, self.params_path, say=self.say)
        self.ticks += 1
        self.last = result
        if result.get("started") or result.get("resumed") or result["reason"] != self._said:
            # a started upgrade, and each new reason, once: not a line a minute for nothing
            self._said = result.get("reason")
            self.say(f"registry watcher: {json.dumps(result)}")
        return result

    def run(self, delay: float = 0.0) -> None:
        """Check every ``interval`` seconds, the first after ``delay``, until ``stop``."""
        if self._stop.wait(delay):
            return
        while True:
            try:
                self.tick()
            except Exception as error:  # noqa: BLE001 - a watcher keeps watching; the next tick tries again
                self.say(f"registry watcher: this check failed ({type(error).__name__}: {error}); trying again in "
                         f"{self.interval:g} s")
            if self._stop.wait(self.interval):
                return

    def start(self, delay: float = 0.0) -> RegistryWatcher:
        self._thread = threading.Thread(target=self.run, args=(delay,), name="registry-watcher", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, self.interval))


def _print(message: str) -> None:
    print(message, flush=True)


def deployments(params: Params, params_path: str = "params.yaml", store_uri: str | None = None) -> list:
    """Every deployment, defined in this one place; `fastfill serve` serves them (and polls the
    registry with a RegistryWatcher). ``registry-watcher/poll`` has no schedule: a schedule would
    make a flow run a minute; the watcher polls instead, and this deployment is its pause switch
    and a check on demand. ``store_uri``: the gallery the upgrade and the checks work on, when it
    is not gallery.store (`fastfill serve --store`)."""
    parameters = {"params_path": params_path, **({"store": store_uri} if store_uri else {})}
    triggers = params.triggers
    found = [
        upgrade_entry.to_deployment(name="upgrade", parameters=parameters, concurrency_limit=1,
                                    description="Upgrade the stored gallery (started by the watcher or a webhook)"),
        watch_flow.to_deployment(name="poll", parameters=parameters,
                                 description=f"One registry check now. `fastfill serve` checks every "
                                             f"{triggers.poll_seconds} s without a flow run and starts the upgrade "
                                             "when a new version has the alias challenger; pause this deployment "
                                             "to pause those checks"),
    ]
    if triggers.nightly_cron:
        found.append(watch_flow.to_deployment(
            name="nightly", parameters={**parameters, "resume": True},
            cron=triggers.nightly_cron, description="Check the registry and resume a paused upgrade"))
    if triggers.comparison_cron:
        found.append(comparison_entry.to_deployment(name="weekly", parameters={"params_path": params_path},
                                                    cron=triggers.comparison_cron,
                                                    description="Re-run the comparison of every method"))
    return found


# ------------------------------------------------------------------------------------------------
# The webhook receiver


class WebhookReceiver:
    """An HTTP endpoint for MLflow registry webhooks. POST / with a signed
    ``model_version_alias.created`` delivery for ``challenger`` starts the upgrade; GET /health
    answers ok. It listens on ``host`` (127.0.0.1 by default) only. Every request gets an answer
    with a one-line reason; see the module's docstring for what is refused and how."""

    def __init__(self, params: Params, params_path: str, store_uri: str, secret: str, host: str, port: int,
                 on_event=None):
        self.params, self.params_path, self.store_uri, self.secret = params, params_path, store_uri, secret
        self.on_event = on_event or (lambda version: start_upgrade(params, store_uri, version, "webhook", params_path))
        settings = params.triggers
        self.max_body = settings.webhook_max_body_bytes
        self.limiter = RateLimiter(settings.webhook_rate_per_minute, settings.webhook_burst)
        # a replay older than the clock check's window is refused by that check, so the window is enough
        self.deliveries = DeliveryLog(settings.max_clock_skew_seconds)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            timeout = settings.webhook_read_timeout_seconds  # per read of the socket: a stalled sender is dropped
            server_version = "fastfill-webhook"

            def log_message(self, format, *args):  # noqa: A002 - the stdlib's signature
                log("webhook: " + format % args)

            def _reply(self, code: int, body: dict, headers: dict | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                if self.close_connection:
                    self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)

            def _refuse(self, code: int, message: str, headers: dict | None = None) -> None:
                """Answer without reading the body; the connection closes, so its unread bytes are
                never taken for a next request."""
                log(f"webhook: refused a request from {self.client_address[0]} with {code}: {message}")
                self.close_connection = True
                self._reply(code, {"error": message}, headers)

            def do_GET(self):  # noqa: N802
                self._reply(200, {"ok": True}) if self.path == "/health" else self._reply(404, {"error": "not found"})

            def do_POST(self):  # noqa: N802
                wait = receiver.limiter.take(self.client_address[0])
                if wait:
                    retry = max(1, math.ceil(wait))
                    return self._refuse(429, f"too many requests from this address; retry in {retry} s",
                                        {"Retry-After": str(retry)})
                try:
                    length = body_length(self.headers.get_all("Content-Length") or [],
                                         self.headers.get_all("Transfer-Encoding") or [], receiver.max_body)
                except WebhookRejected as error:
                    return self._refuse(error.status, str(error))
                try:
                    body = self.rfile.read(length)
                except TimeoutError:
                    return self._refuse(408, f"the body did not arrive within {self.timeout:g} s")
                if len(body) < length:
                    return self._refuse(400, f"the body ended after {len(body)} of {length} bytes")
                code, reply = receiver.handle(dict(self.headers), body)
                self._reply(code, reply)

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.address = self.server.server_address
        self._lock = threading.Lock()

    def handle(self, headers: dict, body: bytes) -> tuple[int, dict]:
        """The answer to one delivery whose body has been read: (HTTP status, JSON body)."""
        if len(body) > self.max_body:
            return 413, {"error": f"the body is over this receiver's limit of {self.max_body} bytes"}
        try:
            delivery, sent = verify(self.secret, headers, body, max_skew=self.params.triggers.max_clock_skew_seconds)
            event = alias_event(body)
        except WebhookRejected as error:
            log(f"webhook: refused a delivery: {error}")
            return error.status, {"error": str(error)}
        # one delivery at a time: the replay check, the start and the record of the id are one step
        # (MLflow re-sends a delivery it got a 429 or 5xx for with the same id: only accepted ids count)
        with self._lock:
            accepted = self.deliveries.accepted_at(delivery)
            if accepted is not None:
                log(f"webhook: delivery {delivery} was accepted before; ignoring the replay")
                return 200, {"started": False, "duplicate": True,
                             "reason": f"delivery {delivery} was already accepted "
                                       f"{max(0.0, time.time() - accepted):.0f} s ago; a repeat starts nothing"}
            code, reply = self._act(event)
            if code < 300:
                self.deliveries.remember(delivery, sent)
            return code, reply

    def _act(self, event: dict | None) -> tuple[int, dict]:
        if event is None:
            return 200, {"started": False, "reason": "not a model_version_alias.created event"}
        if event["name"] != self.params.mlflow.registered_model or event["alias"] != registry.CHALLENGER:
            return 200, {"started": False, "reason": f"alias {event['alias']} of {event['name']} is not watched"}
        try:  # the claim in the gallery's store makes a repeated version a no-op
            return 200, self.on_event(event["version"])
        except DeploymentMissing as error:  # the sender gets a 503 and retries; the message says what to do
            log(f"webhook: could not start the upgrade of version {event['version']}: {error}")
            return 503, {"error": f"could not start the upgrade: {error}"}
        except Exception as error:  # noqa: BLE001 - the sender gets a 500 and retries
            log(f"webhook: could not start the upgrade of version {event['version']}: {error!r}")
            return 500, {"error": f"could not start the upgrade: {type(error).__name__}: {error}"}

    def serve_forever(self) -> None:
        log(f"webhook receiver on http://{self.address[0]}:{self.address[1]}/ for "
            f"{self.params.mlflow.registered_model}@{registry.CHALLENGER} -> {self.store_uri}")
        self.server.serve_forever()

    def shutdown(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def webhook_secret(params: Params) -> str:
    secret = os.environ.get(params.triggers.webhook_secret_env, "")
    if not secret:
        raise ValueError(f"set {params.triggers.webhook_secret_env} to the webhook's secret (the same one given to "
                         "`fastfill webhook register`); without it no delivery can be verified")
    return secret


def params_file(path: Path) -> str:
    return str(Path(path).resolve())
