"""The gallery on an S3 endpoint that fails as S3 does: a proxy of ours (s3_fault_proxy.py) between
the product and moto's server fails about 10% of requests, with S3 error answers or with lost
connections and late answers; the upgrade's work through it ends bit-identical to the same work
without faults. An outage longer than the retries ends in one clear line, and the next run
resumes. The upgrade lock on S3: a lost reply to its conditional writes, two contenders for an
expired lease, and a holder that cannot renew."""

import threading
import time

import numpy as np
import pytest

from fastfill.components.gallery.layouts.catalog import PartsGallery
from fastfill.components.gallery.store import StoreUnreachable, configure_s3, open_store
from fastfill.components.gallery.store import lock as locking
from fastfill.components.gallery.upgrade import backfill, ending
from fastfill.components.platform.config import S3Config
from testkit.s3_fault_proxy import CONNECTION_FAULTS, STATUS_FAULTS, FaultProxy
from tests.environment import new_bucket
from tests.gallery_cases import NEW, _gallery, _plan, make_data, make_models

# the proxy answers "late" after 1.5 s: with a 1 s read timeout that is a timed-out attempt, retried
PATIENT = S3Config(retry_mode="standard", max_attempts=10, connect_timeout=2, read_timeout=1)


@pytest.fixture
def faulty(s3_endpoint, monkeypatch):
    """``start(**proxy options)``: a FaultProxy in front of moto, this process's S3 clients pointed at
    it with PATIENT settings (or ``settings``)."""
    proxies = []

    def start(settings: S3Config = PATIENT, **options) -> FaultProxy:
        proxy = FaultProxy(s3_endpoint, **options).__enter__()
        proxies.append(proxy)
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
        configure_s3(settings)
        return proxy

    yield start
    configure_s3(None)
    for proxy in proxies:
        proxy.__exit__()


def _upgrade_work(store_uri: str):
    """An upgrade's store work, under its lock: ingest, plan, every chunk, finish."""
    old, new, h = make_models()
    lock = locking.acquire_lock(open_store(store_uri), "upgrade", log=print, lease_seconds=15)
    try:
        gallery = _gallery(store_uri, (old, new, h), make_data())
        plan = _plan(gallery, h)
        records = [backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, new) for chunk in range(plan.num_chunks)]
        ending.finish(gallery, plan)
    finally:
        lock.release()
    return PartsGallery(open_store(store_uri)), plan, records


@pytest.fixture(scope="module")
def without_faults(s3_endpoint):
    gallery, plan, _ = _upgrade_work(f"s3://{new_bucket(s3_endpoint)}/galleries/main")
    return gallery.all_features(NEW), [backfill.chunk_features(gallery.store, plan.upgrade_id, c) for c in range(plan.num_chunks)]


@pytest.mark.slow
@pytest.mark.parametrize("kinds", [STATUS_FAULTS, CONNECTION_FAULTS], ids=["status-errors", "lost-connections"])
def test_an_upgrade_through_a_failing_endpoint_ends_as_one_without_faults(kinds, s3_endpoint, faulty, without_faults):
    features, chunks = without_faults
    store_uri = f"s3://{new_bucket(s3_endpoint)}/galleries/main"
    proxy = faulty(rate=0.1, kinds=kinds, seed=7)
    started = time.monotonic()
    gallery, plan, records = _upgrade_work(store_uri)
    print(f"\n{len(kinds)} kinds of fault: {proxy.requests} requests, {proxy.injected} faults injected "
          f"{dict(proxy.faults)}, {time.monotonic() - started:.1f} s")
    assert proxy.injected > 0 and len(proxy.faults) >= 2
    assert not any(r["skipped"] for r in records)  # every chunk done once, in this run
    assert gallery.model == NEW and gallery.manifest()["upgrade"] is None
    np.testing.assert_array_equal(gallery.all_features(NEW), features)  # bit-identical
    for chunk, expected in enumerate(chunks):
        np.testing.assert_array_equal(backfill.chunk_features(gallery.store, plan.upgrade_id, chunk), expected)
    assert not gallery.store.exists(locking.LOCK)


