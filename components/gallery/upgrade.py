"""The end of an upgrade and its state: finish (switch the gallery to the new model), reject
(the promotion gate failed), abort (the user drops an unfinished upgrade), rollback (a finished
upgrade undone while the previous model's features exist), status, and garbage collection of
ended upgrades' working data. The steps before are in ``components.gallery.plan`` and
``components.gallery.backfill``; the order they run in is ``components.gallery.lifecycle``'s.

Besides ``plan``'s layout, an upgrade's folder may hold::

    aborted.json      the upgrade was aborted before its end: who, when, how far it had got
    rolled-back.json  the finished upgrade was rolled back: who, when, from which model to which

Either makes the upgrade's working data garbage, and an upgrade to the same version asked for
later is planned again from scratch (``start_over``), never resumed.
"""

from __future__ import annotations

from components.gallery.advisor import stored_advice
from components.gallery.backfill import done_chunks, failed_images, iter_mixed_parts
from components.gallery.catalog import Gallery, GalleryError, ModelRef, features_key, now
from components.gallery.lock import LOCK, lease_expired
from components.gallery.plan import DECISION, ENDINGS, FINISHED, REJECTED, Plan, load_plan, plan_key, upgrade_key
from components.gallery.store import ObjectMissing, Store

FAILED_SHOWN = 20  # failed images listed by status (finished.json keeps them all)
ABORTED, ROLLED_BACK = "aborted.json", "rolled-back.json"
ROLLBACK = "rollback"  # the ``by`` of a manifest history entry written by a rollback


def finish(gallery: Gallery, plan: Plan) -> dict:
    """All chunks done: write the new model's features part by part, then switch the gallery.
    Again after the switch (a re-run whose first try was killed after it): nothing is rewritten,
    the record it wrote is returned."""
    manifest = gallery.manifest(refresh=True)
    if manifest.get("upgrade") is None and _same(ModelRef.from_dict(manifest["model"]), plan.new):
        try:
            return gallery.store.get_json(upgrade_key(plan.id, FINISHED))
        except ObjectMissing:
            pass
    missing = sorted(set(range(plan.num_chunks)) - set(done_chunks(gallery.store, plan.id)))
    if missing:
        raise GalleryError(f"upgrade {plan.id} is not complete: {len(missing)} chunks left (first: {missing[0]})")
    for part, features, backfilled in iter_mixed_parts(gallery, plan):  # bounded memory, part by part
        assert backfilled.all()
        gallery.store.put_array(features_key(plan.new, part), features)
    record = {"upgrade": plan.id, "finished": now(), "model": plan.new.to_dict()}
    if gallery.adopted:
        failed = failed_images(gallery.store, plan.id)
        record["failed_images"] = {"count": len(failed), "items": failed}
    gallery.store.put_json(upgrade_key(plan.id, FINISHED), record)
    manifest = dict(gallery.manifest(refresh=True))
    manifest["model"] = plan.new.to_dict()
    manifest["upgrade"] = None
    manifest["history"] = [*manifest.get("history", []), {"model": plan.new.to_dict(), "since": now(), "by": plan.id}]
    gallery.write_manifest(manifest)
    return record


def reject(gallery: Gallery, plan: Plan, decision: dict) -> dict:
    """The promotion gate failed: the gallery goes back to serving its own model's features (the
    champion's); the upgrade's record says why, and its working data is garbage."""
    record = {"upgrade": plan.id, "rejected": now(), "model": plan.new.to_dict(), **decision}
    gallery.store.put_json(upgrade_key(plan.id, REJECTED), record)
    manifest = dict(gallery.manifest(refresh=True))
    if manifest.get("upgrade") == plan.id:
        manifest["upgrade"] = None
        gallery.write_manifest(manifest)
    return record


def _same(a: ModelRef, b: ModelRef) -> bool:
    return (a.name, str(a.version)) == (b.name, str(b.version))


