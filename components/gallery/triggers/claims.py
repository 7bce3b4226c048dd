"""What starts an upgrade by itself: a new `challenger` in the registry, seen by a watcher that
polls or delivered by an MLflow registry webhook. Both paths claim the version in the gallery's
store with a create-only write before starting anything, so one version never starts two
upgrades, whichever path (or how many watchers, or webhook retries) saw it first; and both ask
``wants_upgrade`` whether the candidate version should start one at all.
"""

from __future__ import annotations

from fastfill.components.gallery.layouts.catalog import now
from fastfill.components.gallery.store import AlreadyExists, ObjectMissing, Store
from fastfill.components.platform.registry import ModelRef


def trigger_key(name: str, version: str) -> str:
    return f"triggers/{name}-v{version}.json"


def claim(store: Store, name: str, version: str, source: str, **details) -> bool:
    """True for the first claim of this version in this gallery, False for every later one."""
    return put_claim(store, claim_record(name, version, source, **details))


def claim_record(name: str, version: str, source: str, **details) -> dict:
    """The record of a claim of ``version`` (``put_claim`` writes it)."""
    return {"name": name, "version": str(version), "source": source, "claimed": now(), **details}


def put_claim(store: Store, record: dict, *, retried: bool = False) -> bool:
    """``claim`` with a record made before (``claim_record``). ``retried``: an earlier try may have
    written this very record and lost the answer; finding it is that try's first claim."""
    try:
        store.put_json(trigger_key(record["name"], record["version"]), record, create_only=True)
    except AlreadyExists:
        return retried and claimed(store, record["name"], record["version"]) == record
    return True


def record_start(store: Store, name: str, version: str, source: str, flow_run_id: str, attempt: int = 1) -> None:
    """The claim's upgrade was started: its flow run, written over the claim (which said
    ``starting``). A claim still ``starting`` is one whose process stopped between the claim and
    the start; the next trigger starts it (the flow run's idempotency key keeps that one run).
    ``attempt``: how many flow runs were started for this version (see ``ENDED_UNSTARTED``)."""
    store.put_json(trigger_key(name, version), {"name": name, "version": str(version), "source": source,
                                                "claimed": now(), "flow_run_id": flow_run_id, "attempt": attempt})


# The states of a started flow run that ended before its upgrade could do anything of its own: the
# run was cancelled (by a person, or by Prefect when the deployment's concurrency slot was lost)
# or its infrastructure crashed. A claim whose run ended so is started again by the next trigger,
# when the gallery is neither on the version nor upgrading to it. A run that failed (a refused
# map, a rejected gate) keeps its claim: starting it again would fail the same way.
ENDED_UNSTARTED = ("CANCELLED", "CRASHED")


def attempt(record: dict | None) -> int:
    """The number of flow runs started so far for a claim (0 for none)."""
    if not record or not record.get("flow_run_id"):
        return 0
    return int(record.get("attempt", 1))


def unfinished(record: dict | None) -> bool:
    """A trigger's claim whose start was never recorded (see ``record_start``). The claims that
    abort and rollback write to keep a version from starting again are never unfinished."""
    return bool(record and record.get("starting"))


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
