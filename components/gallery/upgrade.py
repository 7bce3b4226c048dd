"""The end of an upgrade and its state: finish (switch the gallery to the new model), reject
(the promotion gate failed), status, and garbage collection of finished upgrades' working data.
The steps before are in ``components.gallery.plan`` and ``components.gallery.backfill``; the
order they run in is ``components.gallery.lifecycle``'s."""

from __future__ import annotations

from components.gallery.backfill import done_chunks, failed_images, iter_mixed_parts
from components.gallery.catalog import Gallery, GalleryError, ModelRef, features_key, now
from components.gallery.lock import LOCK, lease_expired
from components.gallery.plan import DECISION, ENDINGS, FINISHED, REJECTED, Plan, load_plan, upgrade_key
from components.gallery.store import ObjectMissing, Store

FAILED_SHOWN = 20  # failed images listed by status (finished.json keeps them all)


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
        if failures and gallery.adopted:
            failed = failed_images(gallery.store, upgrade)
            result["upgrade"]["failed_images"] = {"count": len(failed), "items": failed[:FAILED_SHOWN]}
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


def collect_garbage(gallery: Gallery) -> dict:
    """Delete features of models other than the gallery's own, and the working data of finished
    upgrades (their plan.json and finished.json stay as the record)."""
    manifest = gallery.manifest(refresh=True)
    if manifest.get("upgrade"):
        raise GalleryError(f"upgrade {manifest['upgrade']} is in progress; finish it before collecting garbage "
                           "(its queries still use the old features)")
    current = ModelRef.from_dict(manifest["model"]).key
    deleted = {"features": 0, "upgrade_objects": 0}
    for key in gallery.store.list("features/"):
        if key.split("/")[1] != current:
            gallery.store.delete(key)
            deleted["features"] += 1
    for key in gallery.store.list("upgrades/"):
        parts = key.split("/")
        if len(parts) < 3 or parts[2] in ("plan.json", DECISION, *ENDINGS):
            continue
        if any(gallery.store.exists(upgrade_key(parts[1], end)) for end in ENDINGS):
            gallery.store.delete(key)
            deleted["upgrade_objects"] += 1
    return deleted