def test_an_outage_longer_than_the_retries_ends_in_one_clear_line_and_the_next_run_resumes(
        s3_endpoint, faulty, without_faults, tiny_workdir):
    from typer.testing import CliRunner

    from fastfill.cli import app

    store_uri = f"s3://{new_bucket(s3_endpoint)}/galleries/main"
    proxy = faulty(S3Config(max_attempts=3, connect_timeout=1, read_timeout=2), rate=0)
    _, new, h = make_models()
    gallery = _gallery(store_uri, make_models(), make_data())
    plan = _plan(gallery, h)
    first = {c: backfill.backfill_chunk(gallery, plan.upgrade_id, c, new) for c in (0, 1, 2)}

    proxy.down = True  # every connection is dropped, for longer than the retries last
    with pytest.raises(StoreUnreachable) as caught:
        backfill.backfill_chunk(gallery, plan.upgrade_id, 3, new)
    message = str(caught.value)
    print(f"\n{message}")
    assert "\n" not in message and message.startswith(f"{store_uri}: ")
    assert f"failed 3 times at the S3 endpoint {proxy.url}" in message
    assert "run the same command again: finished work is kept" in message
    cli = CliRunner().invoke(app, ["upgrade", "status", "--store", store_uri])  # what a command prints
    assert cli.exit_code == 5 and f"error: {store_uri}: reaching the bucket failed 3 times" in cli.output
    assert len([line for line in cli.output.splitlines() if line.strip()]) == 1, cli.output
    assert proxy.faults["down"] >= 3 + 3  # every attempt of both

    proxy.down = False  # the store is back: the same work resumes
    again = [backfill.backfill_chunk(gallery, plan.upgrade_id, c, new) for c in range(plan.num_chunks)]
    assert [r["skipped"] for r in again] == [True] * 3 + [False] * (plan.num_chunks - 3)
    assert [again[c]["token"] for c in first] == [first[c]["token"] for c in first]  # not redone
    ending.finish(gallery, plan)
    np.testing.assert_array_equal(PartsGallery(open_store(store_uri)).all_features(NEW), without_faults[0])


def _lock_writes(method: str):
    """A rule for the proxy: lose the answer of the next ``method`` request on the lock, after
    moto acted on it; ``seen`` lists the requests it failed."""
    seen = []

    def rule(request_method: str, path: str):
        if request_method == method and path.split("?")[0].endswith("/upgrades/lock.json") and armed:
            armed.clear()
            seen.append(path)
            return "drop-reply"
        return None

    armed = [True]
    rule.seen, rule.arm = seen, lambda: armed.append(True)
    return rule


def test_a_lost_reply_to_the_lock_s_conditional_writes_leaves_the_lock_with_its_writer(s3_endpoint, faulty):
    store_uri = f"s3://{new_bucket(s3_endpoint)}/galleries/main"
    proxy = faulty(rate=0)
    put = _lock_writes("PUT")
    proxy.rules.append(put)
    store = open_store(store_uri)
    messages = []
    # the create-only PUT lands, its answer is lost, boto3's retry finds the key taken (412):
    # the lock holds this holder's token, so it is this holder's (it used to refuse itself:
    # "is being upgraded ... by process <its own pid>")
    lock = locking.acquire_lock(store, "u1", log=messages.append, renew=False)
    assert len(put.seen) == 1 and proxy.faults["drop-reply"] == 1 and messages == []
    assert store.get_json(locking.LOCK)["token"] == lock.token
    with pytest.raises(locking.UpgradeLocked, match="being upgraded: upgrade u1"):
        locking.acquire_lock(open_store(store_uri), "u2", log=messages.append, renew=False)

    put.arm()  # the same for a renewal: its If-Match PUT lands, the retry finds another ETag
    before = store.get_json(locking.LOCK)["expires"]
    time.sleep(0.01)
    lock.renew()
    assert len(put.seen) == 2
    assert store.get_json(locking.LOCK)["expires"] > before and store.get_json(locking.LOCK)["token"] == lock.token
    store.put("still-writing.bin", b"x")  # the holder keeps its lease

    delete = _lock_writes("DELETE")  # and the release: the conditional delete lands, its answer is lost
    proxy.rules.append(delete)
    lock.release()
    assert len(delete.seen) == 1 and not store.exists(locking.LOCK)


