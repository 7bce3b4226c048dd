"""The webhook receiver under abuse, over real sockets to a real uvicorn server: replays, bodies
that are too large or have no usable length, malformed requests, stalled senders, bursts, and a
stop with a delivery in flight. Every request gets an HTTP answer; only a well-formed, signed
delivery reaches the start."""

import http.client
import json
import os
import re
import select
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from fastfill.components.gallery.store import LocalStore
from fastfill.components.gallery.triggers.claims import claim
from fastfill.components.gallery.triggers.webhook_checks import DeliveryLog, RateLimiter, sign
from fastfill.components.platform.config import parse_params
from testkit.tiny_demo import tiny_params

SECRET = "s3cret-for-tests"
ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def _alias_body(version="7", alias="challenger", name="embedder") -> bytes:
    return json.dumps({"entity": "model_version_alias", "action": "created", "timestamp": "2026-11-22T00:00:00+00:00",
                       "data": {"name": name, "alias": alias, "version": version}}).encode()


def _signed(body: bytes, delivery: str, secret: str = SECRET, age: int = 0) -> dict:
    """The headers of an MLflow delivery signed ``age`` seconds ago."""
    stamp = str(int(time.time()) - age)
    return {"X-MLflow-Delivery-Id": delivery, "X-MLflow-Timestamp": stamp,
            "X-MLflow-Signature": sign(secret, delivery, stamp, body), "Content-Type": "application/json"}


def _head(headers, content_length: int | None = None) -> bytes:
    """A POST's request line and headers; ``headers`` a dict or a list of pairs (repeats allowed)."""
    pairs = list(headers.items()) if isinstance(headers, dict) else list(headers)
    if content_length is not None:
        pairs.append(("Content-Length", str(content_length)))
    lines = ["POST / HTTP/1.1", "Host: 127.0.0.1"] + [f"{key}: {value}" for key, value in pairs]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _read_answer(sock: socket.socket) -> tuple[int, dict, dict | str]:
    """Status, headers (lower-cased names) and body of one answer: the JSON body, or the text of
    an answer that is not JSON (the HTTP server's own)."""
    response = http.client.HTTPResponse(sock)
    response.begin()
    data = response.read()
    headers = {key.lower(): value for key, value in response.getheaders()}
    return response.status, headers, json.loads(data) if headers["content-type"] == "application/json" else data.decode()


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
    from fastfill.services.webhook_receiver import WebhookReceiver

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


def test_a_delivery_signed_longer_ago_than_the_clock_skew_is_refused_and_starts_nothing(serve):
    calls = []
    receiver = serve(triggers={"max_clock_skew_seconds": 60},
                     on_event=lambda version: calls.append(version) or {"started": True, "version": version})
    body = _alias_body("7")
    status, _, reply = _post(receiver.address, _signed(body, "stale", age=90), body)  # an old delivery replayed
    assert status == 401 and "more than 60 s): a replay, or clocks out of sync" in reply["error"], reply
    assert calls == [] and len(receiver.deliveries) == 0
    status, _, reply = _post(receiver.address, _signed(body, "recent", age=30), body)
    assert status == 200 and reply == {"started": True, "version": "7"} and calls == ["7"]


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
    ([("Transfer-Encoding", "chunked"), ("Content-Length", "10")], 400, "both Transfer-Encoding and Content-Length"),
    ([("Content-Length", str(MiB + 1))], 413, f"({MiB + 1} bytes) is over this receiver's limit of {MiB} bytes"),
    ([("Content-Length", str(200 * MiB))], 413, "it was not read"),
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


@pytest.mark.parametrize("lengths", [["-1"], ["abc"], ["1e3"], ["+{n}"], ["{n}", "{m}"], ["9" * 40]],
                         ids=["negative", "letters", "exponent", "plus-sign", "conflicting", "40-digits"])
def test_a_malformed_content_length_is_refused_with_400_and_starts_nothing(serve, lengths):
    """uvicorn's HTTP parser refuses these before the app runs: its own 400 (plain text, not the
    receiver's JSON), and the signed delivery that follows the headers starts nothing."""
    calls = []
    receiver = serve(on_event=lambda version: calls.append(version) or {"started": True, "version": version})
    body = _alias_body("7")
    pairs = list(_signed(body, "malformed").items())
    pairs += [("Content-Length", value.format(n=len(body), m=len(body) + 1)) for value in lengths]
    status, headers, reply = _exchange(receiver.address, _head(pairs) + body)
    assert status == 400 and headers["connection"] == "close", reply
    assert calls == [] and len(receiver.deliveries) == 0
    # the same delivery, well formed, does start
    assert _post(receiver.address, _signed(body, "well-formed"), body)[2] == {"started": True, "version": "7"}
    assert calls == ["7"]