# ---- the end of an upgrade as a recoverable sequence: decision, switch, registry, lock
#
# 1. the decision is recorded in the store (``decision.json``), before anything changes;
# 2. the gallery switches (``finish``) or goes back to the champion's features (``reject``);
# 3. the registry follows: the version's tags, and ``champion`` moved when it passed;
#    ``decision.json`` then says ``registry_recorded``;
# 4. the lock is released (by the caller, last).
# A run killed after any step finds the decision and completes the steps after it; the
# decision is never measured again (after the switch that would judge the version against itself).


def decision(store: Store, upgrade: str) -> dict | None:
    try:
        return store.get_json(upgrade_key(upgrade, DECISION))
    except ObjectMissing:
        return None


def record_decision(store: Store, plan: Plan, *, passed: bool, reasons: list[str], numbers: dict | None,
                    tags: dict, champion: ModelRef) -> dict:
    """Step 1: the decision, written once (a decision already recorded is returned as it is)."""
    existing = decision(store, plan.id)
    if existing is not None:
        return existing
    record = {"upgrade": plan.id, "decided": now(), "passed": passed, "reasons": reasons, "numbers": numbers,
              "tags": tags, "champion": champion.to_dict(), "new": plan.new.to_dict(), "registry_recorded": None}
    store.put_json(upgrade_key(plan.id, DECISION), record)
    return record


def mark_registry_recorded(store: Store, upgrade: str) -> dict:
    """Step 3 done: the registry holds the decision (tags, and champion when it passed)."""
    record = {**decision(store, upgrade), "registry_recorded": now()}
    store.put_json(upgrade_key(upgrade, DECISION), record)
    return record


def interrupted_ending(gallery: Gallery) -> dict | None:
    """The decision of an upgrade whose end was interrupted after the gallery switched or went
    back (step 2) but before the registry followed (step 3), or None. Found through the
    manifest's history (a finish) or the newest rejection without its registry step."""
    manifest = gallery.manifest(refresh=True)
    history = manifest.get("history") or []
    candidates = [history[-1].get("by")] if history else []
    candidates += sorted({key.split("/")[1] for key in gallery.store.list("upgrades/")
                          if key.endswith("/" + REJECTED)})
    for upgrade in candidates:
        if not upgrade:
            continue
        record = decision(gallery.store, upgrade)
        if record is not None and not record.get("registry_recorded"):
            switched = (record["passed"] and manifest.get("upgrade") is None
                        and _same(ModelRef.from_dict(manifest["model"]), ModelRef.from_dict(record["new"])))
            if switched or (not record["passed"] and rejection(gallery.store, upgrade) is not None):
                return record
    return None


def rejection(store: Store, upgrade: str) -> dict | None:
    try:
        return store.get_json(upgrade_key(upgrade, REJECTED))
    except ObjectMissing:
        return None


