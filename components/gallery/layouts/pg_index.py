"""The server side of a pgvector gallery (``components.gallery.layouts.pg_table``): the connection
(a password never in a URI it keeps or shows), the names the product derives beside the team's
table (within PostgreSQL's 63 bytes), the marks that say which objects are the product's and of
which gallery (``ownership``), and ``Index``: the statements that read and write the gallery's
table, each model's vectors table, the view and the bookkeeping tables."""

from __future__ import annotations

import hashlib
import os
import re
from contextlib import contextmanager
from typing import Any

import numpy as np

from fastfill.components.gallery.layouts.catalog import EMBEDDED, MAPPED, PGVECTOR, GalleryError, Serving
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
from fastfill.components.gallery.store import DamagedObject, StoreError, StoreUnreachable
from fastfill.components.platform.registry import ModelRef
from fastfill.components.platform.secrets import password_for, redact, take_password

URI_ENV = "FASTFILL_PG_URI"
MAX_DIM, MAX_INDEXED_DIM = 16000, 2000  # pgvector 0.6: the vector type; an HNSW or IVFFlat index
OPERATORS = {"l2": ("<->", "vector_l2_ops"), "cosine": ("<=>", "vector_cosine_ops")}
ROWS_PER_STATEMENT = 20000
MAX_NAME = 63  # bytes: PostgreSQL cuts longer identifiers


class IndexError_(StoreError):
    """The index server refused a statement (retried as a store error; exit 6)."""


class IndexUnreachable(IndexError_, StoreUnreachable):
    """The index server cannot be reached, or the connection to it was lost (retried; the commands
    exit 5, a service that does not answer)."""


LOST = ("08", "57P01", "57P02", "57P03")  # SQLSTATEs of a connection failure or a server shutting down


def failed(where: str, error) -> IndexError_:
    """The product's error for psycopg's OperationalError ``error``: unreachable when the
    connection is gone, else a refused statement."""
    line = f"{where}: {redact(' '.join(str(error).split()))[:300]}"
    state = getattr(error, "sqlstate", None)
    if state is None or state.startswith(LOST):
        return IndexUnreachable(f"{line}; check that the server is up and that gallery.pgvector.uri (or "
                                "FASTFILL_PG_URI) names it, then run the same command again: finished work is kept")
    return IndexError_(line)


def safe_uri(uri: str) -> str:
    """``uri`` without its password (the manifest never keeps one, no line shows one): taken out
    on the raw text, whatever characters the password holds (components/platform/secrets.py)."""
    if not uri:
        return uri
    return redact(take_password(uri))


def plain_identifier(name: str, what: str) -> str:
    """``name``, when it is a plain PostgreSQL identifier; else an error naming ``what`` it is."""
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_$]{0,62}", name):
        raise GalleryError(f"{what} {name!r} is not a plain PostgreSQL identifier (letters, digits and _, at most 63, "
                           "not starting with a digit); name the table or column as it is in the database")
    return name


def derived_name(prefix: str, suffix: str) -> str:
    """``<prefix>_<suffix>``, the name of an object the product makes beside a team's table, within
    PostgreSQL's 63 bytes: a longer one keeps the suffix (what the object is) whole and shortens
    the prefix with a digest of the whole name, so two derived names never become one."""
    name = f"{prefix}_{suffix}"
    if len(name.encode()) <= MAX_NAME:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:10]
    keep = MAX_NAME - len(suffix.encode()) - len(digest) - 2
    if keep >= 8:
        return f"{prefix[:keep]}_{digest}_{suffix}"
    return f"{name[:MAX_NAME - len(digest) - 1]}_{digest}"


