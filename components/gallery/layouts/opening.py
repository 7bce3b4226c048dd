"""Which layout a gallery is kept in, and opening it: the one place that reads a gallery's
``layout`` (the manifest's, written when the gallery was made from ``gallery.layout``)."""

from __future__ import annotations

from fastfill.components.gallery.layouts.catalog import (
    LANCE,
    MANIFEST,
    MILVUS,
    PARTS,
    PGVECTOR,
    QDRANT,
    Gallery,
    GalleryError,
    PartsGallery,
    check_manifest,
)
from fastfill.components.gallery.layouts.lance_serving import lance_settings
from fastfill.components.gallery.layouts.milvus_collection import MilvusGallery, milvus_settings
from fastfill.components.gallery.layouts.pg_table import PgGallery, index_settings
from fastfill.components.gallery.layouts.qdrant_collection import QdrantGallery, qdrant_settings
from fastfill.components.gallery.layouts.table import TableGallery
from fastfill.components.gallery.store import ObjectMissing, Store
from fastfill.components.platform.config import GalleryConfig

LAYOUTS: dict[str, type[Gallery]] = {PARTS: PartsGallery, LANCE: TableGallery, PGVECTOR: PgGallery, MILVUS: MilvusGallery,
                                     QDRANT: QdrantGallery}


def gallery_at(store: Store) -> Gallery:
    """The gallery in ``store``, as its manifest says it is kept (a manifest without ``layout``
    is the parts layout's); a GalleryError when there is none."""
    try:
        manifest = store.get_json(MANIFEST)
    except ObjectMissing:
        raise GalleryError(f"no gallery at {store.uri}: {MANIFEST} is missing; run `fastfill gallery ingest --store "
                           "...` (or `adopt`) first") from None
    manifest = check_manifest(manifest, store.describe(MANIFEST))
    layout = manifest.get("layout", PARTS)
    if layout not in LAYOUTS:
        raise GalleryError(f"{store.describe(MANIFEST)} says layout {layout!r}; this version reads "
                           f"{', '.join(LAYOUTS)}. Upgrade fastfill")
    return LAYOUTS[layout](store, manifest)


# the index layouts' settings: the gallery section's part that names them, and what makes the
# manifest's ``index`` of a new gallery from it
BOUND = {LANCE: ("lance", lance_settings), PGVECTOR: ("pgvector", index_settings), MILVUS: ("milvus", milvus_settings),
         QDRANT: ("qdrant", qdrant_settings)}


def layout_of(name: str, gallery_config=None):
    """What writes a new gallery in the layout ``name`` (gallery.layout): its class, or for an
    index layout (lance, pgvector, milvus, qdrant) one bound to ``gallery_config``'s settings (gallery.lance,
    gallery.pgvector, gallery.milvus, gallery.qdrant; the defaults when None). Either has ``layout`` and
    ``writer(store, model, part_size)``."""
    if name not in LAYOUTS:
        raise GalleryError(f"gallery.layout {name!r} is not a layout; use one of {', '.join(LAYOUTS)}")
    if name in BOUND:
        return BoundLayout(name, gallery_config)
    return LAYOUTS[name]


class BoundLayout:
    """An index layout bound to its settings, for writing a new gallery."""

    def __init__(self, name: str, gallery_config=None):
        self.layout, self.config = name, gallery_config or GalleryConfig()

    def writer(self, store: Store, model, part_size: int):
        section, settings_of = BOUND[self.layout]
        settings = settings_of(getattr(self.config, section), self.config.distance, store.uri)
        return LAYOUTS[self.layout].writer(store, model, part_size, settings)
