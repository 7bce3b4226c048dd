"""The gallery as a Lance table (``layout: lance``): the items, their images and every model's
features in one dataset, ``<store>/gallery.lance``, that pyarrow, DuckDB, Polars and LanceDB read.
Everything else is the parts layout's, as objects beside it in the same store: the manifest
(``gallery.json``, the authority on which model serves), the upgrade lock, and each upgrade's
plan, chunks and records (``components.gallery.upgrade.planning``). So an upgrade runs the same
flow on both layouts, and a chunk commit writes the same one object.

One row per item, in position order (rows are only ever appended in that order, and columns
added, so row ``i`` is position ``i``)::

    position                     int64      the item's number, 0..N-1
    id                                      the team's item id (text or integers, as adopted)
    image                        string     the image's key or URI (adopted galleries)
    pixels, pixels_digest        binary     the uint8 image, C*H*W bytes (ingested galleries), and its check
    label, group, weight                    as in the items table
    features_<name>-v<version>   float32[d] one model's features; its field metadata
                                            ``fastfill.model`` names the model
    features_<...>_digest        uint64     a check of (position, features), verified on every read

An upgrade's finish adds the new model's column (one Lance commit that writes that column's data
files only, never the pixels again), then the manifest names the new model; the schema metadata
``fastfill.serving`` names the serving column for other tools. A rollback switches the manifest
back while the old column is kept; ``fastfill gallery gc`` drops the other models' columns and
the table's old versions.

Lance stores no content hash, and a flipped byte in a float payload reads back as another number
without an error, so the pixels and every vector column carry a digest per row (``digests``); a
mismatch, or a data file Lance cannot read, raises ``DamagedObject`` naming the data file and the
item. The ids and labels rely on Lance's own format checks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import numpy as np
import pyarrow as pa

from fastfill.components.gallery.layouts.catalog import (
    EMBEDDED,
    LANCE,
    MAPPED,
    GalleryError,
    Serving,
    check_features,
    dim_of,
)
from fastfill.components.gallery.layouts.item_ids import id_array
from fastfill.components.gallery.layouts.lance_serving import DEFAULTS as SERVING_DEFAULTS
from fastfill.components.gallery.layouts.lance_serving import TABLE, ServingTable, storage_options, table_uri
from fastfill.components.gallery.layouts.ownership import OWNER_KEY, STORE_KEY, new_owner
from fastfill.components.gallery.layouts.served import ServedGallery
from fastfill.components.gallery.store import DamagedObject, ObjectMissing, Store
from fastfill.components.gallery.upgrade.stored import Plan, done_chunks, iter_mixed_parts, order_of
from fastfill.components.platform.registry import ModelRef

MODEL_KEY = "fastfill.model"
SERVING_KEY = "fastfill.serving"
FORMAT_KEY = "fastfill.format"
FORMAT = "2"
ITEM_COLUMNS = ("id", "image", "label", "group", "weight")
ROWS_PER_WRITE = 65536


_MIX = np.random.default_rng(20261127).integers(0, 2**32, size=1 << 18, dtype=np.uint64).astype(np.uint32) | np.uint32(1)
_BLOCK = 8192  # rows per pass: the products stay in the cache


def digests(positions: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """A 64-bit check of each row (features, or an image's pixels): the row's bytes as 32-bit
    words, each times an odd constant of its place modulo 2^32, summed, and the position mixed
    in. A change of any one word always changes it (an odd factor is invertible modulo 2^32,
    and the sum of at most 2^18 such products cannot wrap); it detects damage, not tampering.
    Vectorised, block by block: about 20 ms for 100,000 rows of 128 floats."""
    data = np.ascontiguousarray(rows).reshape(len(rows), -1)
    if data.dtype != np.float32:
        data = data.view(np.uint8)
        if data.shape[1] % 4:
            data = np.pad(data, ((0, 0), (0, 4 - data.shape[1] % 4)))
    words = np.ascontiguousarray(data).view("<u4")
    if words.shape[1] > len(_MIX):
        raise GalleryError(f"rows of {4 * words.shape[1]} bytes are longer than the digest supports ({4 * len(_MIX)})")
    mix = _MIX[:words.shape[1]]
    out = np.empty(len(words), dtype=np.uint64)
    for start in range(0, len(words), _BLOCK):
        out[start:start + _BLOCK] = (words[start:start + _BLOCK] * mix).sum(axis=1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return out ^ (np.asarray(positions, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))


_SESSION = None


def _session():
    """One Lance session per process: the tables' file metadata cached once (256 MB at most),
    not again by every gallery object that opens the table (a chunk's task opens it)."""
    global _SESSION
    if _SESSION is None:
        import lance

        _SESSION = lance.Session(metadata_cache_size_bytes=256 << 20, index_cache_size_bytes=64 << 20)
    return _SESSION


def column_name(model: ModelRef) -> str:
    """The features column of ``model``: ``features_<name>-v<version>``, letters, digits, ``-``,
    ``_`` and ``.`` kept (the field's metadata names the model exactly)."""
    return "features_" + re.sub(r"[^A-Za-z0-9_.-]", "_", model.key)


def _vector_fields(model: ModelRef, dim: int) -> list[pa.Field]:
    name = column_name(model)
    meta = {MODEL_KEY: json.dumps(ModelRef(model.name, model.version, dim).to_dict(), sort_keys=True)}
    return [pa.field(name, pa.list_(pa.float32(), dim), metadata=meta), pa.field(f"{name}_digest", pa.uint64())]


def _vector_arrays(positions: np.ndarray, vectors: np.ndarray) -> list[pa.Array]:
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    values = pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1), pa.float32()), vectors.shape[1])
    return [values, pa.array(digests(positions, vectors), pa.uint64())]


