"""The webhook receiver: an HTTP endpoint for MLflow registry webhooks. A signed
``model_version_alias.created`` delivery for `challenger` starts the upgrade deployment
(flows/deployments.py, ``start_upgrade``), which claims the version first.

The receiver answers every request, malformed ones included: a body over
``triggers.webhook_max_body_bytes`` (413), without a usable Content-Length (400/411) or chunked
(411) is refused before it is read; more POSTs from one address than the token bucket allows get
429 with Retry-After; a delivery id it accepted before gets a 200 that says "duplicate" and starts
nothing; a missing upgrade deployment gets a 503 that says how to create it. The checks
themselves, free of HTTP, are components/gallery/webhook_checks.py.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from components.gallery.webhook_checks import DeliveryLog, RateLimiter, WebhookRejected, alias_event, body_length, verify
from components.platform import registry
from components.platform.config import Params
from flows.deployments import DeploymentMissing, start_upgrade
from tasks._policy import log


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
