"""The checks of an MLflow registry webhook delivery, free of HTTP. The signature follows
MLflow's delivery: headers ``X-MLflow-Delivery-Id``, ``X-MLflow-Timestamp`` (Unix seconds) and
``X-MLflow-Signature`` = ``v1,<base64 HMAC-SHA256 of "<delivery id>.<timestamp>.<body>">`` with the
webhook's secret.

What keeps the receiver (services/webhook_receiver.py) standing under abuse lives here too: the
check of a request's declared body length (made before any of the body is read), a token bucket
per client address, and the memory of accepted delivery ids that turns a replay into a no-op.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping

SIGNATURE_HEADER = "X-MLflow-Signature"
TIMESTAMP_HEADER = "X-MLflow-Timestamp"
DELIVERY_HEADER = "X-MLflow-Delivery-Id"
MAX_DELIVERY_ID = 200  # MLflow sends a UUID (36 characters); the id is kept in memory


def webhook_secret(params) -> str:
    """The webhooks' shared secret: the variable triggers.webhook_secret_env names (Params)."""
    secret = os.environ.get(params.triggers.webhook_secret_env, "")
    if not secret:
        raise ValueError(f"set {params.triggers.webhook_secret_env} to the webhook's secret (the same one given to "
                         "`fastfill webhook register`); without it no delivery can be verified")
    return secret


class WebhookRejected(ValueError):
    """A delivery that must not be acted on; the message says why (no secrets in it), ``status``
    is the HTTP answer: 401 when the sender is not proven, 400 when the request or body is
    malformed, 411 when it has no usable length, 413 when it is too large."""

    def __init__(self, message: str, status: int = 401):
        super().__init__(message)
        self.status = status


_DIGITS = re.compile(r"[0-9]{1,20}")


def body_length(lengths: list[str], encodings: list[str], limit: int) -> int:
    """The body length a request declares (its ``Content-Length`` and ``Transfer-Encoding``
    header values), checked against ``limit`` bytes before any of the body is read."""
    if encodings:
        raise WebhookRejected("Transfer-Encoding is not accepted (no chunked bodies); send the body with a "
                              "Content-Length", status=411)
    if not lengths:
        raise WebhookRejected("Content-Length is required", status=411)
    values = {value.strip() for value in lengths}
    if len(values) > 1:
        raise WebhookRejected("the request has conflicting Content-Length headers", status=400)
    value = values.pop()
    if not _DIGITS.fullmatch(value):
        raise WebhookRejected(f"Content-Length is not a non-negative integer: {value[:40]!r}", status=400)
    length = int(value)
    if length > limit:
        raise WebhookRejected(f"the body ({length} bytes) is over this receiver's limit of {limit} bytes "
                              "(triggers.webhook_max_body_bytes); it was not read", status=413)
    return length


class RateLimiter:
    """A token bucket per client address: ``burst`` requests at once, then ``per_minute``.
    At most ``max_clients`` buckets are kept; the least recently seen address is forgotten first
    (it comes back with a full bucket). Safe to call from many threads."""

    def __init__(self, per_minute: float, burst: int, *, max_clients: int = 4096,
                 clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self.max_clients, self.clock = per_minute / 60.0, burst, max_clients, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # address -> (tokens, when)
        self._lock = threading.Lock()

    def take(self, client: str) -> float:
        """0 when ``client`` may go on (a token is spent), else the seconds until it may."""
        with self._lock:
            now = self.clock()
            tokens, then = self._buckets.pop(client, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - then) * self.rate)
            wait = 0.0 if tokens >= 1 else (1 - tokens) / self.rate
            self._buckets[client] = (tokens - 1 if wait == 0 else tokens, now)
            while len(self._buckets) > self.max_clients:
                self._buckets.popitem(last=False)
            return wait


