"""The one-upgrade-at-a-time lock of a gallery: ``upgrades/lock.json``, a lease.

- *Taking it*: a create-only write (S3 ``If-None-Match: *``; a folder: under an exclusive flock).
  The record names the upgrade, the host, the process, a token unique to this holder, and when
  the lease ends (``expires``, Unix time, ``lease_seconds`` after the last renewal).
- *Holding it*: a thread renews the lease every third of ``lease_seconds`` with a conditional
  write on the version it wrote last (S3 ``If-Match: <etag>``). Every write this process makes to
  the gallery first checks the lease (``store.fence``): once it could not be renewed in time, or
  another process took it over, the next write raises LeaseLost and the upgrade stops; the same
  command resumes it.
- *Taking over*: a lock whose lease has expired (held on any host), whose process is gone (on
  this host), or any lock with ``break_lock``, is replaced by a conditional write on the version
  that was read, so of two contenders exactly one wins; the other is refused, naming the winner.
- *Ambiguous writes*: when a reply is lost after the store wrote (a dropped connection; boto3
  retries, and the retry finds the object already changed), the writer reads the lock back: its
  own token there means the write landed and the lock is its own.

Expiry is judged by the reader's clock against the holder's ``expires``; the holder stops writing
a sixth of the lease before its own deadline, so hosts' clocks must agree to within that (10 s
with the default 60 s lease; NTP keeps them far closer). A lock without ``expires`` (from a
version that did not renew its lock) never expires by itself: ``fastfill upgrade unlock`` or
``--break-lock`` breaks it.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from fastfill.components.gallery.layouts.catalog import now
from fastfill.components.gallery.store import (
    Conflict,
    ObjectMissing,
    Store,
    StoreError,
    fence,
    json_bytes,
    parse_json,
    unfence,
)

LOCK = "upgrades/lock.json"
DEFAULT_LEASE_SECONDS = 60.0


class UpgradeLocked(RuntimeError):
    """Another upgrade holds the gallery's lock."""


class LeaseLost(UpgradeLocked):
    """This process's lock of the gallery is gone (not renewed in time, taken over, or broken):
    it writes nothing more to the gallery."""


