"""The WAL a pgvector gallery's backfill writes, design by design, at the SQL level: the same synthetic
gallery (``--items`` rows of 256-d vectors) written in chunks of ``--chunk`` rows through half the table
and then the whole of it, on a local PostgreSQL with pgvector (testkit.local_postgres, PostgreSQL's
default checkpoint settings), each design in a fresh database, one after the other, in one run.

    .venv/bin/python benchmarks/pg_wal_study.py --items 100000 --designs A,B,C,C0,CS   # a few minutes
    .venv/bin/python benchmarks/pg_wal_study.py --items 1000000 --designs A,B,C --design-minutes 8
    .venv/bin/python benchmarks/pg_wal_study.py --items 1000000 --after-half 5  # half way and 5 chunks more
    .venv/bin/python benchmarks/pg_wal_study.py --items 1000000 --designs A,C --checkpoint-each-chunk \
        --design-minutes 8 --suffix checkpoint-each-chunk
    .venv/bin/python benchmarks/pg_wal_study.py --render reports/pg_wal_study-1000000.json  # the .md again

The designs (the product's table is A; this study changes nothing in the product):

- **A** one table ``gallery (position bigint PRIMARY KEY, embedding vector(256), source text)`` holding
  the mapped vectors after the switch, IVFFlat on ``embedding`` (lists = sqrt(rows)); a chunk is one
  transaction: its rows COPYed into a temporary table (in the chunk's order, random over the table),
  then one ``UPDATE gallery ... FROM`` that table (as the product's pgvector layout writes a chunk).
- **B** A with the table made ``WITH (fillfactor = 50)`` and the chunk's rows updated in physical order
  (sorted by position, which is the load's physical order; a nested loop over the sorted rows).
- **C** append-only: ``mapped (position, embedding)`` with its IVFFlat, never written after the switch,
  and ``embedded (position bigint PRIMARY KEY, embedding)`` to which a chunk only COPYs (INSERTs); its
  IVFFlat (lists = sqrt(rows)) is built on the first chunk's rows, right after that chunk.
- **C0** C with the embedded table's IVFFlat built at the switch on the empty table.
- **CS** C with the embedded table's IVFFlat built at the switch on a sample of the mapped vectors
  (50 x lists rows, inserted under negative positions, the index built, the rows deleted, VACUUM).

Readers of C: the view ``gallery_view`` (the mapped rows that have no embedded row, UNION ALL the
embedded rows) is made and its k-NN query EXPLAINed; the query readers run is ``gallery_knn(q, k)``, a
SQL function inlined into the query: each branch's ``ORDER BY embedding <-> q LIMIT k``, then the
k nearest of the two, so that each branch is an IVFFlat index scan (the mapped branch's rows filtered
by an anti-join on the embedded table's key). ``gallery_knn_capped(q, k, n)`` is the same with the
mapped branch's anti-join applied to its n nearest rows only (``--mapped-candidates``), so that a
query looks up at most n keys when few mapped rows are left. After the last chunk C is also searched
as readers read it once the upgrade has finished: the embedded table alone.

Measured per design: the WAL of each chunk's transaction (``pg_current_wal_lsn()`` before and after;
median and mean) and its ratio to the chunk's payload (rows x 256 x 4 bytes); the WAL of the whole
backfill (autovacuum and the like included, the searches excluded) per chunk; the record and
full-page-image bytes by resource manager (pg_waldump --stats over each chunk's WAL); checkpoints
during the backfill; the chunk's seconds; and, half way, at 90 % and after the last chunk, ``--queries``
queries (``ivfflat.probes = 10``, k = 10): latency median/p95 and recall@10 against an exact numpy
search of the same mixed gallery, and the EXPLAIN ANALYZE of the search. A CHECKPOINT is taken just
before each design's first chunk (``--checkpoint-each-chunk``: before every chunk). Writes
reports/pg_wal_study-<items>[-<suffix>].{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DIM = 256
K = 10
PROBES = 10
DESIGNS = {
    "A": "one table, UPDATE of the chunk's rows (random order)",
    "B": "one table, fillfactor 50, UPDATE in physical order",
    "C": "append-only: INSERT into embedded; its IVFFlat built after the first chunk",
    "C0": "append-only: INSERT into embedded; its IVFFlat built on the empty table at the switch",
    "CS": "append-only: INSERT into embedded; its IVFFlat built at the switch on a mapped sample (deleted)",
}
COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + bytes(8)  # signature, flags, header extension length
COPY_TRAILER = b"\xff\xff"
VIEW = ("CREATE VIEW gallery_view AS SELECT position, embedding FROM embedded UNION ALL "
        "SELECT m.position, m.embedding FROM mapped m "
        "WHERE NOT EXISTS (SELECT 1 FROM embedded e WHERE e.position = m.position)")
KNN = """CREATE FUNCTION gallery_knn(q vector, k integer) RETURNS TABLE (item bigint, distance double precision)
LANGUAGE sql STABLE AS $$
SELECT s.item, s.distance FROM (
    (SELECT e.position AS item, e.embedding <-> q AS distance FROM embedded e ORDER BY e.embedding <-> q LIMIT k)
    UNION ALL
    (SELECT m.position, m.embedding <-> q FROM mapped m
     WHERE NOT EXISTS (SELECT 1 FROM embedded x WHERE x.position = m.position)
     ORDER BY m.embedding <-> q LIMIT k)
) s ORDER BY s.distance LIMIT k
$$"""
KNN_CAPPED = """CREATE FUNCTION gallery_knn_capped(q vector, k integer, n integer)
RETURNS TABLE (item bigint, distance double precision) LANGUAGE sql STABLE AS $$
SELECT s.item, s.distance FROM (
    (SELECT e.position AS item, e.embedding <-> q AS distance FROM embedded e ORDER BY e.embedding <-> q LIMIT k)
    UNION ALL
    (SELECT c.item, c.distance FROM (SELECT m.position AS item, m.embedding <-> q AS distance FROM mapped m
                                     ORDER BY m.embedding <-> q LIMIT n) c
     WHERE NOT EXISTS (SELECT 1 FROM embedded x WHERE x.position = c.item))
) s ORDER BY s.distance LIMIT k
$$"""


def _data(items: int, queries: int, dim: int = DIM, seed: int = 0) -> dict:
    """benchmarks/serving_index.py's recipe: clustered new features, mapped = new + noise, a random
    backfill order, queries near the centres."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((64, dim), dtype=np.float32)
    labels = rng.integers(0, 64, items)
    new = centres[labels] + 0.6 * rng.standard_normal((items, dim), dtype=np.float32)
    mapped = new + 0.5 * rng.standard_normal((items, dim), dtype=np.float32)
    order = rng.permutation(items)
    qs = centres[rng.integers(0, 64, queries)] + 0.6 * rng.standard_normal((queries, dim), dtype=np.float32)
    return {"new": new, "mapped": mapped, "order": order, "queries": qs}


