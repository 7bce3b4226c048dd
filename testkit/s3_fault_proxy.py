"""An HTTP proxy between the product and an S3 endpoint that misbehaves on purpose, as S3 does
now and then: a share of requests gets an S3 error answer (500 InternalError, 503 SlowDown, 503
ServiceUnavailable, with S3's XML error body), or loses its connection (before the request
reaches the endpoint, or after the endpoint acted on it, or halfway through the answer), or is
answered late. ``down`` makes it drop every connection (an outage); ``rules`` fail chosen requests.
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

STATUS_FAULTS = ("500", "503-slowdown", "503-unavailable")
CONNECTION_FAULTS = ("drop-request", "drop-reply", "reset-reply", "truncate-reply", "slow-reply")

_ERRORS = {
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "503-slowdown": (503, "SlowDown", "Please reduce your request rate."),
    "503-unavailable": (503, "ServiceUnavailable", "Service is unable to handle request."),
}
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection", "te", "upgrade"}


class FaultProxy:
    def __init__(self, upstream: str, *, rate: float = 0.1, kinds: tuple[str, ...] = STATUS_FAULTS, seed: int = 0,
                 slow_seconds: float = 1.5):
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.rate, self.kinds, self.slow_seconds = rate, kinds, slow_seconds
        self.down = False
        self.rules: list[Callable[[str, str], str | None]] = []  # (method, path) -> a fault, or None
        self.faults: Counter = Counter()
        self.requests = 0
        self._random = random.Random(seed)
        self._mutex = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self):
                proxy._handle(self)

            do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def injected(self) -> int:
        return sum(self.faults.values())

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    # ---- what to do with one request

    def _choose(self, method: str, path: str) -> str | None:
        with self._mutex:
            self.requests += 1
            if self.down:
                return "down"
            for rule in self.rules:
                fault = rule(method, path)
                if fault:
                    return fault
            if self.rate and self._random.random() < self.rate:
                fault = self._random.choice(self.kinds)
                if fault == "truncate-reply" and method != "GET":
                    fault = "drop-reply"
                return fault
            return None

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        method = handler.command
        body = _read_body(handler)
        fault = self._choose(method, handler.path)
        if fault is not None:
            with self._mutex:
                self.faults[fault] += 1
        if fault in ("down", "drop-request"):
            return _drop(handler)
        if fault in _ERRORS:
            return _error(handler, *_ERRORS[fault])
        status, headers, payload = self._forward(handler, method, body)
        if fault == "drop-reply":
            return _drop(handler)
        if fault == "reset-reply":
            return _drop(handler, reset=True)
        if fault == "slow-reply":
            time.sleep(self.slow_seconds)
        try:
            handler.send_response(status)
            for name, value in headers:
                handler.send_header(name, value)
            handler.end_headers()
            if method != "HEAD":
                if fault == "truncate-reply" and len(payload) > 1:
                    handler.wfile.write(payload[: len(payload) // 2])
                    handler.wfile.flush()
                    return _drop(handler, reset=True)
                handler.wfile.write(payload)
        except OSError:  # the client gave up waiting (a slow answer): nothing to tell it
            handler.close_connection = True

    def _forward(self, handler: BaseHTTPRequestHandler, method: str, body: bytes):
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in _HOP_BY_HOP}
        if body or method in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        connection = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            connection.request(method, handler.path, body=body or None, headers=headers)
            response = connection.getresponse()
            payload = response.read()
            kept = [(k, v) for k, v in response.getheaders()
                    if k.lower() not in _HOP_BY_HOP | {"server", "date", "content-length"}]
            length = response.getheader("Content-Length") if method == "HEAD" else str(len(payload))
            kept.append(("Content-Length", length or "0"))
            return response.status, kept, payload
        finally:
            connection.close()


def _read_body(handler: BaseHTTPRequestHandler) -> bytes:
    if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
        chunks = []
        while True:
            size = int(handler.rfile.readline().split(b";")[0].strip(), 16)
            if size == 0:
                while handler.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(chunks)
            chunks.append(handler.rfile.read(size))
            handler.rfile.readline()
    length = int(handler.headers.get("Content-Length") or 0)
    return handler.rfile.read(length) if length else b""


def _drop(handler: BaseHTTPRequestHandler, reset: bool = False) -> None:
    """Close the connection without an answer (``reset``: with a TCP reset, not a clean close)."""
    handler.close_connection = True
    try:
        if reset:
            handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            handler.connection.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _error(handler: BaseHTTPRequestHandler, status: int, code: str, message: str) -> None:
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<Resource>{handler.path.split('?')[0]}</Resource><RequestId>FAULT{time.monotonic_ns()}</RequestId>"
            "</Error>").encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/xml")
    handler.send_header("Content-Length", str(len(body)))
    if status == 503:
        handler.send_header("Retry-After", "1")
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(body)
