"""The webhook receiver under abuse, over real sockets: replays, bodies that are too large or have
no usable length, stalled senders and bursts. Every request gets an HTTP answer."""

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from components.gallery.store import LocalStore
from components.gallery.claims import claim
from components.gallery.webhook_checks import DeliveryLog, RateLimiter, sign
from components.platform.config import parse_params
from components.experiment.tiny_demo import tiny_params

SECRET = "s3cret-for-tests"
ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def _alias_body(version="7", alias="challenger", name="embedder") -> bytes:
    return json.dumps({"entity": "model_version_alias", "action": "created", "timestamp": "2026-11-22T00:00:00+00:00",
                       "data": {"name": name, "alias": alias, "version": version}}).encode()


def _signed(body: bytes, delivery: str, secret: str = SECRET) -> dict:
    stamp = str(int(time.time()))
    return {"X-MLflow-Delivery-Id": delivery, "X-MLflow-Timestamp": stamp,
            "X-MLflow-Signature": sign(secret, delivery, stamp, body), "Content-Type": "application/json"}


def _head(headers, content_length: int | None = None) -> bytes:
    """A POST's request line and headers; ``headers`` a dict or a list of pairs (repeats allowed)."""
    pairs = list(headers.items()) if isinstance(headers, dict) else list(headers)
    if content_length is not None:
        pairs.append(("Content-Length", str(content_length)))
    lines = ["POST / HTTP/1.1", "Host: 127.0.0.1"] + [f"{key}: {value}" for key, value in pairs]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _read_answer(sock: socket.socket) -> tuple[int, dict, dict]:
    """Status, headers (lower-cased names) and JSON body of the answer; the receiver closes."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    return status, headers, json.loads(body)


def _exchange(address, data: bytes, source: str | None = None, timeout: float = 5) -> tuple[int, dict, dict]:
    """Send ``data`` on a fresh connection and read the answer; a socket timeout means no answer came."""
    with socket.create_connection(address, timeout=timeout,
                                  source_address=(source, 0) if source else None) as sock:
        sock.sendall(data)
        return _read_answer(sock)


def _post(address, headers: dict, body: bytes, **kwargs) -> tuple[int, dict, dict]:
    return _exchange(address, _head(headers, len(body)) + body, **kwargs)


@pytest.fixture
def serve(tmp_path):
    """Start receivers in threads: ``serve(triggers={...}, on_event=...)`` -> the receiver."""
    from services.webhook_receiver import WebhookReceiver

    running = []

    def start(triggers: dict | None = None, on_event=None):
        data = tiny_params(tmp_path)
        data["triggers"] = triggers or {}
        receiver = WebhookReceiver(parse_params(data), "params.yaml", str(tmp_path / "gallery"), SECRET,
                                   "127.0.0.1", 0, on_event or (lambda version: {"started": True, "version": version}))
        threading.Thread(target=receiver.serve_forever, daemon=True).start()
        running.append(receiver)
        return receiver

    yield start
    for receiver in running:
        receiver.shutdown()


# ------------------------------------------------------------------------------------------------
# replays


def test_a_replayed_delivery_is_a_duplicate_and_starts_nothing(serve, tmp_path):
    store = LocalStore(tmp_path / "gallery")
    calls = []

    def on_event(version):  # what start_upgrade does without a Prefect server: claim, then start
        calls.append(version)
        if not claim(store, "embedder", version, "webhook"):
            return {"started": False, "reason": "already claimed"}
        return {"started": True, "version": version}

    receiver = serve(on_event=on_event)
    body = _alias_body("7")
    headers = _signed(body, "delivery-a")
    status, _, reply = _post(receiver.address, headers, body)
    assert status == 200 and reply == {"started": True, "version": "7"}
    status, _, reply = _post(receiver.address, headers, body)  # the very same bytes again
    assert status == 200 and reply["duplicate"] is True and reply["started"] is False
    assert "delivery delivery-a was already accepted" in reply["reason"]
    assert calls == ["7"]  # the replay did not even reach the start

    # another delivery id with the same event (MLflow sends a new id for a new event) does reach
    # the start, and the version's claim keeps it from starting a second upgrade
    status, _, reply = _post(receiver.address, _signed(body, "delivery-b"), body)
    assert status == 200 and reply == {"started": False, "reason": "already claimed"} and calls == ["7", "7"]

    # the memory is this process's: after a restart the replay is not known as one, and the claim
    # in the gallery's store still starts nothing
    receiver.shutdown()
    restarted = serve(on_event=on_event)
    status, _, reply = _post(restarted.address, headers, body)
    assert status == 200 and reply == {"started": False, "reason": "already claimed"}


def test_a_delivery_that_failed_is_not_remembered_so_mlflows_retry_goes_through(serve):
    attempts = []

    def on_event(version):
        attempts.append(version)
        if len(attempts) == 1:
            raise RuntimeError("the Prefect server is restarting")
        return {"started": True, "version": version}

    receiver = serve(on_event=on_event)
    body = _alias_body("8")
    headers = _signed(body, "delivery-retried")  # MLflow's retry re-sends the same id and signature
    status, _, reply = _post(receiver.address, headers, body)
    assert status == 500 and reply["error"] == "could not start the upgrade: RuntimeError: the Prefect server is restarting"
    status, _, reply = _post(receiver.address, headers, body)
    assert status == 200 and reply == {"started": True, "version": "8"}
    status, _, reply = _post(receiver.address, headers, body)
    assert status == 200 and reply["duplicate"] is True
    assert attempts == ["8", "8"]


def test_unsigned_or_overlong_ids_are_not_remembered(serve):
    receiver = serve()
    body = _alias_body("9")
    forged = _signed(body, "delivery-f", secret="not-the-secret")
    assert _post(receiver.address, forged, body)[0] == 401
    assert _post(receiver.address, _signed(body, "delivery-f"), body)[2] == {"started": True, "version": "9"}
    status, _, reply = _post(receiver.address, _signed(body, "x" * 201), body)
    assert status == 400 and "longer than 200" in reply["error"]
    assert len(receiver.deliveries) == 1


def test_the_delivery_log_forgets_after_the_window_and_stays_bounded():
    clock = [1000.0]
    log = DeliveryLog(300, capacity=3, clock=lambda: clock[0])
    log.remember("a", sent=1000)
    assert log.accepted_at("a") == 1000.0
    clock[0] = 1299
    assert log.accepted_at("a") == 1000.0
    clock[0] = 1301  # the clock check refuses the delivery from now on: no need to remember it
    assert log.accepted_at("a") is None and len(log) == 0
    for name in "bcde":
        log.remember(name, sent=clock[0])
    assert len(log) == 3 and log.accepted_at("b") is None and log.accepted_at("e") is not None


# ------------------------------------------------------------------------------------------------
# body sizes and lengths: refused before the body is read, each with an HTTP answer


@pytest.mark.parametrize("pairs, status, reason", [
    ([], 411, "Content-Length is required"),
    ([("Content-Length", "-1")], 400, "not a non-negative integer: '-1'"),
    ([("Content-Length", "abc")], 400, "not a non-negative integer: 'abc'"),
    ([("Content-Length", "1e3")], 400, "not a non-negative integer"),
    ([("Content-Length", "+12")], 400, "not a non-negative integer"),
    ([("Content-Length", "10"), ("Content-Length", "20")], 400, "conflicting Content-Length"),
    ([("Transfer-Encoding", "chunked")], 411, "Transfer-Encoding is not accepted"),
    ([("Transfer-Encoding", "chunked"), ("Content-Length", "10")], 411, "Transfer-Encoding is not accepted"),
    ([("Content-Length", str(MiB + 1))], 413, f"({MiB + 1} bytes) is over this receiver's limit of {MiB} bytes"),
    ([("Content-Length", str(200 * MiB))], 413, "it was not read"),
    ([("Content-Length", "9" * 40)], 400, "not a non-negative integer"),
])
def test_a_bad_length_is_answered_without_sending_a_body(serve, pairs, status, reason):
    """Only the headers are sent: the answer comes without the receiver waiting for a body."""
    receiver = serve()
    got, headers, reply = _exchange(receiver.address, _head(pairs))
    assert got == status
    assert reason in reply["error"] and "\n" not in reply["error"]
    assert headers["connection"] == "close"
    with socket.create_connection(receiver.address, timeout=5) as sock:  # still serving
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_answer(sock)[2] == {"ok": True}


def test_the_body_limit_is_configurable(serve):
    receiver = serve(triggers={"webhook_max_body_bytes": 100})
    body = _alias_body("7")
    assert len(body) > 100
    status, _, reply = _post(receiver.address, _signed(body, "big"), body)
    assert status == 413 and "limit of 100 bytes" in reply["error"]


def test_a_stalled_body_is_dropped_with_408(serve):
    receiver = serve(triggers={"webhook_read_timeout_seconds": 1})
    started = time.monotonic()
    status, _, reply = _exchange(receiver.address, _head({}, 100) + b"{" * 10)
    assert status == 408 and "did not arrive within 1 s" in reply["error"]
    assert time.monotonic() - started < 4


def _rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1))


@contextmanager
def receiver_process(folder: Path, env: dict | None = None):
    """`fastfill webhook serve` in its own process, on a free port of 127.0.0.1, with the tiny
    params and a gallery store under ``folder``: yields (process, address); its output goes to
    ``folder/webhook.log``."""
    (folder / "params.yaml").write_text(yaml.safe_dump(tiny_params(folder / "images")))
    log_path = folder / "webhook.log"
    env = {**(os.environ if env is None else env), "FASTFILL_WEBHOOK_SECRET": SECRET, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        process = subprocess.Popen([str(ROOT / ".venv" / "bin" / "fastfill"), "webhook", "serve", "-p", "params.yaml",
                                    "--port", "0", "--store", str(folder / "gallery")],
                                   cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while not (found := re.search(r"listening on http://127\.0\.0\.1:(\d+)/", log_path.read_text())):
                assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.1)
            yield process, ("127.0.0.1", int(found.group(1)))
        finally:
            process.terminate()
            process.wait(timeout=30)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the receiver's RSS from /proc")
def test_a_large_body_sent_anyway_does_not_grow_the_receiver(tmp_path):
    """A client declares 200 MiB (or -1) and streams 128 MiB at once without waiting for an
    answer. The receiver, in its own process, must not grow by the body."""
    with receiver_process(tmp_path) as (process, address):
        assert _exchange(address, _head([("Content-Length", "abc")]))[0] == 400  # warm up the request path
        before = _rss_kib(process.pid)
        chunk = b"x" * MiB
        for declared, status in (("-1", 400), (str(200 * MiB), 413)):
            # first the polite way: the answer comes before any of the body is sent
            got, _, reply = _exchange(address, _head([("Content-Length", declared)]))
            assert got == status, reply
            # then a sender that streams the body regardless
            with socket.create_connection(address, timeout=10) as sock:
                sent = 0
                try:
                    sock.sendall(_head([("Content-Length", declared)]))
                    while sent < 128 * MiB:
                        sock.sendall(chunk)
                        sent += len(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the receiver answered and closed: what it should do
            assert sent < 128 * MiB, "the receiver took the whole body"
        grown = _rss_kib(process.pid) - before
        assert grown < 16 * 1024, f"the receiver's RSS grew by {grown} KiB"
        assert process.poll() is None
        with socket.create_connection(address, timeout=5) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _read_answer(sock)[2] == {"ok": True}


# ------------------------------------------------------------------------------------------------
# bursts


def test_a_burst_is_rate_limited_per_address_with_retry_after(serve):
    receiver = serve(triggers={"webhook_burst": 3, "webhook_rate_per_minute": 60})
    body = _alias_body("7", alias="staging")  # a signed delivery the receiver answers 200 and ignores
    answers = [_post(receiver.address, _signed(body, f"burst-{i}"), body) for i in range(6)]
    assert [status for status, _, _ in answers] == [200, 200, 200, 429, 429, 429]
    status, headers, reply = answers[3]
    assert headers["retry-after"] == "1" and reply["error"] == "too many requests from this address; retry in 1 s"
    # the limit holds before anything else: a malformed request is limited too
    assert _exchange(receiver.address, _head([("Content-Length", "abc")]))[0] == 429
    # another address has its own bucket
    assert _post(receiver.address, _signed(body, "other-address"), body, source="127.0.0.2")[0] == 200
    with socket.create_connection(receiver.address, timeout=5) as sock:  # health checks are not counted
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_answer(sock)[0] == 200
    time.sleep(1.1)  # one token back after Retry-After
    assert _post(receiver.address, _signed(body, "after-wait"), body)[0] == 200
    assert _post(receiver.address, _signed(body, "too-soon"), body)[0] == 429


def test_the_token_bucket_refills_at_its_rate_and_forgets_old_addresses():
    clock = [0.0]
    limiter = RateLimiter(per_minute=6, burst=2, max_clients=2, clock=lambda: clock[0])
    assert limiter.take("a") == 0 and limiter.take("a") == 0
    assert limiter.take("a") == pytest.approx(10.0)  # 6 a minute: one every 10 s
    clock[0] = 4.0
    assert limiter.take("a") == pytest.approx(6.0)  # a refused request spends nothing
    clock[0] = 10.0
    assert limiter.take("a") == 0 and limiter.take("a") > 0
    limiter.take("b")
    limiter.take("c")  # a third address: "a", the least recently seen, is forgotten
    assert limiter.take("a") == 0