def _exact(gallery: np.ndarray, queries: np.ndarray, k: int = K, block: int = 100_000) -> np.ndarray:
    """The k nearest rows of ``gallery`` to each query (squared L2, float64), by blocks of rows."""
    q = queries.astype(np.float64)
    best_d = np.full((len(q), 0), np.inf)
    best_i = np.zeros((len(q), 0), dtype=np.int64)
    for start in range(0, len(gallery), block):
        g = gallery[start:start + block].astype(np.float64)
        d = (g ** 2).sum(1)[None] - 2 * q @ g.T
        d = np.concatenate([best_d, d], axis=1)
        i = np.concatenate([best_i, np.broadcast_to(np.arange(start, start + len(g)), (len(q), len(g)))], axis=1)
        keep = np.argsort(d, axis=1, kind="stable")[:, :k]
        best_d, best_i = np.take_along_axis(d, keep, 1), np.take_along_axis(i, keep, 1)
    return best_i


def _copy_rows(positions: np.ndarray, vectors: np.ndarray, source: str | None = None) -> bytes:
    """COPY ... (FORMAT BINARY) data for rows (position bigint, embedding vector[, source text]),
    built by numpy (pgvector's binary vector: int16 dim, int16 unused, float4 x dim, big-endian)."""
    dim = vectors.shape[1]
    fields = [("n", ">i2"), ("lp", ">i4"), ("p", ">i8"), ("lv", ">i4"), ("dim", ">i2"), ("unused", ">i2"),
              ("v", ">f4", (dim,))]
    if source is not None:
        fields += [("ls", ">i4"), ("s", f"S{len(source)}")]
    rows = np.zeros(len(positions), dtype=fields)
    rows["n"] = 2 if source is None else 3
    rows["lp"], rows["p"] = 8, positions
    rows["lv"], rows["dim"], rows["v"] = 4 + 4 * dim, dim, vectors
    if source is not None:
        rows["ls"], rows["s"] = len(source), source.encode()
    return COPY_HEADER + rows.tobytes() + COPY_TRAILER


def _copy(connection, target: str, payload: bytes) -> None:
    with connection.cursor().copy(f"COPY {target} FROM STDIN WITH (FORMAT BINARY)") as copy:
        copy.write(payload)


