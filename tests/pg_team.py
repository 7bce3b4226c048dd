"""A team's own table in the tests' PostgreSQL (tests/pg.py), adopted as a pgvector gallery: the
setup tests/unit/test_pg_ownership.py and test_pg_held.py share (the ``pg_team`` fixture of
tests/unit/conftest.py makes one per call), and the helpers they use on it."""

import os
from dataclasses import dataclass

from psycopg import sql

from fastfill.components.experiment.inference import embed
from fastfill.components.gallery.layouts.catalog import Gallery
from fastfill.components.gallery.layouts.opening import gallery_at
from fastfill.components.gallery.layouts.pg_adopt import adopt_table
from fastfill.components.gallery.layouts.pg_index import Index, index_settings
from fastfill.components.gallery.store import open_store
from fastfill.components.gallery.upgrade import backfill, ending
from tests.gallery_cases import OLD, N, _originals, _plan, _png, _put_original
from tests.pg import pg_gallery_config


def ident(name: str) -> sql.Identifier:
    return sql.Identifier(name)


def team_table(store_uri: str, data, models, table: str, **config) -> tuple[dict, Index, str]:
    """The team's table ``table`` (sku, photo, vec: the old model's vectors, price), its images
    beside the store; (the settings that adopt it, its index, the images' folder)."""
    old = models[0]
    images, _ = data
    root = _originals(store_uri)
    for i in range(N):
        _put_original(root, f"img-{i:05d}.png", _png(images[i]))
    settings = index_settings(pg_gallery_config(store_uri, table=table, id_column="sku", image_column="photo",
                                                **config).pgvector, "l2", store_uri)
    index = Index(settings)
    index.execute(sql.SQL("DROP TABLE IF EXISTS {} CASCADE").format(ident(table)))
    index.execute(sql.SQL("CREATE TABLE {} (sku text PRIMARY KEY, photo text, vec vector(8), price numeric)").format(
        ident(table)))
    features = embed(old, images)
    with index.transaction() as connection, connection.cursor().copy(sql.SQL(
            "COPY {} (sku, photo, vec, price) FROM STDIN").format(ident(table))) as copy:
        for i in range(N):
            copy.write_row((f"sku-{i:03d}", f"img-{i:05d}.png", features[i], 9.5))
    return settings, index, root


def adopt(store_uri: str, settings: dict, root: str) -> Gallery:
    adopt_table(open_store(store_uri), settings, OLD, (1, 8, 8), vector_column="vec", root=root, part_size=10)
    return gallery_at(open_store(store_uri))


def upgrade(gallery: Gallery, models, chunks: int | None = None):
    """Plan the upgrade (the switch), backfill ``chunks`` (default all), finish when all."""
    _, new, h = models
    plan = _plan(gallery, h)
    for chunk in range(plan.num_chunks if chunks is None else chunks):
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, new)
    if chunks is None:
        ending.finish(gallery, plan)
    return plan


def table_name(tmp_path, tag: str) -> str:
    """The test's own table name: ``tag`` and its temporary folder's."""
    return f"t{tag}_" + os.path.basename(str(tmp_path))[-6:].lower().replace("-", "_")


@dataclass
class TeamGallery:
    """A team's table (``table``, its ``settings`` and ``index``, its images under ``root``) and the
    store at ``store_uri`` that adopted it as ``gallery`` (None: not adopted yet)."""

    store_uri: str
    table: str
    settings: dict
    index: Index
    root: str
    gallery: Gallery | None = None

    def adopt(self) -> Gallery:
        self.gallery = adopt(self.store_uri, self.settings, self.root)
        return self.gallery


def team_gallery(tmp_path, models, data, tag: str, *, store: str = "store", table: str | None = None,
                 adopted: bool = True) -> TeamGallery:
    """The team's table (``table``, or ``table_name(tmp_path, tag)``) and the store
    ``tmp_path/store``, adopted unless ``adopted`` is False."""
    store_uri = str(tmp_path / store)
    table = table or table_name(tmp_path, tag)
    settings, index, root = team_table(store_uri, data, models, table)
    team = TeamGallery(store_uri, table, settings, index, root)
    if adopted:
        team.adopt()
    return team