def _alive(host: str, pid: int) -> bool | None:
    """Whether process ``pid`` on ``host`` still runs: None when it can't be told (another host)."""
    if host != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed child its parent hasn't reaped yet is a zombie: dead
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _moment(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")


def _describe(record: dict) -> str:
    return (f"upgrade {record.get('upgrade')} by process {record.get('pid')} on {record.get('host')} "
            f"since {record.get('since')}")


def _expired(record: dict) -> bool:
    """The lease has run out (a lock without one never does)."""
    try:
        return time.time() > float(record["expires"])
    except (KeyError, TypeError, ValueError):
        return False


def _margin(lease_seconds: float) -> float:
    """How long before the lease's end its holder stops writing (clock skew, writes in flight)."""
    return lease_seconds / 6


class Lock:
    """A held upgrade lock: renewed in the background (``renew=True``), checked before every write
    of this process to the gallery, released by ``release`` (or leaving a ``with`` block)."""

    def __init__(self, store: Store, holder: dict, version: str, sent: float, lease_seconds: float,
                 log: Callable[[str], None]):
        self.store, self.holder, self.version = store, holder, version
        self.token: str = holder["token"]
        self.lease_seconds = lease_seconds
        self._log = log
        self._deadline = sent + lease_seconds - _margin(lease_seconds)
        self._renewed = holder.get("renewed") or holder.get("since")
        self._renew_error: str | None = None
        self._lost: str | None = None
        self._released = False
        self._mutex = threading.Lock()  # a renewal and the release never overlap
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- the lease

    def check(self, key: str | None = None) -> None:
        """Raise LeaseLost if this process may no longer write to the gallery: the lease was not
        renewed in time, or the lock was taken over or broken."""
        if self._lost is None and time.monotonic() >= self._deadline:
            self._lost = (f"its {self.lease_seconds:g} s lease was not renewed since {self._renewed}"
                          + (f": {self._renew_error}" if self._renew_error else ""))
        if self._lost is not None:
            writing = f" before writing {self.store.describe(key)}" if key else ""
            raise LeaseLost(f"{self.store.uri}: this process no longer holds the upgrade lock ({self._lost}); it "
                            f"stopped{writing}. Run the same command again to resume: finished chunks are kept")

    def _lose(self, reason: str) -> None:
        self._lost = reason
        self.check()

    def renew(self) -> None:
        """Extend the lease by a conditional write on the version this holder wrote last. A store
        error (unreachable) propagates and may be retried; LeaseLost when the lock is not ours."""
        with self._mutex:
            self.check()
            for _ in range(3):
                sent = time.monotonic()
                record = {**self.holder, "renewed": now(), "expires": round(time.time() + self.lease_seconds, 3)}
                try:
                    self.version = self.store.swap(LOCK, json_bytes(record), expected=self.version)
                except Conflict:
                    try:
                        data, version = self.store.get_versioned(LOCK)
                    except ObjectMissing:
                        self._lose("the lock was removed: broken with `fastfill upgrade unlock` or --break-lock")
                    current = parse_json(self.store, LOCK, data)
                    if current.get("token") != self.token:
                        self._lose(f"it was taken over: {_describe(current)}")
                    self.version = version  # an earlier write of ours landed after all; write on top of it
                    continue
                self.holder, self._renewed, self._renew_error = record, record["renewed"], None
                self._deadline = sent + self.lease_seconds - _margin(self.lease_seconds)
                return
            raise StoreError(f"{self.store.describe(LOCK)} keeps changing under this holder's own token")

    def start_renewing(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._renew_until_released, name="upgrade-lock-lease",
                                            daemon=True)
            self._thread.start()

    def _renew_until_released(self) -> None:
        interval = self.lease_seconds / 3
        wait = interval
        while not self._stop.wait(wait):
            try:
                self.renew()
                wait = interval
            except LeaseLost as error:
                self._log(str(error))
                return
            except StoreError as error:  # the store is unreachable now: retry until the lease ends
                self._renew_error = " ".join(str(error).split())
                remaining = self._deadline - time.monotonic()
                self._log(f"could not renew the upgrade lock of {self.store.uri} ({self._renew_error}); trying again, "
                          f"{max(remaining, 0):.0f} s before this process stops writing")
                wait = min(interval, max(0.5, remaining / 4))

    # ---- the end

    def release(self) -> None:
        """Stop renewing and remove the lock if it is still this holder's. A store that cannot be
        reached leaves it to expire by itself (``lease_seconds``)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with self._mutex:
            unfence(self.store, self.token)
            if self._released:
                return
            self._released = True
            try:
                for _ in range(3):
                    try:
                        self.store.delete_if(LOCK, expected=self.version)
                        return
                    except Conflict:
                        data, version = self.store.get_versioned(LOCK)
                        if parse_json(self.store, LOCK, data).get("token") != self.token:
                            return
                        self.version = version
            except ObjectMissing:
                return
            except StoreError as error:
                self._log(f"could not remove the upgrade lock of {self.store.uri} ({error}); it expires by itself "
                          f"{self.lease_seconds:g} s after its last renewal")

    def __enter__(self) -> Lock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _held(store: Store, record: dict, version: str, sent: float, lease_seconds: float, renew: bool,
          log: Callable[[str], None]) -> Lock:
    lock = Lock(store, record, version, sent, lease_seconds, log)
    fence(store, lock.token, lambda key: lock.check(key) if key != LOCK else None)
    if renew:
        lock.start_renewing()
    return lock


def acquire_lock(store: Store, upgrade_id: str, *, break_lock: bool = False, log: Callable[[str], None] = print,
                 lease_seconds: float = DEFAULT_LEASE_SECONDS, renew: bool = True) -> Lock:
    """Take the gallery's upgrade lock for ``lease_seconds``, renewed in the background until
    ``release`` (``renew=False``: not renewed). A lock whose lease expired, or whose process is gone
    on this host (a killed backfill resumes with the same command), is taken over; any other held
    lock refuses, unless ``break_lock``."""
    token = uuid.uuid4().hex
    base = {"upgrade": upgrade_id, "host": socket.gethostname(), "pid": os.getpid(), "since": now(), "token": token,
            "lease_seconds": lease_seconds}
    expected = None  # None: create it; else the version of the lock being taken over
    for _ in range(5):
        sent = time.monotonic()
        record = {**base, "renewed": now(), "expires": round(time.time() + lease_seconds, 3)}
        try:
            version = store.swap(LOCK, json_bytes(record), expected=expected)
            return _held(store, record, version, sent, lease_seconds, renew, log)
        except Conflict:  # taken, or changed since it was read: look at it
            pass
        try:
            data, version = store.get_versioned(LOCK)
        except ObjectMissing:
            expected = None  # released meanwhile
            continue
        current = parse_json(store, LOCK, data)
        if current.get("token") == token:  # our write landed, though its reply was lost: ours
            return _held(store, current, version, sent, lease_seconds, renew, log)
        alive = _alive(current.get("host", ""), int(current.get("pid", -1)))
        expired = _expired(current)
        if alive is False or expired or break_lock:
            why = ("that process is gone" if alive is False else
                   f"its lease expired at {_moment(float(current['expires']))} without renewal" if expired else
                   "--break-lock")
            log(f"taking over the lock of {_describe(current)} ({why})")
            expected = version
            continue
        lease = (f"; its lease runs to {_moment(float(current['expires']))} and is taken over automatically if not "
                 "renewed" if "expires" in current else "")
        raise UpgradeLocked(
            f"{store.uri} is being upgraded: {_describe(current)}{lease}. Wait for it to finish, or, if that process "
            f"is gone, break the lock with `fastfill upgrade unlock --store {store.uri}`")
    raise UpgradeLocked(f"could not take the upgrade lock of {store.uri}; another process keeps taking it")


@dataclass(frozen=True)
class LockRecord:
    """A gallery's upgrade lock as read: its holder (the upgrade, its process and host; None where
    the record does not name them), whether its lease had run out when it was read (``expired``,
    marked by ``read_lock``) and the record itself (``to_dict``: lock.json's keys in their stored
    order, whichever version of fastfill wrote it). ``break_lock`` returns the lock it removed,
    token and all (an unreadable one names only the upgrade); ``read_lock`` the lock held, without
    its token (what `fastfill upgrade status` shows)."""

    upgrade_id: str | None  # ``upgrade`` in the record
    pid: int | None
    host: str | None
    record: dict
    expired: bool = False  # ``expired`` in the record, where ``read_lock`` marked it

    @classmethod
    def from_dict(cls, record: dict) -> LockRecord:
        return cls(upgrade_id=record.get("upgrade"), pid=record.get("pid"), host=record.get("host"),
                   record=dict(record), expired=record.get("expired") is True)

    def to_dict(self) -> dict:
        """The lock's record as stored (as read: ``read_lock``'s without its token)."""
        return dict(self.record)

    def holder(self) -> dict:
        """The record without the lock's token (what ``fastfill upgrade unlock --json`` shows)."""
        return {key: value for key, value in self.record.items() if key != "token"}


def read_lock(store: Store) -> LockRecord | None:
    """The lock's holder as `fastfill upgrade status` shows it: its record without the token,
    marked ``expired`` when its lease has run out (its holder stopped renewing it); None unlocked."""
    try:
        record = store.get_json(LOCK)
    except ObjectMissing:
        return None
    record.pop("token", None)
    if _expired(record):
        record["expired"] = True
    return LockRecord.from_dict(record)


def break_lock(store: Store) -> LockRecord | None:
    """Remove the lock whoever holds it (``fastfill upgrade unlock``), even an unreadable one. A
    holder that still runs finds out at its next renewal (within a third of its lease) and writes
    nothing after that."""
    try:
        current = store.get_json(LOCK)
    except ObjectMissing:
        return None
    except StoreError as error:
        current = {"upgrade": f"unknown (the lock was unreadable: {error})"}
    store.delete(LOCK)
    return LockRecord.from_dict(current)
