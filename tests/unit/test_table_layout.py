"""What only the Lance table layout has (the shared cases of tests/gallery_cases.py run on both
layouts): what other tools read, convert between layouts, a killed write, a finish run twice,
the opening of a gallery by its manifest, and the row digest."""

import json

import numpy as np
import pyarrow as pa
import pytest

from fastfill.components.experiment.inference import embed
from fastfill.components.gallery.layouts.catalog import MANIFEST, GalleryError, ingest
from fastfill.components.gallery.layouts.convert import convert
from fastfill.components.gallery.layouts.opening import gallery_at, layout_of
from fastfill.components.gallery.layouts.table import TableGallery, TableWriter, column_name, digests, table_uri
from fastfill.components.gallery.store import open_store
from fastfill.components.gallery.upgrade import backfill, ending, garbage
from tests.gallery_cases import NEW, OLD, N, _gallery, _plan


def _finished(uri, models, data, layout="lance"):
    _, new, h = models
    gallery = _gallery(uri, models, data, layout=layout)
    plan = _plan(gallery, h)
    for chunk in range(plan.num_chunks):
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, new)
    ending.finish(gallery, plan)
    return gallery_at(open_store(uri)), plan


def test_other_tools_read_the_items_and_the_serving_features(tmp_path, models, data):
    """pyarrow through Lance, with no fastfill code: one row per item in position order, the
    team's ids, the pixels, one column per model named for it, and which one serves."""
    import lance

    uri = str(tmp_path / "g")
    _finished(uri, models, data)
    dataset = lance.dataset(table_uri(uri))
    table = dataset.to_table()
    serving = dataset.schema.metadata[b"fastfill.serving"].decode()
    assert serving == column_name(NEW) == "features_embedder-v2"
    assert table.column("position").to_pylist() == list(range(N))
    assert table.column("id").to_pylist() == list(range(1000, 1000 + N))
    assert {"pixels", "label", "group", column_name(OLD), column_name(NEW)} <= set(table.column_names)
    vectors = np.array(table.column(serving).to_pylist(), dtype=np.float32)
    np.testing.assert_allclose(vectors, embed(models[1], data[0]), rtol=1e-5, atol=1e-6)
    field = dataset.schema.field(serving)
    assert json.loads(field.metadata[b"fastfill.model"])["version"] == NEW.version


def test_convert_moves_a_gallery_into_the_table_in_place_and_gc_removes_the_parts(tmp_path, models, data):
    uri = str(tmp_path / "g")
    gallery = _gallery(uri, models, data)  # the parts layout
    features, ids = gallery.all_features(OLD), gallery.ids()
    result = convert(gallery, None, "lance")
    assert result["in_place"] and result["layout"] == "lance" and result["items"] == N
    moved = gallery_at(open_store(uri))
    assert isinstance(moved, TableGallery) and moved.manifest()["history"] == gallery.manifest()["history"]
    np.testing.assert_array_equal(moved.all_features(OLD), features)
    np.testing.assert_array_equal(moved.ids(), ids)
    np.testing.assert_array_equal(moved.images(2), data[0][20:30])
    assert moved.store.list("features/")  # the parts' data stays until gc
    garbage.collect_garbage(moved)
    assert moved.store.list("features/") == moved.store.list("items/") == moved.store.list("images/") == []
    np.testing.assert_array_equal(gallery_at(open_store(uri)).all_features(OLD), features)

    with pytest.raises(GalleryError, match="already in the lance layout"):
        convert(moved, None, "lance")
    back = convert(moved, str(tmp_path / "parts-again"), "parts")  # and back, into another store
    again = gallery_at(open_store(back["store"]))
    assert again.layout == "parts" and not back["in_place"]
    np.testing.assert_array_equal(again.all_features(OLD), features)
    with pytest.raises(GalleryError, match="already holds a gallery"):
        convert(moved, str(tmp_path / "parts-again"), "parts")
    convert(moved, None, "parts")  # back in place: the tables stay until gc
    assert moved.store.list("gallery.lance/") and moved.store.list("serving.lance/")
    assert garbage.collect_garbage(gallery_at(open_store(uri)))["features"] == 2
    assert moved.store.list("gallery.lance/") == moved.store.list("serving.lance/") == []
    np.testing.assert_array_equal(gallery_at(open_store(uri)).all_features(OLD), features)


def test_convert_is_refused_during_an_upgrade(tmp_path, models, data):
    gallery = _gallery(str(tmp_path / "g"), models, data)
    plan = _plan(gallery, models[2])
    with pytest.raises(GalleryError, match=f"upgrade {plan.upgrade_id} is in progress"):
        convert(gallery, None, "lance")
    assert gallery_at(gallery.store).layout == "parts"


