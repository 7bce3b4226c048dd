"""A gallery adopted where it is: its images stay in their bucket or folder, read by URI when a
backfill re-embeds them; the store gets the items table, the current features part by part,
and the manifest (last, so a crashed adopt leaves no gallery).

The manifest file (CSV or Parquet) has one row per item: ``id`` (unique integer), ``uri``
(``s3://bucket/key``, an absolute path, or a path relative to the root), and optionally
``label`` (integer), ``group`` and ``weight`` (a number >= 0: how much queries ask for the item,
what the usage backfill orders rank by; see components.gallery.upgrade.usage). The features come in
the same row order, as ``.npy`` shards (concatenated in the order given) or a list column of a Parquet file; without them,
the model embeds the images (then adopting is an ingest that copies no image).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from fastfill.components.gallery.layouts.catalog import (
    Gallery,
    GalleryError,
    PartsGallery,
    check_empty,
    check_features,
    commit_manifest,
    written_fields,
)
from fastfill.components.gallery.layouts.item_ids import id_array
from fastfill.components.gallery.store import Store
from fastfill.components.platform.registry import ModelRef

REQUIRED, OPTIONAL = ("id", "uri"), ("label", "group", "weight")


def read_manifest(path: Path, shown: str | None = None):
    """The manifest file as a pyarrow table with columns id, uri (and label, group, weight if given);
    a GalleryError naming what is wrong otherwise. ``shown``: how messages name it (the URI
    it was copied from)."""
    import pyarrow as pa

    path = Path(path)
    shown = shown or str(path)
    table = _manifest_file(path, shown)
    missing = [c for c in REQUIRED if c not in table.column_names]
    if missing:
        raise GalleryError(f"--manifest {shown}: no column {', '.join(missing)}; it needs id and uri (and may have "
                           f"label, group and weight), found {', '.join(table.column_names)}")
    if table.num_rows < 2:
        raise GalleryError(f"--manifest {shown}: a gallery needs at least 2 items, found {table.num_rows}")
    columns = {name: _manifest_column(table.column(name), name, shown)
               for name in (*REQUIRED, *OPTIONAL) if name in table.column_names}
    if "weight" in columns:
        weights = columns["weight"].to_numpy()
        bad = ~np.isfinite(weights) | (weights < 0)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise GalleryError(f"--manifest {shown}: column weight must hold numbers >= 0 (how much queries ask for "
                               f"each item); {int(bad.sum())} are not (first: row {row}, {weights[row]})")
    ids = id_array(columns["id"])
    if len(np.unique(ids)) != len(ids):
        raise GalleryError(f"--manifest {shown}: item ids must be unique")
    return pa.table(columns)


def _manifest_file(path: Path, shown: str):
    """The manifest's CSV, TSV or Parquet file as it is, as a pyarrow table."""
    import pyarrow as pa

    if not path.is_file():
        raise GalleryError(f"--manifest {shown}: no such file")
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path)
        if suffix in (".csv", ".tsv"):
            import pyarrow.csv as pcsv

            return pcsv.read_csv(path, parse_options=pcsv.ParseOptions(delimiter="\t" if suffix == ".tsv" else ","),
                                 convert_options=pcsv.ConvertOptions(column_types={"id": pa.string(), "uri": pa.string(),
                                                                                    "group": pa.string()}))
        raise GalleryError(f"--manifest {shown}: give a .csv, .tsv or .parquet file")
    except (pa.ArrowInvalid, OSError) as error:
        raise GalleryError(f"--manifest {shown}: cannot read it: {error}") from None


def _manifest_column(column, name: str, shown: str):
    """One of the manifest's columns with no empty row, as its type: the ids as ``_ids`` makes
    them, labels integers, weights numbers, the rest text."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if column.null_count:
        row = int(np.flatnonzero(pc.is_null(column).to_numpy(zero_copy_only=False))[0])
        raise GalleryError(f"--manifest {shown}: column {name} is empty at row {row}")
    if name == "id":
        return _ids(column, shown)
    kind = pa.int64() if name == "label" else pa.float64() if name == "weight" else pa.string()
    try:
        return column.cast(kind)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        raise GalleryError(f"--manifest {shown}: column {name} must hold "
                           f"{'integers' if kind == pa.int64() else 'numbers' if name == 'weight' else 'text'}, "
                           f"found {column.type}") from None


def _ids(column, path):
    """The manifest's id column as the team has it: integers stay int64; text stays text (SKUs,
    UUIDs, paths), unless every id is written as a plain integer ("00123" is text: its zeros are
    part of the id)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_integer(column.type):
        return column.cast(pa.int64())
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise GalleryError(f"--manifest {path}: column id must hold integers or text, found {column.type}")
    column = pc.utf8_trim_whitespace(column.cast(pa.string()))
    if pc.any(pc.equal(column, "")).as_py():
        row = int(np.flatnonzero(pc.equal(column, "").to_numpy(zero_copy_only=False))[0])
        raise GalleryError(f"--manifest {path}: column id is empty at row {row}")
    if pc.all(pc.match_substring_regex(column, r"^(0|-?[1-9][0-9]{0,17})$")).as_py():
        return column.cast(pa.int64())
    return column


