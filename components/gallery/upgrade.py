"""The end of an upgrade and its state: finish (switch the gallery to the new model), reject
(the promotion gate failed), status, and garbage collection of finished upgrades' working data.
The steps before are in ``components.gallery.plan`` and ``components.gallery.backfill``; the
order they run in is ``components.gallery.lifecycle``'s."""

from __future__ import annotations

from components.gallery.backfill import done_chunks, failed_images, iter_mixed_parts
from components.gallery.catalog import Gallery, GalleryError, ModelRef, features_key, now
from components.gallery.lock import LOCK
from components.gallery.plan import ENDINGS, FINISHED, REJECTED, Plan, load_plan, upgrade_key
from components.gallery.store import ObjectMissing, Store

FAILED_SHOWN = 20  # failed images listed by status (finished.json keeps them all)


def finish(gallery: Gallery, plan: Plan) -> dict:
    """All chunks done: write the new model's features part by part, then switch the gallery."""
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
    upgrade = manifest.get("upgrade")
    if upgrade:
        plan = load_plan(gallery.store, upgrade)
        done = done_chunks(gallery.store, upgrade)
        items = plan.items_in(done) if plan else 0
        result.update(state="running" if result["lock"] else "paused", upgrade={
            "id": upgrade, "from": plan.old.uri if plan else None, "to": plan.new.uri if plan else None,
            "order": plan.order_kind if plan else None,
            "chunks_done": len(done), "chunks": plan.num_chunks if plan else None,
            "items_done": items, "fraction": items / manifest["num_items"],
            "mlflow_run_id": plan.mlflow_run_id if plan else None})
        if failures and gallery.adopted:
            failed = failed_images(gallery.store, upgrade)
            result["upgrade"]["failed_images"] = {"count": len(failed), "items": failed[:FAILED_SHOWN]}
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
        if len(parts) < 3 or parts[2] in ("plan.json", *ENDINGS):
            continue
        if any(gallery.store.exists(upgrade_key(parts[1], end)) for end in ENDINGS):
            gallery.store.delete(key)
            deleted["upgrade_objects"] += 1
    return deleted

