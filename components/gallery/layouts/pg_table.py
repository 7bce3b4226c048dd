"""The gallery served from PostgreSQL with pgvector (``layout: pgvector``): the index the team's
service queries is the gallery. The gallery's table holds one row per item (the team's id column,
the image's URI; an adopted table its own vector column too); each model the product writes gets
a table of its own beside it, ``<table>_emb_<name>_v<version>`` (id, embedding, source: what made
the row's vector), so an upgrade's writes touch that table and its ANN index only, never the
team's rows or the old model's index. The team's service queries a view, ``<table>_serving`` by
default::

    SELECT id, embedding, model, source FROM gallery_serving ORDER BY embedding <-> $1 LIMIT 10

``model`` is the model version whose space the view serves (the same on every row), ``source``
is ``embedded`` (the model embedded the item's image) or ``mapped`` (the old model's features
through the upgrade's alignment map, h(old)).

During an upgrade (``components.gallery.upgrade``):

- **the switch** (when the gallery is pointed at a planned upgrade): every item's row as the
  switch finds it (h(old); the new model's features of the chunks done while planning) is written
  (one COPY) into a held table, ``<vectors table>_held``, with its rank in the backfill order, and
  its ANN index built in bulk; the chunks already done go into the new model's table; then, in one
  transaction, the view is redefined over both and ``<table>_fastfill_serving`` names the new
  model. Readers move at that commit, from one space to the other, never seeing both in one
  answer;
- **each chunk** appends its rows (new features, ``source = embedded``) to the new model's table
  (one COPY: they enter its ANN index as they are written, built once the table holds enough rows
  to train it) in one transaction with its completion record (``<table>_fastfill_chunks``, with
  the chunk's ranks): once, whatever the retries. No other row is written: the view serves a held
  row only while its rank is in no recorded chunk. So a chunk's WAL is its own rows, not the
  heap and index pages that sigma order spreads a chunk over (reports/pg_wal_study-1000000.md,
  docs/serving.md); a search is two ordered ANN index scans merged;
- **the finish** keeps the table the chunks filled (nothing is rewritten), redefines the view over
  it alone, drops the held table and names the new model in the manifest; **reject, abort and
  rollback** redefine the view over the model the manifest serves (the old vectors, and an ended
  upgrade's tables, are kept until ``fastfill gallery gc`` drops every other model's table of this
  gallery's and every held table; a team's adopted column is never dropped).

Every object the product creates here is marked as this gallery's (a ``COMMENT``,
``components.gallery.layouts.ownership``); nothing without that mark is dropped, replaced or
written, and a name held by anything else is refused before any write. Each chunk's commit and the
finish check the tables' ids against the gallery's, naming what another writer changed.

Everything that is not a vector stays in the gallery's store, as on the parts layout: the manifest
(``gallery.json``, the authority on which model serves; its ``index`` names the server, table and
columns), the items table (ids in position order, image URIs, labels), an ingested gallery's
images, the upgrade lock and each upgrade's plan, chunks and records. So the upgrade flow is the
same on every layout. The lock stays in the store because what it guards (the plan, the chunks'
markers, the decision) is there, and because a lease in the store outlives a dropped connection
the way an upgrade killed mid-chunk needs (it is taken over when its lease runs out).

Connections: the manifest's ``postgresql://`` URI (never with a password: a password written in
``gallery.pgvector.uri`` or ``FASTFILL_PG_URI`` is taken out when it is read and kept in the
process's memory only, ``components.platform.secrets``; else libpq reads ``PGPASSWORD`` or
``~/.pgpass``), then the usual ``PG*`` variables; ``FASTFILL_PG_URI`` replaces the URI (a team
whose server moved, or a service account of its own).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import numpy as np

from fastfill.components.gallery.layouts.catalog import (
    EMBEDDED,
    MAPPED,
    PGVECTOR,
    GalleryError,
    PartsWriter,
    StoredItems,
    check_features,
    dim_of,
)
from fastfill.components.gallery.layouts.item_ids import id_array, is_text
from fastfill.components.gallery.layouts.ownership import NotOurs
from fastfill.components.gallery.layouts.pg_index import MAX_DIM, MAX_INDEXED_DIM, TABLE, Index, Place, index_settings
from fastfill.components.gallery.layouts.served import FeaturesById, ServedGallery
from fastfill.components.gallery.store import DamagedObject, ObjectMissing, Store
from fastfill.components.gallery.upgrade.stored import Plan, done_chunks, iter_mixed_parts, order_of
from fastfill.components.platform.registry import ModelRef

__all__ = ["Index", "PgGallery", "PgWriter", "index_settings"]


class _Recount(Exception):
    """A chunk's transaction found the tables' row counts changed by another writer."""


def _named(diff: dict, what: str) -> str:
    """``3 ids missing (first: 4, 9, 12); `` or nothing."""
    if not diff["count"]:
        return ""
    return f"{diff['count']} ids {what} (first: {', '.join(map(str, diff['first']))}); "


class PgGallery(StoredItems, FeaturesById, ServedGallery[Index, Place]):
    """A gallery whose vectors are rows of PostgreSQL tables that queries are served from (see
    the module's docstring); the manifest, items and upgrade objects are in its store."""

    layout = PGVECTOR

    def _open_index(self, settings: dict) -> Index:
        return Index(settings, self.store.uri)

    # ---- features

    def _rows(self, model: ModelRef, ids: np.ndarray) -> np.ndarray:
        index = self.index
        place = index.place(model)
        columns = index.columns(place.table)
        if place.column not in columns:
            raise ObjectMissing(f"{index.where} holds no features of {model.uri} (no {place.name})")
        declared = re.search(r"\((\d+)\)", columns[place.column])  # vector(512)
        dim = model.dim or (int(declared.group(1)) if declared else 0)
        return check_features(index.read(place, ids, dim), model.dim, f"{index.where} vectors {place.name}")

    def write_features(self, model: ModelRef, parts: Iterable[tuple[int, np.ndarray]]) -> None:
        """``model``'s vectors from ``parts``. Those an upgrade's chunks kept up to date (the
        finish) are not written again: the parts are read to their end (they check that every
        part is backfilled) and the rows are the chunks'."""
        index = self.index
        place = index.place(model)
        serving = index.serving()
        if serving is not None and serving.vectors == place.name and index.has(place):
            for _ in parts:
                pass
            self.check_other_writers(place)
            return
        ids = self.ids()

        def rows():
            for part, features in parts:
                start, stop = self.part_bounds(part)
                yield ids[start:stop], features, EMBEDDED

        index.new_vectors(place, dim_of(model), rows())
        index.ann_index(place)

    def missing_features(self, model: ModelRef) -> list[str]:
        index = self.index
        place = index.place(model)
        if not index.has(place):
            return [f"{index.where} vectors {place.name}"]
        from psycopg import sql

        rows, empty = index.execute(sql.SQL("SELECT count(*), count(*) FILTER (WHERE {} IS NULL) FROM {}").format(
            sql.Identifier(place.column), sql.Identifier(place.table))).fetchone()
        if empty or rows != self.num_items:
            return [f"{index.where} vectors {place.name}: {empty + self.num_items - rows} rows without a vector"]
        return []

    def collect_features(self) -> int:
        """Drop the vectors of every model but the serving one that this gallery made (the other
        models' tables with its mark; a team's adopted column stays: ``kept_columns``), and an
        aborted upgrade's held table; returns how many models' vectors."""
        from psycopg import sql

        index = self.index
        keep = index.place(self.model)
        drop = [Place(table, "id", "embedding", "source") for table in index.vectors_tables() if table != keep.table]
        for held in index.held_tables():  # an aborted upgrade's (a finished one's was dropped at its finish)
            index.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(held)))
        return sum(index.drop(place) for place in drop)

    def kept_columns(self) -> list[str]:
        """The team's columns of vectors no model serves any more: gc leaves them (they are the
        team's); the team drops them when no reader of its own uses them."""
        index = self.index
        keep = index.place(self.model)
        columns = index.columns()
        return [f"{index.table}.{column}" for column in self.manifest()["index"].get("columns", {}).values()
                if column in columns and Place(index.table, index.id_column, column, None) != keep]

    def check_other_writers(self, place: Place, filled: np.ndarray | None = None) -> None:
        """The new model's table holds exactly the gallery's ids (while an upgrade's chunks fill
        it: the ids ``filled`` of the chunks recorded, and its held table every id), and the
        team's table holds every id the gallery was made with (a count and a checksum; the ids
        named when they differ): a DamagedObject naming the table at fault. Rows the team added
        since are recorded (``unserved_rows``)."""
        index, ids = self.index, self.ids()
        expected = index.ids_digest(ids)
        self._unserved = None
        held = index.held(place) if filled is not None else None
        if held and filled is not None:  # the held table every id, the new table the recorded chunks' ids
            checks = [(held, "id", ids, expected), (place.table, place.id_column, filled, index.ids_digest(filled))]
        else:
            checks = [(place.table, place.id_column, ids, expected)]
        for table, id_column, wanted, digest in checks:
            if table == index.table or index.id_digest(table, id_column) == digest:
                continue
            diff = index.id_differences(table, id_column, wanted)
            raise DamagedObject(
                f"{index.where}: the new model's table {table} no longer holds the gallery's items: "
                f"{_named(diff['missing'], 'missing')}{_named(diff['added'], 'not in the gallery')}(another writer "
                "deleted or inserted rows in a table of the product's); nothing was switched: run the upgrade again "
                "(`fastfill upgrade abort` then `fastfill upgrade`) to write it anew")
        if index.id_digest(index.table, index.id_column) != expected:
            diff = index.id_differences(index.table, index.id_column, ids)
            if diff["missing"]["count"]:
                raise DamagedObject(
                    f"{index.where}: the gallery's table {index.table} lost items the gallery serves: "
                    f"{_named(diff['missing'], 'deleted')}(by another writer, since the gallery was made): restore "
                    "them, or end this upgrade (`fastfill upgrade abort`) and adopt the table again "
                    "(docs/serving.md, \"What the product touches in your database\")")
            if diff["added"]["count"]:
                self._unserved = {"table": index.table, **diff["added"]}

    def release(self) -> list[str]:
        """Every object of this gallery's in the database dropped (its mark): the view first, so
        readers stop at once, then the ANN indexes it built, its vectors tables and bookkeeping
        tables, and the table an ingest made. Refused while an upgrade is under way."""
        upgrade_id = self.manifest(refresh=True).get("upgrade")
        if upgrade_id:
            raise GalleryError(f"upgrade {upgrade_id} is in progress; finish it, or end it with `fastfill upgrade abort`, "
                               "before releasing the gallery's objects")
        return self.index.release()

    def unserved_rows(self) -> dict | None:
        """Rows the team added to its table since the gallery was made, seen by the last check:
        the view does not serve them (they have no vector of the serving model)."""
        return getattr(self, "_unserved", None)

    def check_sources(self, sequential: bool = False) -> None:
        index = self.index
        if not index.exists():
            raise GalleryError(f"{index.where} does not exist, though {self.store.uri}'s manifest says layout pgvector; "
                               "restore it, or re-adopt the table. Nothing was written.")
        index.check_names(index.place(self.model))
        rows = index.count()
        if rows != self.num_items:
            raise GalleryError(f"{index.where} has {rows} rows, but the manifest says {self.num_items} items: rows were "
                               "added or deleted since it was adopted; adopt it again into a new store. Nothing was "
                               "written.")
        if not sequential:
            missing = self.missing_features(self.model)
            if missing:
                raise GalleryError(f"{missing[0]} (the gallery's model {self.model.uri}). Nothing was written.")
        if not self.adopted:
            present = set(self.store.list("images/"))
            keys = [f"images/part-{p:05d}.npy" for p in range(self.num_parts)]
            lost = [key for key in keys if key not in present]
            if lost:
                raise GalleryError(f"{self.store.uri}: {len(lost)} images parts are missing (first: {lost[0]}). "
                                   "Nothing was written.")

    # ---- serving

    def cannot_serve(self, model: ModelRef, task_runner: str = "threads") -> str | None:
        """pgvector 0.6 stores vectors of up to 16,000 dimensions and indexes (HNSW, IVFFlat) up to
        2,000."""
        dim, ann = int(model.dim or 0), self.manifest()["index"].get("ann", "ivfflat")
        try:
            self.index.check_names(self.index.place(model))
        except NotOurs as refused:
            return str(refused)
        if dim > MAX_DIM:
            return (f"{model.uri} embeds into {dim:,} dimensions; pgvector's vector type holds at most {MAX_DIM:,}. "
                    "Keep this gallery in another layout (`fastfill gallery convert --layout lance`)")
        if ann != "none" and dim > MAX_INDEXED_DIM:
            return (f"{model.uri} embeds into {dim:,} dimensions; pgvector's {ann} index takes at most "
                    f"{MAX_INDEXED_DIM:,}, and this gallery's index ({self.index.where}) was made with ann {ann}. "
                    "Choose a model of at most 2,000 dimensions, or keep the gallery in another layout "
                    "(`fastfill gallery convert --layout lance`)")
        return None

    def _target(self, model: ModelRef) -> Place:
        """``model``'s vectors table (the bookkeeping tables made first, where they are not yet)."""
        self.index.bookkeeping()
        return self.index.place(model)

    def _vectors_name(self, target: Place) -> str:
        return target.name

    def _point(self, target: Place, model: ModelRef, upgrade_id: str | None) -> None:
        """The view redefined over ``target`` and the serving row rewritten, in one transaction."""
        self.index.serve(model, target, upgrade_id)

    def _prepare_switch(self, plan: Plan, place: Place) -> None:
        """The new model's rows written as the mixed gallery is now, before any reader moves to
        them: every item's row (h(old); the new features of the chunks already done) in the held
        table with its rank in the order, the done chunks' rows in the new model's table and
        recorded as done; the held table's ANN index built (and the new table's, once it holds
        enough rows to train one). The chunks then only append (``serve_chunk``)."""
        from psycopg import sql

        index = self.index
        ids = self.ids()
        rank = np.empty(self.num_items, dtype=np.int64)
        rank[order_of(self.store, plan.upgrade_id)] = np.arange(self.num_items)

        def rows():
            for part, features, backfilled in iter_mixed_parts(self, plan):
                start, stop = self.part_bounds(part)
                yield ids[start:stop], features, rank[start:stop], np.asarray(backfilled, dtype=bool)

        if place.table == index.table:
            raise GalleryError(f"{index.where}: an upgrade writes the new model's vectors into a table of its own, not "
                               f"a column of the team's table ({place.name})")
        written = index.new_held(place, dim_of(plan.new), rows())
        done = done_chunks(self.store, plan.upgrade_id)
        if written != plan.items_in(done):
            raise DamagedObject(f"{index.where}: the switch found {written} rows of done chunks, the plan "
                                f"{plan.items_in(done)}; run the upgrade again")
        with index.transaction() as connection:  # an earlier try of the same upgrade (aborted) left its own
            connection.execute(sql.SQL("DELETE FROM {} WHERE upgrade = %s").format(sql.Identifier(index.chunks_table)),
                               (plan.upgrade_id,))
            for chunk in done:
                start, stop = plan.chunk_bounds(chunk)
                connection.execute(sql.SQL("INSERT INTO {} (upgrade, chunk, items, first, stop) VALUES (%s, %s, %s, "
                                           "%s, %s)").format(sql.Identifier(index.chunks_table)),
                                   (plan.upgrade_id, chunk, stop - start, start, stop))
        index.index_when_full_enough(place, self.num_items)

    def serve_chunk(self, plan, chunk: int, positions: np.ndarray, features: np.ndarray, embedded: np.ndarray) -> None:
        """A chunk's rows appended to the new model's table, in one transaction with its
        completion record (which hides the same items' held rows from the view): once (a chunk
        whose record is there is not written again). In the same transaction the new table must
        hold the recorded chunks' rows, the held table one row per item and the team's table at
        least as many: otherwise nothing of the chunk is kept and the ids at fault are named
        (``check_other_writers``). An upgrade switched by a release that kept no held table
        updates its rows in place."""
        from psycopg import sql

        index = self.index
        place = index.place(plan.new)
        held = index.held(place)
        ids = self.ids()[np.asarray(positions, dtype=np.int64)]
        sources = [EMBEDDED if e else MAPPED for e in embedded]
        start, stop = plan.chunk_bounds(chunk)
        try:
            with index.transaction() as connection:
                inserted = connection.execute(
                    sql.SQL("INSERT INTO {} (upgrade, chunk, items, first, stop) VALUES (%s, %s, %s, %s, %s) "
                            "ON CONFLICT DO NOTHING").format(sql.Identifier(index.chunks_table)),
                    (plan.upgrade_id, int(chunk), len(positions), start, stop)).rowcount
                if inserted and held:
                    index.append(connection, place, ids, features, sources)
                    ours, kept, theirs, recorded = connection.execute(sql.SQL(
                        "SELECT (SELECT count(*) FROM {}), (SELECT count(*) FROM {}), (SELECT count(*) FROM {}), "
                        "(SELECT coalesce(sum(items), 0) FROM {} WHERE upgrade = %s)").format(
                        sql.Identifier(place.table), sql.Identifier(held), sql.Identifier(index.table),
                        sql.Identifier(index.chunks_table)), (plan.upgrade_id,)).fetchone()
                    if ours != recorded or kept != self.num_items or theirs < self.num_items:
                        raise _Recount(f"{place.table} has {ours} rows for {recorded} recorded, {held} {kept}, "
                                       f"{index.table} {theirs}, for {self.num_items} items")
                elif inserted:
                    index.write(connection, place, ids, features, sources)
                    ours, theirs = connection.execute(sql.SQL("SELECT (SELECT count(*) FROM {}), (SELECT count(*) "
                                                              "FROM {})").format(
                        sql.Identifier(place.table), sql.Identifier(index.table))).fetchone()
                    if ours != self.num_items or theirs < self.num_items:
                        raise _Recount(f"{place.table} has {ours} rows, {index.table} {theirs}, for "
                                       f"{self.num_items} items")
        except _Recount as counted:
            filled = None
            if held:  # the ids of the chunks recorded (this one's record was rolled back with its rows)
                order = order_of(self.store, plan.upgrade_id)
                recorded = [order[slice(*plan.chunk_bounds(c))] for c in sorted(index.chunk_done(plan.upgrade_id))]
                filled = self.ids()[np.concatenate(recorded) if recorded else order[:0]]
            self.check_other_writers(place, filled)
            raise DamagedObject(f"{index.where}: {counted} (another writer is changing them); chunk {chunk} was "
                                "not written") from None
        if inserted and held:
            index.index_when_full_enough(place, self.num_items)

    @staticmethod
    def writer(store: Store, model: ModelRef, part_size: int, settings: dict | None = None) -> PgWriter:
        if settings is None:
            raise GalleryError("a pgvector gallery is written with its index settings (gallery.pgvector)")
        return PgWriter(store, model, part_size, settings)