class DeliveryLog:
    """The delivery ids this receiver accepted, each kept until its signed timestamp is older than
    ``window`` seconds (the clock check refuses it from then on), and at most ``capacity`` of them
    (the oldest go first). Held in memory: a restart forgets them, and the version claim in the
    gallery's store is what still keeps a replayed event from starting a second upgrade. Not
    locked itself; its caller serialises the check and the record."""

    def __init__(self, window: float, *, capacity: int = 10_000, clock: Callable[[], float] = time.time):
        self.window, self.capacity, self.clock = window, capacity, clock
        self._ids: OrderedDict[str, tuple[float, float]] = OrderedDict()  # id -> (accepted at, forget at)

    def _prune(self) -> None:
        now = self.clock()
        while self._ids and next(iter(self._ids.values()))[1] < now:
            self._ids.popitem(last=False)

    def accepted_at(self, delivery_id: str) -> float | None:
        """When ``delivery_id`` was accepted (Unix seconds), or None when it was not (or is forgotten)."""
        self._prune()
        found = self._ids.get(delivery_id)
        return None if found is None or found[1] < self.clock() else found[0]

    def remember(self, delivery_id: str, sent: float) -> None:
        now = self.clock()
        self._ids[delivery_id] = (now, max(sent, now) + self.window)
        self._ids.move_to_end(delivery_id)
        self._prune()
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def __len__(self) -> int:
        return len(self._ids)


def sign(secret: str, delivery_id: str, timestamp: str, body: bytes) -> str:
    signed = f"{delivery_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(secret.encode(), signed, hashlib.sha256).digest()).decode()


def verify(secret: str, headers: Mapping[str, str], body: bytes, *, max_skew: int = 300,
           now_seconds: float | None = None) -> tuple[str, int]:
    """Raise WebhookRejected unless the delivery is signed with ``secret`` and recent; return its
    delivery id and signed timestamp."""
    if not secret:
        raise WebhookRejected("the receiver has no secret configured; it accepts no deliveries")
    lowered = {k.lower(): v for k, v in headers.items()}
    delivery = lowered.get(DELIVERY_HEADER.lower())
    timestamp = lowered.get(TIMESTAMP_HEADER.lower())
    signature = lowered.get(SIGNATURE_HEADER.lower())
    if not (delivery and timestamp and signature):
        raise WebhookRejected(f"missing {DELIVERY_HEADER}, {TIMESTAMP_HEADER} or {SIGNATURE_HEADER} header")
    if len(delivery) > MAX_DELIVERY_ID:
        raise WebhookRejected(f"{DELIVERY_HEADER} is longer than {MAX_DELIVERY_ID} characters", status=400)
    try:
        sent = int(timestamp)
    except ValueError:
        raise WebhookRejected(f"{TIMESTAMP_HEADER} is not a Unix time: {timestamp[:40]!r}") from None
    now_seconds = time.time() if now_seconds is None else now_seconds
    if abs(now_seconds - sent) > max_skew:
        raise WebhookRejected(f"the delivery is {abs(now_seconds - sent):.0f} s away from this clock "
                              f"(more than {max_skew} s): a replay, or clocks out of sync")
    if not hmac.compare_digest(sign(secret, delivery, timestamp, body), signature):
        raise WebhookRejected("the signature does not match the body and the configured secret")
    return delivery, sent


def alias_event(body: bytes) -> dict | None:
    """``{"name", "alias", "version"}`` of a ``model_version_alias.created`` delivery, else None."""
    try:
        event = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise WebhookRejected("the body is not JSON", status=400) from None
    if not isinstance(event, dict) or (event.get("entity"), event.get("action")) != ("model_version_alias", "created"):
        return None
    data = event.get("data") or {}
    if not all(isinstance(data.get(k), str) for k in ("name", "alias", "version")):
        raise WebhookRejected("a model_version_alias.created delivery without name, alias and version", status=400)
    return {"name": data["name"], "alias": data["alias"], "version": data["version"]}