def test_a_table_a_killed_ingest_left_is_replaced_and_a_finish_run_twice_writes_once(tmp_path, models, data):
    old, _, _ = models
    images, labels = data
    store = open_store(tmp_path / "g")
    writer = TableWriter(store, OLD)  # a killed ingest: rows written, no manifest
    writer.write(0, pa.table({"id": np.arange(5)}), np.zeros((5, 8), np.float32), images[:5])
    writer.close()
    assert not store.exists(MANIFEST)
    ingest(store, images, embed(old, images), OLD, labels=labels, part_size=10, layout=TableGallery)
    gallery = gallery_at(store)
    assert gallery.dataset().count_rows() == N
    np.testing.assert_array_equal(gallery.ids(), np.arange(N))

    _finished(str(tmp_path / "h"), models, data)
    twice = gallery_at(open_store(tmp_path / "h"))
    versions = len(twice.dataset().versions())
    twice.write_features(NEW, ((p, twice.features(NEW, p)) for p in range(twice.num_parts)))  # already there
    assert len(twice.dataset(refresh=True).versions()) == versions


def test_a_table_that_does_not_fit_its_manifest_is_refused_before_planning(tmp_path, models, data):
    import lance

    uri = str(tmp_path / "g")
    gallery = _gallery(uri, models, data, layout="lance")
    extra = gallery.dataset().to_table().slice(0, 3)
    lance.write_dataset(extra, table_uri(uri), mode="append")  # another tool appended rows
    with pytest.raises(GalleryError, match=f"has {N + 3} rows, but the manifest says {N} items"):
        gallery_at(open_store(uri)).check_sources()
    manifest = dict(gallery.manifest())
    gallery.store.put_json(MANIFEST, {**manifest, "layout": "zarr"})
    with pytest.raises(GalleryError, match="says layout 'zarr'; this version reads parts, lance"):
        gallery_at(gallery.store)
    with pytest.raises(GalleryError, match="gallery.layout 'zarr' is not a layout"):
        layout_of("zarr")
    del manifest["layout"]  # a manifest of an earlier release: the parts layout
    gallery.store.put_json(MANIFEST, manifest)
    assert gallery_at(gallery.store).layout == "parts"


def test_the_row_digest_changes_with_any_one_word_and_with_the_position():
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((200, 96)).astype(np.float32)
    positions = np.arange(200)
    base = digests(positions, rows)
    assert len(set(base.tolist())) == 200
    words = rows.view(np.uint32).copy()
    for _ in range(500):
        row, column, bit = rng.integers(200), rng.integers(96), rng.integers(32)
        changed = words.copy()
        changed[row, column] ^= np.uint32(1 << int(bit))
        after = digests(positions, changed.view(np.float32))
        assert after[row] != base[row] and np.array_equal(np.delete(after, row), np.delete(base, row))
    assert not np.array_equal(digests(positions + 1, rows), base)
    pixels = rng.integers(0, 256, (10, 1, 7, 7), dtype=np.uint8)  # 49 bytes: padded to words
    checked = digests(np.arange(10), pixels)
    pixels[4, 0, 6, 6] ^= 1
    assert (digests(np.arange(10), pixels) != checked).tolist() == [i == 4 for i in range(10)]


def test_the_lines_of_docs_lance_md_read_the_table(tmp_path, models, data):
    """The reading lines of docs/lance.md, run as written on a finished upgrade: DuckDB counts the
    labels, LanceDB's exact search on the serving column finds what the product's search finds."""
    import re
    from pathlib import Path

    from fastfill.components.gallery.search.index import GallerySearch

    uri = str(tmp_path / "g")
    gallery, _ = _finished(uri, models, data)
    text = (Path(__file__).resolve().parents[2] / "docs" / "lance.md").read_text()
    code = re.search(r"## Reading the table with other tools\s+```python\n(.*?)```", text, re.S).group(1)
    query = embed(models[1], data[0][:1])[0]
    scope = {"store": uri, "options": None, "query": query}
    exec(compile(code, "docs/lance.md", "exec"), scope)  # noqa: S102 - the documented lines, as written
    assert scope["serving"] == column_name(NEW)
    labels = data[1]
    assert scope["counts"] == [(label, int((labels == label).sum())) for label in sorted(set(labels.tolist()))]
    ids, _ = GallerySearch(gallery).search(query[None], k=10)
    assert [hit["id"] for hit in scope["hits"]] == ids[0].tolist()