class Server:
    """The local PostgreSQL: a fresh database per design, the WAL's position, pg_waldump."""

    def __init__(self, uri: str):
        import pgserver
        import psycopg

        self.uri = uri
        self.admin = psycopg.connect(uri, autocommit=True)
        self.data_dir = self.admin.execute("SHOW data_directory").fetchone()[0]
        self.waldump = str(Path(pgserver.__file__).parent / "pginstall" / "bin" / "pg_waldump")

    def settings(self) -> dict:
        names = ["server_version", "max_wal_size", "min_wal_size", "checkpoint_timeout",
                 "checkpoint_completion_target", "full_page_writes", "wal_compression", "wal_level",
                 "shared_buffers", "autovacuum", "data_checksums", "wal_log_hints"]
        out = {name: self.admin.execute(f"SHOW {name}").fetchone()[0] for name in names}
        connection = self.database("wal_probe")
        out["pgvector"] = connection.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'").fetchone()[0]
        connection.close()
        self.drop("wal_probe")
        return out

    def database(self, name: str):
        import psycopg
        from pgvector.psycopg import register_vector
        from psycopg.conninfo import make_conninfo

        self.drop(name)
        self.admin.execute(f"CREATE DATABASE {name}")
        connection = psycopg.connect(make_conninfo(self.uri, dbname=name), autocommit=True)
        connection.execute("CREATE EXTENSION vector")
        register_vector(connection)
        return connection

    def drop(self, name: str) -> None:
        self.admin.execute(f"DROP DATABASE IF EXISTS {name}")

    def lsn(self) -> tuple[int, str]:
        row = self.admin.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn, pg_current_wal_lsn()::text").fetchone()
        return int(row[0]), row[1]

    def checkpoints(self) -> int:
        return int(self.admin.execute("SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter").fetchone()[0])

    def wal_stats(self, start: str, end: str) -> dict | None:
        """Records, record bytes and full-page-image bytes by resource manager between two LSNs
        (pg_waldump --stats; None when the WAL is gone already)."""
        done = subprocess.run([self.waldump, "--stats", "-p", os.path.join(self.data_dir, "pg_wal"), "-s", start,
                               "-e", end], capture_output=True, text=True)
        if done.returncode != 0:
            return None
        out = {}
        for line in done.stdout.splitlines():
            match = re.match(r"^(\S+)\s+(\d+)\s+\(\s*[\d.]+\)\s+(\d+)\s+\(\s*[\d.]+\)\s+(\d+)\s+\(", line)
            if match and match.group(1) != "Type" and int(match.group(2)):
                out[match.group(1)] = [int(match.group(2)), int(match.group(3)), int(match.group(4))]
        return out


def _ivfflat(connection, table: str, lists: int) -> None:
    with connection.transaction():
        connection.execute("SET LOCAL maintenance_work_mem = '1GB'")
        connection.execute(f"CREATE INDEX {table}_ivfflat ON {table} USING ivfflat (embedding vector_l2_ops) "
                           f"WITH (lists = {lists})")


def _load(connection, table: str, vectors: np.ndarray, source: str | None, batch: int = 100_000) -> None:
    """The mapped gallery written after the switch, in position order, by COPY."""
    for start in range(0, len(vectors), batch):
        with connection.transaction():
            _copy(connection, table, _copy_rows(np.arange(start, start + len(vectors[start:start + batch])),
                                                vectors[start:start + batch], source))


def _plan_text(rows) -> str:
    text = "\n".join(row[0] for row in rows)
    return re.sub(r"'\[[^\]']*\]'(::vector)?", "$q", text)  # the query vector's literal


