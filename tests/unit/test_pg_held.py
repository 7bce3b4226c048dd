"""A pgvector upgrade writes least where every chunk only appends: from the switch on, every item's
row as the switch found it is in a held table that nothing writes again, each chunk appends its
rows to the new model's table in one transaction with its record, and the view serves the held
rows whose rank is in no recorded chunk. On a real PostgreSQL 16 with pgvector: no held row is
rewritten, each item is served once whatever chunks are done, a search is planned as two ordered
ANN index scans merged, and the held table goes at the finish (an aborted upgrade's at gc)."""

import numpy as np
from psycopg import sql

from fastfill.components.gallery.layouts.pg_index import HELD, Index, vectors_table
from fastfill.components.gallery.upgrade import backfill, ending, garbage, reversal
from fastfill.components.gallery.upgrade.stored import order_of
from tests.gallery_cases import NEW, N
from tests.pg_team import ident, upgrade


def _rows_as_written(index: Index, table: str) -> tuple:
    """Each row's place and the transaction that wrote it: an UPDATE or a DELETE changes it."""
    return index.execute(sql.SQL("SELECT count(*), md5(string_agg(ctid::text || ':' || xmin::text, ',' ORDER BY id)) "
                                 "FROM {}").format(ident(table))).fetchone()


def _served(index: Index, view: str) -> tuple[list, int]:
    rows = index.execute(sql.SQL("SELECT id, source FROM {}").format(ident(view))).fetchall()
    return sorted(r[0] for r in rows), sum(r[1] == "embedded" for r in rows)


def _chunk_ids(gallery, plan, chunks) -> list:
    order = order_of(gallery.store, plan.upgrade_id)
    return sorted(gallery.ids()[np.concatenate([order[slice(*plan.chunk_bounds(c))] for c in chunks])].tolist())


def test_chunks_append_their_rows_and_the_held_rows_are_never_rewritten(pg_team, models):
    team = pg_team("held")
    table, settings, index, gallery = team.table, team.settings, team.index, team.gallery
    plan = upgrade(gallery, models, chunks=0)
    vectors = vectors_table(table, NEW)
    held = index.held_table(index.place(NEW))
    assert index.object(held)[1]["role"] == HELD
    assert index.count(vectors) == 0 and index.count(held) == N
    before = _rows_as_written(index, held)
    # chunks out of order: 0 and 2 done, 1 not (the view's ranges are not one prefix)
    for chunk in (0, 2):
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, models[1])
    assert _rows_as_written(index, held) == before
    assert sorted(index.execute(sql.SQL("SELECT id FROM {}").format(ident(vectors))).fetchall()) == \
        [(i,) for i in _chunk_ids(gallery, plan, (0, 2))]
    ids, embedded = _served(index, settings["view"])
    assert ids == sorted(gallery.ids().tolist()) and embedded == plan.items_in((0, 2))
    assert gallery.index.embedded_count() == plan.items_in((0, 2))
    # the features read by id mid-upgrade: new where a chunk is done, h(old) elsewhere
    done, waiting = _chunk_ids(gallery, plan, (0,))[0], _chunk_ids(gallery, plan, (1,))[0]
    positions = [int(np.flatnonzero(gallery.ids() == item)[0]) for item in (done, waiting)]
    read = gallery.features_at(NEW, np.asarray(positions))
    stored = [index.execute(sql.SQL("SELECT embedding FROM {} WHERE id = %s").format(ident(t)), (item,)).fetchone()[0]
              for t, item in ((vectors, done), (held, waiting))]
    np.testing.assert_array_equal(read, np.stack([np.asarray(v.to_numpy()) for v in stored]))
    # a search can be two ordered ANN scans merged (the filter does not stop the UNION ALL's pull-up)
    query = gallery.features_at(NEW, np.asarray([0]))[0]
    with index.transaction() as connection:
        connection.execute("SET LOCAL enable_seqscan = off")
        connection.execute("SET LOCAL enable_sort = off")
        plan_text = "\n".join(r[0] for r in connection.execute(sql.SQL(
            "EXPLAIN SELECT id FROM {} ORDER BY embedding <-> %s LIMIT 10").format(ident(settings["view"])),
            (query,)).fetchall())
    assert "Merge Append" in plan_text and plan_text.count("Index Scan using") == 2, plan_text
    assert "Subquery Scan" not in plan_text, plan_text
    for chunk in (1, *range(3, plan.num_chunks)):
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, models[1])
    assert _rows_as_written(index, held) == before
    ending.finish(gallery, plan)
    assert index.object(held) is None and index.count(vectors) == N
    assert held not in index.execute("SELECT pg_get_viewdef(to_regclass(%s))", (f'"{settings["view"]}"',)).fetchone()[0]
    assert _served(index, settings["view"]) == (sorted(gallery.ids().tolist()), N)
    assert index.ann_indexed(index.place(NEW))


def test_an_aborted_upgrades_held_table_stays_until_gc_and_a_new_try_starts_afresh(pg_team, models):
    team = pg_team("abrt")
    settings, index, gallery = team.settings, team.index, team.gallery
    plan = upgrade(gallery, models, chunks=2)
    held = index.held_table(index.place(NEW))
    reversal.abort(gallery, plan.upgrade_id)
    assert index.object(held) is not None
    assert _served(index, settings["view"]) == (sorted(gallery.ids().tolist()), N)  # the team's vectors again
    assert index.held_tables() == [held]
    garbage.collect_garbage(gallery)
    assert index.object(held) is None and index.held_tables() == []
    again = upgrade(gallery, models)  # planned from scratch: a held table anew, dropped at its finish
    assert again.upgrade_id == plan.upgrade_id and index.object(held) is None
    assert _served(index, settings["view"]) == (sorted(gallery.ids().tolist()), N)