def status(gallery: Gallery, *, failures: bool = True) -> dict:
    """The gallery's model, lock and upgrade in progress; ``failures``: with the adopted images a
    backfill could not read (one read per done chunk)."""
    manifest = gallery.manifest(refresh=True)
    result = {"store": gallery.store.uri, "items": manifest["num_items"], "model": manifest["model"]["uri"],
              "state": "idle", "upgrade": None}
    try:
        result["lock"] = gallery.store.get_json(LOCK)
        result["lock"].pop("token", None)
    except ObjectMissing:
        result["lock"] = None
    if result["lock"] is not None and lease_expired(result["lock"]):
        # its holder stopped renewing (killed, or cut off from the store): nobody is working
        result["lock"]["expired"] = True
        result["next"] = "the lock's lease has expired: the next `fastfill upgrade` takes it over and resumes"
    held = result["lock"] is not None and not result["lock"].get("expired")
    upgrade = manifest.get("upgrade")
    if upgrade:
        plan = load_plan(gallery.store, upgrade)
        done = done_chunks(gallery.store, upgrade)
        items = plan.items_in(done) if plan else 0
        result.update(state="running" if held else "paused", upgrade={
            "id": upgrade, "from": plan.old.uri if plan else None, "to": plan.new.uri if plan else None,
            "order": plan.order_kind if plan else None,
            "chunks_done": len(done), "chunks": plan.num_chunks if plan else None,
            "items_done": items, "fraction": items / manifest["num_items"],
            "mlflow_run_id": plan.mlflow_run_id if plan else None})
        advice = stored_advice(gallery.store, upgrade)
        if advice is not None and advice.get("metric") == "agreement":  # the label-free prediction (points)
            every = range(0, len(advice["fractions"]), 2)
            result["upgrade"]["predicted"] = {
                "sample": advice["sample"], "metric": f"agreement with the finished upgrade's top-{advice['k']}",
                "agreement": {f"{100 * advice['fractions'][i]:.0f}%": round(100 * advice["agreement"][i], 2)
                              for i in every},
                "recommendation": advice.get("recommendation")}
        elif advice is not None:  # the budget advisor's prediction, every 10% (points)
            every = range(0, len(advice["fractions"]), 2)
            result["upgrade"]["predicted"] = {
                "sample": advice["sample"],
                "top1": {f"{100 * advice['fractions'][i]:.0f}%": round(100 * advice["top1"][i], 2) for i in every},
                "map": {f"{100 * advice['fractions'][i]:.0f}%": round(100 * advice["map"][i], 2) for i in every},
                "top1_standard_error": round(100 * max(advice["top1_se"]), 2),
                "recommendation": advice.get("recommendation")}
        if failures and gallery.adopted:
            failed = failed_images(gallery.store, upgrade)
            result["upgrade"]["failed_images"] = {"count": len(failed), "items": failed[:FAILED_SHOWN]}
        if aborted(gallery.store, upgrade) is not None:  # an abort cut short before the gallery went back
            result["state"] = "abort interrupted"
            result["next"] = ("run `fastfill upgrade abort` again to complete it, or `fastfill upgrade` to plan this "
                              "upgrade again from scratch")
            return result
        decided = decision(gallery.store, upgrade)
        if decided is not None:  # killed between the decision and the switch
            result["upgrade"]["decision"] = {"passed": decided["passed"], "decided": decided["decided"]}
            if not held:
                result["state"] = "ending interrupted"
                result["next"] = "run the same `fastfill upgrade` again: it completes the recorded decision"
        return result
    ending = interrupted_ending(gallery)
    if ending is not None:  # killed after the switch, before the registry followed
        result["state"] = "running" if held else "ending interrupted"
        result["upgrade"] = {"id": ending["upgrade"], "to": ModelRef.from_dict(ending["new"]).uri,
                             "decision": {"passed": ending["passed"], "decided": ending["decided"]},
                             "registry_recorded": False}
        if not held:
            result["next"] = ("run `fastfill upgrade` again: it records the decision in the registry (tags"
                              + (", champion" if ending["passed"] else "") + ") and ends")
        return result
    undone = interrupted_rollback(gallery)
    if undone is not None and not held:  # the gallery went back; the registry did not follow yet
        result["state"] = "rollback interrupted"
        result["next"] = "run `fastfill gallery rollback` again: it moves champion back and tags the version"
    return result


def collect_garbage(gallery: Gallery) -> dict:
    """Delete features of models other than the gallery's own, and the working data of ended
    upgrades: finished, rejected, superseded or aborted (their plan.json, decision and the record
    of their end stay). A previous model's features deleted here can no longer be rolled back to."""
    manifest = gallery.manifest(refresh=True)
    if manifest.get("upgrade"):
        raise GalleryError(f"upgrade {manifest['upgrade']} is in progress; finish it (or drop it with `fastfill "
                           "upgrade abort`) before collecting garbage (its queries still use the old features)")
    current = ModelRef.from_dict(manifest["model"]).key
    deleted = {"features": 0, "upgrade_objects": 0}
    for key in gallery.store.list("features/"):
        if key.split("/")[1] != current:
            gallery.store.delete(key)
            deleted["features"] += 1
    ended = (*ENDINGS, ABORTED)
    for key in gallery.store.list("upgrades/"):
        parts = key.split("/")
        if len(parts) < 3 or parts[2] in ("plan.json", DECISION, *ended, ROLLED_BACK):
            continue
        if any(gallery.store.exists(upgrade_key(parts[1], end)) for end in ended):
            gallery.store.delete(key)
            deleted["upgrade_objects"] += 1
    return deleted