class Design:
    """A design's tables, its chunk write and its readers' query."""

    def __init__(self, name: str, connection, data: dict, lists: int, candidates: int):
        self.name, self.connection, self.data, self.lists = name, connection, data, lists
        self.candidates = candidates  # the capped reader query's candidates from the mapped table
        self.append_only = name.startswith("C")
        self.notes: dict = {}

    def switch(self) -> None:
        """The state right after the switch: the mapped vectors in place, indexed, readers moved."""
        c, mapped = self.connection, self.data["mapped"]
        if not self.append_only:
            fill = " WITH (fillfactor = 50)" if self.name == "B" else ""
            c.execute("CREATE TABLE gallery (position bigint PRIMARY KEY, embedding vector(256) NOT NULL, "
                      f"source text NOT NULL){fill}")
            _load(c, "gallery (position, embedding, source)", mapped, "mapped")
            _ivfflat(c, "gallery", self.lists)
            c.execute("VACUUM (ANALYZE) gallery")
            return
        c.execute("CREATE TABLE mapped (position bigint PRIMARY KEY, embedding vector(256) NOT NULL)")
        _load(c, "mapped (position, embedding)", mapped, None)
        _ivfflat(c, "mapped", self.lists)
        c.execute("VACUUM (ANALYZE) mapped")
        c.execute("CREATE TABLE embedded (position bigint PRIMARY KEY, embedding vector(256) NOT NULL)")
        if self.name == "C0":
            _ivfflat(c, "embedded", self.lists)
        elif self.name == "CS":
            rng = np.random.default_rng(3)
            sample = np.sort(rng.choice(len(mapped), min(len(mapped), 50 * self.lists), replace=False))
            with c.transaction():
                _copy(c, "embedded (position, embedding)", _copy_rows(-1 - np.arange(len(sample)), mapped[sample]))
            _ivfflat(c, "embedded", self.lists)
            c.execute("DELETE FROM embedded")
            c.execute("VACUUM (ANALYZE) embedded")
        c.execute(VIEW)
        c.execute(KNN)
        c.execute(KNN_CAPPED)

    def write_chunk(self, number: int, positions: np.ndarray) -> None:
        c, new = self.connection, self.data["new"]
        if self.append_only:
            with c.transaction():
                _copy(c, "embedded (position, embedding)", _copy_rows(positions, new[positions]))
            if number == 0 and self.name == "C":
                start = time.perf_counter()
                _ivfflat(c, "embedded", self.lists)
                self.notes["index_after_first_chunk_s"] = time.perf_counter() - start
            if number == 0:
                c.execute("ANALYZE embedded")
            return
        if self.name == "B":
            positions = np.sort(positions)  # the load's physical order
        with c.transaction():
            c.execute("CREATE TEMPORARY TABLE chunk_rows (position bigint, embedding vector(256)) ON COMMIT DROP")
            _copy(c, "chunk_rows (position, embedding)", _copy_rows(positions, new[positions]))
            if self.name == "B":
                c.execute("SET LOCAL enable_hashjoin = off")
                c.execute("SET LOCAL enable_mergejoin = off")
            update = ("UPDATE gallery t SET embedding = r.embedding, source = 'embedded' FROM chunk_rows r "
                      "WHERE t.position = r.position")
            if number == 0:
                self.notes["update_plan"] = _plan_text(c.execute("EXPLAIN " + update).fetchall())
            updated = c.execute(update).rowcount
        if updated != len(positions):
            raise RuntimeError(f"{self.name}: {updated} of {len(positions)} rows updated")

    def query(self, finished: bool = False) -> str:
        if not self.append_only:
            return f"SELECT position FROM gallery ORDER BY embedding <-> %s LIMIT {K}"
        if finished:
            return f"SELECT position FROM embedded ORDER BY embedding <-> %s LIMIT {K}"
        return f"SELECT item FROM gallery_knn(%s, {K})"

    def sizes(self) -> dict:
        rows = self.connection.execute(
            "SELECT c.relname, pg_relation_size(c.oid) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = 'public' AND c.relkind IN ('r', 'i') ORDER BY 1").fetchall()
        return {name: int(size) for name, size in rows}

    def updates(self) -> dict:
        if self.append_only:
            return {}
        time.sleep(1.5)  # the writer's table statistics reach the collector
        self.connection.execute("SELECT 1")
        self.connection.execute("SELECT pg_stat_clear_snapshot()")
        row = self.connection.execute("SELECT n_tup_upd, n_tup_hot_upd, n_dead_tup, autovacuum_count, "
                                      "autoanalyze_count FROM pg_stat_user_tables WHERE relname = 'gallery'").fetchone()
        return dict(zip(["n_tup_upd", "n_tup_hot_upd", "n_dead_tup", "autovacuum_count", "autoanalyze_count"], row))


def _timed(connection, sql: str, queries: np.ndarray, truth: np.ndarray) -> dict:
    """Each query's latency and recall@k through ``sql`` (warmed by 5 queries), and the EXPLAIN
    ANALYZE of the first."""
    for query in queries[:5]:
        connection.execute(sql, (query,)).fetchall()
    latencies, recalls = [], []
    for query, true in zip(queries, truth):
        start = time.perf_counter()
        found = [row[0] for row in connection.execute(sql, (query,)).fetchall()]
        latencies.append(time.perf_counter() - start)
        recalls.append(len(set(found) & set(true.tolist())) / K)
    explain = _plan_text(connection.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql.replace("%s", "%s::vector", 1),
                                            (queries[0],)).fetchall())
    return {"latency_ms_median": 1000 * statistics.median(latencies),
            "latency_ms_p95": 1000 * float(np.percentile(latencies, 95)), "recall_at_10": float(np.mean(recalls)),
            "explain": explain, "query": sql}


