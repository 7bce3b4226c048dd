"""Triggers: one claim per version, MLflow webhook signatures, and the receiver over real HTTP."""

import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from fastfill.components.gallery.store import LocalStore
from fastfill.components.gallery.triggers.claims import claim, claimed, release, wants_upgrade
from fastfill.components.gallery.triggers.webhook_checks import WebhookRejected, alias_event, sign, verify
from fastfill.components.platform.config import parse_params
from fastfill.components.platform.registry import ModelRef
from testkit.tiny_demo import tiny_params

SECRET = "s3cret-for-tests"


def _delivery(body: dict, secret: str = SECRET, timestamp: int | None = None, delivery: str | None = None):
    """Headers and body of one delivery, signed; each gets its own delivery id unless given one."""
    delivery = delivery or f"d-{uuid.uuid4()}"
    raw = json.dumps(body).encode()
    stamp = str(int(time.time()) if timestamp is None else timestamp)
    return {"X-MLflow-Delivery-Id": delivery, "X-MLflow-Timestamp": stamp,
            "X-MLflow-Signature": sign(secret, delivery, stamp, raw), "Content-Type": "application/json"}, raw


def _alias_body(version="7", alias="challenger", name="embedder"):
    return {"entity": "model_version_alias", "action": "created", "timestamp": "2026-11-22T00:00:00+00:00",
            "data": {"name": name, "alias": alias, "version": version}}


def test_a_version_is_claimed_once(tmp_path):
    store = LocalStore(tmp_path)
    assert claim(store, "embedder", "7", "webhook")
    assert not claim(store, "embedder", "7", "registry-watcher")
    assert claimed(store, "embedder", "7")["source"] == "webhook"
    assert claim(store, "embedder", "8", "registry-watcher")
    release(store, "embedder", "7")
    assert claim(store, "embedder", "7", "registry-watcher")


def test_our_check_accepts_mlflows_own_signature():
    from mlflow.webhooks.delivery import _generate_hmac_signature

    body = json.dumps(_alias_body())
    stamp = str(int(time.time()))
    headers = {"X-MLflow-Delivery-Id": "abc", "X-MLflow-Timestamp": stamp,
               "X-MLflow-Signature": _generate_hmac_signature(SECRET, "abc", stamp, body)}
    verify(SECRET, headers, body.encode())


@pytest.mark.parametrize("change, message", [
    (lambda h, b: ({**h, "X-MLflow-Signature": sign("other", "d-1", h["X-MLflow-Timestamp"], b)}, b), "signature"),
    (lambda h, b: (h, b.replace(b'"7"', b'"8"')), "signature"),  # a tampered body
    (lambda h, b: ({k: v for k, v in h.items() if k != "X-MLflow-Signature"}, b), "missing"),
    (lambda h, b: ({**h, "X-MLflow-Timestamp": "yesterday"}, b), "not a Unix time"),
])
def test_bad_deliveries_are_refused(change, message):
    headers, body = change(*_delivery(_alias_body()))
    with pytest.raises(WebhookRejected, match=message):
        verify(SECRET, headers, body)


def test_an_old_delivery_is_a_replay():
    headers, body = _delivery(_alias_body(), timestamp=int(time.time()) - 3600)
    with pytest.raises(WebhookRejected, match="replay"):
        verify(SECRET, headers, body, max_skew=300)
    with pytest.raises(WebhookRejected, match="no secret"):
        verify("", *_delivery(_alias_body()))


def test_alias_events_are_parsed_and_others_ignored():
    assert alias_event(json.dumps(_alias_body()).encode()) == {"name": "embedder", "alias": "challenger", "version": "7"}
    other = {"entity": "model_version", "action": "created", "data": {"name": "embedder", "version": "7"}}
    assert alias_event(json.dumps(other).encode()) is None
    with pytest.raises(WebhookRejected, match="not JSON"):
        alias_event(b"<xml/>")


def test_which_challenger_starts_an_upgrade():
    gallery = ModelRef("embedder", "3", 16)
    assert wants_upgrade(gallery, None, None) == "no version has the alias"
    assert "already on version 3" in wants_upgrade(gallery, None, "3")
    assert "already upgrading to version 4" in wants_upgrade(gallery, ModelRef("embedder", "4", 16), "4")
    assert wants_upgrade(gallery, ModelRef("embedder", "4", 16), "5") is None  # a sequential upgrade
    assert wants_upgrade(gallery, None, "4") is None


