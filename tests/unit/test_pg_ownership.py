"""The team's database is theirs: on a real PostgreSQL 16 with pgvector, a careless or hostile
neighbour keeps tables, views and indexes beside the team's table under the very names the product
would use. Whatever the product does (adopt, upgrade, finish, gc, release), the neighbour's objects
are the same before and after, byte for byte (rows through an md5 of their text, view definitions,
comments); a taken name is refused in one line before any write; what another writer does to the
gallery's rows is named, never papered over."""

import os

import pytest
from psycopg import sql

from fastfill.components.experiment.inference import embed
from fastfill.components.gallery.layouts.catalog import GalleryError
from fastfill.components.gallery.layouts.ownership import NotOurs, read_mark
from fastfill.components.gallery.layouts.pg_adopt import adopt_table
from fastfill.components.gallery.layouts.pg_index import MAX_NAME, Index, derived_name, index_settings, vectors_table
from fastfill.components.gallery.store import DamagedObject, open_store
from fastfill.components.gallery.upgrade import backfill, ending, garbage
from tests.gallery_cases import NEW, OLD
from tests.pg import pg_gallery_config
from tests.pg_team import adopt, ident, upgrade


def _neighbour(index: Index, name: str, kind: str = "table", reads: str | None = None) -> None:
    """A team object ``name`` (a table with rows of its own, or a view over ``reads``), created
    as a careless neighbour would, with a comment of the team's."""
    index.execute(sql.SQL("DROP VIEW IF EXISTS {} CASCADE").format(ident(name))) if kind == "view" else None
    if kind == "view":
        index.execute(sql.SQL("CREATE VIEW {} AS SELECT sku, price FROM {} WHERE price > 1").format(
            ident(name), ident(reads)))
    else:
        index.execute(sql.SQL("DROP TABLE IF EXISTS {} CASCADE").format(ident(name)))
        index.execute(sql.SQL("CREATE TABLE {} (id text PRIMARY KEY, note text)").format(ident(name)))
        index.execute(sql.SQL("INSERT INTO {} VALUES ('a', 'the team''s own'), ('b', 'do not touch')").format(
            ident(name)))
    index.execute(sql.SQL("COMMENT ON {} {} IS 'owned by the catalog team'").format(sql.SQL(kind.upper()),
                                                                                     ident(name)))


def _snapshot(index: Index, *names: str) -> dict:
    """Each object's kind, comment, and its rows' md5 (tables) or definition (views)."""
    out = {}
    for name in names:
        row = index.execute("SELECT c.relkind, obj_description(c.oid, 'pg_class') FROM pg_class c "
                            "WHERE c.oid = to_regclass(%s)", (f'"{name}"',)).fetchone()
        if row is None:
            out[name] = None
            continue
        if row[0] == "v":
            body = index.execute("SELECT pg_get_viewdef(to_regclass(%s))", (f'"{name}"',)).fetchone()[0]
        else:
            body = index.execute(sql.SQL("SELECT count(*), md5(coalesce(string_agg(t::text, '|' ORDER BY t::text), '')) "
                                         "FROM {} t").format(ident(name))).fetchone()
        out[name] = (row[0], row[1], body)
    return out


def test_gc_and_an_upgrade_leave_the_neighbours_objects_as_they_were(pg_team, tmp_path, models):
    """A team table ``<table>_emb_legacy`` and one named exactly as the new model's table would be:
    the upgrade to that model is refused before any work, naming the table and the setting; with
    another prefix it runs, and gc after it drops only the product's own old tables."""
    team = pg_team("gc", adopted=False)
    table, index = team.table, team.index
    legacy, taken = f"{table}_emb_legacy", vectors_table(table, NEW)
    for name in (legacy, taken):
        _neighbour(index, name)
    before = _snapshot(index, table, legacy, taken)
    gallery = team.adopt()
    assert garbage.collect_garbage(gallery)["features"] == 0
    refused = gallery.cannot_serve(NEW)
    assert refused and f"the table {taken} exists and is not the product's" in refused
    assert "gallery.pgvector.prefix" in refused and "\n" not in refused
    assert _snapshot(index, table, legacy, taken) == before

    store2 = str(tmp_path / "store2")  # the same table, the product's objects under another prefix
    settings2 = index_settings(pg_gallery_config(store2, table=table, id_column="sku", image_column="photo",
                                                 prefix=f"{table}_ff", view=f"{table}_ff_view").pgvector, "l2", store2)
    gallery2 = adopt(store2, settings2, team.root)
    assert gallery2.cannot_serve(NEW) is None
    upgrade(gallery2, models)
    assert gallery2.index.serving().model == NEW.uri
    deleted = garbage.collect_garbage(gallery2)
    assert deleted["features"] == 0 and deleted["kept_columns"] == [f"{table}.vec"]
    assert _snapshot(index, table, legacy, taken) == before
    marks = {name: read_mark(_snapshot(index, name)[name][1]) for name in (f"{table}_ff_view",
                                                                            vectors_table(f"{table}_ff", NEW))}
    assert all(m and m["gallery"] == settings2["owner"] for m in marks.values()), marks


