"""The gallery as a Lance dataset: one table that pyarrow, DuckDB, Polars and LanceDB read.

Under a store URI (a local folder or ``s3://bucket/prefix``) the table is ``<uri>/gallery.lance``,
which is what ``lancedb.connect(<uri>).open_table("gallery")`` opens. One row per item:

    position          int64     the item's number, 0..N-1 (the product's numbering; rows move
                                between data files as chunks land, so order by it)
    id                          the user's item id (the items table's type)
    image             string    the image's key or URI (adopted galleries), or null
    pixels            binary    the uint8 image, C*H*W bytes (ingested galleries), or absent
    label, group, weight        optional, as in the items table
    features          fixed_size_list<float32>[d]   the serving model's features
    features_digest   binary(16)                     BLAKE2b of (position, features)

While an upgrade runs, its columns sit beside them (added by ``begin_upgrade``, dropped by
``finish`` or ``abort``):

    mapped, mapped_digest   h(old): the old features through the alignment map
    log_sigma2              the map's predicted uncertainty (null for maps without one)
    rank                    the item's place in the backfill order (0 first)
    new, new_digest         the new model's features, null until the item's chunk is folded in
    new_chunk               int32, the chunk that wrote ``new`` (null before)

and the chunks land in a second table beside it, ``<uri>/gallery_backfill.lance`` (deleted by the
finish or the abort), one append per chunk:

    position, chunk, token (the plan's), commit (an id per append), new, new_digest

Which model a vector column holds is in that column's field metadata (``fastfill.model``), so a
column renamed at the finish carries its model with it; the upgrade's id, new model and plan token
are in the schema metadata. The upgrade's records (plan, lock, decision) stay objects beside the
table.

Why two tables, measured with pylance 14 (docs/lance.md): a ``merge_insert`` by position into the
gallery table is idempotent and concurrent writers of different chunks all succeed, but each one
joins against the whole table (about 80 ms per 2,000-row chunk at 100,000 items on a local disk,
half a second on S3), where an append costs a data file and a manifest (about 15 ms locally). An
append is not idempotent after a lost reply, so each carries a commit id and readers keep one
commit per chunk (the smallest id): a chunk committed twice is read once. Appends never conflict,
so workers commit at once. ``fold`` writes the landed chunks into the gallery table's ``new``
column in one ``merge_insert`` (by the backfill between batches, and by the finish), so a team's
service reading ``gallery.lance`` alone sees them; ``mixed`` and ``fastfill search`` read both.

Lance stores no content hash, and a flipped byte in a float payload reads back as another number
without an error (measured). Every vector column therefore carries a digest per row, checked on
every read of the vectors; a mismatch, or a data file Lance cannot read (truncated, torn),
raises ``TableCorrupt`` naming the data file and the item.

The served state is a tag: ``serving-<n>`` marks each version that began serving a model (the
creation, each finish, each rollback). ``rollback`` restores the version of the serving tag before
the latest, ``collect_garbage`` removes the versions no tag references and older than an age.
"""

from __future__ import annotations

import json
import re
from datetime import timedelta
from pathlib import Path

import numpy as np

from components.gallery.layouts.catalog import GalleryError
from components.gallery.layouts.lance_backfill import UpgradeSteps
from components.gallery.layouts.lance_format import (  # noqa: F401 - table_uri, storage_options, TableCorrupt: the interface
    BACKFILL, FORMAT, FORMAT_KEY, SERVING, TABLE, VECTOR_COLUMNS, TableCorrupt, Upgrade, _as_numpy, _field_model,
    _metadata, _one_line, _vector_and_digest_names, _vector_arrays, _vector_fields, _where, digests, storage_options,
    table_uri, UPGRADE_KEY,
)
from components.platform.registry import ModelRef


