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

import hashlib
import json
import os
import re
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np

from components.gallery.catalog import GalleryError
from components.platform.registry import ModelRef

TABLE = "gallery"
BACKFILL = "gallery_backfill"
MODEL_KEY = "fastfill.model"
UPGRADE_KEY = "fastfill.upgrade"
FINISHED_KEY = "fastfill.finished"
FORMAT_KEY = "fastfill.format"
FORMAT = "1"
SERVING = "serving-"
VECTOR_COLUMNS = ("features", "mapped", "new")
UPGRADE_COLUMNS = ("mapped", "mapped_digest", "log_sigma2", "rank", "new", "new_digest", "new_chunk")
DIGEST_BYTES = 16


class TableCorrupt(GalleryError):
    """A data file of the table is unreadable, or a vector's digest does not match."""


def table_uri(uri: str | Path) -> str:
    """Where the table of the store ``uri`` lives: ``<uri>/gallery.lance``."""
    text = str(uri).removeprefix("file://")
    if text.startswith("s3://"):
        return text.rstrip("/") + f"/{TABLE}.lance"
    return str(Path(text).resolve() / f"{TABLE}.lance")


def storage_options(uri: str | Path) -> dict | None:
    """Lance's object-store settings for an ``s3://`` URI: the endpoint of ``AWS_ENDPOINT_URL_S3``
    / ``AWS_ENDPOINT_URL`` (as the product's other S3 clients), credentials and region from
    boto3's standard configuration; None for a local folder."""
    if not str(uri).startswith("s3://"):
        return None
    import boto3

    from components.gallery.store import s3_endpoint

    session = boto3.session.Session()
    options = {"aws_region": session.region_name or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"}
    credentials = session.get_credentials()
    if credentials is not None:
        frozen = credentials.get_frozen_credentials()
        options.update(aws_access_key_id=frozen.access_key, aws_secret_access_key=frozen.secret_key)
        if frozen.token:
            options["aws_session_token"] = frozen.token
    endpoint = s3_endpoint()
    if endpoint:
        options["aws_endpoint"] = endpoint
        if endpoint.startswith("http://"):
            options["allow_http"] = "true"
    return options


def digests(positions: np.ndarray, vectors: np.ndarray) -> list[bytes]:
    """BLAKE2b-128 of each row's position (int64, little-endian) and float32 bytes."""
    positions = np.ascontiguousarray(positions, dtype="<i8")
    vectors = np.ascontiguousarray(vectors, dtype="<f4")
    return [hashlib.blake2b(p.tobytes() + v.tobytes(), digest_size=DIGEST_BYTES).digest()
            for p, v in zip(positions, vectors, strict=True)]


def _model_meta(model: ModelRef) -> dict[str, str]:
    return {MODEL_KEY: json.dumps(model.to_dict(), sort_keys=True)}


def _metadata(source) -> dict[str, str]:
    """A schema's or field's metadata with text keys and values (Arrow gives bytes)."""
    return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in (source.metadata or {}).items()}


def _vector_fields(name: str, dim: int, model: ModelRef | None):
    import pyarrow as pa

    metadata = _model_meta(model) if model is not None else None
    return [pa.field(name, pa.list_(pa.float32(), dim), metadata=metadata),
            pa.field(f"{name}_digest", pa.binary(DIGEST_BYTES))]


def _vector_arrays(positions: np.ndarray, vectors: np.ndarray) -> list:
    import pyarrow as pa

    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    dim = vectors.shape[1]
    values = pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1), pa.float32()), dim)
    return [values, pa.array(digests(positions, vectors), pa.binary(DIGEST_BYTES))]


def _as_numpy(column, dim: int) -> np.ndarray:
    """A fixed-size-list column (chunked) as an (n, dim) float32 array; nulls as NaN rows."""
    import pyarrow as pa

    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if len(column) == 0:
        return np.empty((0, dim), dtype=np.float32)
    if column.null_count:
        out = np.full((len(column), dim), np.nan, dtype=np.float32)
        valid = column.is_valid().to_numpy(zero_copy_only=False)
        out[valid] = column.drop_null().flatten().to_numpy(zero_copy_only=False).reshape(-1, dim)
        return out
    return np.array(column.flatten().to_numpy(zero_copy_only=False).reshape(-1, dim), dtype=np.float32)  # writable


