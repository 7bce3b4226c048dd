"""Upgrades that run themselves: the deployments, the registry watcher, the webhook receiver.

Every path ends in the same Prefect deployment, ``upgrade-gallery/upgrade``:

- the registry watcher (deployment ``registry-watcher/poll``, on an interval; any MLflow backend)
  starts it when `challenger` names a version the gallery is not on or moving to;
- ``registry-watcher/nightly`` (cron) does the same check and also resumes a paused upgrade;
- the webhook receiver (`fastfill webhook serve`) starts it on a signed
  ``model_version_alias.created`` delivery for `challenger` from an MLflow server;
- ``comparison/weekly`` (cron) re-runs the comparison of methods.

A version is claimed in the gallery's store (create-only) before its upgrade starts, and the
flow run carries an idempotency key, so no version starts two upgrades.
"""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prefect import flow

from components.platform import registry
from components.platform.config import Params, load_params
from components.gallery import plan as pl, upgrade as up
from components.gallery.catalog import Gallery
from components.gallery.triggers import WebhookRejected, alias_event, claim, release, verify, wants_upgrade
from tasks._policy import log
from tasks.gallery import store_at

UPGRADE_DEPLOYMENT = "upgrade-gallery/upgrade"
MAX_BODY = 1 << 20


@flow(name="upgrade-gallery", log_prints=True)
def upgrade_entry(params_path: str = "params.yaml", store: str | None = None, to: str = "",
                  gate: bool | None = None, budget: float | None = None) -> dict:
    """What the upgrade deployment runs: the gallery upgrade with params.yaml's settings."""
    from flows.upgrade import run_upgrade

    params = load_params(params_path)
    return run_upgrade(params, store or params.gallery.store, to, budget=budget, gate=gate)


@flow(name="comparison", log_prints=True)
def comparison_entry(params_path: str = "params.yaml") -> dict:
    """What the scheduled comparison runs: every method over compare.seeds."""
    from flows.compare import compare_flow

    summary = compare_flow(load_params(params_path))
    return {"seeds": summary["seeds"], "expectations": summary["expectations"]}


def start_upgrade(params: Params, store_uri: str, version: str, source: str, params_path: str) -> dict:
    """Claim ``version`` for this gallery and start the upgrade deployment (without waiting).
    A version claimed before is not started again."""
    from prefect.deployments import run_deployment

    name = params.mlflow.registered_model
    store = store_at(store_uri)
    if not claim(store, name, version, source):
        log(f"{name} version {version} was already claimed for {store.uri}; not starting it again")
        return {"started": False, "reason": f"version {version} was already claimed for this gallery"}
    try:
        run = run_deployment(UPGRADE_DEPLOYMENT, timeout=0, idempotency_key=f"upgrade:{store.uri}:{name}:{version}",
                             parameters={"params_path": params_path, "store": store_uri,
                                         "to": f"models:/{name}/{version}"})
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


@flow(name="registry-watcher", log_prints=True)
def watch_flow(params_path: str = "params.yaml", store: str | None = None, resume: bool = False) -> dict:
    """Start an upgrade when `challenger` is new to the gallery; with ``resume``, also resume a
    paused upgrade (the nightly check-and-upgrade)."""
    params = load_params(params_path)
    store_uri = store or params.gallery.store
    candidate, why_not = check_registry(params, store_uri)
    if why_not is None:
        return start_upgrade(params, store_uri, candidate, "registry-watcher", params_path)
    log(f"registry watcher: nothing to start ({why_not})")
    if resume:
        gallery = Gallery(store_at(store_uri))
        state = up.status(gallery)
        if state["state"] == "paused":
            from prefect.deployments import run_deployment

            run = run_deployment(UPGRADE_DEPLOYMENT, timeout=0, parameters={
                "params_path": params_path, "store": store_uri, "to": state["upgrade"]["to"]})
            log(f"resuming the paused upgrade {state['upgrade']['id']}: flow run {run.id}")
            return {"started": False, "resumed": True, "flow_run_id": str(run.id), "reason": why_not}
    return {"started": False, "reason": why_not}


def deployments(params: Params, params_path: str = "params.yaml") -> list:
    """Every deployment, defined in this one place; `fastfill serve` serves them."""
    parameters = {"params_path": params_path}
    triggers = params.triggers
    found = [
        upgrade_entry.to_deployment(name="upgrade", parameters=parameters, concurrency_limit=1,
                                    description="Upgrade the stored gallery (started by the watcher or a webhook)"),
        watch_flow.to_deployment(name="poll", parameters=parameters, interval=triggers.poll_seconds,
                                 description="Start an upgrade when a new version has the alias challenger"),
    ]
    if triggers.nightly_cron:
        found.append(watch_flow.to_deployment(
            name="nightly", parameters={**parameters, "resume": True},
            cron=triggers.nightly_cron, description="Check the registry and resume a paused upgrade"))
    if triggers.comparison_cron:
        found.append(comparison_entry.to_deployment(name="weekly", parameters=parameters, cron=triggers.comparison_cron,
                                                    description="Re-run the comparison of every method"))
    return found


# ------------------------------------------------------------------------------------------------
# The webhook receiver


class WebhookReceiver:
    """An HTTP endpoint for MLflow registry webhooks. POST / with a signed
    ``model_version_alias.created`` delivery for ``challenger`` starts the upgrade; GET /health
    answers ok. It listens on ``host`` (127.0.0.1 by default) only."""

    def __init__(self, params: Params, params_path: str, store_uri: str, secret: str, host: str, port: int,
                 on_event=None):
        self.params, self.params_path, self.store_uri, self.secret = params, params_path, store_uri, secret
        self.on_event = on_event or (lambda version: start_upgrade(params, store_uri, version, "webhook", params_path))
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format, *args):  # noqa: A002 - the stdlib's signature
                log("webhook: " + format % args)

            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                self._reply(200, {"ok": True}) if self.path == "/health" else self._reply(404, {"error": "not found"})

            def do_POST(self):  # noqa: N802
                code, body = receiver.handle(dict(self.headers), self._body())
                self._reply(code, body)

            def _body(self) -> bytes:
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(min(length, MAX_BODY + 1))

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.address = self.server.server_address
        self._lock = threading.Lock()

    def handle(self, headers: dict, body: bytes) -> tuple[int, dict]:
        if len(body) > MAX_BODY:
            return 413, {"error": "body too large"}
        try:
            verify(self.secret, headers, body, max_skew=self.params.triggers.max_clock_skew_seconds)
            event = alias_event(body)
        except WebhookRejected as error:
            log(f"webhook: refused a delivery: {error}")
            return error.status, {"error": str(error)}
        if event is None:
            return 200, {"started": False, "reason": "not a model_version_alias.created event"}
        if event["name"] != self.params.mlflow.registered_model or event["alias"] != registry.CHALLENGER:
            return 200, {"started": False, "reason": f"alias {event['alias']} of {event['name']} is not watched"}
        with self._lock:  # one start at a time; the claim makes repeats no-ops
            try:
                return 200, self.on_event(event["version"])
            except Exception as error:  # noqa: BLE001 - the sender gets a 500 and retries
                log(f"webhook: could not start the upgrade of version {event['version']}: {error}")
                return 500, {"error": f"could not start the upgrade: {error}"}

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