# ---- undoing: abort an unfinished upgrade, roll back a finished one
#
# Both run under the gallery's lock (taken by the caller), write the record of what they did
# first, then change the manifest. An abort recorded but cut short before the manifest changed
# is completed by the next abort (or by the next upgrade of the same version, which plans it
# again); a rollback whose registry step did not happen is completed by the next rollback.


def who() -> dict:
    """Who is doing something to the gallery: user, host and process."""
    import getpass
    import os
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container)
        user = str(os.getuid())
    return {"user": user, "host": socket.gethostname(), "pid": os.getpid()}


def _record(store: Store, upgrade: str, name: str) -> dict | None:
    try:
        return store.get_json(upgrade_key(upgrade, name))
    except ObjectMissing:
        return None


def aborted(store: Store, upgrade: str) -> dict | None:
    """The record of ``upgrade``'s abort, or None."""
    return _record(store, upgrade, ABORTED)


def rolled_back(store: Store, upgrade: str) -> dict | None:
    """The record of ``upgrade``'s rollback, or None."""
    return _record(store, upgrade, ROLLED_BACK)


def _finished(store: Store, upgrade: str) -> dict | None:
    return _record(store, upgrade, FINISHED)


def _last_ended(gallery: Gallery, manifest: dict) -> tuple[str, str, dict] | None:
    """The newest upgrade that ended by finishing or by the gate's rejection: (id, "finished" or
    "rejected", its record), or None."""
    found = []
    history = manifest.get("history") or []
    if history and history[-1].get("by") not in (None, "ingest", "adopt", ROLLBACK):
        record = _finished(gallery.store, history[-1]["by"])
        if record is not None:
            found.append((record["finished"], history[-1]["by"], "finished", record))
    for key in gallery.store.list("upgrades/"):
        if key.endswith("/" + REJECTED):
            upgrade = key.split("/")[1]
            record = rejection(gallery.store, upgrade)
            found.append((record.get("rejected", ""), upgrade, "rejected", record))
    if not found:
        return None
    _, upgrade, how, record = max(found, key=lambda entry: entry[0])
    return upgrade, how, record


def _rollback_hint(manifest: dict) -> str:
    history = manifest.get("history") or []
    if len(history) < 2:
        return ""
    return (f"; `fastfill gallery rollback` returns the gallery to {ModelRef.from_dict(history[-2]['model']).uri} "
            "while that model's features are still stored")


def abortable(gallery: Gallery) -> str:
    """The id of the gallery's unfinished upgrade (planned, or part of the way through its
    backfill, its end not begun), or a GalleryError that says why there is none to abort."""
    store = gallery.store
    manifest = gallery.manifest(refresh=True)
    upgrade = manifest.get("upgrade")
    if upgrade:
        decided = decision(store, upgrade)
        if decided is not None:
            raise GalleryError(
                f"upgrade {upgrade} of {store.uri} is ending: its promotion decision "
                f"({'passed' if decided['passed'] else 'rejected'}) was recorded on {decided['decided']}, so it is no "
                "longer unfinished and cannot be aborted; run `fastfill upgrade` to complete its end"
                + (", then `fastfill gallery rollback` to undo it" if decided["passed"] else ""))
        return upgrade
    ending = interrupted_ending(gallery)
    if ending is not None:
        raise GalleryError(
            f"upgrade {ending['upgrade']} of {store.uri} has ended ({'passed' if ending['passed'] else 'rejected'} on "
            f"{ending['decided']}); only its registry step is left, so it cannot be aborted: run `fastfill upgrade` to "
            "complete it" + (", then `fastfill gallery rollback` to undo it" if ending["passed"] else ""))
    serving = ModelRef.from_dict(manifest["model"]).uri
    message = f"no upgrade of {store.uri} is in progress (the gallery serves {serving}); nothing to abort"
    last = _last_ended(gallery, manifest)
    if last is not None:
        upgrade, how, record = last
        if how == "finished":
            message += (f". The last upgrade, {upgrade}, finished on {record['finished']}: a finished upgrade cannot "
                        "be aborted" + _rollback_hint(manifest))
        else:
            message += (f". The last upgrade, {upgrade}, was rejected by the promotion gate on {record['rejected']}: "
                        "it is over, and the gallery already serves the champion's features")
    raise GalleryError(message)