def _chunked(body: bytes, size: int) -> bytes:
    """``body`` in chunks of ``size`` bytes, with the last chunk."""
    chunks = [body[i:i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for chunk in chunks) + b"0\r\n\r\n"


def test_a_chunked_delivery_is_read_and_one_that_grows_past_the_limit_is_cut_off_with_413(serve):
    calls = []
    receiver = serve(triggers={"webhook_max_body_bytes": 400},
                     on_event=lambda version: calls.append(version) or {"started": True, "version": version})
    body = _alias_body("7")
    assert len(body) < 400
    chunked = [*_signed(body, "chunked").items(), ("Transfer-Encoding", "chunked")]
    status, _, reply = _exchange(receiver.address, _head(chunked) + _chunked(body, 50))
    assert status == 200 and reply == {"started": True, "version": "7"} and calls == ["7"]

    # a body without a declared length that keeps growing: answered 413 as soon as it is over the
    # limit, while the sender is still sending (the body never ends here)
    with socket.create_connection(receiver.address, timeout=5) as sock:
        sock.sendall(_head([*_signed(body, "grows").items(), ("Transfer-Encoding", "chunked")]))
        sent = 0
        while not select.select([sock], [], [], 0.5)[0]:
            assert sent < 10_000, "no answer while the body grew"
            sock.sendall(b"64\r\n" + b"x" * 100 + b"\r\n")  # 100 bytes a chunk
            sent += 100
        status, headers, reply = _read_answer(sock)
    assert status == 413 and "grew past this receiver's limit of 400 bytes" in reply["error"], reply
    assert headers["connection"] == "close" and 400 < sent <= 600 and calls == ["7"]


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
# the server: HTTP/1.1, loopback by default, a stop that does not wait for a start in flight


def test_deliveries_share_a_kept_alive_connection_and_the_default_host_is_loopback(tmp_path):
    from fastfill.services.webhook_receiver import WebhookReceiver

    params = parse_params(tiny_params(tmp_path))
    assert params.triggers.webhook_host == "127.0.0.1"
    receiver = WebhookReceiver(params, "params.yaml", str(tmp_path / "gallery"), SECRET, params.triggers.webhook_host,
                               0, lambda version: {"started": True, "version": version})
    assert receiver.address[0] == "127.0.0.1"
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    try:
        connection = http.client.HTTPConnection(*receiver.address, timeout=5)
        for number in ("7", "8"):
            body = _alias_body(number)
            connection.request("POST", "/", body, _signed(body, f"kept-alive-{number}"))
            response = connection.getresponse()
            assert response.status == 200 and json.loads(response.read())["version"] == number
        connection.request("GET", "/health")
        assert connection.getresponse().read() == b'{"ok": true}'
        connection.close()
    finally:
        receiver.shutdown()


def test_a_stop_with_a_delivery_in_flight_ends_within_the_grace_period(serve):
    """A start that hangs (a Prefect server that does not answer) does not hold the stop: the
    delivery gets 503 once the grace period is over, and its id is not remembered, so MLflow's
    retry goes through."""
    from fastfill.services.webhook_receiver import STOP_GRACE_SECONDS

    called, release = threading.Event(), threading.Event()

    def on_event(version):
        called.set()
        release.wait(60)
        return {"started": True, "version": version}

    receiver = serve(on_event=on_event)
    body = _alias_body("7")
    answers = []
    client = threading.Thread(target=lambda: answers.append(_post(receiver.address, _signed(body, "in-flight"), body,
                                                                  timeout=30)))
    client.start()
    assert called.wait(10)
    started = time.monotonic()
    receiver.shutdown()
    took = time.monotonic() - started
    client.join(10)
    release.set()
    assert STOP_GRACE_SECONDS - 0.5 < took < STOP_GRACE_SECONDS + 2, took
    status, headers, reply = answers[0]
    assert status == 503 and reply["error"] == "the receiver is stopping; send the delivery again"
    assert headers["connection"] == "close" and len(receiver.deliveries) == 0
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(receiver.address, timeout=5)


# ------------------------------------------------------------------------------------------------
# bursts


def test_a_burst_is_rate_limited_per_address_with_retry_after(serve):
    calls = []
    receiver = serve(triggers={"webhook_burst": 3, "webhook_rate_per_minute": 60},
                     on_event=lambda version: calls.append(version) or {"started": True, "version": version})
    body = _alias_body("7", alias="staging")  # a signed delivery the receiver answers 200 and ignores
    answers = [_post(receiver.address, _signed(body, f"burst-{i}"), body) for i in range(6)]
    assert [status for status, _, _ in answers] == [200, 200, 200, 429, 429, 429]
    status, headers, reply = answers[3]
    assert headers["retry-after"] == "1" and reply["error"] == "too many requests from this address; retry in 1 s"
    # the limit holds before the length and the body are looked at: an over-long declared body and
    # a signed delivery for challenger are limited too, and the latter starts nothing
    assert _exchange(receiver.address, _head([("Content-Length", str(200 * MiB))]))[0] == 429
    wanted = _alias_body("7")
    assert _post(receiver.address, _signed(wanted, "limited"), wanted)[0] == 429
    assert calls == []
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