def npy_rows(paths: Sequence[Path]) -> Iterator[np.ndarray]:
    """The rows of ``.npy`` shards in order, one memory-mapped shard at a time."""
    for path in paths:
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as error:
            raise GalleryError(f"--features {path}: not a readable .npy file ({error})") from None
        if array.ndim != 2:
            raise GalleryError(f"--features {path}: expected a 2-D array (items, dimension), got {array.shape}")
        yield from (array[start:start + 65536] for start in range(0, len(array), 65536))


def parquet_rows(path: Path, column: str) -> Iterator[np.ndarray]:
    """The rows of a list column of a Parquet file (one list of floats per item), batch by batch."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    reader = pq.ParquetFile(path)
    if column not in reader.schema_arrow.names:
        raise GalleryError(f"--features {path}: no column {column!r}; found {', '.join(reader.schema_arrow.names)} "
                           "(name it with --features-column)")
    for batch in reader.iter_batches(columns=[column], batch_size=65536):
        values = batch.column(0)
        if not (pa.types.is_list(values.type) or pa.types.is_fixed_size_list(values.type)
                or pa.types.is_large_list(values.type)):
            raise GalleryError(f"--features {path}: column {column!r} must hold one list of numbers per item, "
                               f"found {values.type}")
        lengths = set(values.value_lengths().to_numpy(zero_copy_only=False).tolist())
        if len(lengths) != 1:
            raise GalleryError(f"--features {path}: column {column!r} holds lists of different lengths "
                               f"{sorted(lengths)[:5]}")
        yield values.flatten().to_numpy(zero_copy_only=False).reshape(len(values), lengths.pop())


def _take(rows: Iterator[np.ndarray], count: int, buffer: list[np.ndarray]) -> np.ndarray | None:
    """The next ``count`` rows of ``rows`` (None if fewer remain); ``buffer`` keeps the rest."""
    have = sum(len(b) for b in buffer)
    while have < count:
        block = next(rows, None)
        if block is None:
            return None
        buffer.append(np.asarray(block))
        have += len(block)
    joined = np.concatenate(buffer) if len(buffer) > 1 else buffer[0]
    buffer[:] = [joined[count:]] if len(joined) > count else []
    return joined[:count]


def adopt(store: Store, table, model: ModelRef, image_shape: Sequence[int], *, root: str | None = None,
          features: Iterator[np.ndarray] | None = None,
          embed_part: Callable[[list[str]], np.ndarray] | None = None, part_size: int = 1000,
          on_part: Callable[[int, int], None] | None = None, registry: str | None = None,
          layout: type[Gallery] | None = None) -> dict:
    """Write the gallery of ``table`` (``read_manifest``): items and ``model``'s features part by
    part, from ``features`` (rows in table order) or ``embed_part(uris)``, in ``layout`` (a
    Gallery class; default the parts layout); the manifest last."""
    import pyarrow as pa

    check_empty(store, "adopt")
    if (features is None) == (embed_part is None):
        raise GalleryError("adopt needs either the current features or a model to embed the images")
    if part_size < 1:
        raise GalleryError(f"part_size must be >= 1, got {part_size}")
    if len(image_shape) != 3 or min(image_shape) < 1:
        raise GalleryError(f"image shape must be (channels, height, width), got {tuple(image_shape)}")
    n = table.num_rows
    num_parts = -(-n // part_size)
    layout = layout or PartsGallery
    writer = layout.writer(store, model, part_size)
    buffer: list[np.ndarray] = []
    for part in range(num_parts):
        start, stop = part * part_size, min((part + 1) * part_size, n)
        items = table.slice(start, stop - start)
        if features is not None:
            block = _take(features, stop - start, buffer)
            if block is None:
                raise GalleryError(f"the features end before item {start}: fewer feature rows than the manifest's "
                                   f"{n} items; give them in the manifest's row order")
            what = f"features of items {start}..{stop - 1}"
        else:
            assert embed_part is not None  # exactly one of the two is given (checked above)
            block, what = embed_part(items.column("uri").to_pylist()), f"embedded features of part {part}"
        block = check_features(block, model.dim, what)
        columns = {
            "id": items.column("id"),
            "image": items.column("uri"),
            "label": items.column("label") if "label" in items.column_names else pa.nulls(len(items), pa.int64()),
            "group": items.column("group") if "group" in items.column_names else pa.nulls(len(items), pa.string()),
            **({"weight": items.column("weight")} if "weight" in items.column_names else {}),  # the usage orders'
        }
        writer.write(start, pa.table(columns), block)
        if on_part is not None:
            on_part(part + 1, num_parts)
    if features is not None and (buffer or next(features, None) is not None):
        raise GalleryError(f"more feature rows than the manifest's {n} items; give one row per item, in its order")
    writer.close()
    return commit_manifest(store, model, num_items=n, part_size=part_size, image_shape=image_shape,
                           has_labels="label" in table.column_names, has_groups="group" in table.column_names,
                           by="adopt", images={"source": "uri", "root": root}, registry=registry,
                           layout=layout.layout, extra=written_fields(writer))