class LanceGallery(UpgradeSteps):
    """The gallery table of one store URI."""

    def __init__(self, uri: str | Path):
        self.store_uri = str(uri)
        self.uri = table_uri(uri)
        self.backfill_uri = self.uri.removesuffix(f"{TABLE}.lance") + f"{BACKFILL}.lance"
        self.options = storage_options(self.store_uri)

    # ---- opening

    def exists(self) -> bool:
        try:
            self.dataset()
        except GalleryError:
            return False
        return True

    def dataset(self, version: int | str | None = None):
        import lance

        try:
            return lance.dataset(self.uri, version=version, storage_options=self.options)
        except (ValueError, OSError) as error:
            if "not found" in str(error).lower() or "does not exist" in str(error).lower():
                raise GalleryError(f"{self.uri}: no gallery table here; make one with `fastfill gallery convert` "
                                   "or `fastfill gallery ingest`") from None
            raise GalleryError(f"{self.uri}: cannot open the gallery table: {_one_line(error)}") from None

    # ---- what the table says

    def model(self, dataset=None) -> ModelRef:
        """The serving model: the one whose features the ``features`` column holds."""
        dataset = dataset or self.dataset()
        return _field_model(dataset.schema.field("features"))

    def upgrade(self, dataset=None) -> Upgrade | None:
        dataset = dataset or self.dataset()
        raw = _metadata(dataset.schema).get(UPGRADE_KEY)
        if not raw:
            return None
        data = json.loads(raw)
        return Upgrade(data["id"], ModelRef.from_dict(data["new"]), data.get("token", ""))

    def num_items(self) -> int:
        return self.dataset().count_rows()

    def status(self) -> dict:
        """The table's state for `fastfill gallery info`: items, model, version, serving tags, and
        the upgrade in progress with its landed and folded chunks."""
        dataset = self.dataset()
        upgrade = self.upgrade(dataset)
        result = {"store": self.store_uri, "table": self.uri, "layout": "lance", "items": dataset.count_rows(), "model": self.model(dataset).uri,
                  "version": dataset.version, "serving_tags": {name: version for _, name, version in self.serving_tags(dataset)},
                  "state": "idle", "upgrade": None}
        if upgrade is not None:
            folded = self._folded(dataset)
            landed = folded | set(self._landed(upgrade)[2])
            result.update(state="upgrading", upgrade={"id": upgrade.id, "to": upgrade.new.uri, "chunks_landed": len(landed),
                                                      "chunks_folded": len(folded)})
        return result

    def serving_tags(self, dataset=None) -> list[tuple[int, str, int]]:
        """(n, tag, version) of every ``serving-<n>`` tag, oldest first."""
        dataset = dataset or self.dataset()
        found = []
        for name, info in dataset.tags.list().items():
            match = re.fullmatch(rf"{SERVING}(\d+)", name)
            if match:
                found.append((int(match.group(1)), name, int(info["version"])))
        return sorted(found)

    def _tag_serving(self, dataset) -> str:
        tags = self.serving_tags(dataset)
        name = f"{SERVING}{tags[-1][0] + 1 if tags else 1}"
        dataset.tags.create(name, dataset.version)
        return name

    # ---- writing a gallery

    @classmethod
    def create(cls, uri: str | Path, items, features: np.ndarray, model: ModelRef, *,
               pixels: np.ndarray | None = None, image_shape=None, metadata: dict[str, str] | None = None,
               max_rows_per_file: int = 1 << 20) -> LanceGallery:
        """A new table from an items table (pyarrow: id, and any of image, label, group, weight,
        in position order) and the serving model's features; tagged ``serving-1``. Refused where
        a table exists."""
        import lance
        import pyarrow as pa

        from components.gallery.layouts.catalog import check_features

        table = cls(uri)
        if table.exists():
            raise GalleryError(f"{table.uri} already holds a gallery table; convert into an empty location")
        features = check_features(features, model.dim, "gallery features")
        n = len(features)
        if items.num_rows != n:
            raise GalleryError(f"{items.num_rows} items for {n} feature rows")
        if "id" not in items.column_names:
            raise GalleryError(f"the items need an id column; found {', '.join(items.column_names)}")
        model = ModelRef(model.name, model.version, int(features.shape[1]))
        positions = np.arange(n, dtype=np.int64)
        fields = [pa.field("position", pa.int64())]
        arrays = [pa.array(positions)]
        for name in ("id", "image", "label", "group", "weight"):
            if name in items.column_names:
                fields.append(pa.field(name, items.schema.field(name).type))
                arrays.append(items.column(name).combine_chunks())
        metadata = {**(metadata or {}), FORMAT_KEY: FORMAT}
        if image_shape is not None:
            metadata["fastfill.image_shape"] = json.dumps([int(x) for x in image_shape])
        if pixels is not None:
            pixels = np.ascontiguousarray(pixels, dtype=np.uint8)
            size = int(np.prod(pixels.shape[1:]))
            fields.append(pa.field("pixels", pa.binary(size)))
            arrays.append(pa.FixedSizeBinaryArray.from_buffers(pa.binary(size), n, [None, pa.py_buffer(pixels.reshape(-1))]))
            metadata.setdefault("fastfill.image_shape", json.dumps([int(x) for x in pixels.shape[1:]]))
        fields += _vector_fields("features", features.shape[1], model)
        arrays += _vector_arrays(positions, features)
        data = pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata=metadata))
        dataset = lance.write_dataset(data, table.uri, mode="create", max_rows_per_file=max_rows_per_file,
                                      storage_options=table.options)
        table._tag_serving(dataset)
        return table

    # ---- reading

    def items(self, columns: list[str] | None = None):
        """The items (no vectors) in position order, as a pyarrow table."""
        dataset = self.dataset()
        names = [n for n in dataset.schema.names if n not in _vector_and_digest_names()]
        if columns is not None:
            names = ["position", *[c for c in columns if c != "position"]]
        return self._read(dataset, names).sort_by("position")

    def features(self, column: str = "features", dataset=None) -> np.ndarray:
        """Every item's vectors of ``column`` in position order, digests checked; rows that have
        none yet (``new`` before its chunk) are NaN."""
        dataset = dataset or self.dataset()
        if column not in dataset.schema.names:
            raise GalleryError(f"{self.uri} has no column {column!r} (columns: {', '.join(dataset.schema.names)})")
        data = self._read(dataset, ["position", "id", column, f"{column}_digest"], with_address=True).sort_by("position")
        dim = dataset.schema.field(column).type.list_size
        vectors = _as_numpy(data.column(column), dim)
        self._check(dataset, data, column, vectors)
        return vectors

    def features_at(self, positions: np.ndarray, column: str = "features", dataset=None) -> np.ndarray:
        """The vectors of ``column`` of the items at ``positions``, in that order, digests checked:
        only their rows are read."""
        dataset = dataset or self.dataset()
        if column not in dataset.schema.names:
            raise GalleryError(f"{self.uri} has no column {column!r} (columns: {', '.join(dataset.schema.names)})")
        positions = np.asarray(positions, dtype=np.int64)
        dim = dataset.schema.field(column).type.list_size
        if not len(positions):
            return np.zeros((0, dim), dtype=np.float32)
        wanted = ", ".join(map(str, np.unique(positions).tolist()))
        data = self._read(dataset, ["position", "id", column, f"{column}_digest"], filter=f"position IN ({wanted})",
                          with_address=True)
        vectors = _as_numpy(data.column(column), dim)
        self._check(dataset, data, column, vectors)
        where = {p: row for row, p in enumerate(data.column("position").to_pylist())}
        missing = [p for p in positions.tolist() if p not in where]
        if missing:
            raise GalleryError(f"{self.uri} has no items at positions {missing[:5]} (it holds {self.num_items()})")
        return vectors[[where[p] for p in positions.tolist()]]

    def mixed(self) -> tuple[np.ndarray, np.ndarray, ModelRef]:
        """What queries of the serving (or, during an upgrade, the new) model search: the new
        features where an item's chunk landed (folded into the table or still in the backfill
        table), h(old) elsewhere, in position order; with ``backfilled`` (bool per item) and the
        model whose space the vectors are in."""
        dataset = self.dataset()
        upgrade = self.upgrade(dataset)
        if upgrade is None:
            vectors = self.features("features", dataset)
            return vectors, np.ones(len(vectors), dtype=bool), self.model(dataset)
        names = dataset.schema.names
        if "new" not in names or "features" not in names:  # a finish between its steps: the new features are whole
            column = "new" if "new" in names else "features"
            if column == "new" or _field_model(dataset.schema.field("features")).same_version(upgrade.new):
                vectors = self.features(column, dataset)
                return vectors, np.ones(len(vectors), dtype=bool), upgrade.new
        vectors = self.features("mapped", dataset)
        backfilled = np.zeros(len(vectors), dtype=bool)
        if "new" in dataset.schema.names:
            new = self.features("new", dataset)
            backfilled = ~np.isnan(new[:, 0])
            vectors[backfilled] = new[backfilled]
        positions, rows, _ = self._landed(upgrade, exclude=self._folded(dataset))
        vectors[positions] = rows
        backfilled[positions] = True
        return vectors, backfilled, upgrade.new

    def landed_chunks(self) -> set[int]:
        """The chunks whose new features are committed (folded into the table or not yet)."""
        dataset = self.dataset()
        upgrade = self.upgrade(dataset)
        if upgrade is None:
            return set()
        return self._folded(dataset) | set(self._landed(upgrade)[2])

    def verify(self) -> dict:
        """Every vector column read whole and its digests checked, the backfill table's too:
        {column: rows checked}."""
        dataset = self.dataset()
        checked = {column: int(np.isfinite(self.features(column, dataset)[:, 0]).sum())
                   for column in VECTOR_COLUMNS if column in dataset.schema.names}
        upgrade = self.upgrade(dataset)
        if upgrade is not None:
            checked["backfill"] = len(self._landed(upgrade)[0])
        return checked

    def _read(self, dataset, columns: list[str], *, filter: str | None = None, with_address: bool = False):
        try:
            return dataset.to_table(columns=columns, filter=filter, with_row_address=with_address)
        except (OSError, ValueError) as error:  # pyarrow.ArrowInvalid is a ValueError
            raise self._unreadable(dataset, columns, error) from None

    def _unreadable(self, dataset, columns: list[str], error: Exception) -> TableCorrupt:
        """Which data file could not be read: each fragment read alone, the first that fails named."""
        for fragment in dataset.get_fragments():
            try:
                fragment.to_table(columns=columns)
            except Exception:  # noqa: BLE001 - Lance raises several kinds; any failure names the file
                files = ", ".join(f"{_where(dataset)}/data/{f.path}" for f in fragment.data_files())
                return TableCorrupt(f"{_where(dataset)}: data file {files} (fragment {fragment.fragment_id}) cannot be "
                                    f"read ({_one_line(error)}); it is truncated or damaged. Restore it from a "
                                    "copy, or roll back to a serving tag that does not use it (`fastfill gallery "
                                    "rollback` with gallery.layout lance)")
        return TableCorrupt(f"{self.uri}: the table cannot be read: {_one_line(error)}")

    def _check(self, dataset, data, column: str, vectors: np.ndarray) -> None:
        """The digests of the rows that have vectors; a mismatch names the item and its data file."""
        positions = data.column("position").to_numpy()
        stored = data.column(f"{column}_digest").to_pylist()
        present = ~np.isnan(vectors[:, 0]) if len(vectors) else np.zeros(0, dtype=bool)
        rows = np.flatnonzero(present)
        computed = digests(positions[rows], vectors[rows])
        bad = [row for row, digest in zip(rows, computed, strict=True) if stored[row] != digest]
        if not bad:
            return
        row = bad[0]
        fragment_id = int(data.column("_rowaddr")[row].as_py()) >> 32
        files = [f"{_where(dataset)}/data/{f.path}" for fr in dataset.get_fragments() if fr.fragment_id == fragment_id
                 for f in fr.data_files()]
        item = data.column("id")[row].as_py() if "id" in data.column_names else None
        raise TableCorrupt(f"{_where(dataset)}: {len(bad)} rows of {column!r} do not match their digest (first: item "
                           f"{item!r}, position {int(positions[row])}, in data file {', '.join(files) or '?'}); the "
                           "file was altered or damaged. Restore it from a copy, or roll back to an earlier serving tag "
                           "(`fastfill gallery rollback` with gallery.layout lance)")

    # ---- versions

    def rollback(self) -> tuple[ModelRef, ModelRef]:
        """Back to the serving tag before the latest: its version restored as the newest (a new
        version, so history is kept), tagged ``serving-<n>``. Returns (from, to)."""
        dataset = self.dataset()
        if self.upgrade(dataset) is not None:
            raise GalleryError(f"{self.uri}: an upgrade is in progress; abort it before rolling back")
        tags = self.serving_tags(dataset)
        served = self.model(dataset)
        pending = self.tag_pending_rollback(dataset)
        if pending is not None:
            return pending, served
        earlier = [(n, name, version) for n, name, version in tags
                   if not self.model(self.dataset(version)).same_version(served)]
        if not earlier:
            raise GalleryError(f"{self.uri}: no earlier model to roll back to (serving tags: "
                               f"{', '.join(t[1] for t in tags) or 'none'})")
        _, name, version = earlier[-1]
        try:
            previous = self.dataset(version)
        except GalleryError as error:
            raise GalleryError(f"{self.uri}: the version of {name} is gone ({error}); garbage collection removed it") from None
        previous.restore()
        self._tag_serving(self.dataset())
        return served, self.model(previous)

    def tag_pending_rollback(self, dataset=None) -> ModelRef | None:
        """A rollback killed between its restore and its tag: tagged now; returns the model it
        rolled back from (None: nothing was pending)."""
        dataset = dataset or self.dataset()
        tags = self.serving_tags(dataset)
        if not tags:
            return None
        tagged = self.model(self.dataset(tags[-1][2]))
        if tagged.same_version(self.model(dataset)):
            return None
        self._tag_serving(dataset)
        return tagged

    def collect_garbage(self, older_than: timedelta = timedelta(days=7)) -> dict:
        """Remove the versions that no tag references and that are older than ``older_than``."""
        dataset = self.dataset()
        if self.upgrade(dataset) is None:
            self._remove_backfill()  # what a finish or an abort killed before its last step left
        stats = dataset.cleanup_old_versions(older_than=older_than, error_if_tagged_old_versions=False)
        return {"old_versions": int(stats.old_versions), "bytes_removed": int(stats.bytes_removed),
                "data_files_removed": int(getattr(stats, "data_files_removed", 0))}
