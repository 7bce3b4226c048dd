"""A local folder store: each object and its checksum change as one unit (readers racing a
rewriting process never see a mismatch), folders of the older layout still read; and the upgrade
lock as a lease there: renewed while held, taken over when expired by exactly one of two racing
processes, and a holder whose lease ran out writes nothing more."""

import json
import multiprocessing
import os
import threading
import time
from pathlib import Path

import pytest

from fastfill.components.gallery.store import ChecksumMismatch, LocalStore, open_store, sha256
from fastfill.components.gallery.store import lock as locking

# ---- one unit per object --------------------------------------------------------------------------


VALUES = [bytes([i]) * (1000 + 7919 * i) for i in range(1, 6)]  # different sizes and bytes


def _rewrite_forever(root: str, key: str, stop, written) -> None:
    store = open_store(root)
    count = 0
    while not stop.is_set():
        store.put(key, VALUES[count % len(VALUES)])
        count += 1
    written.value = count


def test_readers_never_see_an_object_with_another_version_s_checksum(tmp_path):
    root = str(tmp_path / "store")
    key = "gallery.json"
    store = open_store(root)
    store.put(key, VALUES[0])
    context = multiprocessing.get_context("fork")  # the writer runs beside the readers, on its own core
    stop, written = context.Event(), context.Value("l", 0)
    writer = context.Process(target=_rewrite_forever, args=(root, key, stop, written))
    reads, problems = [0, 0, 0], []

    def read(slot: int) -> None:
        reader = open_store(root)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                data = reader.get(key)
            except ChecksumMismatch as error:  # what a torn pair looked like
                problems.append(str(error))
                continue
            if data not in VALUES:
                problems.append(f"{len(data)} bytes that were never written")
            reads[slot] += 1

    writer.start()
    try:
        threads = [threading.Thread(target=read, args=(slot,)) for slot in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        stop.set()
        writer.join(timeout=30)
    print(f"{sum(reads)} reads while the writer rewrote the key {written.value} times")
    assert problems == []
    assert written.value > 100 and sum(reads) > 100
    # what remains: the key (a link) and the object file it points to, nothing else
    assert store.list("") == [key]
    leftovers = [p.name for p in Path(root).iterdir() if p.name.startswith(".")]
    assert len(leftovers) == 1 and leftovers[0].startswith(".gallery.json.")


def test_a_folder_of_the_older_layout_reads_and_moves_to_the_new_one_on_write(tmp_path):
    root = tmp_path / "store"
    (root / "a").mkdir(parents=True)
    (root / "a" / "x.bin").write_bytes(b"old bytes")
    (root / "a" / "x.bin.sha256").write_text(sha256(b"old bytes"))
    (root / "a" / "bad.bin").write_bytes(b"changed")
    (root / "a" / "bad.bin.sha256").write_text(sha256(b"original"))
    store = LocalStore(root)
    assert store.get("a/x.bin") == b"old bytes" and store.list("a/") == ["a/bad.bin", "a/x.bin"]
    with pytest.raises(ChecksumMismatch, match="a/bad.bin is corrupt"):
        store.get("a/bad.bin")
    store.put("a/x.bin", b"new bytes")
    assert store.get("a/x.bin") == b"new bytes" and (root / "a" / "x.bin").is_symlink()
    assert not (root / "a" / "x.bin.sha256").exists() and store.list("a/") == ["a/bad.bin", "a/x.bin"]
    # the bytes are a plain file under the key for any reader; changing them behind the store is caught
    assert (root / "a" / "x.bin").read_bytes() == b"new bytes"
    (root / "a" / "x.bin").write_bytes(b"tampered")
    with pytest.raises(ChecksumMismatch, match="a/x.bin is corrupt"):
        store.get("a/x.bin")
    store.delete("a/x.bin")
    assert not store.exists("a/x.bin") and not [p for p in (root / "a").iterdir() if p.name.startswith(".x.bin.")]


# ---- the lock as a lease --------------------------------------------------------------------------


def _expired_lock(store, host="elsewhere") -> None:
    store.put_json(locking.LOCK, {"upgrade": "old", "host": host, "pid": 1, "since": "t", "token": "dead",
                                  "lease_seconds": 60, "expires": time.time() - 1})


def _contend(root: str, barrier, results, slot: int, overlap: bool) -> None:
    store = open_store(root)
    if overlap:  # linger after reading the lock, so that both contenders read the expired one first
        read = store.get_versioned
        store.get_versioned = lambda key: (read(key), time.sleep(0.1))[0]
    messages = []
    barrier.wait()
    try:
        lock = locking.acquire_lock(store, f"u{slot}", log=messages.append, renew=False)
        results[slot] = f"won {lock.token}"
    except locking.UpgradeLocked:
        results[slot] = "lost, tried" if messages else "lost"
    barrier.wait()  # a winner stays alive until the other is done (a dead holder's lock is fair game)


def test_exactly_one_of_two_processes_takes_over_an_expired_lease(tmp_path):
    root = str(tmp_path / "store")
    store = open_store(root)
    context = multiprocessing.get_context("fork")
    both_tried = 0
    manager = context.Manager()
    for round_ in range(20):
        _expired_lock(store)
        barrier, results = context.Barrier(2), manager.dict()
        contenders = [context.Process(target=_contend, args=(root, barrier, results, slot, round_ % 2 == 0))
                      for slot in range(2)]
        for process in contenders:
            process.start()
        for process in contenders:
            process.join(timeout=60)
        outcomes = [results[slot] for slot in range(2)]
        winners = [o for o in outcomes if o.startswith("won")]
        assert len(winners) == 1, outcomes
        assert store.get_json(locking.LOCK)["token"] == winners[0].split()[1]  # the lock is the winner's
        both_tried += all(o != "lost" for o in outcomes)  # both saw it expired and raced to replace it
        store.delete(locking.LOCK)
    manager.shutdown()
    print(f"rounds where both contenders raced for the expired lease: {both_tried} of 20")
    assert both_tried >= 8  # the even rounds make them overlap: the conditional write decided those


def test_a_lease_is_renewed_while_held_and_taken_over_from_any_host_once_expired(tmp_path):
    store = open_store(tmp_path / "store")
    lock = locking.acquire_lock(store, "u1", log=lambda m: None, lease_seconds=1.2)
    first = store.get_json(locking.LOCK)["expires"]
    time.sleep(2.0)  # longer than the lease: only renewals keep it
    record = store.get_json(locking.LOCK)
    assert record["token"] == lock.token and record["expires"] > first and record["expires"] > time.time()
    store.put("after-the-lease.bin", b"x")  # the holder still writes
    with pytest.raises(locking.UpgradeLocked, match="lease runs to"):
        locking.acquire_lock(open_store(tmp_path / "store"), "u2", log=lambda m: None)
    lock.release()
    assert not store.exists(locking.LOCK)

    _expired_lock(store)  # left by a machine that died: no unlock needed
    messages = []
    taken = locking.acquire_lock(store, "u3", log=messages.append, renew=False)
    assert "its lease expired at" in messages[0] and "on elsewhere" in messages[0]
    assert store.get_json(locking.LOCK)["token"] == taken.token
    taken.release()


def test_a_holder_whose_lease_ran_out_stops_before_its_next_write(tmp_path):
    store = open_store(tmp_path / "store")
    lock = locking.acquire_lock(store, "u1", log=lambda m: None, lease_seconds=0.6, renew=False)
    store.put("before.bin", b"x")
    time.sleep(0.7)
    with pytest.raises(locking.LeaseLost, match=r"no longer holds the upgrade lock \(its 0.6 s lease was not "
                                                r"renewed since .*\); it stopped before writing .*chunk.bin"):
        store.put("chunk.bin", b"y")
    with pytest.raises(locking.LeaseLost):
        open_store(tmp_path / "store").delete("before.bin")  # any store object of this gallery, any write
    assert not store.exists("chunk.bin") and store.exists("before.bin")
    # the expired lock is taken over by the next upgrade; the old holder cannot renew it back
    successor = locking.acquire_lock(open_store(tmp_path / "store"), "u1", log=lambda m: None, renew=False)
    with pytest.raises(locking.LeaseLost):
        lock.renew()
    store.put("chunk.bin", b"y")  # the successor's fence replaced the old holder's
    lock.release()
    assert store.get_json(locking.LOCK)["token"] == successor.token  # the old holder's release leaves it
    successor.release()


def test_a_holder_whose_lock_was_taken_over_or_broken_stops(tmp_path):
    store = open_store(tmp_path / "store")
    lock = locking.acquire_lock(store, "u1", log=lambda m: None, renew=False)
    record = json.loads(store.get(locking.LOCK))
    store.put_json(locking.LOCK, {**record, "token": "someone-else", "pid": 4242, "host": "other"})
    with pytest.raises(locking.LeaseLost, match="it was taken over: upgrade u1 by process 4242 on other"):
        lock.renew()
    with pytest.raises(locking.LeaseLost, match="taken over"):
        store.put("x.bin", b"x")
    lock.release()
    assert store.get_json(locking.LOCK)["token"] == "someone-else"
    locking.break_lock(store)

    lock = locking.acquire_lock(store, "u2", log=lambda m: None, renew=False)
    assert locking.break_lock(store).upgrade_id == "u2"  # `fastfill upgrade unlock`
    with pytest.raises(locking.LeaseLost, match="the lock was removed"):
        lock.renew()
    lock.release()
    assert not store.exists(locking.LOCK)
    store.put("x.bin", b"x")  # released: no fence left


def test_the_lease_comes_from_configuration():
    from fastfill.components.platform.config import GalleryConfig, load_params

    params = load_params(Path(__file__).resolve().parents[2] / "params.yaml")
    assert params.gallery.upgrade.lease_seconds == 60
    assert params.gallery.s3.retry_mode == "standard" and params.gallery.s3.max_attempts >= 3
    with pytest.raises(ValueError, match="lease_seconds"):
        GalleryConfig(upgrade={"lease_seconds": 1})
    with pytest.raises(ValueError, match="retry_mode"):
        GalleryConfig(s3={"retry_mode": "legacy"})


def test_the_s3_client_takes_its_retries_and_timeouts_from_configuration(monkeypatch):
    from fastfill.components.gallery import store as stores
    from fastfill.components.platform.config import S3Config

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    chosen = S3Config(retry_mode="adaptive", max_attempts=11, connect_timeout=2.5, read_timeout=7)
    explicit = stores.open_store("s3://bucket/x", s3=chosen)
    try:
        stores.configure_s3(chosen)
        implicit = stores.open_store("s3://bucket/x")
    finally:
        stores.configure_s3(None)
    default = stores.open_store("s3://bucket/x")
    for store, (mode, attempts, connect, read) in [(explicit, ("adaptive", 11, 2.5, 7)),
                                                   (implicit, ("adaptive", 11, 2.5, 7)),
                                                   (default, ("standard", S3Config().max_attempts, 5, 60))]:
        config = store.client.meta.config
        assert config.retries["mode"] == mode and config.retries["total_max_attempts"] == attempts
        assert (config.connect_timeout, config.read_timeout) == (connect, read)
    assert explicit._probe.meta.config.retries["total_max_attempts"] == 3  # reachability: asked quickly


def test_keys_may_not_name_the_store_s_own_files(tmp_path):
    from fastfill.components.gallery.store import StoreError

    with pytest.raises(StoreError, match="invalid key"):
        open_store(tmp_path).put("a/.hidden", b"x")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("response, expected", [
    ({"ChecksumSHA256": "n4bQgYhMfWWaL+qgxVrQFaO/TxsrC4Is0V1sFbDwCgg=", "Metadata": {"sha256": "ab"}}, "ab"),
    ({"ChecksumSHA256": "n4bQgYhMfWWaL+qgxVrQFaO/TxsrC4Is0V1sFbDwCgg="},  # S3's whole-object value alone
     "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"),
    ({"ChecksumSHA256": "n4bQgYhMfWWaL+qgxVrQFaO/TxsrC4Is0V1sFbDwCgg=-3"}, None),  # multipart: composite
    ({"ChecksumSHA256": "n4bQgYhMfWWaL+qgxVrQFaO/TxsrC4Is0V1sFbDwCgg=", "ChecksumType": "COMPOSITE"}, None),
    ({"Metadata": {"sha256": "ab"}}, "ab"),  # written before: the metadata
    ({"ChecksumSHA256": "not base64!"}, None),
    ({}, None),
])
def test_the_recorded_sha256_of_an_s3_object(response, expected):
    from fastfill.components.gallery.store.s3 import recorded_sha256

    assert recorded_sha256(response) == expected
