"""The gallery as a Lance table on a local folder: the upgrade's columns, chunk commits that are
idempotent and concurrent, the finish and its resumption, rollback and gc by tags, damaged data
files named, today's layout converted, and the table read by pyarrow, DuckDB and LanceDB."""

from __future__ import annotations

import multiprocessing
from datetime import timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from components.gallery.layouts.catalog import GalleryError, ingest
from components.gallery.layouts.lance_convert import convert
from components.gallery.layouts.lance_table import LanceGallery, TableCorrupt
from components.gallery.store import LocalStore
from components.platform.registry import ModelRef

N, OLD_DIM, NEW_DIM, CHUNK = 600, 8, 12, 150
OLD = ModelRef("embedder", "1", OLD_DIM)
NEW = ModelRef("embedder", "2", NEW_DIM)


def _data(seed: int = 0):
    rng = np.random.default_rng(seed)
    return {"old": rng.normal(size=(N, OLD_DIM)).astype(np.float32),
            "mapped": rng.normal(size=(N, NEW_DIM)).astype(np.float32),
            "new": rng.normal(size=(N, NEW_DIM)).astype(np.float32),
            "rank": rng.permutation(N), "sigma": rng.normal(size=N).astype(np.float32),
            "labels": rng.integers(0, 5, N)}


def _items(data) -> pa.Table:
    return pa.table({"id": pa.array(np.arange(N, dtype=np.int64) * 7 + 3), "label": pa.array(data["labels"])})


def _chunk_positions(rank: np.ndarray, chunk: int) -> np.ndarray:
    order = np.argsort(rank)
    return order[chunk * CHUNK:(chunk + 1) * CHUNK]


TOKEN = "plan-1"


def _upgraded(tmp_path, data) -> LanceGallery:
    table = LanceGallery.create(tmp_path / "store", _items(data), data["old"], OLD)
    assert table.begin_upgrade("u1", NEW, data["mapped"], data["rank"], data["sigma"], token=TOKEN) == TOKEN
    return table