def _one_line(error: object) -> str:
    return " ".join(str(error).split())[:300]


class TableGallery(ServedGallery[ServingTable, ModelRef]):
    """The gallery of one store kept as a Lance table (see the module's docstring); its readers
    search ``<store>/serving.lance`` (lance_serving.py), which holds one model's space whole."""

    layout = LANCE

    def __init__(self, store: Store, manifest: dict | None = None):
        super().__init__(store, manifest)
        self.table_uri = table_uri(store.uri)
        self._dataset: Any = None  # lance's dataset, opened when first read

    def _open_index(self, settings: dict) -> ServingTable:
        """The serving table, with the manifest's settings (a gallery made before it: the defaults)."""
        return ServingTable(self.store.uri, settings)

    # ---- the dataset

    def dataset(self, refresh: bool = False):
        """The table's newest version (opened once per gallery object; ``refresh`` reopens it)."""
        import lance

        if self._dataset is None or refresh:
            try:
                self._dataset = lance.dataset(self.table_uri, storage_options=storage_options(self.store.uri),
                                              session=_session())
            except (ValueError, OSError) as error:
                if "not found" in str(error).lower() or "does not exist" in str(error).lower():
                    raise ObjectMissing(f"{self.table_uri}: the gallery's table is missing, though {self.store.uri}'s "
                                        "manifest says layout lance; restore it, or re-create the gallery (`fastfill "
                                        "gallery ingest` / `adopt` / `convert`)") from None
                raise DamagedObject(f"{self.table_uri}: cannot open the gallery's table: {_one_line(error)}") from None
        return self._dataset

    def manifest(self, refresh: bool = False) -> dict:
        if refresh:
            self._dataset = None
        return super().manifest(refresh)

    def write_manifest(self, manifest: dict) -> None:
        """The serving table made to serve what ``manifest`` says, then the manifest
        (``ServedGallery``'s), then the table's ``fastfill.serving`` (for other tools) when the
        serving model changed."""
        super().write_manifest(manifest)
        serving = ModelRef.from_dict(manifest["model"])
        dataset = self.dataset(refresh=True)
        wanted = self._column_of(serving, dataset)
        if wanted is not None and (dataset.schema.metadata or {}).get(SERVING_KEY.encode(), b"").decode() != wanted:
            dataset.update_schema_metadata({SERVING_KEY: wanted})
            self._dataset = None

    def _column_of(self, model: ModelRef, dataset=None) -> str | None:
        """The column that holds ``model``'s features (by its field metadata), or None."""
        dataset = dataset if dataset is not None else self.dataset()
        for field in dataset.schema:
            meta = field.metadata or {}
            if MODEL_KEY.encode() in meta and ModelRef.from_dict(json.loads(meta[MODEL_KEY.encode()])).same_version(model):
                return field.name
        return None

    def _take(self, rows: np.ndarray, columns: list[str]) -> pa.Table:
        """The table's rows ``rows`` (positions, ascending), checked to be those positions; a data
        file Lance cannot read is named. A run of consecutive rows is one ranged scan."""
        dataset = self.dataset()
        try:
            if len(rows) and int(rows[-1]) - int(rows[0]) == len(rows) - 1:
                data = dataset.to_table(columns=["position", *columns], offset=int(rows[0]), limit=len(rows))
            else:
                data = dataset.take(pa.array(rows, pa.uint64()), columns=["position", *columns])
        except (OSError, ValueError) as error:  # pyarrow.ArrowInvalid is a ValueError
            raise self._unreadable(dataset, ["position", *columns], error) from None
        found = data.column("position").to_numpy()
        if len(found) != len(rows) or not np.array_equal(found, rows):
            raise DamagedObject(f"{self.table_uri}: rows {int(rows[0]) if len(rows) else 0}.. hold other positions than "
                                f"their own ({len(found)} rows read for {len(rows)}); the table was rewritten by "
                                "another tool. Re-create it with `fastfill gallery convert`")
        return data

    def _unreadable(self, dataset, columns: list[str], error: Exception) -> DamagedObject:
        """Which data file could not be read: each fragment read alone, the first that fails named."""
        for fragment in dataset.get_fragments():
            try:
                fragment.to_table(columns=columns)
            except Exception:  # noqa: BLE001 - Lance raises several kinds; any failure names the file
                files = ", ".join(f"{self.table_uri}/data/{f.path}" for f in fragment.data_files())
                return DamagedObject(f"{self.table_uri}: data file {files} (fragment {fragment.fragment_id}) cannot be "
                                     f"read ({_one_line(error)}); it is truncated or damaged. Restore it from a copy")
        return DamagedObject(f"{self.table_uri}: the table cannot be read: {_one_line(error)}")

    def _file_of(self, position: int) -> str:
        """The data files of the fragment that holds the row at ``position``."""
        row = 0
        for fragment in self.dataset().get_fragments():
            count = fragment.count_rows()
            if position < row + count:
                return ", ".join(f"{self.table_uri}/data/{f.path}" for f in fragment.data_files())
            row += count
        return "?"

    # ---- items and images

    def items_part(self, part: int) -> pa.Table:
        start, stop = self.part_bounds(part)
        return self._items(np.arange(start, stop, dtype=np.int64))

    def _items(self, rows: np.ndarray) -> pa.Table:
        names = self.dataset().schema.names
        data = self._take(rows, [c for c in ITEM_COLUMNS if c in names])
        if "image" not in names:  # an ingested gallery: its images are the pixels column
            data = data.append_column("image", pa.array([f"{TABLE}#{p}" for p in rows.tolist()], pa.string()))
        return data.drop_columns(["position"])

    def items(self) -> pa.Table:
        return self._items(np.arange(self.num_items, dtype=np.int64))

    def images(self, part: int) -> np.ndarray:
        if "pixels" not in self.dataset().schema.names:
            raise GalleryError(f"{self.table_uri} keeps no images (an adopted gallery: they are read by URI)")
        start, stop = self.part_bounds(part)
        shape = tuple(self.manifest()["image_shape"])
        rows = np.arange(start, stop, dtype=np.int64)
        data = self._take(rows, ["pixels", "pixels_digest"])
        pixels = data.column("pixels").combine_chunks()
        if pixels.type.byte_width != int(np.prod(shape)):
            raise DamagedObject(f"{self.table_uri}: pixels of {pixels.type.byte_width} bytes per item, but the manifest "
                                f"says images of shape {shape}")
        images = np.frombuffer(pixels.buffers()[1], dtype=np.uint8, count=len(pixels) * pixels.type.byte_width,
                               offset=pixels.offset * pixels.type.byte_width).reshape(len(pixels), *shape).copy()
        self._verify(rows, images, data.column("pixels_digest").to_numpy(), "pixels")
        return images

    def _verify(self, rows: np.ndarray, values: np.ndarray, stored: np.ndarray, column: str) -> None:
        """Each row against its stored digest; a mismatch names the first item and its data files."""
        bad = np.flatnonzero(stored != digests(rows, values))
        if len(bad):
            position = int(rows[bad[0]])
            raise DamagedObject(f"{self.table_uri}: {len(bad)} rows of {column!r} do not match their digest (first: "
                                f"position {position}, in data files {self._file_of(position)}); the file was "
                                "altered or damaged. Restore it from a copy")

    # ---- features

    def features(self, model: ModelRef, part: int) -> np.ndarray:
        start, stop = self.part_bounds(part)
        return self._vectors(model, np.arange(start, stop, dtype=np.int64))

    def all_features(self, model: ModelRef) -> np.ndarray:
        return self._vectors(model, np.arange(self.num_items, dtype=np.int64))

    def features_at(self, model: ModelRef, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        rows, back = np.unique(positions, return_inverse=True)
        return self._vectors(model, rows)[back] if len(rows) else np.zeros((0, model.dim or 0), np.float32)

    def _vectors(self, model: ModelRef, rows: np.ndarray) -> np.ndarray:
        name = self._column_of(model)
        if name is None:  # added since this object opened the table (a finish by another process)?
            name = self._column_of(model, self.dataset(refresh=True))
        if name is None:
            raise ObjectMissing(f"{self.table_uri} holds no features of {model.uri} (its columns: "
                                f"{', '.join(self.dataset().schema.names)})")
        data = self._take(rows, [name, f"{name}_digest"])
        column, stored = data.column(name), data.column(f"{name}_digest").to_numpy()
        dim = column.type.list_size
        vectors = np.empty((len(rows), dim), dtype=np.float32)
        at, finite = 0, True
        for chunk in column.chunks:  # one copy into the array returned, checked block by block while in cache
            block = chunk.flatten().to_numpy(zero_copy_only=False).reshape(-1, dim)
            span = slice(at, at + len(block))
            vectors[span] = block
            self._verify(rows[span], block, stored[span], name)
            finite = finite and bool(np.isfinite(block).all())
            at += len(block)
        if not finite or (model.dim and model.dim != dim):  # the error, naming what is wrong
            return check_features(vectors, model.dim, f"{self.table_uri} column {name}")
        return vectors

    def write_features(self, model: ModelRef, parts: Iterable[tuple[int, np.ndarray]]) -> None:
        """``model``'s column, added in one commit that writes only its data files, from ``parts``
        in part order; a column that is already there (a finish run again after its commit) is
        kept."""
        if self._column_of(model) is not None:
            for _ in parts:  # the caller's generator runs to its end, as on the parts layout
                pass
            return
        schema = pa.schema(_vector_fields(model, dim_of(model)))

        def batches():
            expected = 0
            for part, features in parts:
                start, stop = self.part_bounds(part)
                if start != expected or len(features) != stop - start:
                    raise GalleryError(f"features of part {part} given out of order or short ({len(features)} rows)")
                expected = stop
                yield pa.record_batch(_vector_arrays(np.arange(start, stop), features), schema=schema)

        self.dataset().add_columns(pa.RecordBatchReader.from_batches(schema, batches()))
        self._dataset = None

    def missing_features(self, model: ModelRef) -> list[str]:
        return [] if self._column_of(model) is not None else [f"{self.table_uri} column {column_name(model)}"]

    def collect_features(self) -> int:
        """Drop the columns of every model but the gallery's own, delete the table's old versions
        and the parts layout's objects a convert left; returns how many columns and objects."""
        dataset = self.dataset(refresh=True)
        keep = self._column_of(self.model, dataset)
        drop = [f.name for f in dataset.schema if (f.metadata or {}).get(MODEL_KEY.encode()) and f.name != keep]
        if drop:
            dataset.drop_columns([n for name in drop for n in (name, f"{name}_digest")])
        self.dataset(refresh=True).cleanup_old_versions(older_than=timedelta(0), error_if_tagged_old_versions=False)
        self.index.cleanup()
        self._dataset = None
        leftovers = [key for prefix in ("features/", "items/", "images/") for key in self.store.list(prefix)]
        for key in leftovers:
            self.store.delete(key)
        return len(drop) + len(leftovers)

    def check_sources(self, sequential: bool = False) -> None:
        """The table opens, holds one row per item of the manifest, the gallery's model's
        features (unless ``sequential``) and, for an ingested gallery, the pixels."""
        dataset = self.dataset(refresh=True)
        rows = dataset.count_rows()
        if rows != self.num_items:
            raise GalleryError(f"{self.table_uri} has {rows} rows, but the manifest says {self.num_items} items: the "
                               "table belongs to another gallery. Nothing was written.")
        if not sequential and self._column_of(self.model, dataset) is None:
            raise GalleryError(f"{self.table_uri} holds no features of the gallery's model {self.model.uri}. Nothing "
                               "was written.")
        if not self.adopted and "pixels" not in dataset.schema.names:
            raise GalleryError(f"{self.table_uri} keeps no pixels, and the gallery was ingested. Nothing was written.")

    # ---- serving

    def _target(self, model: ModelRef) -> ModelRef:
        """Every space is written to the one serving table: the target is the model."""
        return model

    def _holds(self, serving: Serving, target: ModelRef, upgrade_id: str | None) -> bool:
        return serving.model == target.uri and serving.upgrade == upgrade_id

    def _prepare_switch(self, plan: Plan, target: ModelRef) -> None:
        self._write_mixed(plan)

    def _point(self, target: ModelRef, model: ModelRef, upgrade_id: str | None) -> None:
        """A finish: the rows are the new model's already, the metadata says so (``retag``);
        another model (an abort, a rejection, a rollback): its space written from the table."""
        serving = self.index.serving()
        if serving is not None and serving.model == model.uri:
            if serving.upgrade != upgrade_id:
                self.index.retag(model, upgrade_id)
        else:
            self._write_model(model)

    def _write_model(self, model: ModelRef) -> None:
        ids = self.ids()

        def parts():
            for part in range(self.num_parts):
                start, stop = self.part_bounds(part)
                yield np.arange(start, stop), self.features(model, part), [EMBEDDED] * (stop - start), \
                    np.full(stop - start, -1)

        self.index.write(model, None, ids, parts())

    def _write_mixed(self, plan: Plan) -> None:
        """The switch: the new model's space as it is now (h(old); the new features of the chunks
        already done, each row with its chunk), written in one commit before the ANN index."""

        chunk_of = np.full(self.num_items, -1, dtype=np.int32)
        done = done_chunks(self.store, plan.upgrade_id)
        if done:
            order = order_of(self.store, plan.upgrade_id)
            for chunk in done:
                start, stop = plan.chunk_bounds(chunk)
                chunk_of[order[start:stop]] = chunk

        def parts():
            for part, features, backfilled in iter_mixed_parts(self, plan):
                start, stop = self.part_bounds(part)
                yield np.arange(start, stop), features, [EMBEDDED if b else MAPPED for b in backfilled], \
                    chunk_of[start:stop]

        self.index.write(plan.new, plan.upgrade_id, self.ids(), parts())

    def serve_chunk(self, plan, chunk: int, positions: np.ndarray, features: np.ndarray, embedded: np.ndarray) -> None:
        """A chunk's rows upserted into the serving table in one commit, once."""
        positions = np.asarray(positions, dtype=np.int64)
        self.index.serve_chunk(plan.upgrade_id, chunk, positions, self.ids()[positions], features,
                               [EMBEDDED if e else MAPPED for e in embedded])

    @staticmethod
    def writer(store: Store, model: ModelRef, part_size: int, settings: dict | None = None) -> TableWriter:
        return TableWriter(store, model, settings)


class TableWriter:
    """Writes a new table row block by row block (ingest, adopt, convert): the items, their
    pixels or URIs and ``model``'s features, appended in position order. A table left by a
    killed write (no manifest names it) is replaced by the next one."""

    def __init__(self, store: Store, model: ModelRef, settings: dict | None = None):
        # a new gallery: its id marks its serving table (lance_serving.py)
        self.store, self.settings = store, {OWNER_KEY: new_owner(), STORE_KEY: store.uri, **(settings or {})}
        self.uri = table_uri(store.uri)
        self.options = storage_options(store.uri)
        self.model = model
        self.schema: pa.Schema | None = None
        self.pending: list[pa.RecordBatch] = []
        self.rows = 0
        self.written = False

    def write(self, start: int, items: pa.Table, features: np.ndarray, images: np.ndarray | None = None) -> None:
        if self.schema is None:  # before any write: the serving table's path is free, or this gallery's
            ServingTable(self.store.uri, self.settings, reclaim=True).check_free()
        positions = np.arange(start, start + len(features), dtype=np.int64)
        columns = {"position": pa.array(positions)}
        for name in ITEM_COLUMNS:
            if name in items.column_names and not (name == "image" and images is not None):
                columns[name] = items.column(name).combine_chunks()
        fields = [pa.field(name, array.type) for name, array in columns.items()]
        arrays = list(columns.values())
        if images is not None:
            images = np.ascontiguousarray(images, dtype=np.uint8)
            size = int(np.prod(images.shape[1:]))
            fields += [pa.field("pixels", pa.binary(size)), pa.field("pixels_digest", pa.uint64())]
            arrays += [pa.FixedSizeBinaryArray.from_buffers(pa.binary(size), len(images),
                                                            [None, pa.py_buffer(images.reshape(-1))]),
                       pa.array(digests(positions, images), pa.uint64())]
        fields += _vector_fields(self.model, features.shape[1])
        arrays += _vector_arrays(positions, features)
        batch = pa.record_batch(arrays, schema=pa.schema(fields))
        if self.schema is None:
            self.schema = batch.schema.with_metadata({FORMAT_KEY: FORMAT, SERVING_KEY: column_name(self.model)})
        elif not batch.schema.equals(self.schema, check_metadata=False):
            raise GalleryError(f"rows {start}.. do not have the columns of the rows before them: {batch.schema.names}")
        self.pending.append(batch.replace_schema_metadata(self.schema.metadata))
        self.rows += len(features)
        if sum(b.num_rows for b in self.pending) >= ROWS_PER_WRITE:
            self._flush()

    def _flush(self) -> None:
        import lance

        if not self.pending:
            return
        data = pa.Table.from_batches(self.pending, schema=self.schema)
        mode = "append" if self.written else "create"
        if not self.written:  # a table that a killed write left (no manifest names it) is replaced
            try:
                lance.dataset(self.uri, storage_options=self.options)
                mode = "overwrite"
            except (ValueError, OSError):
                pass
        lance.write_dataset(data, self.uri, mode=mode, storage_options=self.options, max_rows_per_file=1 << 20)
        self.written = True
        self.pending = []

    def close(self) -> None:
        """The rows not yet written, appended; then the table is whole (its manifest comes next)."""
        self._flush()
        if not self.written:
            raise GalleryError("a gallery needs items; none were written")
        self._serve()

    def _serve(self) -> None:
        """The serving table, the model's features with the items' ids, read back from the table
        just written (its readers search it from the start)."""
        import lance

        dataset = lance.dataset(self.uri, storage_options=self.options)
        name = column_name(self.model)
        dim = dataset.schema.field(name).type.list_size
        model = ModelRef(self.model.name, self.model.version, dim)

        def parts():
            for batch in dataset.to_batches(columns=["position", "id", name], batch_size=ROWS_PER_WRITE):
                positions = batch.column("position").to_numpy()
                vectors = batch.column(name).flatten().to_numpy(zero_copy_only=False).reshape(-1, dim)
                yield positions, vectors, [EMBEDDED] * len(positions), np.full(len(positions), -1)

        ids = id_array(dataset.to_table(columns=["id"]).column("id"))
        ServingTable(self.store.uri, self.settings, reclaim=True).write(model, None, ids, parts())

    def manifest_fields(self) -> dict:
        return {"index": {**SERVING_DEFAULTS, **self.settings}}