def _search(design: Design, done: np.ndarray, finished: bool = False) -> dict:
    """``--queries`` queries through the design's reader query, against an exact search of the mixed
    gallery (the new vectors of the rows written so far, the mapped vectors of the rest); on C also
    the capped reader query, and the view's plan and a few of its queries."""
    c, data = design.connection, design.data
    queries = data["queries"]
    mixed = data["mapped"].copy()
    mixed[done] = data["new"][done]
    truth = _exact(mixed, queries)
    del mixed
    c.execute(f"SET ivfflat.probes = {PROBES}")
    out = {"rows_embedded": int(len(done)), **_timed(c, design.query(finished), queries, truth)}
    if design.append_only and not finished:
        capped = f"SELECT item FROM gallery_knn_capped(%s, {K}, {design.candidates})"
        out["capped"] = _timed(c, capped, queries, truth)
        view_sql = f"SELECT position FROM gallery_view ORDER BY embedding <-> %s::vector LIMIT {K}"
        out["view_explain"] = _plan_text(c.execute("EXPLAIN " + view_sql, (queries[0],)).fetchall())
        view = _timed(c, view_sql.replace("::vector", ""), queries[:3], truth[:3])
        out["view_query"] = {"queries": 3, "latency_ms_median": view["latency_ms_median"],
                             "recall_at_10": view["recall_at_10"]}
    return out


def _merge(total: dict, stats: dict | None) -> None:
    for name, values in (stats or {}).items():
        total[name] = [a + b for a, b in zip(total.get(name, [0, 0, 0]), values)]