@dataclass(frozen=True)
class Upgrade:
    """The upgrade whose columns the table holds."""

    id: str
    new: ModelRef
    token: str = ""


class LanceGallery:
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

        from components.gallery.catalog import check_features

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

    # ---- an upgrade's columns

    def begin_upgrade(self, upgrade: str, new: ModelRef, mapped: np.ndarray, rank: np.ndarray,
                      log_sigma2: np.ndarray | None = None, token: str | None = None) -> str:
        """Add the upgrade's columns (h(old), sigma, the backfill rank, empty new features) and its
        empty backfill table, then, last, the upgrade's record in the schema metadata: from that
        commit on, queries use the new model against the mixed gallery (as the parts layout's
        manifest, written last). A planning killed before it left columns that no record names:
        they are dropped and written again. Again after the record (a re-run): nothing changes.
        ``token`` names this plan (default: a new one): chunks committed under another token (a
        worker of an aborted plan of the same id) are never read. Returns the token."""
        import lance
        import pyarrow as pa

        from components.gallery.catalog import check_features

        dataset = self.dataset()
        current = self.upgrade(dataset)
        if current is not None:
            if current.id != upgrade:
                raise GalleryError(f"{self.uri}: upgrade {current.id} holds the table; finish or abort it first")
            return current.token
        n = dataset.count_rows()
        mapped = check_features(mapped, new.dim, "the transformed features h(old)")
        rank = np.asarray(rank, dtype=np.int64)
        if len(mapped) != n or len(rank) != n or not np.array_equal(np.sort(rank), np.arange(n)):
            raise GalleryError(f"begin_upgrade: {len(mapped)} transformed rows and a rank of {len(rank)} for {n} items; "
                               "the rank must be a permutation of 0..N-1")
        new = ModelRef(new.name, new.version, int(mapped.shape[1]))
        leftover = [c for c in UPGRADE_COLUMNS if c in dataset.schema.names]
        if leftover:  # a killed planning's (or finish's, or abort's) columns
            dataset.drop_columns(leftover)
            dataset = self.dataset()
        self._remove_backfill()  # rows of an ended upgrade, or of a killed planning
        positions = np.arange(n, dtype=np.int64)
        fields = [pa.field("position", pa.int64()), *_vector_fields("mapped", mapped.shape[1], new),
                  pa.field("log_sigma2", pa.float32()), pa.field("rank", pa.int64())]
        sigma = pa.array(np.asarray(log_sigma2, dtype=np.float32)) if log_sigma2 is not None else \
            pa.nulls(n, pa.float32())
        columns = pa.Table.from_arrays([pa.array(positions), *_vector_arrays(positions, mapped), sigma,
                                        pa.array(rank)], schema=pa.schema(fields))
        dataset.merge(columns, left_on="position")
        self.dataset().add_columns([*_vector_fields("new", mapped.shape[1], new), pa.field("new_chunk", pa.int32())])
        # created empty here, under the upgrade's lock: chunks only ever append (two "create"
        # commits racing on S3 let the second overwrite the first's rows, measured)
        empty = pa.schema(_backfill_fields(mapped.shape[1], new)).empty_table()
        lance.write_dataset(empty, self.backfill_uri, mode="create", storage_options=self.options)
        token = token or uuid.uuid4().hex
        dataset = self.dataset()
        metadata = _metadata(dataset.schema)
        metadata[UPGRADE_KEY] = json.dumps({"id": upgrade, "new": new.to_dict(), "token": token}, sort_keys=True)
        dataset.update_schema_metadata(metadata, replace=True)
        return token

    # ---- the backfill table: chunks appended, folded into the gallery table in batches

    def _backfill_dataset(self):
        import lance

        try:
            return lance.dataset(self.backfill_uri, storage_options=self.options)
        except (ValueError, OSError) as error:
            if "not found" in str(error).lower() or "does not exist" in str(error).lower():
                return None
            raise GalleryError(f"{self.backfill_uri}: cannot open the backfill table: {_one_line(error)}") from None

    def commit_chunk(self, upgrade: str, chunk: int, positions: np.ndarray, features: np.ndarray, token: str) -> dict:
        """The chunk's new features appended to the backfill table in one commit, under a commit id
        of its own. Appends never conflict, so several processes commit at once; a chunk
        committed twice (re-run after a kill, or after a lost reply to its commit) is read once:
        readers keep one commit per chunk, the smallest commit id."""
        import lance
        import pyarrow as pa

        dataset = self.dataset()
        current = self.upgrade(dataset)
        if current is None or current.id != upgrade or current.token != token:
            raise GalleryError(f"{self.uri}: the table's upgrade is {current.id + ' ' + current.token if current else 'none'}"
                               f", not {upgrade} {token}; chunk {chunk} is not written (a worker of an aborted plan)")
        positions = np.asarray(positions, dtype=np.int64)
        features = np.ascontiguousarray(features, dtype=np.float32)
        n = dataset.count_rows()
        if len(positions) != len(features) or len(np.unique(positions)) != len(positions) or \
                (len(positions) and (positions.min() < 0 or positions.max() >= n)):
            raise GalleryError(f"chunk {chunk}: {len(features)} rows need as many distinct positions in 0..{n - 1}")
        dim = dataset.schema.field("new").type.list_size
        if features.shape[1:] != (dim,):
            raise GalleryError(f"chunk {chunk}: features of dimension {features.shape[1:]}, the new model's is {dim}")
        if self._backfill_dataset() is None:
            raise GalleryError(f"{self.backfill_uri}: the upgrade's backfill table is missing; plan the upgrade again "
                               "(`fastfill upgrade`)")
        commit = uuid.uuid4().hex
        rows = pa.Table.from_arrays([pa.array(positions), pa.array(np.full(len(positions), chunk, dtype=np.int32)),
                                     pa.array([token] * len(positions), pa.string()),
                                     pa.array([commit] * len(positions), pa.string()),
                                     *_vector_arrays(positions, features)],
                                    schema=pa.schema(_backfill_fields(dim, current.new)))
        try:
            lance.write_dataset(rows, self.backfill_uri, mode="append", storage_options=self.options)
        except (OSError, ValueError) as error:
            raise GalleryError(f"{self.backfill_uri}: chunk {chunk} not committed: {_one_line(error)}") from None
        return {"chunk": chunk, "rows": len(positions), "commit": commit}

    def _landed(self, upgrade: Upgrade, exclude: set[int] = frozenset()) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """(positions, new features, chunks) committed under the upgrade's token, one commit per
        chunk (the smallest id), digests checked; chunks in ``exclude`` left out."""
        side = self._backfill_dataset()
        dim = upgrade.new.dim or 0
        empty = (np.empty(0, dtype=np.int64), np.empty((0, dim), dtype=np.float32), [])
        if side is None:
            return empty
        token = upgrade.token.replace("'", "")
        marks = self._read(side, ["chunk", "commit"], filter=f"token = '{token}'")
        if marks.num_rows == 0:
            return empty
        chosen = {}
        for chunk, commit in zip(marks.column("chunk").to_pylist(), marks.column("commit").to_pylist(), strict=True):
            if chunk not in exclude and (chunk not in chosen or commit < chosen[chunk]):
                chosen[chunk] = commit
        if not chosen:
            return empty
        wanted = ", ".join(f"'{c}'" for c in sorted(set(chosen.values())))
        data = self._read(side, ["position", "chunk", "new", "new_digest"],
                          filter=f"token = '{token}' AND commit IN ({wanted})", with_address=True)
        dim = side.schema.field("new").type.list_size
        vectors = _as_numpy(data.column("new"), dim)
        self._check(side, data, "new", vectors)
        # an append whose commit was retried after a lost reply can be in the table twice, with
        # the same commit id and the same rows: each position once
        positions, first = np.unique(data.column("position").to_numpy(), return_index=True)
        return positions, vectors[first], sorted(chosen)

    def _folded(self, dataset) -> set[int]:
        if "new_chunk" not in dataset.schema.names:
            return set()
        column = self._read(dataset, ["new_chunk"], filter="new_chunk IS NOT NULL").column("new_chunk")
        return set(np.unique(column.to_numpy()).tolist())

    def fold(self, upgrade: str) -> int:
        """The committed chunks not yet in the gallery table written into its ``new`` column, in
        one commit (an update by position: a re-run writes the same). Then a team's own service
        reading the table sees them. Returns the chunks folded."""
        import pyarrow as pa

        dataset = self.dataset()
        current = self.upgrade(dataset)
        if current is None or current.id != upgrade:
            raise GalleryError(f"{self.uri}: upgrade {upgrade} is not the table's")
        if "new" not in dataset.schema.names:
            return 0
        positions, vectors, chunks = self._landed(current, exclude=self._folded(dataset))
        if not chunks:
            return 0
        chunk_of = self._read(self._backfill_dataset(), ["position", "chunk"],
                              filter=f"token = '{current.token}' AND chunk IN ({', '.join(map(str, chunks))})")
        by_position = dict(zip(chunk_of.column("position").to_pylist(), chunk_of.column("chunk").to_pylist(), strict=False))
        dim = dataset.schema.field("new").type.list_size
        fields = [pa.field("position", pa.int64()), *_vector_fields("new", dim, current.new),
                  pa.field("new_chunk", pa.int32())]
        source = pa.Table.from_arrays([pa.array(positions), *_vector_arrays(positions, vectors),
                                       pa.array([by_position[int(p)] for p in positions], pa.int32())],
                                      schema=pa.schema(fields))
        result = dataset.merge_insert("position").when_matched_update_all().execute(source)
        if result["num_inserted_rows"]:
            raise TableCorrupt(f"{self.uri}: folding inserted {result['num_inserted_rows']} rows; positions outside "
                               "the gallery")
        return len(chunks)

    def _remove_backfill(self) -> None:
        """Delete the backfill table's files (after a finish or an abort)."""
        if self.backfill_uri.startswith("s3://"):
            from components.gallery.store import s3_client, s3_endpoint

            bucket, _, prefix = self.backfill_uri[len("s3://"):].partition("/")
            client = s3_client(s3_endpoint())
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
                keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                if keys:
                    client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
        else:
            import shutil

            shutil.rmtree(self.backfill_uri, ignore_errors=True)

    def finish(self, upgrade: str) -> str:
        """Every chunk landed: the chunks folded in, the new features become ``features`` and the
        upgrade's columns go, in steps that each leave a readable table (a re-run after a kill
        completes the rest), then a ``serving-<n>`` tag; the backfill table is deleted last.
        Returns the tag."""
        dataset = self.dataset()
        current = self.upgrade(dataset)
        if current is None:
            if self.model(dataset).same_version(self._finished_model(dataset, upgrade)):
                self._remove_backfill()
                return self.serving_tags(dataset)[-1][1]
            raise GalleryError(f"{self.uri}: no upgrade in the table to finish")
        if current.id != upgrade:
            raise GalleryError(f"{self.uri}: the table's upgrade is {current.id}, not {upgrade}")
        if "new" in dataset.schema.names:
            self.fold(upgrade)
            dataset = self.dataset()
            missing = dataset.count_rows(filter="new IS NULL")
            if missing:
                raise GalleryError(f"upgrade {upgrade} is not complete: {missing} items have no new features")
            if "features" in dataset.schema.names:  # the old features go (the version tagged before keeps them)
                dataset.drop_columns(["features", "features_digest"])
                dataset = self.dataset()
            dataset.alter_columns({"path": "new", "name": "features"}, {"path": "new_digest", "name": "features_digest"})
            dataset = self.dataset()
        self._drop_upgrade(dataset, {FINISHED_KEY: json.dumps({"id": upgrade, "model": current.new.to_dict()},
                                                              sort_keys=True)})
        tag = self._tag_serving(self.dataset())
        self._remove_backfill()
        return tag

    def _drop_upgrade(self, dataset, record: dict[str, str] | None = None) -> None:
        """The upgrade's columns that are left dropped, then its metadata replaced by ``record``."""
        leftover = [c for c in UPGRADE_COLUMNS if c in dataset.schema.names]
        if leftover:
            dataset.drop_columns(leftover)
            dataset = self.dataset()
        metadata = _metadata(dataset.schema)
        metadata.pop(UPGRADE_KEY, None)
        dataset.update_schema_metadata({**metadata, **(record or {})}, replace=True)

    def _finished_model(self, dataset, upgrade: str) -> ModelRef:
        raw = _metadata(dataset.schema).get(FINISHED_KEY)
        if raw and json.loads(raw)["id"] == upgrade:
            return ModelRef.from_dict(json.loads(raw)["model"])
        return ModelRef("", "")

    def abort(self, upgrade: str) -> None:
        """The upgrade's record goes first (from that commit on, queries use the serving model's
        features again), then its columns and its backfill table. Again after a kill, or with no
        upgrade in the table: the leftovers go."""
        dataset = self.dataset()
        current = self.upgrade(dataset)
        if current is not None:
            if current.id != upgrade:
                raise GalleryError(f"{self.uri}: the table's upgrade is {current.id}, not {upgrade}")
            metadata = _metadata(dataset.schema)
            metadata.pop(UPGRADE_KEY, None)
            dataset.update_schema_metadata(metadata, replace=True)
            dataset = self.dataset()
        leftover = [c for c in UPGRADE_COLUMNS if c in dataset.schema.names]
        if leftover:
            dataset.drop_columns(leftover)
        self._remove_backfill()

    # ---- versions

    def rollback(self) -> tuple[ModelRef, ModelRef]:
        """Back to the serving tag before the latest: its version restored as the newest (a new
        version, so history is kept), tagged ``serving-<n>``. Returns (from, to)."""
        dataset = self.dataset()
        if self.upgrade(dataset) is not None:
            raise GalleryError(f"{self.uri}: an upgrade is in progress; abort it before rolling back")
        tags = self.serving_tags(dataset)
        served = self.model(dataset)
        if tags:
            tagged = self.model(self.dataset(tags[-1][2]))
            if not tagged.same_version(served):  # a rollback killed between its restore and its tag
                self._tag_serving(dataset)
                return tagged, served
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

    def collect_garbage(self, older_than: timedelta = timedelta(days=7)) -> dict:
        """Remove the versions that no tag references and that are older than ``older_than``."""
        dataset = self.dataset()
        if self.upgrade(dataset) is None:
            self._remove_backfill()  # what a finish or an abort killed before its last step left
        stats = dataset.cleanup_old_versions(older_than=older_than, error_if_tagged_old_versions=False)
        return {"old_versions": int(stats.old_versions), "bytes_removed": int(stats.bytes_removed),
                "data_files_removed": int(getattr(stats, "data_files_removed", 0))}


