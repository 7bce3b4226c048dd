"""The webhook receiver: an HTTP endpoint for MLflow registry webhooks. A signed
``model_version_alias.created`` delivery for `challenger` starts the upgrade deployment
(flows/deployments.py, ``start_upgrade``), which claims the version first.

It is a small ASGI app served by uvicorn (HTTP/1.1 through h11). The app decides in this order,
so that nothing costly happens for a request it will refuse: the rate limit per client address
(429 with Retry-After), then the declared length (411 without one, 413 over
``triggers.webhook_max_body_bytes``), both before any of the body is read; then the body, read
as it arrives with ``triggers.webhook_read_timeout_seconds`` for each part (408) and cut off with
413 once it grows past the limit (a chunked body has no length to check first); then the
signature, the replay window and the event. A request h11 cannot parse (a malformed
Content-Length, for one) is answered 400 by uvicorn itself and never reaches the app. The checks
themselves, free of HTTP, are components/gallery/triggers/webhook_checks.py.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time

import uvicorn

from fastfill.components.gallery.triggers.webhook_checks import (
    DeliveryLog,
    RateLimiter,
    WebhookRejected,
    alias_event,
    body_length,
    verify,
)
from fastfill.components.platform import registry
from fastfill.components.platform.config import Params
from fastfill.flows.deployments import DeploymentMissing, start_upgrade
from fastfill.tasks._policy import log

STOP_GRACE_SECONDS = 3.0  # what a request in flight still gets once the receiver is told to stop
POLL_SECONDS = 0.1  # how often a waiting request looks whether the receiver is stopping


class _Stopping(Exception):
    """The receiver is stopping and the request in flight has had its grace period."""


class _ClientGone(Exception):
    """The client closed the connection before its body was complete: nobody to answer."""


class WebhookReceiver:
    """An HTTP endpoint for MLflow registry webhooks. POST (any path) with a signed
    ``model_version_alias.created`` delivery for ``challenger`` starts the upgrade; GET /health
    answers ok. It listens on ``host`` (127.0.0.1 by default) only; ``address`` is where it
    listens from construction on (port 0 picks a free one). ``serve_forever()`` serves until
    ``shutdown()`` or, in the main thread, SIGINT/SIGTERM (then KeyboardInterrupt, after the
    requests in flight got ``STOP_GRACE_SECONDS``). See the module's docstring for what is refused."""

    def __init__(self, params: Params, params_path: str, store_uri: str, secret: str, host: str, port: int,
                 on_event=None):
        self.params, self.params_path, self.store_uri, self.secret = params, params_path, store_uri, secret
        self.on_event = on_event or (lambda version: start_upgrade(params, store_uri, version, "webhook", params_path))
        settings = params.triggers
        self.max_body = settings.webhook_max_body_bytes
        self.read_timeout = settings.webhook_read_timeout_seconds
        self.limiter = RateLimiter(settings.webhook_rate_per_minute, settings.webhook_burst)
        # a replay older than the clock check's window is refused by that check, so the window is enough
        self.deliveries = DeliveryLog(settings.max_clock_skew_seconds)
        self._lock = threading.Lock()
        self._socket = _listening_socket(host, port)
        self.address = self._socket.getsockname()[:2]
        self.server = uvicorn.Server(uvicorn.Config(
            self.asgi, http="h11", ws="none", lifespan="off", loop="asyncio", interface="asgi3",
            proxy_headers=False,  # the client address is the socket's: no header may pick its rate-limit bucket
            log_config=None, log_level="warning", access_log=False,
            server_header=False, headers=[("server", "fastfill-webhook")],
            # a backstop (whole seconds): requests end themselves first
            timeout_graceful_shutdown=math.ceil(STOP_GRACE_SECONDS) + 2))
        self._serving, self._stopped = threading.Event(), threading.Event()

    async def asgi(self, scope, receive, send) -> None:
        """The ASGI app: one HTTP request, one answer with a JSON body."""
        if scope["type"] != "http":
            return
        client = (scope.get("client") or ("unknown",))[0]
        try:
            if scope["method"] in ("GET", "HEAD"):
                found = scope["path"] == "/health"
                return await _answer(send, *((200, {"ok": True}) if found else (404, {"error": "not found"})))
            if scope["method"] != "POST":
                return await self._refuse(send, client, 405, "only POST (a delivery) and GET /health are answered")
            wait = self.limiter.take(client)
            if wait:
                retry = max(1, math.ceil(wait))
                return await self._refuse(send, client, 429, f"too many requests from this address; retry in {retry} s",
                                          [(b"retry-after", str(retry).encode())])
            declared_length(scope["headers"], self.max_body)  # 400, 411 or 413 before any of the body is read
            body = await self._read_body(receive)
            headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
            code, reply = await self._until_stopping(_in_daemon_thread(self.handle, headers, body))
            log(f"webhook: a delivery from {client} answered {code}")
            await _answer(send, code, reply)
        except WebhookRejected as error:
            await self._refuse(send, client, error.status, str(error))
        except _Stopping:
            await self._refuse(send, client, 503, "the receiver is stopping; send the delivery again")
        except (_ClientGone, asyncio.CancelledError):
            return  # nobody to answer, or uvicorn gave up on this request while stopping

    async def _refuse(self, send, client: str, code: int, message: str, headers: list | None = None) -> None:
        """Answer and close the connection: any unread bytes of the body are never taken for a
        next request."""
        log(f"webhook: refused a request from {client} with {code}: {message}")
        await _answer(send, code, {"error": message}, [(b"connection", b"close"), *(headers or [])])

    async def _read_body(self, receive) -> bytes:
        """The whole body, each part within the read timeout, no more than the limit."""
        parts, size = [], 0
        while True:
            try:
                message = await self._until_stopping(receive(), timeout=self.read_timeout)
            except TimeoutError:
                raise WebhookRejected(f"the body did not arrive within {self.read_timeout:g} s", status=408) from None
            if message["type"] == "http.disconnect":
                raise _ClientGone
            part = message.get("body", b"")
            size += len(part)
            if size > self.max_body:
                raise WebhookRejected(f"the body grew past this receiver's limit of {self.max_body} bytes "
                                      "(triggers.webhook_max_body_bytes); the rest was not read", status=413)
            parts.append(part)
            if not message.get("more_body", False):
                return b"".join(parts)

    async def _until_stopping(self, awaitable, timeout: float | None = None):
        """The result of ``awaitable``; TimeoutError after ``timeout`` seconds, _Stopping once the
        receiver has been stopping for STOP_GRACE_SECONDS."""
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(awaitable)
        deadline = None if timeout is None else loop.time() + timeout
        stop_at = None
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=POLL_SECONDS)
                if done:
                    return task.result()
                now = loop.time()
                if deadline is not None and now >= deadline:
                    raise TimeoutError
                if self.server.should_exit:
                    stop_at = stop_at or now + STOP_GRACE_SECONDS
                    if now >= stop_at:
                        raise _Stopping
        finally:
            task.cancel()

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
        self._serving.set()
        try:
            self.server.run(sockets=[self._socket])
        finally:
            self._socket.close()
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop serving (from another thread); the requests in flight get STOP_GRACE_SECONDS."""
        self.server.should_exit = True
        if self._serving.is_set():
            self._stopped.wait(STOP_GRACE_SECONDS + 5)
        else:
            self._socket.close()


def declared_length(headers: list[tuple[bytes, bytes]], limit: int) -> int | None:
    """The body length a request declares (its raw ASGI headers), checked against ``limit`` bytes
    before any of the body is read; None for a chunked body, whose size is checked as it is read."""
    lengths = [value.decode("latin-1") for name, value in headers if name == b"content-length"]
    if any(name == b"transfer-encoding" for name, _ in headers):
        if lengths:
            raise WebhookRejected("the request has both Transfer-Encoding and Content-Length; send one", status=400)
        return None
    return body_length(lengths, [], limit)


async def _answer(send, code: int, body: dict, headers: list | None = None) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": code,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": data})


async def _in_daemon_thread(function, *args):
    """``function(*args)`` in a daemon thread of its own. Not the event loop's executor: a start
    blocked on a Prefect server that does not answer must not keep the process from stopping."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, error) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def run() -> None:
        try:
            result, error = function(*args), None
        except BaseException as failure:  # noqa: BLE001 - handed to the waiting request
            result, error = None, failure
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:
            pass  # the receiver stopped meanwhile: nobody waits for this answer

    threading.Thread(target=run, name="webhook-delivery", daemon=True).start()
    return await future


def _listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host``:``port`` (IPv4 or IPv6, as the host is written)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock
