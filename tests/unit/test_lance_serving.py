"""The Lance serving table's ANN index (tests/gallery_cases.py covers the table through whole
upgrades on galleries too small to index): built at the switch, a chunk's rows searched exactly
beside it, rebuilt over one compacted fragment at the finish."""

import os

import numpy as np
import pytest

from fastfill.components.gallery.layouts.catalog import EMBEDDED, MAPPED
from fastfill.components.gallery.layouts.lance_serving import ServingTable
from fastfill.components.gallery.store import DamagedObject
from fastfill.components.platform.registry import ModelRef

N, DIM = 3000, 16
MODEL = ModelRef("m", "2", DIM)


def _exact(vectors, queries, k):
    distances = ((queries[:, None, :] - vectors[None]) ** 2).sum(-1)
    return np.argsort(distances, axis=1, kind="stable")[:, :k]


def test_the_index_is_built_at_the_switch_and_a_chunk_is_searched_beside_it(tmp_path):
    rng = np.random.default_rng(3)
    centres = rng.normal(size=(30, DIM)).astype(np.float32)
    vectors = (centres[rng.integers(0, 30, N)] + 0.3 * rng.normal(size=(N, DIM))).astype(np.float32)
    table = ServingTable(str(tmp_path), {"ann": "ivf_flat", "ann_min_rows": 1000, "nprobes": 20})
    ids = np.arange(N) + 7
    parts = ((np.arange(s, s + 1000), vectors[s:s + 1000], [MAPPED] * 1000, np.full(1000, -1)) for s in range(0, N, 1000))
    table.write(MODEL, "up-1", ids, parts)
    assert [i["fields"] for i in table.dataset().list_indices()] == [["embedding"]]
    queries = vectors[:50] + 0.05
    got, _, models, sources = table.search(queries, 10, MODEL.uri)
    exact = ids[_exact(vectors, queries, 10)]
    recall = np.mean([len(set(g) & set(e)) / 10 for g, e in zip(got, exact)])
    assert recall >= 0.9 and all(m == {MODEL.uri} for m in models)

    chunk = np.arange(0, N, 3)  # a third of the rows, everywhere in the table
    moved = vectors.copy()
    moved[chunk] = rng.normal(size=(len(chunk), DIM)).astype(np.float32)
    table.serve_chunk("up-1", 0, chunk, ids[chunk], moved[chunk], [EMBEDDED] * len(chunk))
    assert table.dataset().count_rows() == N and table.embedded_count() == len(chunk)
    assert table.chunk_done("up-1") == {0} and table.chunk_done("up-2") == set()
    queries = moved[chunk[:40]]
    got, _, _, sources = table.search(queries, 1, MODEL.uri)
    assert [g[0] for g in got] == list(ids[chunk[:40]]) and all(s == [EMBEDDED] for s in sources)
    assert table.search(queries, 1, "models:/m/1")[0] == [[]] * 40  # another space: no rows

    table.retag(MODEL, None)  # the finish: compacted, indexed again, same answers
    assert table.serving().upgrade is None and len(table.dataset().get_fragments()) == 1
    assert table.dataset().has_index
    again, _, _, _ = table.search(queries, 1, MODEL.uri)
    assert again == got


def _switched(tmp_path, rng, ann_min_rows=1000):
    centres = rng.normal(size=(30, DIM)).astype(np.float32)
    vectors = (centres[rng.integers(0, 30, N)] + 0.3 * rng.normal(size=(N, DIM))).astype(np.float32)
    table = ServingTable(str(tmp_path), {"ann": "ivf_flat", "ann_min_rows": ann_min_rows, "nprobes": 20})
    parts = ((np.arange(s, s + 1000), vectors[s:s + 1000], [MAPPED] * 1000, np.full(1000, -1)) for s in range(0, N, 1000))
    table.write(MODEL, "up-1", np.arange(N), parts)
    return table, vectors


def _served(table) -> np.ndarray:
    rows = table.dataset().to_table(columns=["position", "embedding"])
    out = np.zeros((N, DIM), np.float32)
    out[rows.column("position").to_numpy()] = np.stack(rows.column("embedding").to_numpy(zero_copy_only=False))
    return out


