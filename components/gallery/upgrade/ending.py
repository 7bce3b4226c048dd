"""The end of an upgrade: its decision recorded, then finish (switch the gallery to the new
model) or reject (the promotion gate failed), then the registry's step noted.

The end of an upgrade as a recoverable sequence: decision, switch, registry, lock.

1. the decision is recorded in the store (``decision.json``), before anything changes;
2. the gallery switches (``finish``) or goes back to the champion's features (``reject``);
3. the registry follows: the version's tags, and ``champion`` moved when it passed;
   ``decision.json`` then says ``registry_recorded``;
4. the lock is released (by the caller, last).
A run killed after any step finds the decision and completes the steps after it; the
decision is never measured again (after the switch that would judge the version against itself).
``components.gallery.upgrade.decider`` decides which step comes next.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from fastfill.components.gallery.layouts.catalog import Gallery, GalleryError, ModelRef, now
from fastfill.components.gallery.store import Store
from fastfill.components.gallery.upgrade.backfill import FailedImages, done_chunks, failed_images, iter_mixed_parts
from fastfill.components.gallery.upgrade.outcome import Decision
from fastfill.components.gallery.upgrade.planning import DECISION, FINISHED, REJECTED, Plan, upgrade_key, upgrade_record


def finish(gallery: Gallery, plan: Plan, image_shape: Sequence[int] | None = None) -> dict:
    """All chunks done: write the new model's features part by part, then switch the gallery.
    Again after the switch (a re-run whose first try was killed after it): nothing is rewritten,
    the record it wrote is returned. ``image_shape``: the (C, H, W) the new model takes; an
    adopted gallery (images read by URI) records it, so its images are decoded for the model it
    now serves (an ingested gallery's stored pixels keep their shape)."""
    manifest = gallery.manifest(refresh=True)
    if manifest.get("upgrade") is None and ModelRef.from_dict(manifest["model"]).same_version(plan.new):
        recorded = upgrade_record(gallery.store, plan.upgrade_id, FINISHED)
        if recorded is not None:
            return recorded
    missing = sorted(set(range(plan.num_chunks)) - set(done_chunks(gallery.store, plan.upgrade_id)))
    if missing:
        raise GalleryError(f"upgrade {plan.upgrade_id} is not complete: {len(missing)} chunks left (first: {missing[0]})")
    gallery.write_features(plan.new, _whole_parts(gallery, plan))
    record = {"upgrade": plan.upgrade_id, "finished": now(), "model": plan.new.to_dict()}
    if gallery.adopted:
        record["failed_images"] = FailedImages.of(failed_images(gallery.store, plan.upgrade_id)).to_dict()
    unserved = gallery.unserved_rows()
    if unserved:
        record["unserved_rows"] = unserved
    gallery.store.put_json(upgrade_key(plan.upgrade_id, FINISHED), record)
    manifest = dict(gallery.manifest(refresh=True))
    manifest["model"] = plan.new.to_dict()
    manifest["upgrade"] = None
    entry = {"model": plan.new.to_dict(), "since": now(), "by": plan.upgrade_id}
    if gallery.adopted and image_shape is not None and list(image_shape) != list(manifest["image_shape"]):
        entry["image_shape_before"] = list(manifest["image_shape"])  # what a rollback restores
        manifest["image_shape"] = [int(x) for x in image_shape]
    manifest["history"] = [*manifest.get("history", []), entry]
    gallery.write_manifest(manifest)
    return record


def _whole_parts(gallery: Gallery, plan: Plan):
    """(part, the new features) of every part, from the landed chunks; bounded memory."""
    for part, features, backfilled in iter_mixed_parts(gallery, plan):
        if not backfilled.all():
            raise GalleryError(f"part {part} of upgrade {plan.upgrade_id} is not wholly backfilled; run the upgrade again")
        yield part, features


def reject(gallery: Gallery, plan: Plan, decision: Decision) -> dict:
    """The promotion gate failed: the gallery goes back to serving its own model's features (the
    champion's); the upgrade's record says why, and its working data is garbage."""
    record = {"upgrade": plan.upgrade_id, "rejected": now(), "model": plan.new.to_dict(), "reasons": list(decision.reasons),
              "numbers": decision.numbers}
    gallery.store.put_json(upgrade_key(plan.upgrade_id, REJECTED), record)
    manifest = dict(gallery.manifest(refresh=True))
    if manifest.get("upgrade") == plan.upgrade_id:
        manifest["upgrade"] = None
        gallery.write_manifest(manifest)
    return record


def decision(store: Store, upgrade_id: str) -> Decision | None:
    """The upgrade's recorded decision (decision.json), or None."""
    record = upgrade_record(store, upgrade_id, DECISION)
    return Decision.from_dict(record) if record is not None else None


def write_decision(store: Store, decided: Decision) -> Decision:
    """Step 1: the decision, written once, stamped with when (a decision already recorded is
    returned as it is)."""
    existing = decision(store, decided.upgrade_id)
    if existing is not None:
        return existing
    recorded = replace(decided, decided=now(), registry_recorded=None)
    store.put_json(upgrade_key(decided.upgrade_id, DECISION), recorded.to_dict())
    return recorded


def mark_registry_recorded(store: Store, upgrade_id: str) -> Decision:
    """Step 3 done: the registry holds the decision (tags, and champion when it passed)."""
    recorded = upgrade_record(store, upgrade_id, DECISION)
    if recorded is None:
        raise GalleryError(f"upgrade {upgrade_id} has no decision.json in {store.uri}: nothing to mark recorded")
    record = {**recorded, "registry_recorded": now()}  # the record as stored, with its step done
    store.put_json(upgrade_key(upgrade_id, DECISION), record)
    return Decision.from_dict(record)


def interrupted_decision(gallery: Gallery) -> Decision | None:
    """The decision of an upgrade whose end was interrupted after the gallery switched or went
    back (step 2) but before the registry followed (step 3), or None. Found through the
    manifest's history (a finish) or the newest rejection without its registry step."""
    manifest = gallery.manifest(refresh=True)
    history = manifest.get("history") or []
    candidates = [history[-1].get("by")] if history else []
    candidates += sorted({key.split("/")[1] for key in gallery.store.list("upgrades/")
                          if key.endswith("/" + REJECTED)})
    for upgrade_id in candidates:
        if not upgrade_id:
            continue
        recorded = decision(gallery.store, upgrade_id)
        if recorded is not None and not recorded.registry_recorded:
            switched = (recorded.passed and manifest.get("upgrade") is None and recorded.new is not None
                        and ModelRef.from_dict(manifest["model"]).same_version(recorded.new))
            if switched or (not recorded.passed and rejection(gallery.store, upgrade_id) is not None):
                return recorded
    return None


def rejection(store: Store, upgrade_id: str) -> dict | None:
    return upgrade_record(store, upgrade_id, REJECTED)