class PgWriter:
    """Writes a new pgvector gallery: the items (and an ingested gallery's images) as the parts
    layout's objects in the store; in PostgreSQL the gallery's table (id, image, label: created
    here; a table that exists already is refused: adopt it instead) and the model's vectors
    table; the view serves them after ``close``."""

    def __init__(self, store: Store, model: ModelRef, part_size: int, settings: dict):
        self.parts = PartsWriter(store, model, part_size)
        self.model, self.settings = model, dict(settings)
        self.settings["columns"] = {}
        self.index = Index(self.settings)
        self.place = self.index.place(model)
        self._created = False

    def _create(self, ids: np.ndarray) -> None:
        from psycopg import sql

        index = self.index
        if index.exists():
            raise GalleryError(f"{index.where} exists already; adopt it where it is (`fastfill gallery adopt --table "
                               f"{index.table}`), or name a new table in gallery.pgvector.table")
        index.check_names(self.place)  # before anything is written
        self.settings["id_type"] = "text" if is_text(ids) else "bigint"
        with index.transaction() as connection:
            connection.execute(sql.SQL("CREATE TABLE {t} ({id} {kind} PRIMARY KEY, {image} text, label bigint)").format(
                t=sql.Identifier(index.table), id=sql.Identifier(index.id_column),
                kind=sql.SQL(self.settings["id_type"]), image=sql.Identifier(index.image_column)))
            index.marking(connection, "table", index.table, TABLE)
        index.drop(self.place)  # a write of this gallery cut short left it
        with index.transaction() as connection:
            index.create_vectors(connection, self.place.table, self.settings["id_type"], dim_of(self.model))
        self._created = True

    def write(self, start: int, items, features: np.ndarray, images: np.ndarray | None = None) -> None:
        from psycopg import sql

        ids = id_array(items.column("id"))
        if not self._created:
            self._create(ids)
        self.parts.write_items(start, items, images)
        index = self.index
        labels = items.column("label").to_pylist() if "label" in items.column_names else [None] * len(ids)
        id_type = self.settings["id_type"]
        with index.transaction() as connection:
            with connection.cursor().copy(sql.SQL("COPY {t} ({id}, {image}, label) FROM STDIN WITH (FORMAT BINARY)").format(
                    t=sql.Identifier(index.table), id=sql.Identifier(index.id_column),
                    image=sql.Identifier(index.image_column))) as copy:
                copy.set_types([id_type, "text", "int8"])
                for item, image, label in zip(ids.tolist(), items.column("image").to_pylist(), labels):
                    copy.write_row((item, image, label))
            index.append(connection, self.place, ids, features, EMBEDDED)

    def close(self) -> None:
        self.index.bookkeeping()
        self.index.ann_index(self.place)
        self.index.serve(self.model, self.place, None)
        self.index.close()

    def manifest_fields(self) -> dict:
        return {"index": self.settings}

