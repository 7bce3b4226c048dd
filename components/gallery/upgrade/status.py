"""The gallery's state for `fastfill upgrade status`: its model, the lock, the upgrade in progress
with its progress, prediction and failed images, and any step a killed run left to complete."""

from __future__ import annotations

from fastfill.components.gallery.advice.advisor import stored_advice
from fastfill.components.gallery.upgrade.backfill import done_chunks, failed_images
from fastfill.components.gallery.layouts.catalog import Gallery, ModelRef
from fastfill.components.gallery.upgrade.ending import decision, interrupted_decision
from fastfill.components.gallery.store.lock import LOCK, lease_expired
from fastfill.components.gallery.upgrade.planning import load_plan
from fastfill.components.gallery.upgrade.reversal import aborted, interrupted_rollback
from fastfill.components.gallery.store import ObjectMissing

FAILED_SHOWN = 20  # failed images listed by status (finished.json keeps them all)


def gallery_status(gallery: Gallery, *, failures: bool = True) -> dict:
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
    if gallery.serves_queries:
        result["index"] = served_index(gallery, upgrade)
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
    ending = interrupted_decision(gallery)
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


def served_index(gallery: Gallery, upgrade: str | None) -> dict:
    """What the team's index serves (a layout that serves queries): where, the view, its model,
    and whether it is what the manifest says (a switch a killed run left is completed by the
    next `fastfill upgrade`)."""
    index = gallery.index
    serving = index.serving() or {}
    plan = load_plan(gallery.store, upgrade) if upgrade else None
    expected = plan.new.uri if plan is not None else gallery.model.uri
    return {"where": index.where, "view": index.view, "serving": serving.get("model"),
            "vectors": serving.get("vectors"), "since": str(serving["since"]) if serving.get("since") else None,
            "as_manifest_says": serving.get("model") == expected}
