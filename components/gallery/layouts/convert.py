"""A gallery moved into another layout (``fastfill gallery convert``): read part by part through
the Gallery interface, written by the target layout's writer, read back and compared, and only
then the manifest (the same history, the new layout) written, so a convert killed half way
leaves the gallery as it was."""

from __future__ import annotations

import numpy as np

from fastfill.components.gallery.layouts.catalog import MANIFEST, Gallery, GalleryError, check_empty, written_fields
from fastfill.components.gallery.layouts.opening import LAYOUTS, gallery_at, layout_of
from fastfill.components.gallery.store import DamagedObject, Store, open_store


def convert(gallery: Gallery, target_uri: str | None, layout: str, gallery_config=None) -> dict:
    """``gallery`` into ``layout`` at ``target_uri`` (default: its own store, in place). Refused
    during an upgrade, into the layout it already has in place, and into a store that holds a
    gallery. The features are compared bit for bit and the ids equal before the manifest is
    written; in place, the old layout's data stays until ``fastfill gallery gc``. ``gallery_config``
    (gallery): the pgvector layout's server and table."""
    kind = layout_of(layout, gallery_config)
    manifest = gallery.manifest(refresh=True)
    if manifest.get("upgrade"):
        raise GalleryError(f"{gallery.store.uri}: upgrade {manifest['upgrade']} is in progress; finish it or abort it "
                           "(`fastfill upgrade abort`) before converting")
    target: Store = open_store(target_uri) if target_uri else gallery.store
    in_place = target.uri == gallery.store.uri
    if in_place and gallery.layout == layout:
        raise GalleryError(f"{gallery.store.uri} is already in the {layout} layout")
    if not in_place:
        check_empty(target, "convert")
    model = gallery.model
    writer = kind.writer(target, model, gallery.part_size)
    for part in range(gallery.num_parts):
        start, _ = gallery.part_bounds(part)
        writer.write(start, gallery.items_part(part), gallery.features(model, part),
                     None if gallery.adopted else gallery.images(part))
    writer.close()
    converted = {**{k: v for k, v in manifest.items() if k != "index"}, "layout": layout, **written_fields(writer)}
    written = LAYOUTS[layout](target, converted)
    for part in range(gallery.num_parts):  # read back before the manifest makes it the gallery
        if not np.array_equal(written.features(model, part), gallery.features(model, part)):
            raise DamagedObject(f"{target.uri}: the features of part {part} read back differ from the source's; the "
                                f"converted gallery is not used (the manifest still says {gallery.layout})")
        if written.items_part(part).column("id").to_pylist() != gallery.items_part(part).column("id").to_pylist():
            raise DamagedObject(f"{target.uri}: the item ids of part {part} read back differ from the source's")
    target.put_json(MANIFEST, converted)
    written = gallery_at(target)
    return {"store": target.uri, "layout": layout, "items": written.num_items, "model": model.uri,
            "dim": int(model.dim or written.features(model, 0).shape[1]), "in_place": in_place}