def test_a_view_name_taken_by_the_team_is_refused_before_any_write(pg_team):
    """The default view name and a gallery.pgvector.view naming a team view, a team table as the
    view, and a team view as the table: each refused in one line; nothing left behind (no object of
    the product's, an empty store) and the team's objects unchanged."""
    team = pg_team("view", adopted=False)
    store_uri, table, settings, index, root = team.store_uri, team.table, team.settings, team.index, team.root
    _neighbour(index, settings["view"], "view", reads=table)
    _neighbour(index, f"{table}_report", "view", reads=table)
    _neighbour(index, f"{table}_other")
    names = (table, settings["view"], f"{table}_report", f"{table}_other")
    before = _snapshot(index, *names)
    with pytest.raises(NotOurs, match=rf"the view {settings['view']} exists and is not the product's.*"
                                      "gallery.pgvector.view.*Nothing was written"):
        adopt(store_uri, settings, root)
    for view, what in ((f"{table}_report", "view"), (f"{table}_other", "table")):
        again = dict(settings, view=view)
        with pytest.raises(NotOurs, match=f"the {what} {view} exists and is not the product's"):
            adopt(store_uri, again, root)
    as_table = dict(settings, table=f"{table}_report", view=f"{table}_free")
    with pytest.raises(GalleryError, match=f"{table}_report is a view, not a table"):
        adopt_table(open_store(store_uri), as_table, OLD, (1, 8, 8), vector_column="price")
    assert _snapshot(index, *names) == before
    assert open_store(store_uri).list("") == []
    assert Index(settings).marked() == [] and Index(as_table).marked() == []


@pytest.mark.parametrize("length", [53, 54, 55, 62, 63])
def test_long_and_mixed_case_table_names_give_distinct_names_within_63_bytes(pg_team, tmp_path, models, length):
    """A team table of 53 to 63 characters, in mixed case: every name the product derives fits
    63 bytes and names one object, the upgrade runs to its finish, and the team's table holds
    exactly its rows (no DELETE reached it through a cut name)."""
    base = "Prod_" + os.path.basename(str(tmp_path))[-6:].replace("-", "_")
    team = pg_team("long", table=(base + "X" * length)[:length], adopted=False)
    table, settings, index = team.table, team.settings, team.index
    names = [index.serving_table, index.chunks_table, settings["view"], vectors_table(table, NEW),
             index.ann_name(index.place(OLD))]
    assert all(len(n.encode()) <= MAX_NAME for n in names) and len(set(names)) == len(names), names
    before = _snapshot(index, table)
    gallery = team.adopt()
    upgrade(gallery, models)
    assert gallery.index.serving().model == NEW.uri
    assert _snapshot(index, table)[table][2] == before[table][2]
    ours = {name for name, _, _ in gallery.index.marked()}
    assert {index.serving_table, index.chunks_table, settings["view"], vectors_table(table, NEW)} <= ours


def test_derived_names_keep_their_role_and_never_meet():
    for length in range(40, 64):
        prefix = "a" * length
        made = {derived_name(prefix, suffix) for suffix in ("fastfill_serving", "fastfill_chunks", "serving",
                                                            "emb_embedder_v2", "emb_embedder_v3")}
        assert len(made) == 5 and all(len(n) <= MAX_NAME for n in made)
    assert derived_name("products", "serving") == "products_serving"


def test_a_second_store_cannot_take_over_a_served_table(pg_team, tmp_path, models):
    """After the first store's upgrade finished, and while it is mid-backfill, an adopt of the same
    table into another store is refused naming the owner's store; the view keeps serving the
    first store's model. ``gallery release`` hands it over: then the second adopts."""
    team = pg_team("two", store="a")
    store_a, store_b = team.store_uri, str(tmp_path / "b")
    table, settings, root, gallery = team.table, team.settings, team.root, team.gallery
    plan = upgrade(gallery, models, chunks=2)
    settings_b = index_settings(pg_gallery_config(store_b, table=table, id_column="sku", image_column="photo")
                                .pgvector, "l2", store_b)
    with pytest.raises(NotOurs, match=rf"belongs to another gallery \({settings['owner']}, store {store_a}\): "
                                      "upgrade, abort, roll back, gc or release it from that store"):
        adopt(store_b, settings_b, root)
    assert open_store(store_b).list("") == []
    assert gallery.index.serving().model == NEW.uri and gallery.index.serving().gallery == settings["owner"]
    for chunk in range(2, plan.num_chunks):
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, models[1])
    ending.finish(gallery, plan)
    with pytest.raises(NotOurs, match=f"store {store_a}"):
        adopt(store_b, settings_b, root)
    assert gallery.index.serving().model == NEW.uri
    dropped = gallery.release()
    assert f"view {settings['view']}" in dropped and f"table {vectors_table(table, NEW)}" in dropped
    assert Index(settings).marked() == [] and Index(settings).exists()
    gallery_b = adopt(store_b, settings_b, root)
    assert gallery_b.index.serving().model == OLD.uri and gallery_b.index.serving().store == store_b


