"""The table a Lance gallery's readers search (``layout: lance``): ``<store>/serving.lance``, one
Lance dataset that LanceDB opens as the table ``serving`` of the store (``lancedb.connect(store)``).

Each version of it holds one model's space, whole::

    position   int64       the item's number in the gallery
    id                     the team's item id
    embedding  float32[d]  the vector a reader's query is compared with
    model      string      the model whose space the row is in (models:/name/version)
    source     string      embedded (that model embedded the image) or mapped (h(old), not yet backfilled)
    chunk      int32       the upgrade's chunk that wrote the row, -1 for the rows written at the switch

and its schema metadata says which model (``fastfill.model``: uri, name, version, dim), which
upgrade is under way (``fastfill.upgrade``), since when (``fastfill.since``) and whose table it is
(``fastfill.gallery``: the mark of the gallery that wrote it, components/gallery/layouts/ownership.py).
A table at that path without this gallery's mark (one written by another tool, or another
gallery's) is refused in one line, never overwritten, upserted into or cleaned. A Lance version
is a snapshot: a reader that opened version v keeps reading v until it checks out the latest, so
its metadata and its rows are always of the same version, one space.

- **The switch** overwrites the table with the new model's space (h(old) for every item, the new
  features of chunks already done) in one commit, then builds the ANN index on it (a second
  commit: between the two a reader's search is an exact scan, same answers).
- **A chunk** replaces its rows in one commit: the switch's rows of its positions deleted by their
  address (a deletion file per fragment touched) and the chunk's rows appended as one new
  fragment (an upsert, ``merge_insert`` on ``position``, where the table is not laid out as the
  switch wrote it); the rows carry ``chunk``, so a chunk whose rows are there is never written
  twice. Nothing else is written: not the pixels (they are in ``gallery.lance``), not the other
  rows. Then its fragment joins the ANN index as a delta over the same partitions (no
  retraining), deltas merged two by two as they reach the same size.
- **The finish** records that no upgrade is under way, then compacts the fragments and rebuilds
  the index (same rows, same space). Abort, reject and rollback write the serving model's space
  again from ``gallery.lance``; ``gallery gc`` deletes the old versions.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from functools import cache

import numpy as np
import pyarrow as pa

from fastfill.components.gallery.layouts.catalog import EMBEDDED, GalleryError, Serving, dim_of
from fastfill.components.gallery.layouts.item_ids import is_text
from fastfill.components.gallery.layouts.ownership import (
    OWNER_KEY,
    STORE_KEY,
    mark,
    new_owner,
    owner_of,
    read_mark,
    refusal,
)
from fastfill.components.gallery.store import DamagedObject, s3_endpoint
from fastfill.components.platform.registry import ModelRef

TABLE = "gallery.lance"  # the gallery's table (components/gallery/layouts/table.py)
SERVING_TABLE = "serving"
MODEL_KEY = "fastfill.model"
UPGRADE_KEY = "fastfill.upgrade"
SINCE_KEY = "fastfill.since"
GALLERY_KEY = "fastfill.gallery"  # the mark of the gallery whose table it is
ROLE = "serving"
STORE_SETTING = "gallery.store"  # the serving table is <store>/serving.lance: another store names ours otherwise
METRICS = {"l2": "l2", "cosine": "cosine"}
INDEX_TYPES = {"ivf_flat": "IVF_FLAT", "ivf_hnsw_sq": "IVF_HNSW_SQ"}


def lance_settings(config, distance: str, store_uri: str = "") -> dict:
    """The manifest's ``index`` of a new Lance gallery from ``gallery.lance`` (``config``), with the
    new gallery's id (``owner``) that marks its serving table, and its store."""
    return {"kind": "lance", "distance": distance, "ann": config.ann, "ann_min_rows": config.ann_min_rows,
            "partitions": config.partitions, "nprobes": config.nprobes, OWNER_KEY: new_owner(),
            STORE_KEY: str(store_uri)}


DEFAULTS = {"kind": "lance", "distance": "l2", "ann": "ivf_flat", "ann_min_rows": 10000, "partitions": None,
            "nprobes": 20}


def table_uri(store_uri: str, name: str = TABLE) -> str:
    """Where the Lance table ``name`` of the store ``store_uri`` lives: ``<store>/gallery.lance``
    by default."""
    text = str(store_uri).removeprefix("file://").rstrip("/")
    if text.startswith("s3://"):
        return f"{text}/{name}"
    return os.path.join(os.path.abspath(text), name)


