"""A team's pgvector table adopted where it is (``layout: pgvector``): its ids (ordered by id: the
items' positions) and image URIs (and labels) read into the store's items table, its vector
column served as it is, the view and the bookkeeping tables created beside it
(``components.gallery.layouts.pg_table``)."""

from __future__ import annotations

import re

from fastfill.components.gallery.layouts.catalog import (
    PGVECTOR,
    GalleryError,
    PartsWriter,
    check_empty,
    commit_manifest,
)
from fastfill.components.gallery.layouts.pg_index import Index, Place, plain_identifier
from fastfill.components.gallery.store import Store
from fastfill.components.platform.registry import ModelRef


def adopt_table(store: Store, settings: dict, model: ModelRef, image_shape, *, vector_column: str,
                label_column: str | None = None, root: str | None = None, part_size: int = 1000,
                registry: str | None = None, on_part=None) -> dict:
    """A team's existing table adopted where it is: its ids (ordered by id: the items' positions)
    and image URIs (and labels) read into the store's items table, the vectors left where they
    are (``vector_column`` serves ``model``); the view and the bookkeeping tables created, the ANN
    index built if the column has none; the manifest last."""
    check_empty(store, "adopt")
    settings = dict(settings)
    vector_column = plain_identifier(vector_column, "--vector-column")
    index = Index(settings)
    if not index.exists():
        raise GalleryError(f"{index.where} does not exist; name the team's table in gallery.pgvector.table (or "
                           "--table)")
    index.kind_of_table()
    columns = index.columns()
    settings["id_type"] = _checked_columns(index, columns, vector_column, label_column, model)
    n = _checked_rows(index, vector_column)
    adopted = Place(index.table, index.id_column, vector_column, None)
    index.check_names(adopted)  # every name the gallery will use is free or its own, before any write
    _copy_items(index, store, model, label_column, n, part_size, on_part)
    settings["columns"] = {model.key: vector_column}
    if f"{vector_column}_source" in columns:
        settings["sources"] = {model.key: f"{vector_column}_source"}
    index.settings = settings
    index.bookkeeping()
    place = index.place(model)
    index.ann_index(place)  # when the column has none (the team's own, of any name, is kept)
    index.serve(model, place, None)
    index.close()
    return commit_manifest(store, model, num_items=n, part_size=part_size, image_shape=image_shape,
                           has_labels=label_column is not None, has_groups=False, by="adopt",
                           images={"source": "uri", "root": root}, registry=registry, layout=PGVECTOR,
                           extra={"index": settings})


def _checked_columns(index: Index, columns: dict[str, str], vector_column: str, label_column: str | None,
                     model: ModelRef) -> str:
    """The id type the gallery keeps (``text`` or the integer type), once the table has the id,
    image, vector (pgvector, ``model``'s dimension) and label columns named."""
    for name, what in ((index.id_column, "id"), (index.image_column, "image"), (vector_column, "vector"),
                       *([(label_column, "label")] if label_column else [])):
        if name not in columns:
            raise GalleryError(f"{index.where} has no {what} column {name!r}; its columns: {', '.join(columns)}")
    kind = columns[vector_column]
    found = re.fullmatch(r"vector\((\d+)\)", kind)
    if not found:
        raise GalleryError(f"{index.where} column {vector_column} is {kind}, not a pgvector vector(d) column")
    if model.dim and int(found.group(1)) != model.dim:
        raise GalleryError(f"{index.where} column {vector_column} holds {found.group(1)}-d vectors, but {model.uri} "
                           f"embeds into {model.dim}: adopt the column with the model that computed it")
    id_type = columns[index.id_column]
    if id_type not in ("bigint", "integer", "smallint", "text", "character varying") \
            and not id_type.startswith("character varying"):
        raise GalleryError(f"{index.where} id column {index.id_column} is {id_type}; ids must be integers or text")
    return "text" if ("char" in id_type or id_type == "text") else id_type


def _checked_rows(index: Index, vector_column: str) -> int:
    """The table's number of rows, once it has at least 2, unique ids and a vector in every row."""
    from psycopg import sql

    n, distinct, empty = index.execute(sql.SQL("SELECT count(*), count(DISTINCT {id}), count(*) FILTER (WHERE {v} IS "
                                               "NULL) FROM {t}").format(id=sql.Identifier(index.id_column),
                                                                         v=sql.Identifier(vector_column),
                                                                         t=sql.Identifier(index.table))).fetchone()
    if n < 2:
        raise GalleryError(f"{index.where} has {n} rows; a gallery needs at least 2")
    if distinct != n:
        raise GalleryError(f"{index.where}: {n - distinct} ids are repeated or NULL in {index.id_column}; ids must be "
                           "unique")
    if empty:
        raise GalleryError(f"{index.where}: {empty} rows have no vector in {vector_column}; fill them (or delete "
                           "the rows) before adopting")
    return n


def _copy_items(index: Index, store: Store, model: ModelRef, label_column: str | None, n: int, part_size: int,
                on_part) -> None:
    """The table's ids, image URIs (and labels), ordered by id, into the store's items table part
    by part; ``on_part(done, parts)`` after each."""
    import pyarrow as pa
    from psycopg import sql

    label = sql.SQL(", {}").format(sql.Identifier(label_column)) if label_column else sql.SQL("")
    cursor = index.connection().cursor(name="fastfill_adopt")  # server-side: the ids stream, part by part
    writer = PartsWriter(store, model, part_size)
    num_parts = -(-n // part_size)
    with index.connection().transaction():
        cursor.execute(sql.SQL("SELECT {id}, {image}{label} FROM {t} ORDER BY {id}").format(
            id=sql.Identifier(index.id_column), image=sql.Identifier(index.image_column), label=label,
            t=sql.Identifier(index.table)))
        for part in range(num_parts):
            rows = cursor.fetchmany(part_size)
            columns = {"id": pa.array([r[0] for r in rows]), "image": pa.array([r[1] for r in rows], pa.string()),
                       "label": pa.array([r[2] for r in rows], pa.int64()) if label_column
                       else pa.nulls(len(rows), pa.int64()),
                       "group": pa.nulls(len(rows), pa.string())}
            writer.write_items(part * part_size, pa.table(columns))
            if on_part is not None:
                on_part(part + 1, num_parts)
        cursor.close()
