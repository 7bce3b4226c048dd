"""The one-upgrade-at-a-time lock of a gallery: ``upgrades/lock.json``, created only if absent
(a conditional put on S3, an exclusive create on a folder), naming the host, process and token
of its holder. A lock whose process is gone on this host is taken over; one held elsewhere is
broken only on request (``fastfill upgrade unlock`` or ``--break-lock``)."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from components.gallery.catalog import now
from components.gallery.store import AlreadyExists, ObjectMissing, Store, StoreError

LOCK = "upgrades/lock.json"


class UpgradeLocked(RuntimeError):
    """Another upgrade holds the gallery's lock."""


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


@dataclass
class Lock:
    store: Store
    token: str
    holder: dict

    def release(self) -> None:
        try:
            current = self.store.get_json(LOCK)
        except (ObjectMissing, StoreError):
            return
        if current.get("token") == self.token:
            self.store.delete(LOCK)


def acquire_lock(store: Store, upgrade: str, *, break_lock: bool = False, log: Callable[[str], None] = print) -> Lock:
    """Take the gallery's upgrade lock. A lock whose process is gone on this host is taken over
    (a killed backfill resumes with the same command); any other held lock refuses, unless
    ``break_lock``."""
    holder = {"upgrade": upgrade, "host": socket.gethostname(), "pid": os.getpid(), "since": now(),
              "token": uuid.uuid4().hex}
    for _ in range(3):
        try:
            store.put_json(LOCK, holder, create_only=True)
            return Lock(store, holder["token"], holder)
        except AlreadyExists:
            pass
        try:
            current = store.get_json(LOCK)
        except ObjectMissing:
            continue  # released meanwhile
        alive = _alive(current.get("host", ""), int(current.get("pid", -1)))
        described = (f"upgrade {current.get('upgrade')} by process {current.get('pid')} on {current.get('host')} "
                     f"since {current.get('since')}")
        if alive is False or break_lock:
            log(f"breaking the lock of {described}" + (" (that process is gone)" if alive is False else ""))
            store.delete(LOCK)
            continue
        raise UpgradeLocked(
            f"{store.uri} is being upgraded: {described}. Wait for it to finish, or, if that process is gone "
            f"(e.g. its machine died), break the lock with `fastfill upgrade unlock --store {store.uri}`")
    raise UpgradeLocked(f"could not take the upgrade lock of {store.uri}; another process keeps taking it")


def break_lock(store: Store) -> dict | None:
    try:
        current = store.get_json(LOCK)
    except ObjectMissing:
        return None
    store.delete(LOCK)
    return current


# ------------------------------------------------------------------------------------------------
# Backfill of one chunk
