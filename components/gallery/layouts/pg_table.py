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

- **the switch** (when the gallery is pointed at a planned upgrade): the new model's table is
  written (one COPY) with the mixed gallery as it is (h(old), and the new model's features of the
  chunks done while planning), its ANN index is built in bulk, and then, in one transaction, the
  view is redefined over it and ``<table>_fastfill_serving`` names the new model. Readers move at that
  commit, from one space to the other, never seeing both in one answer;
- **each chunk** updates its rows (new features, ``source = embedded``) in one transaction together
  with its completion record (``<table>_fastfill_chunks``): once, whatever the retries;
- **the finish** keeps the table the chunks filled (nothing is rewritten) and names the new model
  in the manifest; **reject, abort and rollback** redefine the view over the model the manifest
  serves (the old vectors are kept until ``fastfill gallery gc`` drops every other model's table,
  and an adopted column once another model serves).

Everything that is not a vector stays in the gallery's store, as on the parts layout: the manifest
(``gallery.json``, the authority on which model serves; its ``index`` names the server, table and
columns), the items table (ids in position order, image URIs, labels), an ingested gallery's
images, the upgrade lock and each upgrade's plan, chunks and records. So the upgrade flow is the
same on every layout. The lock stays in the store because what it guards (the plan, the chunks'
markers, the decision) is there, and because a lease in the store outlives a dropped connection
the way an upgrade killed mid-chunk needs (it is taken over when its lease runs out).

Connections: the manifest's ``postgresql://`` URI (never with a password: libpq reads it from
``PGPASSWORD`` or ``~/.pgpass``), then the usual ``PG*`` variables; ``FASTFILL_PG_URI`` replaces the
URI (a team whose server moved, or a service account of its own).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from contextlib import contextmanager
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from fastfill.components.gallery.layouts.catalog import PGVECTOR, GalleryError, PartsWriter, check_features
from fastfill.components.gallery.layouts.item_ids import id_array, is_text
from fastfill.components.gallery.layouts.served import ServedGallery
from fastfill.components.gallery.store import DamagedObject, ObjectMissing, Store, StoreError
from fastfill.components.platform.registry import ModelRef

URI_ENV = "FASTFILL_PG_URI"
EMBEDDED, MAPPED = "embedded", "mapped"
MAX_DIM, MAX_INDEXED_DIM = 16000, 2000  # pgvector 0.6: the vector type; an HNSW or IVFFlat index
OPERATORS = {"l2": ("<->", "vector_l2_ops"), "cosine": ("<=>", "vector_cosine_ops")}
ROWS_PER_STATEMENT = 20000


class IndexError_(StoreError):
    """The index server cannot be reached or refused a statement (retried as a store error)."""


def safe_uri(uri: str) -> str:
    """``uri`` without its password (the manifest never keeps one)."""
    if not uri:
        return uri
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    netloc = parts.netloc.rsplit("@", 1)
    user = netloc[0].split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}@{netloc[1]}"))


def plain_identifier(name: str, what: str) -> str:
    """``name``, when it is a plain PostgreSQL identifier; else an error naming ``what`` it is."""
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_$]{0,62}", name):
        raise GalleryError(f"{what} {name!r} is not a plain PostgreSQL identifier (letters, digits and _, at most 63, "
                           "not starting with a digit); name the table or column as it is in the database")
    return name


def vectors_table(table: str, model: ModelRef) -> str:
    """The table of ``model``'s vectors beside the gallery's ``table``: ``<table>_emb_<name>_v<version>``
    (lowercase; a digest where that would pass PostgreSQL's 63 characters)."""
    name = re.sub(r"[^a-z0-9_]+", "_", f"{table}_emb_{model.name}_v{model.version}".lower())
    if len(name) > 63:
        name = f"{name[:50]}_{hashlib.sha1(f'{table}/{model.key}'.encode()).hexdigest()[:12]}"
    return name


class Place:
    """Where one model's vectors are: a table, its id, vector and (optional) source columns."""

    def __init__(self, table: str, id_column: str, column: str, source: str | None):
        self.table, self.id_column, self.column, self.source = table, id_column, column, source

    @property
    def name(self) -> str:
        return f"{self.table}.{self.column}"

    def __eq__(self, other) -> bool:
        return isinstance(other, Place) and self.name == other.name


def connect(uri: str):
    """A connection (autocommit) to ``uri`` (or ``FASTFILL_PG_URI``) with pgvector's types."""
    import psycopg
    from pgvector.psycopg import register_vector

    target = os.environ.get(URI_ENV) or uri
    try:
        connection = psycopg.connect(target, autocommit=True, connect_timeout=10)
    except psycopg.OperationalError as error:
        raise IndexError_(f"cannot connect to PostgreSQL at {safe_uri(target) or 'the PG* environment'}: "
                          f"{' '.join(str(error).split())[:300]}") from None
    try:
        register_vector(connection)
    except psycopg.ProgrammingError:  # the extension is not there yet
        connection.execute("CREATE EXTENSION IF NOT EXISTS vector")
        register_vector(connection)
    return connection


def default_table(store_uri: str) -> str:
    """The table of a new gallery whose settings name none: one per store."""
    return "gallery_" + hashlib.sha1(str(store_uri).rstrip("/").encode()).hexdigest()[:10]


def index_settings(config, distance: str, store_uri: str = "") -> dict:
    """The manifest's ``index`` of a new gallery from ``gallery.pgvector`` (``config``) in the
    store ``store_uri`` (it names the table when the settings do not)."""
    table = plain_identifier(config.table or default_table(store_uri), "gallery.pgvector.table")
    return {"kind": PGVECTOR, "uri": safe_uri(config.uri), "table": table,
            "id_column": plain_identifier(config.id_column, "gallery.pgvector.id_column"),
            "image_column": plain_identifier(config.image_column, "gallery.pgvector.image_column"),
            "view": plain_identifier(config.view or f"{table}_serving", "gallery.pgvector.view"),
            "distance": distance, "ann": config.ann, "hnsw_m": config.hnsw_m,
            "hnsw_ef_construction": config.hnsw_ef_construction, "ef_search": config.ef_search,
            "ivfflat_lists": config.ivfflat_lists, "ivfflat_probes": config.ivfflat_probes,
            "index_memory": config.index_memory, "columns": {}}