def storage_options(store_uri: str) -> dict | None:
    """Lance's object-store settings for an ``s3://`` store: the endpoint of
    ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` (as the product's other S3 clients) and the
    region boto3 resolves; None for a local folder. No credentials are copied: Lance resolves them
    itself with the AWS SDK's standard chain, the one boto3 follows (environment, AWS_PROFILE and
    the shared files, SSO, assumed roles, web identity, the instance's role), and refreshes them
    before they expire, so an upgrade that outlives a session token keeps going."""
    if not str(store_uri).startswith("s3://"):
        return None
    import boto3

    session = boto3.session.Session()
    options = {"aws_region": session.region_name or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"}
    endpoint = s3_endpoint()
    if endpoint:
        options["aws_endpoint"] = endpoint
        if endpoint.startswith("http://"):
            options["allow_http"] = "true"
    return options


CACHE_ENV = "FASTFILL_LANCE_CACHE_MB"
DEFAULT_CACHE_MB = 2048  # an IVF_FLAT index of 1,000,000 256-d rows is about 1 GB, its deltas half as much


def cache_bytes() -> int:
    """The bytes the process's Lance session may keep of opened index segments:
    ``FASTFILL_LANCE_CACHE_MB`` (default 2048); its file metadata gets an eighth as much."""
    text = os.environ.get(CACHE_ENV, "").strip()
    if not text:
        return DEFAULT_CACHE_MB << 20
    if not text.isdigit() or int(text) < 1:
        raise GalleryError(f"{CACHE_ENV}={text!r} is not a positive whole number of megabytes; set it to the memory "
                           f"a process may keep of the serving table's index (default {DEFAULT_CACHE_MB}), or unset it")
    return int(text) << 20


@cache
def _session(capacity: int):
    """One Lance session for the process: its caches of opened index segments and file metadata,
    shared by every open of a serving table (an open of its own each would read them again: at a
    million rows half the time of a search, more with the deltas of an upgrade under way), within
    ``capacity`` bytes (with Lance's own default, several GiB, the benchmark's process upgrading a
    million rows held 13.9 GB resident mid-backfill, the merged-away index segments kept)."""
    import lance

    return lance.Session(index_cache_size_bytes=capacity, metadata_cache_size_bytes=max(capacity // 8, 32 << 20))


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _vectors(features: np.ndarray) -> pa.FixedSizeListArray:
    features = np.ascontiguousarray(features, dtype=np.float32)
    return pa.FixedSizeListArray.from_arrays(pa.array(features.reshape(-1), pa.float32()), features.shape[1])


class ServingTable:
    """``<store>/serving.lance`` (see the module's docstring). ``reclaim``: a new gallery's writer,
    which replaces a table a killed write into the same store left (marked with that store)."""

    def __init__(self, store_uri: str, settings: dict | None = None, reclaim: bool = False):
        self.settings = {**DEFAULTS, **(settings or {})}
        self.store_uri = self.settings.get(STORE_KEY) or str(store_uri)
        self.owner = owner_of(self.settings, self.store_uri)
        self.legacy = OWNER_KEY not in self.settings  # a gallery made before galleries had ids
        self.reclaim = reclaim
        self.uri = table_uri(store_uri, f"{SERVING_TABLE}.lance")  # what lancedb.connect(store) opens as `serving`
        self.options = storage_options(store_uri)
        self.where = self.uri
        self.view = SERVING_TABLE  # the LanceDB table's name in the store
        self.metric = METRICS[self.settings.get("distance", "l2")]

    def dataset(self):
        """The newest version, or None before the first switch. Every open shares the process's
        Lance session (``_session``), so the index segments and file metadata a search read stay
        cached for the next open (they are immutable files; each open still reads the newest
        manifest)."""
        import lance

        try:
            return lance.dataset(self.uri, storage_options=self.options, session=_session(cache_bytes()))
        except (ValueError, OSError) as error:
            if "not found" in str(error).lower() or "does not exist" in str(error).lower():
                return None
            raise GalleryError(f"{self.uri}: cannot open the serving table: {' '.join(str(error).split())[:300]}") \
                from None

    @staticmethod
    def _serving_of(dataset) -> Serving | None:
        meta = dataset.schema.metadata or {}
        if MODEL_KEY.encode() not in meta:
            return None
        model = ModelRef.from_dict(json.loads(meta[MODEL_KEY.encode()]))
        upgrade_id = meta.get(UPGRADE_KEY.encode(), b"").decode() or None
        return Serving(model.uri, model.name, str(model.version), int(model.dim or 0), f"{dataset.uri}:embedding",
                       upgrade_id, meta.get(SINCE_KEY.encode(), b"").decode() or None, version=dataset.version)

    def serving(self) -> Serving | None:
        """Which model's space the newest version holds, its upgrade, since when (None before any)."""
        dataset = self.dataset()
        return None if dataset is None else self._serving_of(dataset)

    def close(self) -> None:
        """Nothing held open (a Lance dataset is files)."""

    # ---- whose table

    def mark_text(self) -> str:
        return mark(self.owner, ROLE, self.store_uri)

    def check_ours(self, dataset) -> None:
        """The table ``dataset`` carries this gallery's mark (a gallery made before ids, or a new
        gallery's writer in this store: or no mark but the product's model metadata, a table an
        earlier release wrote); else NotOurs, before any write."""
        meta = dataset.schema.metadata or {}
        found = read_mark(meta.get(GALLERY_KEY.encode(), b"").decode() or None)
        if found is not None and (found.get("gallery") == self.owner
                                  or (self.reclaim and found.get("store") == self.store_uri)):
            return
        if found is None and (self.legacy or self.reclaim) and MODEL_KEY.encode() in meta:
            return
        raise refusal(f"the serving table {self.uri}", found, self.owner, STORE_SETTING)

    def check_free(self) -> None:
        """No serving table yet, or this gallery's (a new gallery's writer asks before any write)."""
        dataset = self.dataset()
        if dataset is not None:
            self.check_ours(dataset)

    @contextmanager
    def reading(self):
        """A read of the table whose file Lance cannot read is named (DamagedObject, one line)."""
        try:
            yield
        except (OSError, ValueError) as error:  # pyarrow.ArrowInvalid is a ValueError
            # Lance numbers its runtime's tasks: the same damage reads the same, whichever task met it
            said = re.sub(r"\btask \d+ panicked", "a task panicked", " ".join(str(error).split()))
            raise DamagedObject(f"{self.uri}: the serving table cannot be read ({said[:300]}); "
                                "restore it from a copy, or delete it: the next switch (`fastfill upgrade` of a new "
                                "version) writes it again from gallery.lance") from None

    # ---- writing

    def write(self, model: ModelRef, upgrade_id: str | None, ids: np.ndarray, parts) -> None:
        """The table overwritten with ``model``'s space, in one commit: ``parts`` yields
        (positions, features, sources, chunks) in position order; then the ANN index."""
        import lance

        existing = self.dataset()
        if existing is not None:
            self.check_ours(existing)
        text = is_text(ids)
        meta = {MODEL_KEY: json.dumps(model.to_dict(), sort_keys=True), UPGRADE_KEY: upgrade_id or "", SINCE_KEY: _now(),
                GALLERY_KEY: self.mark_text()}
        schema = pa.schema([pa.field("position", pa.int64()), pa.field("id", pa.string() if text else pa.int64()),
                            pa.field("embedding", pa.list_(pa.float32(), dim_of(model))),
                            pa.field("model", pa.string()), pa.field("source", pa.string()),
                            pa.field("chunk", pa.int32())], metadata=meta)

        def batches():
            for positions, features, sources, chunks in parts:
                positions = np.asarray(positions, dtype=np.int64)
                if features.shape[1] != dim_of(model):
                    raise GalleryError(f"{self.uri}: {features.shape[1]}-d vectors for {model.uri}, which embeds into "
                                       f"{model.dim}")
                yield self._batch(schema, positions, ids[positions], features, model, sources, chunks)

        mode = "create" if existing is None else "overwrite"
        lance.write_dataset(pa.RecordBatchReader.from_batches(schema, batches()), self.uri, schema=schema,
                            mode=mode, storage_options=self.options, max_rows_per_file=1 << 22)
        self.ann_index()

    @staticmethod
    def _batch(schema, positions, ids, features, model: ModelRef, sources, chunks) -> pa.RecordBatch:
        n = len(positions)
        return pa.record_batch([pa.array(positions, pa.int64()), pa.array(ids.tolist() if ids.dtype == object else ids,
                                                                            schema.field("id").type),
                                _vectors(features), pa.array([model.uri] * n, pa.string()),
                                pa.array(list(sources), pa.string()), pa.array(np.asarray(chunks, np.int32))],
                               schema=schema)

    def ann_index(self) -> None:
        """The configured ANN index on ``embedding`` (IVF_FLAT or IVF_HNSW_SQ, for the gallery's
        distance), when the table has ``ann_min_rows`` rows or more: under it an exact scan is
        as fast. ``partitions`` null: about the square root of the rows."""
        ann = self.settings.get("ann", "ivf_flat")
        dataset = self.dataset()
        rows = dataset.count_rows()
        if ann == "none" or rows < int(self.settings.get("ann_min_rows") or 0) or rows < 256:
            return
        partitions = int(self.settings.get("partitions") or max(1, round(rows ** 0.5)))
        dataset.create_index("embedding", index_type=INDEX_TYPES[ann], metric=self.metric,
                             num_partitions=min(partitions, rows // 4), replace=True)

    def retag(self, model: ModelRef, upgrade_id: str | None) -> None:
        """The metadata says ``upgrade_id`` (a finish: none) in one commit; the rows stay; then the
        chunks' fragments are compacted and the index rebuilt (same rows, same space)."""
        dataset = self.dataset()
        self.check_ours(dataset)
        meta = {k.decode(): v.decode() for k, v in (dataset.schema.metadata or {}).items()}
        meta.update({MODEL_KEY: json.dumps(model.to_dict(), sort_keys=True), UPGRADE_KEY: upgrade_id or "",
                     GALLERY_KEY: self.mark_text()})
        dataset.update_schema_metadata(meta)
        dataset = self.dataset()
        if upgrade_id is None and len(dataset.get_fragments()) > 1:
            # Lance compacts indexed and unindexed fragments apart; an index of several segments
            # (the chunks' deltas) is dropped once by its name
            for name in sorted({index["name"] for index in dataset.list_indices()}):
                self.dataset().drop_index(name)
            self.dataset().optimize.compact_files(materialize_deletions=True)
            self.ann_index()

    def chunk_done(self, upgrade_id: str) -> set[int]:
        """The chunks of ``upgrade_id`` whose rows are in the table."""
        dataset = self.dataset()
        serving = None if dataset is None else self._serving_of(dataset)
        if serving is None or serving.upgrade != upgrade_id:
            return set()
        with self.reading():
            chunks = dataset.to_table(columns=["chunk"], filter="chunk >= 0").column("chunk").to_numpy()
        return {int(c) for c in np.unique(chunks)}

    def serve_chunk(self, upgrade_id: str, chunk: int, positions: np.ndarray, ids: np.ndarray, features: np.ndarray,
                    sources) -> None:
        """A chunk's rows written in one commit, once: a chunk whose rows are there (``chunk``) is
        not written again; the table must be serving ``upgrade_id``. Where the table is laid out as
        the switch wrote it, reading the switch's rows of the chunk back by address shows whether
        they are still there (a chunk's commit deletes them all at once), so the check costs the
        chunk's rows, not the table's."""
        dataset = self.dataset()
        serving = None if dataset is None else self._serving_of(dataset)
        if serving is None or serving.upgrade != upgrade_id:
            raise GalleryError(f"{self.uri} does not serve upgrade {upgrade_id} (it serves "
                               f"{serving and serving.model}, upgrade {serving and serving.upgrade}); run "
                               "`fastfill upgrade` again: it switches the table first")
        self.check_ours(dataset)
        positions = np.asarray(positions, dtype=np.int64)
        model = ModelRef.from_dict(json.loads(dataset.schema.metadata[MODEL_KEY.encode()]))
        schema = dataset.schema
        batch = self._batch(schema, positions, ids, features, model, sources, np.full(len(positions), chunk))
        rows = pa.Table.from_batches([batch], schema)
        if not self._replace_rows(dataset, positions, rows):
            # the switch's rows of these positions are not all where it wrote them: this chunk's
            # rows may be there already (a retry), or the table was rewritten; only here is the
            # table's chunk column read whole
            with self.reading():
                if dataset.count_rows(filter=f"chunk = {int(chunk)}"):
                    return
            dataset.merge_insert("position").when_matched_update_all().execute(rows)
        self._index_chunk()

    def _replace_rows(self, dataset, positions: np.ndarray, rows: pa.Table) -> bool:
        """The chunk's rows replace the switch's rows of ``positions`` in one commit that touches
        nothing else: those rows deleted by their address, the chunk's appended as a new fragment.
        The switch writes position p at row p of its fragments, in order (``write``); every row
        to delete is read back by its address and must hold its position before anything is
        written (a deleted row reads as missing). False, with nothing written, when one does not:
        the chunk was written already, or the table is not laid out so (compacted or rewritten by
        another tool); the caller checks and upserts instead. Its cost does not grow with the
        table, where an upsert joins the chunk against every row."""
        import lance
        from lance.fragment import write_fragments

        fragments = sorted(dataset.get_fragments(), key=lambda fragment: fragment.fragment_id)
        starts = np.cumsum([0] + [fragment.physical_rows for fragment in fragments])
        which = np.searchsorted(starts, positions, side="right") - 1
        if not len(positions) or positions.min() < 0 or which.max() >= len(fragments):
            return False
        ids = np.array([fragment.fragment_id for fragment in fragments], dtype=np.int64)
        addresses = (ids[which] << 32) + (positions - starts[which])
        with self.reading():
            found = dataset._take_rows(addresses.tolist(), columns=["position"]).column("position").to_numpy()
        if not np.array_equal(found, positions):
            return False
        updated, removed = [], []
        for index in np.unique(which):
            offsets = np.sort(positions[which == index] - starts[index])
            kept = fragments[index].delete_rows(offsets.tolist())
            (updated.append(kept) if kept is not None else removed.append(int(ids[index])))
        added = write_fragments(rows, self.uri, schema=rows.schema, storage_options=self.options)
        lance.LanceDataset.commit(self.uri, lance.LanceOperation.Update(
            removed_fragment_ids=removed, updated_fragments=updated, new_fragments=added),
            read_version=dataset.version, storage_options=self.options)
        return True

    def _index_chunk(self) -> None:
        """The chunks' new rows added to the ANN index without retraining it: a delta index over
        the same partitions, and deltas merged two by two when they reach the same size (at most
        about log2(chunks) of them), so a search during the upgrade probes partitions instead of
        scanning every chunk's rows. Nothing without an index (a table under ``ann_min_rows``)."""
        dataset = self.dataset()
        names = {index["name"] for index in dataset.list_indices() if index["fields"] == ["embedding"]}
        if not names or len(dataset.get_fragments()) == 1:
            return
        dataset.optimize.optimize_indices(num_indices_to_merge=0, index_names=sorted(names))
        while True:
            segments = sorted((index for index in self.dataset().list_indices() if index["name"] in names),
                              key=lambda index: index["version"])
            sizes = [len(index["fragment_ids"]) for index in segments[1:]]  # the deltas, after the switch's
            if len(sizes) < 2 or sizes[-1] != sizes[-2]:
                return
            self.dataset().optimize.optimize_indices(num_indices_to_merge=2, index_names=sorted(names))

    def cleanup(self) -> None:
        """Delete the table's old versions (after gc, a reader pinned to one reopens the newest)."""
        dataset = self.dataset()
        if dataset is not None:
            self.check_ours(dataset)
            dataset.cleanup_old_versions(older_than=timedelta(0), error_if_tagged_old_versions=False)

    # ---- reading

    def embedded_count(self) -> int:
        """Rows whose vector the serving model embedded (the rest: h(old))."""
        dataset = self.dataset()
        if dataset is None:
            return 0
        with self.reading():
            return dataset.count_rows(filter=f"source = '{EMBEDDED}'")

    def product_distances(self, distances: list) -> np.ndarray:
        """Lance's distances are the product's already: squared L2, or 1 - cosine."""
        return np.asarray(distances, dtype=np.float64)

    def search(self, queries: np.ndarray, k: int, model: str | None = None) -> tuple[list, list, list, list]:
        """The k nearest rows of each query in the newest version: (ids, distances, the model of
        each answer's rows, sources), one list per query. ``model``: the model URI the queries
        were embedded with; a version that holds another model's space answers no rows (read
        ``serving()`` again and re-embed), never another space's answer."""
        queries = np.asarray(queries, dtype=np.float32)
        dataset = self.dataset()
        serving = None if dataset is None else self._serving_of(dataset)
        if serving is None or (model is not None and serving.model != model):
            return [[] for _ in queries], [[] for _ in queries], [set() for _ in queries], [[] for _ in queries]
        nearest = {"column": "embedding", "q": queries if len(queries) > 1 else queries[0], "k": int(k),
                   "metric": self.metric, "nprobes": int(self.settings.get("nprobes") or 20)}
        with self.reading():
            data = dataset.to_table(nearest=nearest, columns=["id", "model", "source", "_distance"]
                                    + (["query_index"] if len(queries) > 1 else []))
        which = data.column("query_index").to_numpy() if len(queries) > 1 else np.zeros(data.num_rows, np.int64)
        distance = data.column("_distance").to_numpy()
        ids, models, sources = data.column("id").to_pylist(), data.column("model").to_pylist(), \
            data.column("source").to_pylist()
        out: tuple[list, list, list, list] = ([], [], [], [])
        for q in range(len(queries)):
            rows = np.flatnonzero(which == q)
            rows = rows[np.argsort(distance[rows], kind="stable")]
            out[0].append([ids[r] for r in rows])
            out[1].append([float(distance[r]) for r in rows])
            out[2].append({models[r] for r in rows})
            out[3].append([sources[r] for r in rows])
        return out