def run_design(server: Server, name: str, data: dict, chunk: int, after_half: int | None, minutes: float,
               candidates: int, checkpoint_each: bool = False) -> dict:
    items = len(data["new"])
    lists = max(1, int(items ** 0.5))
    connection = server.database(f"wal_{name.lower()}")
    design = Design(name, connection, data, lists, candidates)
    print(f"[{name}] {DESIGNS[name]}: the switch", flush=True)
    start, (lsn_start, _) = time.perf_counter(), server.lsn()
    design.switch()
    switch = {"seconds": time.perf_counter() - start, "wal_bytes": server.lsn()[0] - lsn_start}
    sizes_before = design.sizes()
    connection.execute("CHECKPOINT")
    n_chunks = math.ceil(items / chunk)
    half = n_chunks // 2
    late = math.ceil(0.9 * n_chunks)  # a search at 90 %, where the mapped rows left are few
    stop = n_chunks if after_half is None else min(n_chunks, half + after_half)
    checkpoints0, (lsn0, _) = server.checkpoints(), server.lsn()
    chunks, rmgr, searches, excluded = [], {}, {}, 0
    began = time.perf_counter()
    for number in range(stop):
        positions = data["order"][number * chunk:(number + 1) * chunk]
        if checkpoint_each:
            connection.execute("CHECKPOINT")
        before, before_text = server.lsn()
        start = time.perf_counter()
        design.write_chunk(number, positions)
        seconds = time.perf_counter() - start
        after, after_text = server.lsn()
        stats = server.wal_stats(before_text, after_text)
        _merge(rmgr, stats)
        chunks.append({"chunk": number, "rows": int(len(positions)), "wal_bytes": after - before, "seconds": seconds,
                       "fpi_bytes": sum(v[2] for v in stats.values()) if stats else None})
        if number % 10 == 0 or number == stop - 1:
            print(f"[{name}] chunk {number + 1}/{stop}: {(after - before) / 1e6:.1f} MB WAL, {seconds:.2f} s",
                  flush=True)
        if number + 1 == half:
            s0 = server.lsn()[0]
            searches["half"] = _search(design, data["order"][:half * chunk])
            excluded += server.lsn()[0] - s0
            print(f"[{name}] half way: {searches['half']['latency_ms_median']:.1f} ms, "
                  f"recall {searches['half']['recall_at_10']:.3f}", flush=True)
        if number + 1 == late and late not in (half, n_chunks) and number + 1 < stop:
            s0 = server.lsn()[0]
            searches["late"] = _search(design, data["order"][:late * chunk])
            searches["late"]["label"] = f"at 90 % ({late} of {n_chunks} chunks)"
            excluded += server.lsn()[0] - s0
        if minutes and number + 1 > half and time.perf_counter() - began > 60 * minutes:
            stop = number + 1
            break
    lsn_end = server.lsn()[0]
    checkpoints = server.checkpoints() - checkpoints0
    done = data["order"][:min(items, stop * chunk)]
    label = "after" if stop == n_chunks else f"stopped after {stop} of {n_chunks} chunks"
    searches["after"] = _search(design, done)
    searches["after"]["label"] = label
    if design.append_only and stop == n_chunks:
        searches["finished"] = _search(design, done, finished=True)
    print(f"[{name}] {label}: {searches['after']['latency_ms_median']:.1f} ms, "
          f"recall {searches['after']['recall_at_10']:.3f}", flush=True)
    payload = chunk * DIM * 4
    wal = [c["wal_bytes"] for c in chunks]
    ratios = [c["wal_bytes"] / (c["rows"] * DIM * 4) for c in chunks]
    steady = chunks[1:] if name == "C" else chunks  # C's first chunk includes its index build
    result = {
        "design": name, "description": DESIGNS[name], "lists": lists, "chunks_done": stop, "chunks_total": n_chunks,
        "half_chunk": half, "switch": switch, "notes": design.notes, "sizes_before": sizes_before,
        "sizes_after": design.sizes(), "updates": design.updates(), "checkpoints_during_backfill": checkpoints,
        "payload_bytes_per_chunk": payload,
        "wal_per_chunk_median": statistics.median(wal), "wal_per_chunk_mean": statistics.mean(wal),
        "ratio_median": statistics.median(ratios), "ratio_mean": statistics.mean(ratios),
        "ratio_max": max(ratios),
        "steady_ratio_median": statistics.median([c["wal_bytes"] / (c["rows"] * DIM * 4) for c in steady]),
        "steady_ratio_mean": statistics.mean([c["wal_bytes"] / (c["rows"] * DIM * 4) for c in steady]),
        "span_wal_per_chunk": (lsn_end - lsn0 - excluded) / stop,
        "span_ratio": (lsn_end - lsn0 - excluded) / stop / payload,
        "seconds_median": statistics.median(c["seconds"] for c in chunks),
        "seconds_mean": statistics.mean(c["seconds"] for c in chunks),
        "wal_by_resource_manager": {k: {"records": v[0], "record_bytes": v[1], "fpi_bytes": v[2]}
                                    for k, v in sorted(rmgr.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))},
        "searches": searches, "chunks": chunks,
    }
    connection.close()
    server.drop(f"wal_{name.lower()}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--chunk", type=int, default=10_000)
    parser.add_argument("--designs", default="A,B,C", help=f"some of {','.join(DESIGNS)}")
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--after-half", type=int, default=None,
                        help="stop each design this many chunks after half way (default: write the whole table)")
    parser.add_argument("--design-minutes", type=float, default=0,
                        help="past half way, stop a design's backfill once it has run this long (0: never)")
    parser.add_argument("--mapped-candidates", type=int, default=100,
                        help="C's capped reader query: the nearest rows taken from the mapped table before the "
                             "anti-join")
    parser.add_argument("--checkpoint-each-chunk", action="store_true",
                        help="a CHECKPOINT before every chunk: the WAL of a backfill whose chunks come further apart "
                             "than checkpoint_timeout")
    parser.add_argument("--suffix", default="")
    parser.add_argument("--render", default="", help="only write the .md again from this report's .json")
    args = parser.parse_args()
    if args.render:
        source = Path(args.render)
        source.with_suffix(".md").write_text(report(json.loads(source.read_text())))
        return
    designs = [d.strip().upper() for d in args.designs.split(",") if d.strip()]
    unknown = [d for d in designs if d not in DESIGNS]
    if unknown:
        parser.error(f"unknown designs {unknown}; choose from {list(DESIGNS)}")
    import warnings

    from testkit.local_postgres import start_postgres

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        server = Server(start_postgres("pg-wal-study-"))
    began = time.perf_counter()
    data = _data(args.items, args.queries)
    settings = server.settings()
    print(f"PostgreSQL {settings['server_version']}, pgvector {settings['pgvector']}", flush=True)
    results = {}
    for name in designs:
        results[name] = run_design(server, name, data, args.chunk, args.after_half, args.design_minutes,
                                   args.mapped_candidates, args.checkpoint_each_chunk)
    command = "python benchmarks/pg_wal_study.py " + " ".join(sys.argv[1:])
    out = {"command": command.strip(), "items": args.items, "chunk": args.chunk, "dim": DIM, "k": K,
           "probes": PROBES, "mapped_candidates": args.mapped_candidates,
           "checkpoint_each_chunk": args.checkpoint_each_chunk, "queries": args.queries,
           "cpus": os.cpu_count(), "settings": settings,
           "seconds": time.perf_counter() - began, "designs": results}
    path = ROOT / "reports" / f"pg_wal_study-{args.items}{f'-{args.suffix}' if args.suffix else ''}"
    path.with_suffix(".json").write_text(json.dumps(out, indent=1) + "\n")
    path.with_suffix(".md").write_text(report(out))
    print(f"wrote {path}.md", flush=True)


def _mb(value: float) -> str:
    return f"{value / 1e6:.1f} MB"


