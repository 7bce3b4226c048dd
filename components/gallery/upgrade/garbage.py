"""Garbage collection: the features of models other than the gallery's own, and the working data
of ended upgrades."""

from __future__ import annotations

from fastfill.components.gallery.layouts.catalog import LANCE, Gallery, GalleryError
from fastfill.components.gallery.layouts.lance_serving import SERVING_TABLE
from fastfill.components.gallery.layouts.table import TABLE
from fastfill.components.gallery.upgrade.planning import DECISION, ENDINGS, upgrade_key
from fastfill.components.gallery.upgrade.reversal import ABORTED, ROLLED_BACK


def collect_garbage(gallery: Gallery) -> dict:
    """Delete features of models other than the gallery's own, and the working data of ended
    upgrades: finished, rejected, superseded or aborted (their plan.json, decision and the record
    of their end stay). A previous model's features deleted here can no longer be rolled back to."""
    manifest = gallery.manifest(refresh=True)
    if manifest.get("upgrade"):
        raise GalleryError(f"upgrade {manifest['upgrade']} is in progress; finish it (or drop it with `fastfill "
                           "upgrade abort`) before collecting garbage (its queries still use the old features)")
    deleted: dict = {"features": gallery.collect_features(), "upgrade_objects": 0,
                     "kept_columns": gallery.kept_columns()}
    if gallery.layout != LANCE:  # a convert out of the lance layout left its tables (one each counted)
        for prefix in (f"{TABLE}/", f"{SERVING_TABLE}.lance/"):
            keys = gallery.store.list(prefix)
            for key in keys:
                gallery.store.delete(key)
            deleted["features"] += bool(keys)
    ended = (*ENDINGS, ABORTED)
    for key in gallery.store.list("upgrades/"):
        parts = key.split("/")
        if len(parts) < 3 or parts[2] in ("plan.json", DECISION, *ended, ROLLED_BACK):
            continue
        if any(gallery.store.exists(upgrade_key(parts[1], end)) for end in ended):
            gallery.store.delete(key)
            deleted["upgrade_objects"] += 1
    return deleted
