"""What starts an upgrade by itself: a new `challenger` in the registry, seen by a watcher that
polls or delivered by an MLflow registry webhook. Both paths claim the version in the gallery's
store with a create-only write before starting anything, so one version never starts two
upgrades, whichever path (or how many watchers, or webhook retries) saw it first.

The webhook check follows MLflow's delivery: headers ``X-MLflow-Delivery-Id``,
``X-MLflow-Timestamp`` (Unix seconds) and ``X-MLflow-Signature`` = ``v1,<base64 HMAC-SHA256 of
"<delivery id>.<timestamp>.<body>">`` with the webhook's secret.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Mapping

from components.gallery.catalog import now
from components.platform.registry import ModelRef
from components.gallery.store import AlreadyExists, ObjectMissing, Store

SIGNATURE_HEADER = "X-MLflow-Signature"
TIMESTAMP_HEADER = "X-MLflow-Timestamp"
DELIVERY_HEADER = "X-MLflow-Delivery-Id"


def trigger_key(name: str, version: str) -> str:
    return f"triggers/{name}-v{version}.json"


def claim(store: Store, name: str, version: str, source: str, **details) -> bool:
    """True for the first claim of this version in this gallery, False for every later one."""
    record = {"name": name, "version": str(version), "source": source, "claimed": now(), **details}
    try:
        store.put_json(trigger_key(name, version), record, create_only=True)
    except AlreadyExists:
        return False
    return True


def release(store: Store, name: str, version: str) -> None:
    """Undo a claim whose upgrade could not be started, so a later trigger may try again."""
    store.delete(trigger_key(name, version))


def claimed(store: Store, name: str, version: str) -> dict | None:
    try:
        return store.get_json(trigger_key(name, version))
    except ObjectMissing:
        return None


def wants_upgrade(gallery_model: ModelRef, upgrading_to: ModelRef | None, candidate: str | None) -> str | None:
    """Why the candidate version should NOT start an upgrade, or None when it should."""
    if candidate is None:
        return "no version has the alias"
    if str(candidate) == str(gallery_model.version):
        return f"the gallery is already on version {candidate}"
    if upgrading_to is not None and str(candidate) == str(upgrading_to.version):
        return f"the gallery is already upgrading to version {candidate}"
    return None


class WebhookRejected(ValueError):
    """A delivery that must not be acted on; the message says why (no secrets in it), ``status``
    is the HTTP answer: 401 when the sender is not proven, 400 when the body is malformed."""

    def __init__(self, message: str, status: int = 401):
        super().__init__(message)
        self.status = status


def sign(secret: str, delivery_id: str, timestamp: str, body: bytes) -> str:
    signed = f"{delivery_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(secret.encode(), signed, hashlib.sha256).digest()).decode()


def verify(secret: str, headers: Mapping[str, str], body: bytes, *, max_skew: int = 300,
           now_seconds: float | None = None) -> None:
    """Raise WebhookRejected unless the delivery is signed with ``secret`` and recent."""
    if not secret:
        raise WebhookRejected("the receiver has no secret configured; it accepts no deliveries")
    lowered = {k.lower(): v for k, v in headers.items()}
    delivery = lowered.get(DELIVERY_HEADER.lower())
    timestamp = lowered.get(TIMESTAMP_HEADER.lower())
    signature = lowered.get(SIGNATURE_HEADER.lower())
    if not (delivery and timestamp and signature):
        raise WebhookRejected(f"missing {DELIVERY_HEADER}, {TIMESTAMP_HEADER} or {SIGNATURE_HEADER} header")
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