def progress(gallery: Gallery, plan: Plan) -> dict:
    """How far ``plan``'s upgrade has got: its stage, chunks and items done."""
    done = done_chunks(gallery.store, plan.id)
    items = plan.items_in(done)
    stage = ("planned" if not done else "backfill complete" if len(done) == plan.num_chunks else "backfilling")
    return {"stage": stage, "chunks_done": len(done), "chunks": plan.num_chunks, "items_done": items,
            "items": plan.num_items, "fraction": items / plan.num_items if plan.num_items else 1.0}


def abort(gallery: Gallery, upgrade: str, *, by: dict | None = None) -> dict:
    """Drop the unfinished ``upgrade`` (the caller holds the lock): its record
    ``aborted.json`` first (who, when, how far it got), then the gallery back on its own model's
    features (the champion's). Its working data is garbage from then on, and the same upgrade
    asked for again is planned from scratch. Returns the record (an abort already recorded but
    cut short is completed, its record kept)."""
    store = gallery.store
    if abortable(gallery) != upgrade:
        raise GalleryError(f"upgrade {upgrade} is no longer the one in progress at {store.uri}; nothing was changed")
    record = aborted(store, upgrade)
    if record is None:
        plan = load_plan(store, upgrade)
        if plan is None:
            raise GalleryError(f"the gallery at {store.uri} points at upgrade {upgrade}, which has no plan.json")
        record = {"upgrade": upgrade, "aborted": now(), "by": by or who(), "from": plan.old.uri, "to": plan.new.uri,
                  "base": plan.base, **progress(gallery, plan), "mlflow_run_id": plan.mlflow_run_id,
                  "plan_created": plan.created}
        store.put_json(upgrade_key(upgrade, ABORTED), record)
    manifest = dict(gallery.manifest(refresh=True))
    manifest["upgrade"] = None
    gallery.write_manifest(manifest)
    return record


def start_over(gallery: Gallery, upgrade: str) -> dict | None:
    """``upgrade`` was aborted or rolled back and is asked for again: delete its objects so it is
    planned from scratch (plan.json first, so nothing can resume it; the record of its end last,
    so a run cut short here does this again). Returns that record, with ``ended`` ("aborted" or
    "rolled back"), or None when the upgrade was neither."""
    store = gallery.store
    record = aborted(store, upgrade)
    ended = "aborted"
    if record is None:
        record, ended = rolled_back(store, upgrade), "rolled back"
    if record is None:
        return None
    manifest = gallery.manifest(refresh=True)
    if manifest.get("upgrade") == upgrade:  # an abort cut short before the gallery went back
        gallery.write_manifest({**manifest, "upgrade": None})
    records = {upgrade_key(upgrade, ABORTED), upgrade_key(upgrade, ROLLED_BACK)}
    keys = store.list(f"upgrades/{upgrade}/")
    if plan_key(upgrade) in keys:
        store.delete(plan_key(upgrade))
    for key in keys:
        if key != plan_key(upgrade) and key not in records:
            store.delete(key)
    for key in sorted(records & set(keys)):
        store.delete(key)
    return {"ended": ended, **record}