def _post(address, headers, body):
    request = urllib.request.Request(f"http://{address[0]}:{address[1]}/", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_the_receiver_starts_each_version_once_over_http(tmp_path):
    from fastfill.services.webhook_receiver import WebhookReceiver

    params = parse_params(tiny_params(tmp_path))
    store = LocalStore(tmp_path / "gallery")
    started = []

    def on_event(version):  # what start_upgrade does, without a Prefect server: claim, then start
        if not claim(store, "embedder", version, "webhook"):
            return {"started": False, "reason": "already claimed"}
        started.append(version)
        return {"started": True, "version": version}

    receiver = WebhookReceiver(params, "params.yaml", str(tmp_path / "gallery"), SECRET, "127.0.0.1", 0, on_event)
    assert receiver.address[0] == "127.0.0.1"
    thread = threading.Thread(target=receiver.serve_forever, daemon=True)
    thread.start()
    try:
        code, reply = _post(receiver.address, *_delivery(_alias_body("7")))
        assert code == 200 and reply == {"started": True, "version": "7"}
        code, reply = _post(receiver.address, *_delivery(_alias_body("7"), delivery="d-2"))  # MLflow retries
        assert code == 200 and not reply["started"]
        code, reply = _post(receiver.address, *_delivery(_alias_body("8", alias="staging")))
        assert code == 200 and "not watched" in reply["reason"]
        headers, body = _delivery(_alias_body("9"), secret="wrong")
        code, reply = _post(receiver.address, headers, body)
        assert code == 401 and "signature" in reply["error"]
        stamp = str(int(time.time()))
        signed_junk = {"X-MLflow-Delivery-Id": "d-3", "X-MLflow-Timestamp": stamp,
                       "X-MLflow-Signature": sign(SECRET, "d-3", stamp, b"<xml/>")}
        code, reply = _post(receiver.address, signed_junk, b"<xml/>")
        assert code == 400 and "not JSON" in reply["error"]
        assert started == ["7"]
        with urllib.request.urlopen(f"http://127.0.0.1:{receiver.address[1]}/health", timeout=10) as response:
            assert json.loads(response.read()) == {"ok": True}
    finally:
        receiver.shutdown()


def test_served_deployments_carry_the_store_they_were_given(monkeypatch):
    """`fastfill serve --store X` (or FASTFILL_STORE): the upgrade and the registry checks work on
    X, not on gallery.store; without it they read gallery.store from the params file."""
    from typer.main import get_command

    from fastfill.cli import app
    from fastfill.components.platform.config import load_params
    from fastfill.flows.deployments import deployments

    params = load_params(Path(__file__).resolve().parents[2] / "params.yaml")
    by_name = {d.name: d for d in deployments(params, "/p/params.yaml", "s3://bucket/gallery")}
    for name in ("upgrade", "poll", "nightly"):
        if name in by_name:
            assert by_name[name].parameters["store"] == "s3://bucket/gallery", name
            assert by_name[name].parameters["params_path"] == "/p/params.yaml", name
    if "weekly" in by_name:
        assert "store" not in by_name["weekly"].parameters  # the comparison has no gallery
    assert all("store" not in d.parameters for d in deployments(params, "/p/params.yaml"))

    cli = get_command(app)  # its groups load when asked for (cli/__init__.py's COMMANDS)
    serve = cli.get_command(None, "serve")
    store = next(option for option in serve.params if option.name == "store")
    assert store.envvar == "FASTFILL_STORE"
    webhook = cli.get_command(None, "webhook").get_command(None, "serve")
    assert {option.name: option.envvar for option in webhook.params if option.name in ("host", "port", "store")} == {
        "host": "FASTFILL_WEBHOOK_HOST", "port": "FASTFILL_WEBHOOK_PORT", "store": "FASTFILL_STORE"}


def test_the_comparison_is_served_only_when_its_schedule_is_set():
    """The comparison retrains every method (hours) on the host that serves: off by default."""
    from fastfill.components.platform.config import load_params
    from fastfill.flows.deployments import deployments

    params = load_params(Path(__file__).resolve().parents[2] / "params.yaml")
    assert params.triggers.comparison_cron is None
    assert "weekly" not in {d.name for d in deployments(params, "/p/params.yaml")}
    scheduled = params.model_copy(update={"triggers": params.triggers.model_copy(update={"comparison_cron": "0 3 * * 0"})})
    assert "weekly" in {d.name for d in deployments(scheduled, "/p/params.yaml")}


def test_serve_refuses_in_one_line_without_a_prefect_server(monkeypatch, tmp_path):
    """Its deployments and schedules live on a Prefect server: without PREFECT_API_URL it ends at
    once, exit 5, naming the setting and how to start one; nothing is served."""
    from typer.testing import CliRunner

    from fastfill.cli import app

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    done = CliRunner().invoke(app, ["serve", "--store", str(tmp_path / "gallery")])
    assert done.exit_code == 5, done.output
    assert "fastfill serve needs a Prefect server" in done.output and "PREFECT_API_URL" in done.output
    assert "serving" not in done.output and "Traceback" not in done.output