def _commit_all(table: LanceGallery, data, chunks=None) -> None:
    for chunk in range(N // CHUNK) if chunks is None else chunks:
        positions = _chunk_positions(data["rank"], chunk)
        table.commit_chunk("u1", chunk, positions, data["new"][positions], TOKEN)


def _content(table: LanceGallery) -> dict:
    """The table's rows in position order, every column (the version left aside)."""
    return table.dataset().to_table().sort_by("position").to_pydict()


def test_created_table_reads_back_and_other_tools_open_it(tmp_path):
    data = _data()
    table = LanceGallery.create(tmp_path / "store", _items(data), data["old"], OLD)
    assert table.uri == str((tmp_path / "store" / "gallery.lance").resolve())
    assert np.array_equal(table.features(), data["old"])
    assert table.model() == OLD and table.upgrade() is None
    assert [name for _, name, _ in table.serving_tags()] == ["serving-1"]
    assert table.items().column("id").to_pylist() == (np.arange(N) * 7 + 3).tolist()

    import duckdb
    import lancedb

    ds = table.dataset()  # noqa: F841 - DuckDB finds the dataset by its variable name
    assert duckdb.sql("select count(*), min(position), max(position) from ds").fetchall() == [(N, 0, N - 1)]
    hits = (lancedb.connect(str(tmp_path / "store")).open_table("gallery")
            .search(data["old"][17], vector_column_name="features").limit(1).to_arrow())
    assert hits.column("position").to_pylist() == [17]

    with pytest.raises(GalleryError, match="already holds a gallery table"):
        LanceGallery.create(tmp_path / "store", _items(data), data["old"], OLD)


def test_upgrade_columns_chunks_and_mixed_view(tmp_path):
    data = _data()
    table = _upgraded(tmp_path, data)
    assert table.begin_upgrade("u1", NEW, data["mapped"], data["rank"], data["sigma"]) == TOKEN  # a re-run
    assert table.upgrade().id == "u1" and table.upgrade().new == NEW
    assert np.array_equal(table.features("mapped"), data["mapped"])
    with pytest.raises(GalleryError, match="upgrade u1 holds the table"):
        table.begin_upgrade("u2", NEW, data["mapped"], data["rank"])

    first, second = _chunk_positions(data["rank"], 0), _chunk_positions(data["rank"], 1)
    assert table.commit_chunk("u1", 0, first, data["new"][first], TOKEN)["rows"] == CHUNK
    assert table.fold("u1") == 1  # chunk 0 into the gallery table; chunk 1 stays in the backfill table
    assert table.commit_chunk("u1", 1, second, data["new"][second], TOKEN)["rows"] == CHUNK
    vectors, backfilled, model = table.mixed()
    assert model == NEW and backfilled.sum() == 2 * CHUNK and backfilled[first].all() and backfilled[second].all()
    assert np.array_equal(vectors[backfilled], data["new"][backfilled])
    assert np.array_equal(vectors[~backfilled], data["mapped"][~backfilled])
    assert table.landed_chunks() == {0, 1}
    assert np.isnan(table.features("new")[second]).all()  # not folded yet
    with pytest.raises(GalleryError, match="chunk 2 is not written"):
        table.commit_chunk("u0", 2, first, data["new"][first], TOKEN)
    with pytest.raises(GalleryError, match="chunk 2 is not written"):  # a worker of an aborted plan of u1
        table.commit_chunk("u1", 2, first, data["new"][first], "plan-0")


def test_a_chunk_committed_twice_leaves_the_same_table(tmp_path):
    """A re-run after a kill, or after a lost reply to the commit: an update by position."""
    data = _data()
    table = _upgraded(tmp_path, data)
    positions = _chunk_positions(data["rank"], 1)
    first = table.commit_chunk("u1", 1, positions, data["new"][positions], TOKEN)["commit"]
    once = table.mixed()
    second = table.commit_chunk("u1", 1, positions, data["new"][positions] + 1, TOKEN)["commit"]
    kept = min(first, second)  # readers keep the smallest commit id of a chunk, whichever came first
    twice = table.mixed()
    assert np.array_equal(twice[1], once[1]) and twice[1].sum() == CHUNK
    expected = data["new"][positions] + (0 if kept == first else 1)
    assert np.array_equal(twice[0][positions], expected)
    assert table.fold("u1") == 1 and table.fold("u1") == 0
    assert np.array_equal(table.features("new")[positions], expected)
    assert table.dataset().count_rows() == N and table.landed_chunks() == {1}


def _commit_in_process(uri: str, chunk: int, positions: list[int], rows: list[list[float]]) -> int:
    table = LanceGallery(uri)
    return table.commit_chunk("u1", chunk, np.asarray(positions), np.asarray(rows, dtype=np.float32), TOKEN)["rows"]


def test_chunks_committed_by_several_processes_at_once_all_land(tmp_path):
    data = _data()
    table = _upgraded(tmp_path, data)
    chunks = range(N // CHUNK)
    work = [(str(tmp_path / "store"), c, _chunk_positions(data["rank"], c).tolist(),
             data["new"][_chunk_positions(data["rank"], c)].tolist()) for c in chunks]
    with multiprocessing.get_context("spawn").Pool(len(work)) as pool:
        assert pool.starmap(_commit_in_process, work) == [CHUNK] * len(work)
    assert table.landed_chunks() == set(chunks)
    vectors, backfilled, _ = table.mixed()
    assert backfilled.all() and np.array_equal(vectors, data["new"])
    assert table.dataset().count_rows() == N


def test_finish_rollback_and_gc(tmp_path):
    data = _data()
    table = _upgraded(tmp_path, data)
    with pytest.raises(GalleryError, match="not complete"):
        table.finish("u1")
    _commit_all(table, data)
    assert table.finish("u1") == "serving-2"
    assert not Path(table.backfill_uri).exists()
    assert table.finish("u1") == "serving-2"  # again after it ended: nothing changes
    assert table.model() == NEW and table.upgrade() is None
    assert set(table.dataset().schema.names) == {"position", "id", "label", "features", "features_digest"}
    assert np.array_equal(table.features(), data["new"])

    assert table.rollback() == (NEW, OLD)
    assert table.model() == OLD and np.array_equal(table.features(), data["old"])
    assert [name for _, name, _ in table.serving_tags()] == ["serving-1", "serving-2", "serving-3"]

    versions = len(table.dataset().versions())
    removed = table.collect_garbage(older_than=timedelta(0))
    assert removed["old_versions"] > 0 and len(table.dataset().versions()) == versions - removed["old_versions"]
    for _, name, version in table.serving_tags():  # tagged versions survive gc
        assert table.dataset(version).count_rows() == N, name
    assert np.array_equal(table.features(), data["old"])


@pytest.mark.parametrize("killed_after", ["drop", "rename"])
def test_a_finish_killed_between_its_steps_is_completed_by_the_next(tmp_path, killed_after):
    data = _data()
    table = _upgraded(tmp_path, data)
    _commit_all(table, data)
    table.fold("u1")
    dataset = table.dataset()
    dataset.drop_columns(["features", "features_digest"])  # the finish's first step, as it does it
    if killed_after == "rename":
        table.dataset().alter_columns({"path": "new", "name": "features"},
                                      {"path": "new_digest", "name": "features_digest"})
    vectors, backfilled, model = table.mixed()  # queries in between still read a whole gallery
    assert model == NEW and backfilled.all() and np.array_equal(vectors, data["new"])
    assert table.finish("u1") == "serving-2"
    assert table.model() == NEW and np.array_equal(table.features(), data["new"])


def test_abort_drops_the_upgrade_columns(tmp_path):
    data = _data()
    table = _upgraded(tmp_path, data)
    positions = _chunk_positions(data["rank"], 0)
    table.commit_chunk("u1", 0, positions, data["new"][positions], TOKEN)
    table.abort("u1")
    assert not Path(table.backfill_uri).exists()
    assert table.upgrade() is None and table.model() == OLD
    assert set(table.dataset().schema.names) == {"position", "id", "label", "features", "features_digest"}
    assert np.array_equal(table.features(), data["old"])
    with pytest.raises(GalleryError, match="no earlier model"):
        table.rollback()


def _data_file(table: LanceGallery) -> Path:
    files = sorted((Path(table.uri) / "data").glob("*.lance"))
    assert len(files) == 1
    return files[0]


def test_a_flipped_byte_in_a_data_file_is_named(tmp_path):
    """Lance reads altered float bytes without an error; the row digests do not."""
    data = _data()
    table = LanceGallery.create(tmp_path / "store", _items(data), data["old"], OLD)
    path = _data_file(table)
    raw = bytearray(path.read_bytes())
    target = data["old"][300].tobytes()
    at = bytes(raw).find(target)
    assert at > 0, "the float payload is stored plainly"
    raw[at + 5] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(TableCorrupt, match=rf"item 2103.*position 300.*{path.name}"):
        table.features()


def test_a_truncated_data_file_is_named(tmp_path):
    data = _data()
    table = LanceGallery.create(tmp_path / "store", _items(data), data["old"], OLD)
    path = _data_file(table)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(TableCorrupt, match=rf"data file .*{path.name}.*truncated or damaged"):
        table.features()


def test_convert_today_s_layout(tmp_path):
    data = _data()
    rng = np.random.default_rng(1)
    images = rng.integers(0, 255, size=(N, 1, 4, 4), dtype=np.uint8)
    store = LocalStore(tmp_path / "store")
    ingest(store, images, data["old"], OLD, labels=data["labels"], ids=np.arange(N) * 7 + 3, part_size=250)
    result = convert(tmp_path / "store")
    assert result["items"] == N and result["tag"] == "serving-1" and result["images"] == "in the table (pixels)"
    table = LanceGallery(tmp_path / "store")
    assert np.array_equal(table.features(), data["old"]) and table.model().same_version(OLD)
    items = table.items(["id", "label", "pixels"])
    assert items.column("label").to_pylist() == data["labels"].tolist()
    pixels = np.frombuffer(b"".join(items.column("pixels").to_pylist()), dtype=np.uint8).reshape(images.shape)
    assert np.array_equal(pixels, images)
    with pytest.raises(GalleryError, match="already holds a gallery table"):
        convert(tmp_path / "store")
    with pytest.raises(GalleryError, match="no gallery"):
        convert(tmp_path / "empty")


def test_the_convert_command(tmp_path):
    from typer.testing import CliRunner

    from cli import app

    data = _data()
    store = LocalStore(tmp_path / "store")
    ingest(store, np.zeros((N, 1, 2, 2), dtype=np.uint8), data["old"], OLD, part_size=250)
    params = str(Path(__file__).resolve().parents[2] / "params.yaml")
    result = CliRunner().invoke(app, ["gallery", "convert", "--store", str(tmp_path / "store"),
                                      "--to", str(tmp_path / "lance"), "--params", params])
    assert result.exit_code == 0, result.output
    assert f"{(tmp_path / 'lance' / 'gallery.lance').resolve()}: {N} items" in result.output
    assert "read back and equal to the source" in result.output
    assert np.array_equal(LanceGallery(tmp_path / "lance").features(), data["old"])
    again = CliRunner().invoke(app, ["gallery", "convert", "--store", str(tmp_path / "store"),
                                     "--to", str(tmp_path / "lance"), "--params", params])
    assert again.exit_code != 0 and "already holds a gallery table" in again.output


def _lance_params(tmp_path) -> str:
    import yaml

    root = Path(__file__).resolve().parents[2]
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["gallery"]["layout"] = "lance"
    params["gallery"]["store"] = str(tmp_path / "store")
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return str(path)


def test_commands_on_the_lance_layout(tmp_path):
    """gallery.layout: lance: info, search (mid-upgrade, with sources), abort and gc work on the
    table; what the table's upgrade does not do yet is refused with a message."""
    import json

    from typer.testing import CliRunner

    import flows.lance_undo  # noqa: F401 - Prefect (abort runs a flow) configures its logging outside the runner
    from cli import app

    data = _data()
    table = _upgraded(tmp_path, data)
    positions = _chunk_positions(data["rank"], 0)
    table.commit_chunk("u1", 0, positions, data["new"][positions], TOKEN)
    params = _lance_params(tmp_path)
    runner = CliRunner()

    info = runner.invoke(app, ["gallery", "info", "--params", params])
    assert info.exit_code == 0, info.output
    state = json.loads(info.output)
    assert state["state"] == "upgrading" and state["upgrade"]["chunks_landed"] == 1 and state["items"] == N

    queries = tmp_path / "queries.npy"
    hit, miss = int(positions[0]), int(np.setdiff1d(np.arange(N), positions)[0])
    np.save(queries, np.stack([data["new"][hit], data["mapped"][miss]]))
    found = runner.invoke(app, ["search", "--features", str(queries), "-k", "1", "--params", params])
    assert found.exit_code == 0, found.output
    answer = json.loads(found.output)
    assert answer["ids"] == [[hit * 7 + 3], [miss * 7 + 3]] and answer["backfilled"] == CHUNK
    assert answer["sources"] == [[NEW.uri], [f"{OLD.uri} mapped"]]

    refused = runner.invoke(app, ["upgrade", "--dry-run", "--params", params])
    assert refused.exit_code == 2 and "--dry-run: not available on the lance layout yet" in refused.output
    aborted = runner.invoke(app, ["upgrade", "abort", "--params", params])
    assert aborted.exit_code == 0 and f"aborted upgrade u1 to {NEW.uri}" in aborted.output, aborted.output
    assert table.upgrade() is None
    again = runner.invoke(app, ["upgrade", "abort", "--params", params])
    assert again.exit_code != 0 and "no upgrade in progress" in again.output
    table.begin_upgrade("u1", NEW, data["mapped"], data["rank"], data["sigma"], token=TOKEN)

    _commit_all(table, data)
    table.finish("u1")
    collected = runner.invoke(app, ["gallery", "gc", "--params", params])
    assert collected.exit_code == 0 and "removed 0 table versions older than 7 days" in collected.output
    # `gallery rollback` moves the registry too: tests/integration/test_lance_upgrade.py


def test_the_lancedb_lines_of_docs_lance_md(tmp_path):
    """docs/lance.md's few lines for a team's own service: mid-upgrade, two searches of the same
    table (new features where folded, h(old) elsewhere) merged by distance, equal to the product's
    exact search over the mixed gallery once the landed chunks are folded."""
    import lancedb

    from components.gallery.search.lance import LanceSearch

    data = _data()
    table = _upgraded(tmp_path, data)
    _commit_all(table, data, (0, 1))
    table.fold("u1")

    # --- as in docs/lance.md
    def nearest(tbl, query, k=10):
        new = (tbl.search(query, vector_column_name="new").where("new IS NOT NULL", prefilter=True)
               .limit(k).select(["id"]).to_list())
        mapped = (tbl.search(query, vector_column_name="mapped").where("new IS NULL", prefilter=True)
                  .limit(k).select(["id"]).to_list())
        return sorted(new + mapped, key=lambda hit: hit["_distance"])[:k]

    tbl = lancedb.connect(str(tmp_path / "store")).open_table("gallery")
    # ---
    searcher = LanceSearch(table)
    rng = np.random.default_rng(5)
    for query in rng.normal(size=(5, NEW_DIM)).astype(np.float32):
        hits = nearest(tbl, query)
        ids, distances, _ = searcher.search(query, k=10)
        assert [hit["id"] for hit in hits] == ids[0]
        assert np.allclose([hit["_distance"] for hit in hits], distances[0], rtol=1e-4)


def test_adopt_with_the_current_features(tmp_path):
    from components.gallery.layouts import lance_convert
    from components.gallery.inputs.adopt import npy_rows, read_manifest

    data = _data()
    manifest = tmp_path / "items.csv"
    manifest.write_text("id,uri,weight\n" + "".join(f"{i},s3://shelf/{i}.png,{i % 3}\n" for i in range(N)))
    np.save(tmp_path / "a.npy", data["old"][:200])
    np.save(tmp_path / "b.npy", data["old"][200:])
    result = lance_convert.adopt(tmp_path / "store", read_manifest(manifest), OLD, (1, 4, 4), root="s3://shelf",
                               features=npy_rows([tmp_path / "a.npy", tmp_path / "b.npy"]), registry="sqlite:///r.db")
    assert result["num_items"] == N and result["layout"] == "lance" and not result["has_labels"]
    table = LanceGallery(tmp_path / "store")
    assert np.array_equal(table.features(), data["old"])
    assert table.items(["image", "weight"]).column("weight").to_pylist()[:4] == [0.0, 1.0, 2.0, 0.0]
    metadata = table.dataset().schema.metadata
    assert metadata[b"fastfill.image_root"] == b"s3://shelf" and metadata[b"fastfill.image_shape"] == b"[1, 4, 4]"
    with pytest.raises(GalleryError, match="200 feature rows for the manifest's 600 items"):
        lance_convert.adopt(tmp_path / "other", read_manifest(manifest), OLD, (1, 4, 4),
                          features=npy_rows([tmp_path / "a.npy"]))


def test_a_table_keeps_the_team_s_text_ids_through_search_and_judgments(tmp_path):
    from components.gallery.layouts import lance_convert
    from components.gallery.inputs.adopt import npy_rows, read_manifest
    from components.gallery.inputs.judgments import load_judgments
    from components.gallery.search.lance import LanceSearch

    data = _data()
    manifest = tmp_path / "items.csv"
    manifest.write_text("id,uri\n" + "".join(f"shelf/{i:05d}.png,s3://shelf/{i}.png\n" for i in range(N)))
    np.save(tmp_path / "old.npy", data["old"])
    lance_convert.adopt(tmp_path / "store", read_manifest(manifest), OLD, (1, 4, 4), root="s3://shelf",
                        features=npy_rows([tmp_path / "old.npy"]), registry="sqlite:///r.db")
    table = LanceGallery(tmp_path / "store")
    ids = table.items(["id"]).column("id")
    assert ids.to_pylist()[:2] == ["shelf/00000.png", "shelf/00001.png"]
    found, _, _ = LanceSearch(table).search(data["old"][[5, 321]], k=1)
    assert [row[0] for row in found] == ["shelf/00005.png", "shelf/00321.png"]
    judged_file = tmp_path / "judged.csv"
    judged_file.write_text("query,relevant\nshelf/00005.png,shelf/00006.png\n")
    judged = load_judgments(str(judged_file), ids)
    assert judged.query_positions.tolist() == [5] and [r.tolist() for r in judged.relevant] == [[6]]


def test_status_and_doctor_read_the_table(tmp_path):
    from typer.testing import CliRunner

    from cli import app

    data = _data()
    _upgraded(tmp_path, data)
    params = _lance_params(tmp_path)
    shown = CliRunner().invoke(app, ["status", "--params", params])
    assert f"{tmp_path / 'store'}: {N} items, model {OLD.uri}" in shown.output, shown.output
    assert f"upgrading: u1 to {NEW.uri}" in shown.output
    checked = CliRunner().invoke(app, ["doctor", "--params", params])  # no MLflow store here: only its store line counts
    assert f"ok    store     {tmp_path / 'store' / 'gallery.lance'}: {N} items, model {OLD.uri}, upgrading (u1)" \
        in checked.output, checked.output


def test_the_merged_search_on_the_table_against_a_brute_force_reference(tmp_path):
    """`search --merge rrf` on the table mid-upgrade: the old model's features of the items not yet
    re-embedded and the new model's of those that are, each searched exactly and merged by rrf;
    hits from both parts, each with its source. Also through the CLI."""
    import json

    from typer.testing import CliRunner

    from cli import app
    from components.evaluation.fusion import merge_lists
    from components.gallery.search.lance import LanceDualSearch

    data = _data()
    table = _upgraded(tmp_path, data)
    _commit_all(table, data, (0, 1))
    table.fold("u1")
    positions = _chunk_positions(data["rank"], 2)  # one chunk landed but not folded
    table.commit_chunk("u1", 2, positions, data["new"][positions], TOKEN)
    on_new = np.zeros(N, dtype=bool)
    for chunk in (0, 1, 2):
        on_new[_chunk_positions(data["rank"], chunk)] = True
    ids = np.arange(N) * 7 + 3
    rng = np.random.default_rng(9)
    old_q, new_q = rng.normal(size=(4, OLD_DIM)).astype(np.float32), rng.normal(size=(4, NEW_DIM)).astype(np.float32)
    searcher = LanceDualSearch(table, "l2", "rrf", 60)
    assert searcher.mid_upgrade and searcher.backfilled == 3 * CHUNK
    found, _, sources = searcher.search(old_q, new_q, k=10)
    old_rows, new_rows = np.flatnonzero(~on_new), np.flatnonzero(on_new)
    for q in range(4):
        old_d = ((data["old"][old_rows] - old_q[q]) ** 2).sum(1)
        new_d = ((data["new"][new_rows] - new_q[q]) ** 2).sum(1)
        old_top, new_top = old_rows[np.argsort(old_d)[:10]], new_rows[np.argsort(new_d)[:10]]
        rows, _, source = merge_lists("rrf", [old_top, new_top], [np.sort(old_d)[:10], np.sort(new_d)[:10]], limit=10)
        assert found[q] == ids[rows].tolist()
        assert sources[q] == [[OLD.uri, NEW.uri][s] for s in source]
    assert {OLD.uri, NEW.uri} <= {s for row in sources for s in row}

    np.save(tmp_path / "old.npy", old_q)
    np.save(tmp_path / "new.npy", new_q)
    params = _lance_params(tmp_path)
    merged = CliRunner().invoke(app, ["search", "--merge", "rrf", "--features", str(tmp_path / "new.npy"),
                                      "--old-features", str(tmp_path / "old.npy"), "--params", params])
    assert merged.exit_code == 0, merged.output
    answer = json.loads(merged.output)
    assert answer["ids"] == found and answer["sources"] == sources and answer["merge"] == "rrf"
    assert answer["query_models"] == [OLD.uri, NEW.uri] and answer["backfilled"] == 3 * CHUNK
    missing = CliRunner().invoke(app, ["search", "--merge", "rrf", "--features", str(tmp_path / "new.npy"),
                                       "--params", params])
    assert missing.exit_code != 0 and "--old-features" in missing.output


def test_search_on_the_table_with_inverted_lists(tmp_path):
    """gallery.index on the table's search: inverted lists probed in full give the exact search's
    answer (same hits, same distances); probing one list of four finds fewer of them, each a real
    item at its true distance; too few items for the lists is refused, naming the setting."""
    from components.gallery.search.lance import LanceSearch
    from components.platform.config import IndexConfig

    data = _data()
    table = _upgraded(tmp_path, data)
    _commit_all(table, data, (0, 1))
    exact = LanceSearch(table)
    every_list = LanceSearch(table, index=IndexConfig(kind="ivf", nlist=4, nprobe=4))
    one_list = LanceSearch(table, index=IndexConfig(kind="ivf", nlist=4, nprobe=1))
    queries = np.random.default_rng(3).normal(size=(20, NEW_DIM)).astype(np.float32)
    ids, distances, sources = exact.search(queries, k=10)
    probed_ids, probed_distances, probed_sources = every_list.search(queries, k=10)
    assert probed_ids == ids and probed_sources == sources
    np.testing.assert_allclose(probed_distances, distances, rtol=1e-5)
    few_ids, few_distances, _ = one_list.search(queries, k=10)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(ids, few_ids)])
    assert 0.2 < recall < 1.0, recall
    vectors, _, _ = table.mixed()
    position = {item: p for p, item in enumerate(table.items(["id"]).column("id").to_pylist())}
    for query, row, found in zip(queries, few_ids, few_distances):
        for item, distance in zip(row, found):
            if item is not None:
                assert distance == pytest.approx(float(((vectors[position[item]] - query) ** 2).sum()), rel=1e-4)
    with pytest.raises(GalleryError, match="gallery.index.nlist 64 needs at least 2496 items"):
        LanceSearch(table, index=IndexConfig(kind="ivf", nlist=64))