def test_a_chunk_replaces_only_its_rows_and_joins_the_index_as_a_delta(tmp_path, monkeypatch):
    """Each chunk: its rows deleted by address and appended in one commit (no upsert joining the
    chunk against every row), then indexed as a delta; deltas merge two by two, so a search half
    way probes a few index segments, none of the chunks' rows scanned."""
    import lance

    def no_upsert(*_args, **_kwargs):
        raise AssertionError("a chunk of a table laid out as the switch wrote it was upserted")

    counted = []  # the filters of every count: a chunk's first write reads no column of the whole table
    count_rows = lance.LanceDataset.count_rows

    def recorded(self, *args, **kwargs):
        counted.append(kwargs.get("filter", args[0] if args else None))
        return count_rows(self, *args, **kwargs)

    rng = np.random.default_rng(5)
    table, vectors = _switched(tmp_path, rng)
    monkeypatch.setattr(lance.LanceDataset, "merge_insert", no_upsert)
    monkeypatch.setattr(lance.LanceDataset, "count_rows", recorded)
    order, chunk = rng.permutation(N), 250
    expected = vectors.copy()
    for number, start in enumerate(range(0, N, chunk)):
        positions = order[start:start + chunk]
        features = rng.normal(size=(len(positions), DIM)).astype(np.float32)
        expected[positions] = features
        counted.clear()
        table.serve_chunk("up-1", number, positions, positions, features, [EMBEDDED] * len(positions))
        assert counted == []
        table.serve_chunk("up-1", number, positions, positions, features + 1, [EMBEDDED] * len(positions))  # once
        assert counted == [f"chunk = {number}"]  # the retry finds its rows gone, then the chunk's there
        dataset = table.dataset()
        assert dataset.count_rows() == N and table.embedded_count() == start + len(positions)
        segments = [i for i in dataset.list_indices() if i["fields"] == ["embedding"]]
        indexed = set().union(*(set(i["fragment_ids"]) for i in segments))
        assert {f.fragment_id for f in dataset.get_fragments()} <= indexed  # no fragment left to scan
        assert len(segments) <= 2 + int(np.log2(number + 1))
        if number == 5:
            got, _, _, sources = table.search(features[:20], 1, MODEL.uri)
            assert [g[0] for g in got] == list(positions[:20]) and all(s == [EMBEDDED] for s in sources)
    assert np.array_equal(_served(table), expected)
    assert table.chunk_done("up-1") == set(range(N // chunk))


def test_a_table_another_tool_compacted_mid_upgrade_is_upserted_and_stays_right(tmp_path, monkeypatch):
    import lance

    upserts = []
    original = lance.LanceDataset.merge_insert

    def counted(self, *args, **kwargs):
        upserts.append(True)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(lance.LanceDataset, "merge_insert", counted)
    rng = np.random.default_rng(6)
    table, vectors = _switched(tmp_path, rng)
    order, expected = rng.permutation(N), vectors.copy()
    for number in range(4):
        positions = order[number * 300:(number + 1) * 300]
        features = rng.normal(size=(300, DIM)).astype(np.float32)
        expected[positions] = features
        table.serve_chunk("up-1", number, positions, positions, features, [EMBEDDED] * 300)
        if number == 1:  # rows no longer where the switch wrote them
            for name in {index["name"] for index in table.dataset().list_indices()}:
                table.dataset().drop_index(name)
            table.dataset().optimize.compact_files(materialize_deletions=True)
        assert table.dataset().count_rows() == N
    assert np.array_equal(_served(table), expected) and table.embedded_count() == 1200
    assert len(upserts) == 2  # the two chunks after the compaction, not the two before


def test_a_damaged_serving_table_is_named_in_one_line(tmp_path):
    rng = np.random.default_rng(4)
    table = ServingTable(str(tmp_path), {"ann": "none"})
    vectors = rng.normal(size=(500, DIM)).astype(np.float32)
    table.write(MODEL, None, np.arange(500), [(np.arange(500), vectors, [EMBEDDED] * 500, np.full(500, -1))])
    data = tmp_path / "serving.lance" / "data"
    (victim,) = list(data.iterdir())
    with open(victim, "r+b") as handle:
        handle.truncate(os.path.getsize(victim) // 2)
    with pytest.raises(DamagedObject, match=r"serving.lance: the serving table cannot be read \(.*\); restore it") as raised:
        table.search(vectors[:2], 3, MODEL.uri)
    assert "\n" not in str(raised.value)


def _foreign_table(path, metadata=None):
    """A serving.lance someone else wrote with lance directly."""
    import lance
    import pyarrow as pa

    table = pa.table({"position": pa.array([0, 1], pa.int64()), "note": ["the team's", "rows"]})
    lance.write_dataset(table.replace_schema_metadata(metadata), str(path))
    return lance.dataset(str(path)).version


def test_a_serving_table_not_the_galleries_is_refused_not_overwritten(tmp_path):
    from fastfill.components.gallery.layouts.ownership import NotOurs, mark

    vectors = np.random.default_rng(5).normal(size=(20, DIM)).astype(np.float32)
    parts = [(np.arange(20), vectors, [EMBEDDED] * 20, np.full(20, -1))]
    settings = {"ann": "none", "owner": "0123456789abcdef", "owner_store": str(tmp_path)}
    path = tmp_path / "serving.lance"
    version = _foreign_table(path)
    table = ServingTable(str(tmp_path), settings)
    for write in (lambda: table.write(MODEL, None, np.arange(20), iter(parts)), table.cleanup, table.check_free):
        with pytest.raises(NotOurs, match=r"the serving table .*serving\.lance exists and is not the product's "
                                          r"\(it has no fastfill mark\).*gallery\.store.*Nothing was written\.$") as raised:
            write()
        assert "\n" not in str(raised.value)
    assert table.dataset().version == version and table.dataset().to_table().column("note").to_pylist()[0] == "the team's"

    other = tmp_path / "other"  # another gallery's table: refused naming its store
    _foreign_table(other / "serving.lance", {"fastfill.gallery": mark("fedcba9876543210", "serving", "s3://team/a")})
    with pytest.raises(NotOurs, match=r"belongs to another gallery \(fedcba9876543210, store s3://team/a\)"):
        ServingTable(str(other), settings).write(MODEL, None, np.arange(20), iter(parts))

    mine = tmp_path / "mine"  # the gallery's own: written, marked, and written again
    table = ServingTable(str(mine), settings)
    table.write(MODEL, None, np.arange(20), iter(parts))
    table.write(MODEL, "up-1", np.arange(20), iter(parts))
    meta = table.dataset().schema.metadata
    assert meta[b"fastfill.gallery"].decode() == mark("0123456789abcdef", "serving", str(tmp_path))
    assert table.serving().upgrade == "up-1"


def test_a_gallery_made_before_ids_keeps_writing_its_unmarked_serving_table(tmp_path):
    """A table an earlier release wrote (the product's model metadata, no mark) is the gallery's
    when its manifest has no id either; a gallery with an id refuses it."""
    import json

    from fastfill.components.gallery.layouts.ownership import NotOurs

    vectors = np.random.default_rng(6).normal(size=(10, DIM)).astype(np.float32)
    parts = [(np.arange(10), vectors, [EMBEDDED] * 10, np.full(10, -1))]
    _foreign_table(tmp_path / "serving.lance", {"fastfill.model": json.dumps(MODEL.to_dict())})
    with pytest.raises(NotOurs):
        ServingTable(str(tmp_path), {"ann": "none", "owner": "0123456789abcdef"}).write(MODEL, None, np.arange(10),
                                                                                        iter(parts))
    legacy = ServingTable(str(tmp_path), {"ann": "none"})
    legacy.write(MODEL, None, np.arange(10), iter(parts))
    assert legacy.serving().model == MODEL.uri and b"fastfill.gallery" in legacy.dataset().schema.metadata


def test_a_lance_gallery_is_not_made_over_a_serving_table_not_its_own(tmp_path, models, data):
    from fastfill.components.gallery.layouts.ownership import NotOurs
    from fastfill.components.gallery.store import open_store
    from tests.gallery_cases import _gallery

    store_uri = str(tmp_path / "store")
    version = _foreign_table(tmp_path / "store" / "serving.lance")
    with pytest.raises(NotOurs, match=r"serving\.lance exists and is not the product's"):
        _gallery(store_uri, models, data, layout="lance")
    assert not os.path.exists(tmp_path / "store" / "gallery.lance") and not open_store(store_uri).exists("gallery.json")
    assert ServingTable(store_uri).dataset().version == version


def test_the_session_cache_is_bounded_by_its_setting_and_a_bad_one_is_named(tmp_path, monkeypatch):
    """The process's Lance session keeps at most FASTFILL_LANCE_CACHE_MB of index segments (Lance's
    own default let a million-row upgrade keep every merged-away segment): under a bound smaller
    than the index, searches still answer and the cache holds no more than the bound, where a
    larger bound keeps more."""
    from fastfill.components.gallery.layouts import lance_serving

    monkeypatch.setenv(lance_serving.CACHE_ENV, "3")
    assert lance_serving.cache_bytes() == 3 << 20
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(N, DIM)).astype(np.float32)
    held = {}
    for name, capacity in (("small", 64 << 10), ("large", 64 << 20)):
        monkeypatch.setattr(lance_serving, "cache_bytes", lambda capacity=capacity: capacity)
        table = ServingTable(str(tmp_path / name), {"ann": "ivf_flat", "ann_min_rows": 1000, "nprobes": 20})
        parts = ((np.arange(s, s + 1000), vectors[s:s + 1000], [EMBEDDED] * 1000, np.full(1000, -1))
                 for s in range(0, N, 1000))
        table.write(MODEL, None, np.arange(N), parts)
        got, _, _, _ = table.search(vectors[:3], 1, MODEL.uri)
        assert [row[0] for row in got] == [0, 1, 2]
        held[name] = lance_serving._session(capacity).index_cache_size_bytes()
    assert held["small"] <= 64 << 10 < held["large"]
    monkeypatch.undo()
    for bad in ("0", "two", "-5"):
        monkeypatch.setenv(lance_serving.CACHE_ENV, bad)
        with pytest.raises(lance_serving.GalleryError, match=f"FASTFILL_LANCE_CACHE_MB={bad!r} is not a positive"):
            lance_serving.cache_bytes()