class Index:
    """The server side of a pgvector gallery: its table, the models' vector tables, the view and
    the bookkeeping tables, by the manifest's ``index``. One connection per object, opened when
    first needed."""

    def __init__(self, settings: dict):
        self.settings = settings
        self.table = settings["table"]
        self.id_column, self.image_column = settings["id_column"], settings["image_column"]
        self.view = settings["view"]
        self.serving_table, self.chunks_table = f"{self.table}_fastfill_serving", f"{self.table}_fastfill_chunks"
        self.operator, self.opclass = OPERATORS[settings.get("distance", "l2")]
        self._connection = None

    @property
    def where(self) -> str:
        return f"PostgreSQL {safe_uri(os.environ.get(URI_ENV) or self.settings['uri']) or '(PG* environment)'} " \
               f"table {self.table}"

    def connection(self):
        import psycopg

        if self._connection is None or self._connection.closed:
            self._connection = connect(self.settings["uri"])
        elif self._connection.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
            self._connection.rollback()
        return self._connection

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    @contextmanager
    def transaction(self):
        import psycopg

        connection = self.connection()
        try:
            with connection.transaction():
                yield connection
        except psycopg.OperationalError as error:
            self.close()
            raise IndexError_(f"{self.where}: {' '.join(str(error).split())[:300]}") from None

    def execute(self, statement, args=None):
        import psycopg

        try:
            return self.connection().execute(statement, args)
        except psycopg.OperationalError as error:
            self.close()
            raise IndexError_(f"{self.where}: {' '.join(str(error).split())[:300]}") from None

    # ---- what is there

    def columns(self, table: str | None = None) -> dict[str, str]:
        """A table's columns and their types (``vector(12)``, ``text``, ``bigint``); default the gallery's."""
        rows = self.execute(
            "SELECT a.attname, format_type(a.atttypid, a.atttypmod) FROM pg_attribute a "
            "WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped",
            (f'"{table or self.table}"',)).fetchall()
        return dict(rows)

    def exists(self, table: str | None = None) -> bool:
        return self.execute("SELECT to_regclass(%s) IS NOT NULL", (f'"{table or self.table}"',)).fetchone()[0]

    def count(self, table: str | None = None) -> int:
        from psycopg import sql

        return self.execute(sql.SQL("SELECT count(*) FROM {}").format(
            sql.Identifier(table or self.table))).fetchone()[0]

    def place(self, model: ModelRef) -> Place:
        """Where ``model``'s vectors are: the adopted column of the gallery's table, or its own table."""
        adopted = self.settings.get("columns", {}).get(model.key)
        if adopted:
            source = self.settings.get("sources", {}).get(model.key)
            return Place(self.table, self.id_column, adopted, source)
        return Place(vectors_table(self.table, model), "id", "embedding", "source")

    def vectors_tables(self) -> list[str]:
        """The tables of models' vectors beside the gallery's (``<table>_emb_...``)."""
        rows = self.execute("SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                            "WHERE c.relkind = 'r' AND n.nspname = current_schema() AND starts_with(c.relname, %s)",
                            (f"{self.table}_emb_",)).fetchall()
        return sorted(r[0] for r in rows)

    def has(self, place: Place) -> bool:
        return place.column in self.columns(place.table)

    def bookkeeping(self) -> None:
        """The tables the product keeps beside the gallery's: which model serves, and the chunks
        whose rows are in (created when missing)."""
        from psycopg import sql

        self.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} (one boolean PRIMARY KEY DEFAULT true CHECK (one), "
                             "model text NOT NULL, model_name text NOT NULL, model_version text NOT NULL, "
                             "dim integer NOT NULL, vectors text NOT NULL, upgrade text, "
                             "since timestamptz NOT NULL DEFAULT now())").format(sql.Identifier(self.serving_table)))
        self.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} (upgrade text NOT NULL, chunk integer NOT NULL, "
                             "items integer NOT NULL, at timestamptz NOT NULL DEFAULT now(), "
                             "PRIMARY KEY (upgrade, chunk))").format(sql.Identifier(self.chunks_table)))

    def serving(self) -> dict | None:
        """The row that says which model's vectors the view serves (``vectors``: table.column),
        or None before any."""
        from psycopg import sql
        from psycopg.rows import dict_row

        if not self.exists(self.serving_table):
            return None
        cursor = self.connection().cursor(row_factory=dict_row)
        return cursor.execute(sql.SQL("SELECT model, model_name, model_version, dim, vectors, upgrade, since "
                                      "FROM {}").format(sql.Identifier(self.serving_table))).fetchone()

    # ---- the vectors

    def read(self, place: Place, ids: np.ndarray, dim: int) -> np.ndarray:
        """The vectors at ``place`` of the items ``ids``, in that order; a DamagedObject naming the
        first id without a row or without a vector."""
        import psycopg
        from psycopg import sql

        ids = np.asarray(ids)
        out = np.empty((len(ids), dim), dtype=np.float32)
        kind = "text[]" if is_text(ids) else "bigint[]"
        query = sql.SQL("SELECT q.n, t.{col} FROM unnest(%s::" + kind + ") WITH ORDINALITY AS q(id, n) "
                        "LEFT JOIN {table} t ON t.{id} = q.id ORDER BY q.n").format(
            col=sql.Identifier(place.column), table=sql.Identifier(place.table), id=sql.Identifier(place.id_column))
        for start in range(0, len(ids), ROWS_PER_STATEMENT):
            block = ids[start:start + ROWS_PER_STATEMENT]
            values = [str(v) for v in block] if is_text(ids) else [int(v) for v in block]
            try:
                rows = self.connection().cursor(binary=True).execute(query, (values,)).fetchall()
            except psycopg.OperationalError as error:
                self.close()
                raise IndexError_(f"{self.where}: {' '.join(str(error).split())[:300]}") from None
            for n, vector in rows:
                if vector is None:
                    raise DamagedObject(f"{self.where} vectors {place.name}: item {values[n - 1]!r} has no row or no "
                                        "vector (a row deleted or a vector set to NULL by another writer); restore "
                                        "it, or re-adopt the table")
                value = np.asarray(vector.to_numpy() if hasattr(vector, "to_numpy") else vector, dtype=np.float32)
                if value.shape != (dim,):
                    raise DamagedObject(f"{self.where} vectors {place.name}: item {values[n - 1]!r} has a vector of "
                                        f"dimension {value.shape[0]}, not {dim}")
                out[start + n - 1] = value
        return out

    def _id_type(self, ids: np.ndarray) -> str:
        return self.settings.get("id_type") or ("text" if is_text(ids) else "bigint")

    def write(self, connection, place: Place, ids: np.ndarray, vectors: np.ndarray, sources) -> None:
        """Set the vectors (and sources) at ``place`` of the rows ``ids`` in the caller's
        transaction: the rows are copied into a temporary table, then one UPDATE."""
        from psycopg import sql

        id_type = self._id_type(ids)
        connection.execute(sql.SQL("CREATE TEMPORARY TABLE IF NOT EXISTS fastfill_rows (id {kind}, v vector({dim}), "
                                   "s text) ON COMMIT DROP").format(kind=sql.SQL(id_type),
                                                                    dim=sql.Literal(vectors.shape[1])))
        connection.execute("TRUNCATE fastfill_rows")
        sources = [sources] * len(ids) if isinstance(sources, str) else list(sources)
        with connection.cursor().copy("COPY fastfill_rows (id, v, s) FROM STDIN WITH (FORMAT BINARY)") as copy:
            copy.set_types([id_type, "vector", "text"])
            for item, vector, source in zip(ids.tolist(), vectors, sources):
                copy.write_row((item, vector, source))
        source = sql.SQL(", {} = r.s").format(sql.Identifier(place.source)) if place.source else sql.SQL("")
        updated = connection.execute(sql.SQL("UPDATE {table} t SET {col} = r.v{source} FROM fastfill_rows r "
                                             "WHERE t.{id} = r.id").format(
            table=sql.Identifier(place.table), col=sql.Identifier(place.column), source=source,
            id=sql.Identifier(place.id_column))).rowcount
        if updated != len(ids):
            raise DamagedObject(f"{self.where}: {len(ids) - updated} of {len(ids)} items have no row in "
                                f"{place.table} (deleted by another writer?); nothing of this write was kept")

    def new_vectors(self, place: Place, dim: int, parts) -> None:
        """``place``'s table made anew (dropped first: a switch or a write cut short, or an
        aborted upgrade's) and filled from ``parts``, (ids, vectors, sources) in turn, by COPY:
        no index yet, so no index is maintained row by row (``ann_index`` builds it in bulk)."""
        from psycopg import sql

        table = sql.Identifier(place.table)
        self.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(table))
        created = False
        for ids, vectors, sources in parts:
            if not created:
                self.execute(sql.SQL("CREATE TABLE {} (id {kind} PRIMARY KEY, embedding vector({dim}) NOT NULL, "
                                     "source text NOT NULL)").format(table, kind=sql.SQL(self._id_type(ids)),
                                                                     dim=sql.Literal(int(dim))))
                created = True
            sources = [sources] * len(ids) if isinstance(sources, str) else list(sources)
            with self.transaction() as connection, connection.cursor().copy(sql.SQL(
                    "COPY {} (id, embedding, source) FROM STDIN WITH (FORMAT BINARY)").format(table)) as copy:
                copy.set_types([self._id_type(ids), "vector", "text"])
                for item, vector, source in zip(ids.tolist(), vectors, sources):
                    copy.write_row((item, vector, source))

    def drop(self, place: Place) -> None:
        from psycopg import sql

        if place.table != self.table:
            self.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(place.table)))
        else:
            self.execute(sql.SQL("ALTER TABLE {} DROP COLUMN IF EXISTS {}").format(
                sql.Identifier(place.table), sql.Identifier(place.column)))

    def ann_index(self, place: Place) -> None:
        """The ANN index of ``place``'s vectors (gallery.pgvector.ann, with pgvector's operator
        class for the gallery's distance), built when missing; then ANALYZE."""
        from psycopg import sql

        kind = self.settings.get("ann", "hnsw")
        if kind != "none" and not self.ann_indexed(place):
            name = f"{place.table}_{place.column}_{kind}"
            if len(name) > 63:
                name = f"{name[:50]}_{hashlib.sha1(name.encode()).hexdigest()[:12]}"
            if kind == "hnsw":
                options = sql.SQL("WITH (m = {}, ef_construction = {})").format(
                    sql.Literal(int(self.settings.get("hnsw_m", 16))),
                    sql.Literal(int(self.settings.get("hnsw_ef_construction", 64))))
            else:
                lists = self.settings.get("ivfflat_lists") or max(1, int(self.count(place.table) ** 0.5))
                options = sql.SQL("WITH (lists = {})").format(sql.Literal(int(lists)))
            memory = self.settings.get("index_memory") or "1GB"
            try:
                with self.transaction() as connection:  # the build's memory, for this statement only
                    connection.execute(sql.SQL("SET LOCAL maintenance_work_mem = {}").format(sql.Literal(memory)))
                    connection.execute(sql.SQL("CREATE INDEX IF NOT EXISTS {name} ON {t} USING {kind} ({c} {ops}) "
                                               "{options}").format(
                        name=sql.Identifier(name), t=sql.Identifier(place.table), kind=sql.SQL(kind),
                        c=sql.Identifier(place.column), ops=sql.SQL(self.opclass), options=options))
            except IndexError_ as error:
                if "maintenance_work_mem" in str(error):
                    raise IndexError_(f"{error}; raise gallery.pgvector.index_memory (now {memory}) to what it "
                                      "says is required, or lower gallery.pgvector.ivfflat_lists") from None
                raise
        self.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(place.table)))

    def ann_indexed(self, place: Place) -> bool:
        """Whether ``place``'s vector column has an HNSW or IVFFlat index (the team's own too)."""
        return bool(self.execute(
            "SELECT count(*) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_am am ON am.oid = c.relam "
            "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
            "WHERE i.indrelid = to_regclass(%s) AND a.attname = %s AND am.amname IN ('hnsw', 'ivfflat')",
            (f'"{place.table}"', place.column)).fetchone()[0])

    def serve(self, model: ModelRef, place: Place, upgrade: str | None) -> None:
        """Readers move to ``model``'s vectors at ``place`` in one transaction: the view
        redefined over them and the serving row rewritten together (a reader's statement sees
        one or the other)."""
        from psycopg import sql

        source = sql.SQL("coalesce({}, {})").format(sql.Identifier(place.source), sql.Literal(EMBEDDED)) \
            if place.source else sql.Literal(EMBEDDED)
        with self.transaction() as connection:
            connection.execute(sql.SQL("DROP VIEW IF EXISTS {}").format(sql.Identifier(self.view)))
            connection.execute(sql.SQL(
                "CREATE VIEW {view} AS SELECT {id} AS id, {col} AS embedding, {model}::text AS model, "
                "{source}::text AS source FROM {table}").format(
                view=sql.Identifier(self.view), id=sql.Identifier(place.id_column), col=sql.Identifier(place.column),
                model=sql.Literal(model.uri), source=source, table=sql.Identifier(place.table)))
            connection.execute(sql.SQL("DELETE FROM {}").format(sql.Identifier(self.serving_table)))
            connection.execute(sql.SQL("INSERT INTO {} (model, model_name, model_version, dim, vectors, upgrade) "
                                       "VALUES (%s, %s, %s, %s, %s, %s)").format(sql.Identifier(self.serving_table)),
                               (model.uri, model.name, str(model.version), int(model.dim or 0), place.name, upgrade))

    def product_distances(self, distances: list) -> np.ndarray:
        """pgvector's distances as the product gives them: squared L2, or 1 - cosine."""
        distances = np.asarray(distances, dtype=np.float64)
        return distances ** 2 if self.operator == "<->" else distances

    def embedded_count(self) -> int:
        """Rows of the view whose vector the serving model embedded (the rest: h(old))."""
        from psycopg import sql

        return int(self.execute(sql.SQL("SELECT count(*) FROM {} WHERE source = %s").format(
            sql.Identifier(self.view)), (EMBEDDED,)).fetchone()[0])

    def chunk_done(self, upgrade: str) -> set[int]:
        from psycopg import sql

        rows = self.execute(sql.SQL("SELECT chunk FROM {} WHERE upgrade = %s").format(
            sql.Identifier(self.chunks_table)), (upgrade,)).fetchall()
        return {int(r[0]) for r in rows}

    def search(self, queries: np.ndarray, k: int, model: str | None = None) -> tuple[list, list, list, list]:
        """The view's k nearest rows of each query, by pgvector's operator for the gallery's
        distance: (ids, distances, the serving model of each answer, sources), one list per query.
        ``model``: the model URI the queries were embedded with; the view answers only while it
        serves that model (``WHERE model = ...``, decided before any distance is computed), so a
        query embedded for the space the view served a moment ago gets no rows, never another
        space's answer: read the serving row again and re-embed (``docs/serving.md``)."""
        from psycopg import sql

        ids, distances, models, sources = [], [], [], []
        statement = sql.SQL("SELECT id, embedding {op} %s AS d, model, source FROM {view} {where} "
                            "ORDER BY embedding {op} %s LIMIT %s").format(
            op=sql.SQL(self.operator), view=sql.Identifier(self.view),
            where=sql.SQL("WHERE model = %s" if model else ""))
        with self.transaction() as connection:  # one snapshot for every query of the batch
            self._search_settings(connection)
            for query in np.asarray(queries, dtype=np.float32):
                args = (query, model, query, int(k)) if model else (query, query, int(k))
                rows = connection.execute(statement, args).fetchall()
                ids.append([r[0] for r in rows])
                distances.append([float(r[1]) for r in rows])
                models.append({r[2] for r in rows})
                sources.append([r[3] for r in rows])
        return ids, distances, models, sources

    def _search_settings(self, connection) -> None:
        if self.settings.get("ann") == "hnsw":
            connection.execute(f"SET LOCAL hnsw.ef_search = {int(self.settings.get('ef_search', 40))}")
        elif self.settings.get("ann") == "ivfflat":
            connection.execute(f"SET LOCAL ivfflat.probes = {int(self.settings.get('ivfflat_probes', 10))}")