def test_rows_deleted_or_added_by_another_writer_are_named(pg_team, models):
    """A row deleted from the new model's table after its chunk landed: the next chunk keeps
    nothing and names the id and that table; the finish of a resumed run refuses the same way. A
    row the team adds to its table mid-upgrade is named at the finish as not served."""
    team = pg_team("rows")
    table, index, gallery = team.table, team.index, team.gallery
    plan = upgrade(gallery, models, chunks=2)
    vectors = vectors_table(table, NEW)
    victim = index.execute(sql.SQL("SELECT id FROM {} WHERE source = 'embedded' ORDER BY id LIMIT 1").format(
        ident(vectors))).fetchone()[0]
    saved = index.execute(sql.SQL("SELECT id, embedding, source FROM {} WHERE id = %s").format(ident(vectors)),
                          (victim,)).fetchone()
    index.execute(sql.SQL("DELETE FROM {} WHERE id = %s").format(ident(vectors)), (victim,))
    with pytest.raises(DamagedObject, match=rf"{vectors} no longer holds the gallery's items: 1 ids missing "
                                            rf"\(first: {victim}\)"):
        backfill.backfill_chunk(gallery, plan.upgrade_id, 2, models[1])
    assert 2 not in gallery.index.chunk_done(plan.upgrade_id)
    index.execute(sql.SQL("INSERT INTO {} VALUES (%s, %s, %s)").format(ident(vectors)), saved)
    for chunk in range(2, plan.num_chunks):
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, models[1])
    index.execute(sql.SQL("DELETE FROM {} WHERE id = %s").format(ident(vectors)), (victim,))
    with pytest.raises(DamagedObject, match=f"{vectors} no longer holds"):
        ending.finish(gallery, plan)
    index.execute(sql.SQL("INSERT INTO {} VALUES (%s, %s, %s)").format(ident(vectors)), saved)
    index.execute(sql.SQL("INSERT INTO {} (sku, photo, vec) SELECT 'sku-new', photo, vec FROM {} LIMIT 1").format(
        ident(table), ident(table)))
    record = ending.finish(gallery, plan)
    assert record["unserved_rows"] == {"table": table, "count": 1, "first": ["sku-new"]}


def test_a_row_deleted_from_the_teams_table_mid_upgrade_ends_the_chunk_naming_it(pg_team, models):
    team = pg_team("del")
    table, index, gallery = team.table, team.index, team.gallery
    plan = upgrade(gallery, models, chunks=1)
    index.execute(sql.SQL("DELETE FROM {} WHERE sku = 'sku-007'").format(ident(table)))
    with pytest.raises(DamagedObject, match=rf"the gallery's table {table} lost items the gallery serves: 1 ids "
                                            r"deleted \(first: sku-007\)"):
        backfill.backfill_chunk(gallery, plan.upgrade_id, 1, models[1])


def test_a_dropped_view_or_table_is_a_damaged_object_not_a_traceback(pg_team, models, data):
    team = pg_team("drop")
    table, settings, index, gallery = team.table, team.settings, team.index, team.gallery
    plan = upgrade(gallery, models, chunks=1)
    index.execute(sql.SQL("DROP VIEW {}").format(ident(settings["view"])))
    with pytest.raises(DamagedObject, match="dropped or renamed by another writer"):
        gallery.index.search(embed(models[1], data[0][:1]), 3)
    index.execute(sql.SQL("DROP TABLE {}").format(ident(vectors_table(table, NEW))))
    with pytest.raises(DamagedObject, match="dropped or renamed by another writer"):
        backfill.backfill_chunk(gallery, plan.upgrade_id, 1, models[1])


def test_a_refusal_is_bad_input_and_an_unreachable_server_a_service_problem(tmp_path):
    """Exit codes as docs/operations.md says: a taken name 6, a server that does not answer 5."""
    from fastfill.cli.command_support import INPUT, SERVICE, outcome
    from fastfill.components.gallery.layouts.pg_index import connect

    assert outcome(NotOurs("the view v exists and is not the product's")) == (INPUT, "the view v exists and is "
                                                                                   "not the product's")
    with pytest.raises(Exception) as caught:
        connect(f"postgresql://nobody@/postgres?host={tmp_path}&port=1")
    code, line = outcome(caught.value)
    assert code == SERVICE and line.startswith("cannot connect to PostgreSQL at") and "\n" not in line