def rollback_target(gallery: Gallery) -> tuple[str, ModelRef, ModelRef]:
    """(the upgrade to roll back, the gallery's model now, the model it had before) when the
    gallery's last change is a finished upgrade whose previous model's features all still exist;
    else a GalleryError that says why not."""
    store = gallery.store
    manifest = gallery.manifest(refresh=True)
    if manifest.get("upgrade"):
        raise GalleryError(f"upgrade {manifest['upgrade']} of {store.uri} is in progress; drop it with `fastfill "
                           "upgrade abort` (or let it finish) before rolling back")
    ending = interrupted_ending(gallery)
    if ending is not None:
        raise GalleryError(f"the end of upgrade {ending['upgrade']} of {store.uri} was interrupted before the registry "
                           "followed; run `fastfill upgrade` to complete it, then roll back")
    history = manifest.get("history") or []
    current = ModelRef.from_dict(manifest["model"])
    last = history[-1] if history else {}
    if last.get("by") == ROLLBACK:
        raise GalleryError(f"the last change to {store.uri} was already a rollback (to {current.uri} on "
                           f"{last.get('since')}); only the newest finished upgrade can be rolled back")
    upgrade = last.get("by")
    if len(history) < 2 or upgrade in (None, "ingest", "adopt") or _finished(store, upgrade) is None:
        raise GalleryError(f"nothing to roll back: {store.uri} has served {current.uri} since it was created "
                           f"({last.get('by', 'ingest')}, {last.get('since')}), not since a finished upgrade")
    previous = ModelRef.from_dict(history[-2]["model"])
    wanted = [features_key(previous, part) for part in range(int(manifest["num_parts"]))]
    present = set(store.list(f"features/{previous.key}/"))
    missing = [key for key in wanted if key not in present]
    if missing:
        raise GalleryError(
            f"cannot roll {store.uri} back to {previous.uri}: the old features were collected ({len(missing)} of "
            f"{len(wanted)} feature parts of {previous.key} are gone, first {missing[0]}; `fastfill gallery gc` "
            f"deletes a previous model's features). Re-ingest the gallery with the previous model (`fastfill gallery "
            f"ingest --model {previous.uri} --store <a new store>`, or `adopt`) to serve it again")
    return upgrade, current, previous


def rollback(gallery: Gallery, *, by: dict | None = None) -> dict:
    """Return the gallery to the model it had before its last, finished upgrade (the caller holds
    the lock): the record ``rolled-back.json`` first, then the manifest's model switched back
    with a history entry ``rollback``. The registry's part (champion back, the version tagged) is
    the caller's; ``mark_rollback_recorded`` notes it done."""
    upgrade, current, previous = rollback_target(gallery)
    record = {"upgrade": upgrade, "rolled_back": now(), "by": by or who(), "from": current.to_dict(),
              "to": previous.to_dict(), "registry_recorded": None}
    gallery.store.put_json(upgrade_key(upgrade, ROLLED_BACK), record)
    manifest = dict(gallery.manifest(refresh=True))
    manifest["model"] = previous.to_dict()
    manifest["history"] = [*manifest.get("history", []),
                           {"model": previous.to_dict(), "since": now(), "by": ROLLBACK, "upgrade": upgrade,
                            "from": current.to_dict()}]
    gallery.write_manifest(manifest)
    return record


def interrupted_rollback(gallery: Gallery) -> dict | None:
    """The record of the gallery's last change when it is a rollback whose registry step was not
    recorded, else None."""
    history = gallery.manifest(refresh=True).get("history") or []
    if not history or history[-1].get("by") != ROLLBACK:
        return None
    record = rolled_back(gallery.store, history[-1].get("upgrade", ""))
    return record if record is not None and not record.get("registry_recorded") else None


def mark_rollback_recorded(store: Store, upgrade: str) -> dict:
    record = {**rolled_back(store, upgrade), "registry_recorded": now()}
    store.put_json(upgrade_key(upgrade, ROLLED_BACK), record)
    return record