class PgGallery(ServedGallery):
    """A gallery whose vectors are rows of PostgreSQL tables that queries are served from (see
    the module's docstring); the manifest, items and upgrade objects are in its store."""

    layout = PGVECTOR

    @property
    def index(self) -> Index:
        settings = self.manifest()["index"]
        if self._index is None or self._index.settings != settings:
            if self._index is not None:
                self._index.close()
            self._index = Index(settings)
        return self._index

    # ---- features

    def _rows(self, model: ModelRef, ids: np.ndarray) -> np.ndarray:
        index = self.index
        place = index.place(model)
        columns = index.columns(place.table)
        if place.column not in columns:
            raise ObjectMissing(f"{index.where} holds no features of {model.uri} (no {place.name})")
        dim = model.dim or int(re.search(r"\((\d+)\)", columns[place.column]).group(1))
        return check_features(index.read(place, ids, dim), model.dim, f"{index.where} vectors {place.name}")

    def write_features(self, model: ModelRef, parts: Iterable[tuple[int, np.ndarray]]) -> None:
        """``model``'s vectors from ``parts``. Those an upgrade's chunks kept up to date (the
        finish) are not written again: the parts are read to their end (they check that every
        part is backfilled) and the rows are the chunks'."""
        index = self.index
        place = index.place(model)
        serving = index.serving()
        if serving is not None and serving["vectors"] == place.name and index.has(place):
            for _ in parts:
                pass
            return
        ids = self.ids()

        def rows():
            for part, features in parts:
                start, stop = self.part_bounds(part)
                yield ids[start:stop], features, EMBEDDED

        index.new_vectors(place, int(model.dim), rows())
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
        """Drop the vectors of every model but the serving one: the other models' tables, and a
        team's adopted column once another model serves; returns how many."""
        index = self.index
        keep = index.place(self.model)
        drop = [Place(table, "id", "embedding", "source") for table in index.vectors_tables() if table != keep.table]
        columns = index.columns()
        drop += [Place(index.table, index.id_column, column, None)
                 for column in self.manifest()["index"].get("columns", {}).values()
                 if column in columns and Place(index.table, index.id_column, column, None) != keep]
        for place in drop:
            index.drop(place)
        return len(drop)

    def check_sources(self, sequential: bool = False) -> None:
        index = self.index
        if not index.exists():
            raise GalleryError(f"{index.where} does not exist, though {self.store.uri}'s manifest says layout pgvector; "
                               "restore it, or re-adopt the table. Nothing was written.")
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
        if dim > MAX_DIM:
            return (f"{model.uri} embeds into {dim:,} dimensions; pgvector's vector type holds at most {MAX_DIM:,}. "
                    "Keep this gallery in another layout (`fastfill gallery convert --layout lance`)")
        if ann != "none" and dim > MAX_INDEXED_DIM:
            return (f"{model.uri} embeds into {dim:,} dimensions; pgvector's {ann} index takes at most "
                    f"{MAX_INDEXED_DIM:,}, and this gallery's index ({self.index.where}) was made with ann {ann}. "
                    "Choose a model of at most 2,000 dimensions, or keep the gallery in another layout "
                    "(`fastfill gallery convert --layout lance`)")
        return None

    def sync_serving(self, manifest: dict | None = None) -> dict:
        """Make the view serve what ``manifest`` (default: the stored one) says; returns the
        serving row."""
        from fastfill.components.gallery.upgrade.planning import load_plan

        manifest = manifest or self.manifest(refresh=True)
        index = self.index
        index.bookkeeping()
        upgrade = manifest.get("upgrade")
        plan = load_plan(self.store, upgrade) if upgrade else None
        model = plan.new if plan is not None else ModelRef.from_dict(manifest["model"])
        place = index.place(model)
        serving = index.serving()
        if serving is not None and serving["vectors"] == place.name and serving["model"] == model.uri \
                and serving["upgrade"] == (plan.id if plan else None):
            return serving
        if plan is not None and (serving is None or serving["vectors"] != place.name):
            self._prepare_switch(plan, place)
        index.serve(model, place, plan.id if plan else None)
        return index.serving()

    def _prepare_switch(self, plan, place: Place) -> None:
        """The new model's table written with the mixed gallery as it is now (h(old); the new
        features of the chunks already done, recorded as done) and its ANN index built, before
        any reader moves to it."""
        from psycopg import sql

        from fastfill.components.gallery.upgrade.backfill import done_chunks, iter_mixed_parts

        index = self.index
        ids = self.ids()

        def rows():
            for part, features, backfilled in iter_mixed_parts(self, plan):
                start, stop = self.part_bounds(part)
                yield ids[start:stop], features, [EMBEDDED if b else MAPPED for b in backfilled]

        index.new_vectors(place, int(plan.new.dim), rows())
        done = done_chunks(self.store, plan.id)
        with index.transaction() as connection:  # an earlier try of the same upgrade (aborted) left its own
            connection.execute(sql.SQL("DELETE FROM {} WHERE upgrade = %s").format(sql.Identifier(index.chunks_table)),
                               (plan.id,))
            for chunk in done:
                start, stop = plan.chunk_bounds(chunk)
                connection.execute(sql.SQL("INSERT INTO {} (upgrade, chunk, items) VALUES (%s, %s, %s) ON CONFLICT "
                                           "DO NOTHING").format(sql.Identifier(index.chunks_table)),
                                   (plan.id, chunk, stop - start))
        index.ann_index(place)

    def serve_chunk(self, plan, chunk: int, positions: np.ndarray, features: np.ndarray, embedded: np.ndarray) -> None:
        """A chunk's rows, in one transaction with its completion record: once (a chunk whose
        record is there is not written again)."""
        from psycopg import sql

        index = self.index
        with index.transaction() as connection:
            inserted = connection.execute(
                sql.SQL("INSERT INTO {} (upgrade, chunk, items) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING").format(
                    sql.Identifier(index.chunks_table)), (plan.id, int(chunk), len(positions))).rowcount
            if inserted:
                index.write(connection, index.place(plan.new), self.ids()[np.asarray(positions, dtype=np.int64)],
                            features, [EMBEDDED if e else MAPPED for e in embedded])

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
        self.settings["id_type"] = "text" if is_text(ids) else "bigint"
        index.execute(sql.SQL("CREATE TABLE {t} ({id} {kind} PRIMARY KEY, {image} text, label bigint)").format(
            t=sql.Identifier(index.table), id=sql.Identifier(index.id_column), kind=sql.SQL(self.settings["id_type"]),
            image=sql.Identifier(index.image_column)))
        index.drop(self.place)  # a write cut short left it
        index.execute(sql.SQL("CREATE TABLE {} (id {kind} PRIMARY KEY, embedding vector({dim}) NOT NULL, "
                              "source text NOT NULL)").format(sql.Identifier(self.place.table),
                                                              kind=sql.SQL(self.settings["id_type"]),
                                                              dim=sql.Literal(int(self.model.dim))))
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
            with connection.cursor().copy(sql.SQL("COPY {} (id, embedding, source) FROM STDIN WITH (FORMAT BINARY)").format(
                    sql.Identifier(self.place.table))) as copy:
                copy.set_types([id_type, "vector", "text"])
                for item, vector in zip(ids.tolist(), features):
                    copy.write_row((item, vector, EMBEDDED))

    def close(self) -> None:
        self.index.bookkeeping()
        self.index.ann_index(self.place)
        self.index.serve(self.model, self.place, None)
        self.index.close()

    def manifest_fields(self) -> dict:
        return {"index": self.settings}