def test_exactly_one_of_two_contenders_takes_over_an_expired_lease_on_s3(s3_endpoint):
    store_uri = f"s3://{new_bucket(s3_endpoint)}/galleries/main"
    store = open_store(store_uri)
    both_tried = 0
    contenders = [open_store(store_uri) for _ in range(2)]  # a client each, as two machines would have
    lingering = [open_store(store_uri) for _ in range(2)]
    for mine in lingering:  # linger after reading, so that both read the expired lock before either writes
        mine.get_versioned = (lambda read: lambda key: (read(key), time.sleep(0.1))[0])(mine.get_versioned)
    for round_ in range(20):
        store.put_json(locking.LOCK, {"upgrade": "old", "host": "elsewhere", "pid": 1, "since": "t",
                                      "token": "dead", "lease_seconds": 60, "expires": time.time() - 1})
        barrier, outcomes, tried = threading.Barrier(2), [None, None], [False, False]
        clients = lingering if round_ % 2 == 0 else contenders

        def contend(slot: int, clients=clients, barrier=barrier, outcomes=outcomes, tried=tried) -> None:
            mine = clients[slot]
            barrier.wait()
            try:
                outcomes[slot] = locking.acquire_lock(mine, f"u{slot}", renew=False,
                                                      log=lambda m: tried.__setitem__(slot, True))
            except locking.UpgradeLocked:
                outcomes[slot] = None

        threads = [threading.Thread(target=contend, args=(slot,)) for slot in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        winners = [lock for lock in outcomes if lock is not None]
        assert len(winners) == 1, f"round {round_}: {len(winners)} winners"
        assert store.get_json(locking.LOCK)["token"] == winners[0].token
        both_tried += all(tried)
        winners[0].release()
        assert not store.exists(locking.LOCK)
    print(f"\nrounds where both contenders raced for the expired lease: {both_tried} of 20")
    assert both_tried >= 8


def test_a_holder_that_cannot_renew_its_lease_stops_before_its_next_write(s3_endpoint, faulty):
    store_uri = f"s3://{new_bucket(s3_endpoint)}/galleries/main"
    proxy = faulty(S3Config(max_attempts=2, connect_timeout=1, read_timeout=1), rate=0)
    store = open_store(store_uri)
    messages = []
    lock = locking.acquire_lock(store, "u1", log=messages.append, lease_seconds=3)  # renewed every second
    time.sleep(1.5)
    store.put("before.bin", b"x")
    proxy.down = True  # the holder can no longer reach the store to renew
    time.sleep(3.5)
    proxy.down = False  # the store answers again, but the lease has run out meanwhile
    with pytest.raises(locking.LeaseLost, match=r"no longer holds the upgrade lock \(its 3 s lease was not renewed "
                                                r"since .*failed 2 times.*\); it stopped before writing "):
        store.put("chunk.bin", b"y")
    assert not open_store(store_uri).exists("chunk.bin") and open_store(store_uri).exists("before.bin")
    assert any("could not renew the upgrade lock" in m for m in messages), messages
    # from any host, the expired lease is taken over without `unlock`
    successor = locking.acquire_lock(open_store(store_uri), "u2", log=messages.append, renew=False)
    assert "its lease expired at" in messages[-1]
    lock.release()  # the old holder's release leaves the successor's lock alone
    assert open_store(store_uri).get_json(locking.LOCK)["token"] == successor.token
    successor.release()