def _backfill_fields(dim: int, model: ModelRef) -> list:
    import pyarrow as pa

    return [pa.field("position", pa.int64()), pa.field("chunk", pa.int32()), pa.field("token", pa.string()),
            pa.field("commit", pa.string()), *_vector_fields("new", dim, model)]


def _field_model(field) -> ModelRef:
    raw = _metadata(field).get(MODEL_KEY)
    if not raw:
        raise GalleryError(f"column {field.name!r} does not say which model it holds (no {MODEL_KEY} metadata)")
    return ModelRef.from_dict(json.loads(raw))


def _vector_and_digest_names() -> set[str]:
    names = {"pixels"}
    for column in VECTOR_COLUMNS:
        names |= {column, f"{column}_digest"}
    return names


def _where(dataset) -> str:
    """A dataset's location as the messages name it (Lance drops a local path's leading slash)."""
    uri = str(dataset.uri)
    return uri if "://" in uri or uri.startswith("/") else "/" + uri


def _one_line(error: object) -> str:
    text = " ".join(str(error).split())
    return text if len(text) < 400 else text[:400] + "..."


def convert(source_uri: str | Path, target_uri: str | Path | None = None) -> dict:
    """Today's layout (``gallery.json``, items and features parts) at ``source_uri`` as a Lance
    table at ``target_uri`` (default: the same store, ``<uri>/gallery.lance`` beside the parts).
    Refused during an upgrade. The table is read back and compared with the source before it
    counts: features bit for bit, ids and labels equal."""
    from components.gallery.catalog import Gallery
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
    from components.gallery.catalog import check_features

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

    from components.gallery.catalog import check_ingest

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