def report(out: dict) -> str:
    s, results = out["settings"], out["designs"]
    names = list(results)
    lines = [f"# The WAL of a pgvector backfill, design by design: {out['items']:,} rows of {out['dim']}-d vectors, "
             f"chunks of {out['chunk']:,}", "",
             f"`{out['command']}` on {out['cpus']} cores (other work on the machine at the same time), "
             f"{out['seconds'] / 60:.0f} minutes. PostgreSQL {s['server_version']} + pgvector {s['pgvector']} "
             f"(pgserver, Unix socket), default checkpoint settings: max_wal_size {s['max_wal_size']}, "
             f"checkpoint_timeout {s['checkpoint_timeout']}, full_page_writes {s['full_page_writes']}, "
             f"wal_compression {s['wal_compression']}, shared_buffers {s['shared_buffers']}, data checksums "
             f"{s['data_checksums']}. IVFFlat lists = sqrt(rows), ivfflat.probes = {out['probes']}, k = {out['k']}, "
             f"{out['queries']} queries; recall@10 against an exact search of the same mixed gallery. "
             "Each design in a fresh database, one after the other; "
             + ("a CHECKPOINT before every chunk (as when chunks come further apart than checkpoint_timeout)."
                if out.get("checkpoint_each_chunk") else "a CHECKPOINT just before its first chunk."), ""]
    lines += ["| design | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]

    def row(label: str, fn) -> None:
        lines.append(f"| {label} | " + " | ".join(fn(results[n]) for n in names) + " |")

    row("what", lambda r: r["description"])
    row("chunks written", lambda r: f"{r['chunks_done']} of {r['chunks_total']}")
    row("WAL per chunk, median", lambda r: f"{_mb(r['wal_per_chunk_median'])} ({r['ratio_median']:.2f}x)")
    row("WAL per chunk, mean", lambda r: f"{_mb(r['wal_per_chunk_mean'])} ({r['ratio_mean']:.2f}x)")
    row("WAL per chunk, worst", lambda r: f"{r['ratio_max']:.2f}x")
    row("WAL per chunk, mean, chunks 2.. (C: without the index build)", lambda r: f"{r['steady_ratio_mean']:.2f}x")
    row("WAL of the whole backfill per chunk (autovacuum included)",
        lambda r: f"{_mb(r['span_wal_per_chunk'])} ({r['span_ratio']:.2f}x)")
    row("of which full-page images", lambda r: _mb(sum(v["fpi_bytes"] for v in r["wal_by_resource_manager"].values())
                                                   / max(1, r["chunks_done"])) + " per chunk (chunks' WAL)")
    row("checkpoints during the backfill", lambda r: str(r["checkpoints_during_backfill"]))
    row("chunk seconds, median / mean", lambda r: f"{r['seconds_median']:.2f} / {r['seconds_mean']:.2f}")
    def cell(search: dict | None) -> str:
        if not search:
            return "-"
        return f"{search['latency_ms_median']:.2f} / {search['latency_ms_p95']:.2f}, {search['recall_at_10']:.3f}"

    for phase, title in (("half", "half way"), ("late", "at 90 %"), ("after", "after the last chunk")):
        row(f"search {title}: ms median / p95, recall@10 (C: gallery_knn)",
            lambda r, p=phase: cell(r["searches"].get(p)))
        row(f"search {title}, C capped ({out['mapped_candidates']} mapped candidates)",
            lambda r, p=phase: cell(r["searches"].get(p, {}).get("capped")))
    row("search once finished (C: the embedded table alone)", lambda r: (
        f"{r['searches']['finished']['latency_ms_median']:.2f} / {r['searches']['finished']['latency_ms_p95']:.2f}, "
        f"{r['searches']['finished']['recall_at_10']:.3f}" if "finished" in r["searches"] else "-"))
    row("the switch (load, index, VACUUM): s, WAL", lambda r: f"{r['switch']['seconds']:.0f} s, "
                                                              f"{_mb(r['switch']['wal_bytes'])}")
    row("tables + indexes before -> after", lambda r: f"{_mb(sum(r['sizes_before'].values()))} -> "
                                                      f"{_mb(sum(r['sizes_after'].values()))}")
    payload = out["chunk"] * out["dim"] * 4
    lines += ["", f"The payload of a chunk is {out['chunk']:,} x {out['dim']} x 4 = {_mb(payload)}; the ratios are "
              "the WAL over it. 'WAL per chunk' is the chunk's transaction (pg_current_wal_lsn() before and after, "
              "including whatever else the server wrote meanwhile, autovacuum among it); 'the whole backfill' is "
              "the WAL from the first chunk to the last over the number of chunks, the searches excluded.", ""]
    lines += ["## The chunks' WAL by resource manager (pg_waldump --stats), per chunk", "",
              "| design | " + " | ".join(f"{k} records / FPI" for k in ("Heap", "Heap2", "Btree", "Generic", "other"))
              + " |", "|---|" + "---|" * 5]
    for name in names:
        r = results[name]
        by, n = r["wal_by_resource_manager"], max(1, r["chunks_done"])
        cells = []
        for key in ("Heap", "Heap2", "Btree", "Generic"):
            v = by.get(key, {"record_bytes": 0, "fpi_bytes": 0})
            cells.append(f"{_mb(v['record_bytes'] / n)} / {_mb(v['fpi_bytes'] / n)}")
        rest = [v for k, v in by.items() if k not in ("Heap", "Heap2", "Btree", "Generic")]
        cells.append(f"{_mb(sum(v['record_bytes'] for v in rest) / n)} / {_mb(sum(v['fpi_bytes'] for v in rest) / n)}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Generic is pgvector's IVFFlat (generic WAL records); Btree the primary keys.", ""]
    lines += ["## Against the goal: at most 3x the payload per chunk, recall@10 >= 0.95 half way and after", "",
              "| design | WAL per chunk, mean / worst | whole backfill | recall@10 half / after (C: capped query) "
              "| search ms median half / after (C: capped) | mean <= 3x and recall >= 0.95 |", "|---|---|---|---|---|---|"]
    for name in names:
        r = results[name]
        picked = {p: r["searches"][p].get("capped", r["searches"][p]) for p in ("half", "after") if p in r["searches"]}
        recall = [picked[p]["recall_at_10"] for p in picked]
        met = max(r["ratio_mean"], r["span_ratio"]) <= 3 and len(recall) == 2 and min(recall) >= 0.95
        lines.append(f"| {name} | {r['ratio_mean']:.2f}x / {r['ratio_max']:.2f}x | {r['span_ratio']:.2f}x | "
                     + " / ".join(f"{v:.3f}" for v in recall) + " | "
                     + " / ".join(f"{picked[p]['latency_ms_median']:.1f}" for p in picked)
                     + f" | {'yes' if met else 'no'} |")
    lines.append("")
    if any(n.startswith("C") for n in names):
        lines += ["## The readers of C", "", "The view, as the design has it (its plan under each C search below):",
                  "", "```sql", VIEW + ";", "```", "", "Its k-NN query does not get a Merge Append of two IVFFlat scans "
                  "in these runs: the mapped branch, an anti-join, stays a subquery of the UNION ALL, and the planner "
                  "sorts all of it by distance (sequential scans of both tables and a hash anti-join; the plans "
                  "below). The reader query used instead: an inlined SQL function, each branch an ordered IVFFlat "
                  "scan with its own LIMIT, merged:", "", "```sql", KNN + ";", "```", "",
                  "The capped one: the mapped branch takes its n nearest rows, then drops those that have an "
                  "embedded row (at most n key lookups per query, at the price of missing mapped rows ranked "
                  "beyond n among all mapped rows):", "", "```sql", KNN_CAPPED + ";", "```", ""]
    for name in names:
        r = results[name]
        lines += [f"## {name}: {r['description']}", ""]
        sizes = ", ".join(f"{k} {_mb(v)}" for k, v in r["sizes_after"].items())
        lines += [f"Relations after the backfill: {sizes}."]
        if r["updates"]:
            u = r["updates"]
            lines += [f"Updates {u['n_tup_upd']}, of which HOT {u['n_tup_hot_upd']}; dead rows at the end "
                      f"{u['n_dead_tup']}; autovacuum ran {u['autovacuum_count']} times."]
        if "index_after_first_chunk_s" in r["notes"]:
            first = r["chunks"][0]
            lines += [f"The first chunk with the embedded table's IVFFlat build: {first['seconds']:.1f} s, "
                      f"{_mb(first['wal_bytes'])} of WAL (index build {r['notes']['index_after_first_chunk_s']:.1f} s)."]
        if "update_plan" in r["notes"]:
            lines += ["", "The chunk's UPDATE:", "", "```", r["notes"]["update_plan"], "```"]
        for phase in ("half", "late", "after", "finished"):
            if phase not in r["searches"]:
                continue
            search = r["searches"][phase]
            lines += ["", f"Search, {search.get('label', phase)} ({search['rows_embedded']:,} rows embedded): "
                      f"`{search['query']}`", "", "```", search["explain"], "```"]
            if "capped" in search:
                lines += ["", f"The capped query: `{search['capped']['query']}`", "", "```",
                          search["capped"]["explain"], "```"]
            if "view_explain" in search:
                v = search["view_query"]
                lines += ["", f"The view's query, `SELECT position FROM gallery_view ORDER BY embedding <-> $q LIMIT "
                          f"10` ({v['queries']} queries: {v['latency_ms_median']:.0f} ms median, recall@10 "
                          f"{v['recall_at_10']:.3f}):", "", "```", search["view_explain"], "```"]
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
