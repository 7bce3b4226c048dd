"""Galleries into a Lance table: today's parts layout converted, a manifest of items adopted where
they are, images ingested. The table: components/gallery/layouts/lance_table.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from components.gallery.layouts.catalog import GalleryError
from components.gallery.layouts.lance_format import TableCorrupt
from components.gallery.layouts.lance_table import LanceGallery
from components.platform.registry import ModelRef


def convert(source_uri: str | Path, target_uri: str | Path | None = None) -> dict:
    """Today's layout (``gallery.json``, items and features parts) at ``source_uri`` as a Lance
    table at ``target_uri`` (default: the same store, ``<uri>/gallery.lance`` beside the parts).
    Refused during an upgrade. The table is read back and compared with the source before it
    counts: features bit for bit, ids and labels equal."""
    from components.gallery.layouts.catalog import Gallery
    from components.gallery.store import open_store

    gallery = Gallery(open_store(source_uri))
    if not gallery.exists():
        raise GalleryError(f"{source_uri}: no gallery (no gallery.json) to convert")
    manifest = gallery.manifest(refresh=True)
    if manifest.get("upgrade"):
        raise GalleryError(f"{source_uri}: upgrade {manifest['upgrade']} is in progress; finish it or abort it "
                           "(`fastfill upgrade abort`) before converting")
    model = gallery.model
    items = gallery.items()
    features = gallery.all_features(model)
    pixels = None
    if not gallery.adopted:
        pixels = np.concatenate([gallery.images(part) for part in range(gallery.num_parts)])
    table = LanceGallery.create(target_uri or source_uri, items, features, model, pixels=pixels,
                                image_shape=manifest.get("image_shape"))
    back = table.features()
    if not np.array_equal(back, features):
        raise TableCorrupt(f"{table.uri}: the features read back differ from {source_uri}'s; the table is not usable")
    read = table.items(["id", "label"] if "label" in items.column_names else ["id"])
    if read.column("id").to_pylist() != items.column("id").to_pylist():
        raise TableCorrupt(f"{table.uri}: the item ids read back differ from {source_uri}'s")
    return {"table": table.uri, "items": len(features), "model": model.to_dict(), "dim": int(features.shape[1]),
            "images": "in the table (pixels)" if pixels is not None else "by URI (image column)",
            "version": table.dataset().version, "tag": table.serving_tags()[-1][1]}


def adopt(uri: str | Path, items, model: ModelRef, image_shape, *, root: str | None = None, features=None,
          embed_part=None, part_size: int = 1000, on_part=None, registry: str | None = None) -> dict:
    """A gallery adopted where it is, as a Lance table at ``uri``: the manifest's items (``read_manifest``:
    id, uri, optional label, group, weight; the URIs become the ``image`` column) and ``model``'s
    features, from ``features`` (row blocks in the manifest's order) or ``embed_part(uris)`` part by
    part. The image root and shape and the registry are in the table's metadata."""
    from components.gallery.layouts.catalog import check_features

    if (features is None) == (embed_part is None):
        raise GalleryError("adopt needs either the current features or a model to embed the images")
    n = items.num_rows
    uris = items.column("uri").to_pylist()
    if features is not None:
        blocks = [check_features(block, model.dim, "adopted features") for block in features]
        vectors = np.concatenate(blocks) if blocks else np.empty((0, model.dim or 0), dtype=np.float32)
        if len(vectors) != n:
            raise GalleryError(f"{len(vectors)} feature rows for the manifest's {n} items; give one row per item, "
                               "in its order")
    else:
        parts = -(-n // part_size)
        blocks = []
        for part in range(parts):
            start, stop = part * part_size, min((part + 1) * part_size, n)
            blocks.append(check_features(embed_part(uris[start:stop]), model.dim, f"embedded features of part {part}"))
            if on_part is not None:
                on_part(part + 1, parts)
        vectors = np.concatenate(blocks)
    names = ["image" if name == "uri" else name for name in items.column_names]
    metadata = {"fastfill.image_root": root or "", "fastfill.registry": registry or ""}
    table = LanceGallery.create(uri, items.rename_columns(names), vectors, model, image_shape=image_shape,
                                metadata=metadata)
    return {"num_items": n, "model": ModelRef(model.name, model.version, int(vectors.shape[1])).to_dict(),
            "has_labels": "label" in items.column_names, "table": table.uri, "layout": "lance"}


def ingest(uri: str | Path, images: np.ndarray, features: np.ndarray, model: ModelRef, *,
           labels: np.ndarray | None = None, groups: np.ndarray | None = None, ids: np.ndarray | None = None,
           registry: str | None = None) -> dict:
    """Images with their labels, groups and ids and ``model``'s features as a new Lance table at
    ``uri``: the images in the ``pixels`` column (what a backfill re-embeds); ids 0..N-1 by default.
    The same checks as the parts layout's ingest."""
    import pyarrow as pa

    from components.gallery.layouts.catalog import check_ingest

    images, ids = check_ingest(images, labels, groups, ids)
    n = len(images)
    columns = {"id": pa.array(ids)}
    if labels is not None:
        columns["label"] = pa.array(np.asarray(labels, dtype=np.int64))
    if groups is not None:
        columns["group"] = pa.array([str(g) for g in groups])
    table = LanceGallery.create(uri, pa.table(columns), features, model, pixels=images,
                                metadata={"fastfill.registry": registry or ""})
    return {"num_items": n, "model": table.model().to_dict(), "has_labels": labels is not None, "table": table.uri,
            "layout": "lance"}