def vectors_table(prefix: str, model: ModelRef) -> str:
    """The table of ``model``'s vectors beside the gallery's table: ``<prefix>_emb_<name>_v<version>``
    (lowercase; ``prefix``: gallery.pgvector.prefix, by default the table's name)."""
    suffix = re.sub(r"[^a-z0-9_]+", "_", f"emb_{model.name}_v{model.version}".lower())
    return derived_name(re.sub(r"[^a-z0-9_$]+", "_", prefix.lower()), suffix)


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
    """A connection (autocommit) to ``uri`` (or ``FASTFILL_PG_URI``) with pgvector's types. A
    password written in either URI reaches libpq as the ``password`` keyword, never in the URI
    (libpq echoes a URI it cannot read); else libpq finds one in PGPASSWORD or ~/.pgpass."""
    import psycopg
    from pgvector.psycopg import register_vector

    target = take_password(os.environ.get(URI_ENV) or uri)
    password = password_for(target) if target else None
    where = safe_uri(target) or "the PG* environment"
    try:
        credentials: dict[str, Any] = {"password": password} if password is not None else {}
        connection = psycopg.connect(target, autocommit=True, connect_timeout=10, **credentials)
    except psycopg.OperationalError as error:
        raise IndexUnreachable(f"cannot connect to PostgreSQL at {where}: "
                               f"{redact(' '.join(str(error).split()))[:300]}; check that the server is up and that "
                               "gallery.pgvector.uri (or FASTFILL_PG_URI, PGPASSWORD) names it and its password, then "
                               "run the same command again: finished work is kept") from None
    except psycopg.ProgrammingError as error:  # libpq cannot read the URI
        raise GalleryError(f"cannot connect to PostgreSQL at {where}: {redact(' '.join(str(error).split()))[:300]}; "
                           "correct gallery.pgvector.uri or FASTFILL_PG_URI (percent-encode the password's special "
                           "characters)") from None
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
    store ``store_uri`` (it names the table when the settings do not); a new gallery id
    (``owner``) marks every object the product makes for it."""
    table = plain_identifier(config.table or default_table(store_uri), "gallery.pgvector.table")
    prefix = plain_identifier(config.prefix or table, "gallery.pgvector.prefix")
    return {"kind": PGVECTOR, "uri": safe_uri(config.uri), "table": table,
            "id_column": plain_identifier(config.id_column, "gallery.pgvector.id_column"),
            "image_column": plain_identifier(config.image_column, "gallery.pgvector.image_column"),
            "view": plain_identifier(config.view or derived_name(table, "serving"), "gallery.pgvector.view"),
            "prefix": prefix, OWNER_KEY: new_owner(), STORE_KEY: str(store_uri),
            "distance": distance, "ann": config.ann, "hnsw_m": config.hnsw_m,
            "hnsw_ef_construction": config.hnsw_ef_construction, "ef_search": config.ef_search,
            "ivfflat_lists": config.ivfflat_lists, "ivfflat_probes": config.ivfflat_probes,
            "index_memory": config.index_memory, "columns": {}}


RELKINDS = {"r": "table", "p": "partitioned table", "v": "view", "m": "materialized view", "i": "index",
            "I": "partitioned index", "S": "sequence", "f": "foreign table", "c": "type"}
TABLE, VECTORS, VIEW, SERVING, CHUNKS, ANN = "table", "vectors", "view", "serving", "chunks", "index"
HELD = "held"  # role of an upgrade's table of h(old) rows (``held_table``)


class Index:
    """The server side of a pgvector gallery: its table, the models' vector tables, the view and
    the bookkeeping tables, by the manifest's ``index``. One connection per object, opened when
    first needed."""

    def __init__(self, settings: dict, store_uri: str = ""):
        self.settings = settings
        self.table = settings["table"]
        self.id_column, self.image_column = settings["id_column"], settings["image_column"]
        self.view = settings["view"]
        self.prefix = settings.get("prefix") or self.table
        self.serving_table = derived_name(self.prefix, "fastfill_serving")
        self.chunks_table = derived_name(self.prefix, "fastfill_chunks")
        self.operator, self.opclass = OPERATORS[settings.get("distance", "l2")]
        self.store_uri = settings.get(STORE_KEY) or str(store_uri)
        self.owner = owner_of(settings, self.store_uri)
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
            raise failed(self.where, error) from None
        except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn) as error:
            raise self._vanished(error) from None

    def execute(self, statement, args=None):
        import psycopg

        try:
            return self.connection().execute(statement, args)
        except psycopg.OperationalError as error:
            self.close()
            raise failed(self.where, error) from None
        except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn) as error:
            raise self._vanished(error) from None

    def _vanished(self, error) -> DamagedObject:
        """A table, view or column the gallery uses is not there (dropped by another writer)."""
        first = " ".join(str(error).splitlines()[0].split())[:200] if str(error) else type(error).__name__
        return DamagedObject(f"{self.where}: {first}: an object the "
                             "gallery uses was dropped or renamed by another writer; `fastfill upgrade status` says "
                             "what serves, and docs/serving.md how to restore it")

    # ---- whose objects

    def object(self, name: str) -> tuple[str, dict | None] | None:
        """The kind (``table``, ``view``, ``index``, ...) of the object called ``name`` and its
        product mark (None: the team's), or None when the name is free."""
        row = self.execute("SELECT c.relkind, obj_description(c.oid, 'pg_class') FROM pg_class c "
                           "WHERE c.oid = to_regclass(%s)", (f'"{name}"',)).fetchone()
        if row is None:
            return None
        return RELKINDS.get(row[0], "relation"), read_mark(row[1])

    def ours(self, name: str, role: str, setting: str) -> bool:
        """Whether ``name`` is this gallery's ``role`` object (True) or free (False); anything else
        holding the name (the team's, another gallery's, one of ours of another kind) is refused
        (NotOurs) naming it and ``setting``, the one that names ours otherwise."""
        found = self.object(name)
        if found is None:
            return False
        kind, marked = found
        if marked is not None and marked.get("gallery") == self.owner and marked.get("role") == role:
            return True
        raise refusal(f"{self.where}: the {kind} {name}", marked, self.owner, setting,
                      mark_it=f"COMMENT ON {kind.upper()} \"{name}\" IS '{self.mark_text(role)}'",
                      from_owner="upgrade, abort, roll back, gc or release it")

    def mark_text(self, role: str) -> str:
        return mark(self.owner, role, self.store_uri)

    def marking(self, connection, kind: str, name: str, role: str) -> None:
        """``COMMENT ON`` the object the product just made, in the caller's transaction."""
        from psycopg import sql

        connection.execute(sql.SQL("COMMENT ON {} {} IS {}").format(sql.SQL(kind.upper()), sql.Identifier(name),
                                                                   sql.Literal(self.mark_text(role))))

    def check_names(self, *places: Place) -> None:
        """Every name this gallery uses (the view, the bookkeeping tables, ``places``' vectors
        tables and their ANN indexes) is free or this gallery's; before any write."""
        self.ours(self.view, VIEW, "gallery.pgvector.view")
        self.ours(self.serving_table, SERVING, "gallery.pgvector.prefix")
        self.ours(self.chunks_table, CHUNKS, "gallery.pgvector.prefix")
        for place in places:
            if place.table != self.table:
                self.ours(place.table, VECTORS, "gallery.pgvector.prefix")
                self.ours(self.held_table(place), HELD, "gallery.pgvector.prefix")
            if not (self.exists(place.table) and self.has(place) and self.ann_indexed(place)):
                self.ours(self.ann_name(place), ANN, "gallery.pgvector.prefix")

    def kind_of_table(self) -> None:
        """The gallery's table is a table (a view, a materialized view or a foreign table is named)."""
        found = self.object(self.table)
        if found is not None and found[0] not in ("table", "partitioned table"):
            raise GalleryError(f"{self.where} is a {found[0]}, not a table: adopt the table the {found[0]} reads "
                               "from (gallery.pgvector.table, --table). Nothing was written.")

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
        return Place(vectors_table(self.prefix, model), "id", "embedding", "source")

    def vectors_tables(self) -> list[str]:
        """The tables of models' vectors this gallery made (by their mark, whatever their name: a
        team's table of a like name is not one of them)."""
        rows = self.execute("SELECT c.relname, obj_description(c.oid, 'pg_class') FROM pg_class c "
                            "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.relkind = 'r' "
                            "AND n.nspname = current_schema() AND obj_description(c.oid, 'pg_class') LIKE 'fastfill %%'"
                            ).fetchall()
        return sorted(name for name, text in rows
                      if (found := read_mark(text)) and found["gallery"] == self.owner and found.get("role") == VECTORS)

    def has(self, place: Place) -> bool:
        return place.column in self.columns(place.table)

    def bookkeeping(self) -> None:
        """The tables the product keeps beside the gallery's: which model serves (and which
        gallery owns the view), and the chunks whose rows are in; created and marked when missing,
        refused when their names are another's."""
        from psycopg import sql

        if not self.ours(self.serving_table, SERVING, "gallery.pgvector.prefix"):
            with self.transaction() as connection:
                connection.execute(sql.SQL(
                    "CREATE TABLE {} (one boolean PRIMARY KEY DEFAULT true CHECK (one), model text NOT NULL, "
                    "model_name text NOT NULL, model_version text NOT NULL, dim integer NOT NULL, vectors text NOT NULL, "
                    "upgrade text, gallery text NOT NULL, store text NOT NULL, since timestamptz NOT NULL DEFAULT now())"
                ).format(sql.Identifier(self.serving_table)))
                self.marking(connection, "table", self.serving_table, SERVING)
        if not self.ours(self.chunks_table, CHUNKS, "gallery.pgvector.prefix"):
            with self.transaction() as connection:
                connection.execute(sql.SQL("CREATE TABLE {} (upgrade text NOT NULL, chunk integer NOT NULL, "
                                           "items integer NOT NULL, at timestamptz NOT NULL DEFAULT now(), "
                                           "first integer, stop integer, PRIMARY KEY (upgrade, chunk))").format(
                    sql.Identifier(self.chunks_table)))
                self.marking(connection, "table", self.chunks_table, CHUNKS)
        elif "first" not in self.columns(self.chunks_table):  # made by a release that kept no places
            self.execute(sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS first integer, ADD COLUMN IF NOT EXISTS "
                                 "stop integer").format(sql.Identifier(self.chunks_table)))

    def serving(self) -> Serving | None:
        """The row that says which model's vectors the view serves (``vectors``: table.column),
        or None before any."""
        import psycopg
        from psycopg import sql
        from psycopg.rows import dict_row

        if not self.ours(self.serving_table, SERVING, "gallery.pgvector.prefix"):
            return None
        cursor = self.connection().cursor(row_factory=dict_row)
        try:
            row = cursor.execute(sql.SQL("SELECT model, model_name, model_version, dim, vectors, upgrade, gallery, "
                                         "store, since FROM {}").format(sql.Identifier(self.serving_table))).fetchone()
        except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn) as error:
            raise self._vanished(error) from None
        if row is None:
            return None
        return Serving(row["model"], row["model_name"], row["model_version"], row["dim"], row["vectors"],
                       row["upgrade"], str(row["since"]) if row["since"] is not None else None, row["gallery"],
                       row["store"])

    # ---- the vectors

    def read(self, place: Place, ids: np.ndarray, dim: int) -> np.ndarray:
        """The vectors at ``place`` of the items ``ids``, in that order (while an upgrade's chunks
        fill ``place``, an item not yet there is read from its held table: h(old)); a
        DamagedObject naming the first id without a row or without a vector."""
        import psycopg
        from psycopg import sql

        ids = np.asarray(ids)
        out = np.empty((len(ids), dim), dtype=np.float32)
        kind = "text[]" if is_text(ids) else "bigint[]"
        held = self.held(place)
        vector = sql.SQL("coalesce(t.{col}, h.embedding)" if held else "t.{col}").format(
            col=sql.Identifier(place.column))
        join = sql.SQL("LEFT JOIN {} h ON h.id = q.id").format(sql.Identifier(held)) if held else sql.SQL("")
        query = sql.SQL("SELECT q.n, {vector} FROM unnest(%s::" + kind + ") WITH ORDINALITY AS q(id, n) "
                        "LEFT JOIN {table} t ON t.{id} = q.id {join} ORDER BY q.n").format(
            vector=vector, table=sql.Identifier(place.table), id=sql.Identifier(place.id_column), join=join)
        for start in range(0, len(ids), ROWS_PER_STATEMENT):
            block = ids[start:start + ROWS_PER_STATEMENT]
            values = [str(v) for v in block] if is_text(ids) else [int(v) for v in block]
            try:
                rows = self.connection().cursor(binary=True).execute(query, (values,)).fetchall()
            except psycopg.OperationalError as error:
                self.close()
                raise failed(self.where, error) from None
            except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn) as error:
                raise self._vanished(error) from None
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

        if self.ours(place.table, VECTORS, "gallery.pgvector.prefix"):
            self.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(place.table)))
        created = False
        for ids, vectors, sources in parts:
            with self.transaction() as connection:
                if not created:
                    self.create_vectors(connection, place.table, self._id_type(ids), dim)
                    created = True
                self.append(connection, place, ids, vectors, sources)

    def create_vectors(self, connection, table: str, id_type: str, dim: int) -> None:
        """A model's vectors table (id, embedding, source) created and marked as this gallery's,
        in the caller's transaction."""
        from psycopg import sql

        connection.execute(sql.SQL("CREATE TABLE {} (id {kind} PRIMARY KEY, embedding vector({dim}) NOT NULL, "
                                   "source text NOT NULL)").format(sql.Identifier(table), kind=sql.SQL(id_type),
                                                                   dim=sql.Literal(int(dim))))
        self.marking(connection, "table", table, VECTORS)

    def drop(self, place: Place) -> bool:
        """``place``'s table dropped when it is one this gallery made (its mark); a column of the
        team's table never is. Whether it was."""
        from psycopg import sql

        if place.table == self.table or not self.ours(place.table, VECTORS, "gallery.pgvector.prefix"):
            return False
        self.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(place.table)))
        return True

    def ann_index(self, place: Place, rows: int | None = None) -> None:
        """The ANN index of ``place``'s vectors (gallery.pgvector.ann, with pgvector's operator
        class for the gallery's distance), built when missing; then ANALYZE. IVFFlat's lists:
        gallery.pgvector.ivfflat_lists, else the square root of ``rows``, the rows the table is
        to hold (default: those it holds)."""
        from psycopg import sql

        kind = self.settings.get("ann", "hnsw")
        if kind != "none" and not self.ann_indexed(place):
            name = self.ann_name(place)
            self.ours(name, ANN, "gallery.pgvector.prefix")  # a name taken by another's index is refused
            if kind == "hnsw":
                options = sql.SQL("WITH (m = {}, ef_construction = {})").format(
                    sql.Literal(int(self.settings.get("hnsw_m", 16))),
                    sql.Literal(int(self.settings.get("hnsw_ef_construction", 64))))
            else:
                lists = self.lists(rows if rows is not None else self.count(place.table))
                options = sql.SQL("WITH (lists = {})").format(sql.Literal(int(lists)))
            memory = self.settings.get("index_memory") or "1GB"
            try:
                with self.transaction() as connection:  # the build's memory, for this statement only
                    connection.execute(sql.SQL("SET LOCAL maintenance_work_mem = {}").format(sql.Literal(memory)))
                    connection.execute(sql.SQL("CREATE INDEX {name} ON {t} USING {kind} ({c} {ops}) "
                                               "{options}").format(
                        name=sql.Identifier(name), t=sql.Identifier(place.table), kind=sql.SQL(kind),
                        c=sql.Identifier(place.column), ops=sql.SQL(self.opclass), options=options))
                    self.marking(connection, "index", name, ANN)
            except IndexError_ as error:
                if "maintenance_work_mem" in str(error):
                    raise GalleryError(f"{error}; raise gallery.pgvector.index_memory (now {memory}) to what it "
                                      "says is required, or lower gallery.pgvector.ivfflat_lists") from None
                raise
        self.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(place.table)))

    def lists(self, rows: int) -> int:
        """IVFFlat's lists for a table of ``rows`` rows."""
        return int(self.settings.get("ivfflat_lists") or max(1, int(rows ** 0.5)))

    # ---- an upgrade's held rows: the chunks append, nothing is rewritten

    def held_table(self, place: Place) -> str:
        """The name of the table that holds, while an upgrade fills ``place``'s table chunk by
        chunk, every item's row as the switch found it (h(old), or the new features of a chunk
        done while planning) and its rank in the backfill order."""
        return derived_name(place.table, "held")

    def held(self, place: Place) -> str | None:
        """``place``'s held table when there is one of this gallery's (an upgrade switched to
        ``place`` and has not finished), else None; a name taken by another's is refused."""
        if place.table == self.table:
            return None
        name = self.held_table(place)
        return name if self.ours(name, HELD, "gallery.pgvector.prefix") else None

    def held_tables(self) -> list[str]:
        """Every held table of this gallery's (by its mark)."""
        return [name for name, kind, role in self.marked() if role == HELD and kind == "table"]

    def new_held(self, place: Place, dim: int, parts) -> int:
        """An upgrade's switch to ``place``: its held table (every item, ``parts`` of (ids,
        vectors, ranks, done)) and ``place``'s table (the items whose chunk is done, embedded)
        made anew (an earlier try's dropped first) and filled by COPY; the held table's ANN index
        built in bulk. Returns the rows of ``place``'s table."""
        from psycopg import sql

        held = self.held_table(place)
        for name, role in ((held, HELD), (place.table, VECTORS)):
            if self.ours(name, role, "gallery.pgvector.prefix"):
                self.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(name)))
        rows, created = 0, False
        for ids, vectors, ranks, done in parts:
            id_type = self._id_type(ids)
            with self.transaction() as connection:
                if not created:
                    connection.execute(sql.SQL("CREATE TABLE {} (id {kind} PRIMARY KEY, embedding vector({dim}) "
                                               "NOT NULL, rank integer NOT NULL)").format(
                        sql.Identifier(held), kind=sql.SQL(id_type), dim=sql.Literal(int(dim))))
                    self.marking(connection, "table", held, HELD)
                    self.create_vectors(connection, place.table, id_type, dim)
                    created = True
                with connection.cursor().copy(sql.SQL("COPY {} (id, embedding, rank) FROM STDIN WITH (FORMAT BINARY)"
                                                      ).format(sql.Identifier(held))) as copy:
                    copy.set_types([id_type, "vector", "int4"])
                    for item, vector, rank in zip(ids.tolist(), vectors, ranks.tolist()):
                        copy.write_row((item, vector, rank))
                if done.any():
                    self.append(connection, place, ids[done], vectors[done], EMBEDDED)
                    rows += int(done.sum())
        self.ann_index(Place(held, "id", "embedding", None))
        return rows

    def append(self, connection, place: Place, ids: np.ndarray, vectors: np.ndarray, sources) -> None:
        """Rows added to ``place``'s table by COPY, in the caller's transaction (a chunk's: its
        rows enter the ANN index as they are written; no other row is touched)."""
        from psycopg import sql

        sources = [sources] * len(ids) if isinstance(sources, str) else list(sources)
        with connection.cursor().copy(sql.SQL("COPY {} (id, embedding, source) FROM STDIN WITH (FORMAT BINARY)").format(
                sql.Identifier(place.table))) as copy:
            copy.set_types([self._id_type(ids), "vector", "text"])
            for item, vector, source in zip(ids.tolist(), vectors, sources):
                copy.write_row((item, vector, source))

    def index_when_full_enough(self, place: Place, num_items: int) -> None:
        """``place``'s ANN index, built once its table holds enough rows to train it (HNSW: at
        once; IVFFlat: as many as it has lists, sized for the ``num_items`` the table will
        hold): until then a search scans its few rows."""
        kind = self.settings.get("ann", "hnsw")
        if kind == "none" or self.ann_indexed(place):
            return
        if kind == "hnsw" or self.count(place.table) >= self.lists(num_items):
            self.ann_index(place, num_items)

    def marked(self) -> list[tuple[str, str, str]]:
        """(name, kind, role) of every object in the schema that carries this gallery's mark."""
        rows = self.execute("SELECT c.relname, c.relkind, obj_description(c.oid, 'pg_class') FROM pg_class c "
                            "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = current_schema() "
                            "AND obj_description(c.oid, 'pg_class') LIKE 'fastfill %%'").fetchall()
        return sorted((name, RELKINDS.get(kind, "relation"), found.get("role", "")) for name, kind, text in rows
                      if (found := read_mark(text)) and found["gallery"] == self.owner)

    def release(self) -> list[str]:
        """Drop every object this gallery marked (see ``PgGallery.release``); the names dropped."""
        from psycopg import sql

        order = {VIEW: 0, ANN: 1, HELD: 2, VECTORS: 2, SERVING: 3, CHUNKS: 3, TABLE: 4}
        dropped = []
        for name, kind, _ in sorted(self.marked(), key=lambda o: (order.get(o[2], 5), o[0])):
            if kind not in ("table", "view", "index"):
                continue
            self.execute(sql.SQL("DROP {} IF EXISTS {}").format(sql.SQL(kind.upper()), sql.Identifier(name)))
            dropped.append(f"{kind} {name}")
        return dropped

    # ---- other writers

    def id_digest(self, table: str, id_column: str) -> tuple[int, int]:
        """(rows, a checksum of their ids) of ``table``: the same ids give the same pair."""
        from psycopg import sql

        count, total = self.execute(sql.SQL("SELECT count(*), coalesce(sum(hashtextextended({}::text, 0)::numeric), 0) "
                                            "FROM {}").format(sql.Identifier(id_column), sql.Identifier(table))
                                    ).fetchone()
        return int(count), int(total)

    def ids_digest(self, ids: np.ndarray) -> tuple[int, int]:
        """The pair ``id_digest`` gives for a table holding exactly ``ids``."""
        total = 0
        kind = "text[]" if is_text(ids) else "bigint[]"
        for start in range(0, len(ids), ROWS_PER_STATEMENT):
            block = ids[start:start + ROWS_PER_STATEMENT]
            values = [str(v) for v in block] if is_text(ids) else [int(v) for v in block]
            total += int(self.execute("SELECT coalesce(sum(hashtextextended(x::text, 0)::numeric), 0) "
                                      f"FROM unnest(%s::{kind}) AS x", (values,)).fetchone()[0])
        return len(ids), total

    def id_differences(self, table: str, id_column: str, ids: np.ndarray, shown: int = 5) -> dict:
        """How ``table``'s ids differ from ``ids``: ``missing`` (in ``ids``, not in the table) and
        ``added`` (in the table only), each a count and the first ``shown`` ids; the ids go to
        the server in a temporary table, so memory stays bounded."""
        from psycopg import sql

        id_type = self._id_type(ids)
        with self.transaction() as connection:
            connection.execute(sql.SQL("CREATE TEMPORARY TABLE fastfill_ids (id {} PRIMARY KEY) ON COMMIT DROP").format(
                sql.SQL(id_type)))
            with connection.cursor().copy("COPY fastfill_ids (id) FROM STDIN WITH (FORMAT BINARY)") as copy:
                copy.set_types([id_type])
                for item in ids.tolist():
                    copy.write_row((item,))
            out = {}
            for key, query in (("missing", "SELECT g.id FROM fastfill_ids g WHERE NOT EXISTS (SELECT 1 FROM {t} t "
                                           "WHERE t.{id} = g.id) ORDER BY g.id"),
                               ("added", "SELECT t.{id} FROM {t} t WHERE NOT EXISTS (SELECT 1 FROM fastfill_ids g "
                                         "WHERE g.id = t.{id}) ORDER BY t.{id}")):
                rows = connection.execute(sql.SQL(query).format(t=sql.Identifier(table), id=sql.Identifier(id_column))
                                          ).fetchall()
                out[key] = {"count": len(rows), "first": [r[0] for r in rows[:shown]]}
        return out

    def ann_name(self, place: Place) -> str:
        """The name of the ANN index the product builds on ``place``'s vectors."""
        prefix = self.prefix if place.table == self.table else place.table
        return derived_name(prefix, f"{place.column}_{self.settings.get('ann', 'hnsw')}")

    def ann_indexed(self, place: Place) -> bool:
        """Whether ``place``'s vector column has an HNSW or IVFFlat index (the team's own too)."""
        return bool(self.execute(
            "SELECT count(*) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_am am ON am.oid = c.relam "
            "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
            "WHERE i.indrelid = to_regclass(%s) AND a.attname = %s AND am.amname IN ('hnsw', 'ivfflat')",
            (f'"{place.table}"', place.column)).fetchone()[0])

    def serve(self, model: ModelRef, place: Place, upgrade_id: str | None) -> None:
        """Readers move to ``model``'s vectors at ``place`` in one transaction: the view
        redefined over them and the serving row rewritten together (a reader's statement sees
        one or the other). While ``upgrade_id`` fills ``place`` from its held table, the view is
        both tables' rows, a held row only while its rank is in no chunk ``upgrade_id`` recorded
        (``held_view``); served without an upgrade, the held table is dropped after the commit
        (the finish: every row is in ``place``'s table)."""
        from psycopg import sql

        source = sql.SQL("coalesce({}, {})").format(sql.Identifier(place.source), sql.Literal(EMBEDDED)) \
            if place.source else sql.Literal(EMBEDDED)
        ours = self.ours(self.view, VIEW, "gallery.pgvector.view")
        self.ours(self.serving_table, SERVING, "gallery.pgvector.prefix")
        held = self.held(place)
        if held and upgrade_id is None:
            self.ann_index(place)  # the finish: a table whose index waited for rows gets it now
        with self.transaction() as connection:
            if ours:
                connection.execute(sql.SQL("DROP VIEW {}").format(sql.Identifier(self.view)))
            plain = sql.SQL("SELECT {id} AS id, {col} AS embedding, {model}::text AS model, {source}::text AS source "
                            "FROM {table}").format(
                id=sql.Identifier(place.id_column), col=sql.Identifier(place.column), model=sql.Literal(model.uri),
                source=source, table=sql.Identifier(place.table))
            body = self.held_view(place, held, model, upgrade_id) if held and upgrade_id else plain
            connection.execute(sql.SQL("CREATE VIEW {view} AS ").format(view=sql.Identifier(self.view)) + body)
            self.marking(connection, "view", self.view, VIEW)
            connection.execute(sql.SQL("DELETE FROM {}").format(sql.Identifier(self.serving_table)))
            connection.execute(sql.SQL("INSERT INTO {} (model, model_name, model_version, dim, vectors, upgrade, "
                                       "gallery, store) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)").format(
                sql.Identifier(self.serving_table)),
                (model.uri, model.name, str(model.version), int(model.dim or 0), place.name, upgrade_id, self.owner,
                 self.store_uri))
        if held and upgrade_id is None:
            self.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(held)))

    def held_view(self, place: Place, held: str, model: ModelRef, upgrade_id: str):
        """The view's query while ``upgrade_id`` fills ``place``'s table from ``held``: the rows of
        both, a held row only while its rank lies in no chunk the upgrade recorded. The filter is
        on the UNION ALL as a whole, so PostgreSQL plans a search as a Merge Append of two
        ordered ANN index scans, and the recorded chunks' ranges are read once per query (an
        InitPlan: adjacent chunks merged into one range, so a query tests a few ranges). A
        chunk's rows and its record commit together: a reader sees an item once."""
        from psycopg import sql

        return sql.SQL(
            "SELECT id, embedding, model, source FROM ("
            "SELECT id, embedding, {model}::text AS model, source, -1 AS rank FROM {table} "
            "UNION ALL SELECT id, embedding, {model}::text, {mapped}::text, rank FROM {held}) u "
            "WHERE NOT (u.rank <@ ANY (ARRAY(SELECT int4range(min(first), max(stop)) FROM ("
            "SELECT first, stop, first - coalesce(sum(stop - first) OVER (ORDER BY first ROWS BETWEEN UNBOUNDED "
            "PRECEDING AND 1 PRECEDING), 0) AS island FROM {chunks} WHERE upgrade = {upgrade} AND first IS NOT NULL"
            ") c GROUP BY island)))").format(
            model=sql.Literal(model.uri), table=sql.Identifier(place.table), mapped=sql.Literal(MAPPED),
            held=sql.Identifier(held), chunks=sql.Identifier(self.chunks_table), upgrade=sql.Literal(upgrade_id))

    def product_distances(self, distances: list) -> np.ndarray:
        """pgvector's distances as the product gives them: squared L2, or 1 - cosine."""
        values = np.asarray(distances, dtype=np.float64)
        return values ** 2 if self.operator == "<->" else values

    def embedded_count(self) -> int:
        """Rows of the view whose vector the serving model embedded (the rest: h(old))."""
        from psycopg import sql

        return int(self.execute(sql.SQL("SELECT count(*) FROM {} WHERE source = %s").format(
            sql.Identifier(self.view)), (EMBEDDED,)).fetchone()[0])

    def chunk_done(self, upgrade_id: str) -> set[int]:
        from psycopg import sql

        rows = self.execute(sql.SQL("SELECT chunk FROM {} WHERE upgrade = %s").format(
            sql.Identifier(self.chunks_table)), (upgrade_id,)).fetchall()
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
