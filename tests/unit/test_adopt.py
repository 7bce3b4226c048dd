"""Adopting a gallery where it is: the manifest file, the features' row order, reading images by
URI (decoding, shaping, failures with reasons), and the limit on failed images."""


import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from fastfill.components.gallery.inputs.adopt import adopt, npy_rows, parquet_rows, read_manifest
from fastfill.components.gallery.inputs.images import read_images, resolve
from fastfill.components.gallery.layouts.catalog import GalleryError, PartsGallery
from fastfill.components.gallery.store import open_store
from fastfill.components.gallery.upgrade import planning
from fastfill.components.gallery.upgrade.lifecycle import Backfill, failure_limit
from fastfill.components.platform.registry import ModelRef

OLD = ModelRef("embedder", "1", 4)


def _save(path, array, mode="L"):
    Image.fromarray(array, mode=mode).save(path)


def test_images_are_decoded_to_the_model_shape_and_failures_named(tmp_path):
    grey = np.arange(64, dtype=np.uint8).reshape(8, 8)
    _save(tmp_path / "grey.png", grey)
    rgb = np.zeros((16, 16, 3), dtype=np.uint8)
    rgb[..., 0] = 255  # pure red, twice the size
    _save(tmp_path / "red.jpg", rgb, "RGB")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG but not really")
    uris = ["grey.png", "red.jpg", "gone.png", "broken.png", str(tmp_path / "grey.png")]
    images, failures = read_images(uris, (1, 8, 8), root=str(tmp_path), workers=3)
    assert images.shape == (5, 1, 8, 8) and images.dtype == np.uint8
    np.testing.assert_array_equal(images[0, 0], grey)
    np.testing.assert_array_equal(images[4, 0], grey)  # an absolute path ignores the root
    assert abs(int(images[1, 0].mean()) - 76) <= 2  # red in grey (ITU-R 601-2 luma: 0.299 * 255)
    assert [(f.row, f.uri, f.reason.split(":")[0]) for f in failures] == [
        (2, "gone.png", "missing"), (3, "broken.png", "undecodable")]
    assert not images[2].any() and not images[3].any()
    colour, failures = read_images(["red.jpg"], (3, 4, 4), root=str(tmp_path))
    assert colour.shape == (1, 3, 4, 4) and not failures and colour[0, 0].min() > 240 and colour[0, 1].max() < 15


def test_reads_are_bounded_and_in_order(tmp_path):
    for i in range(40):
        _save(tmp_path / f"{i}.png", np.full((4, 4), i, dtype=np.uint8))
    for workers in (1, 3, 64):
        images, failures = read_images([f"{i}.png" for i in range(40)], (1, 4, 4), root=str(tmp_path),
                                       workers=workers)
        assert [int(x[0, 0, 0]) for x in images] == list(range(40)) and failures == []
    assert resolve("a/b.png", "s3://bucket/pre/") == "s3://bucket/pre/a/b.png"
    assert resolve("s3://x/y.png", "/root") == "s3://x/y.png"


@pytest.mark.parametrize("text, message", [
    ("id,path\n1,a.png\n2,b.png\n", "no column uri"),
    ("id,uri\n1,a.png\n1,b.png\n", "ids must be unique"),
    ("id,uri\n1,a.png\n", "at least 2 items"),
    ("id,uri\nsku-1,a.png\n  ,b.png\n", "column id is empty at row 1"),
    ("id,uri\nsku-1,a.png\n sku-1 ,b.png\n", "ids must be unique"),
    ("id,uri,label\n1,a.png,3\n2,b.png,\n", "column label is empty at row 1"),
])
def test_a_bad_manifest_is_refused_with_the_reason(tmp_path, text, message):
    path = tmp_path / "items.csv"
    path.write_text(text)
    with pytest.raises(GalleryError, match=message):
        read_manifest(path)


def test_manifest_from_csv_and_parquet_agree(tmp_path):
    (tmp_path / "items.csv").write_text("id,uri,label,group\n7,a.png,1,x\n9,s3://b/k.png,0,y\n")
    pq.write_table(pa.table({"id": [7, 9], "uri": ["a.png", "s3://b/k.png"], "label": [1, 0], "group": ["x", "y"]}),
                   tmp_path / "items.parquet")
    assert read_manifest(tmp_path / "items.csv").equals(read_manifest(tmp_path / "items.parquet"))
    with pytest.raises(GalleryError, match="give a .csv, .tsv or .parquet"):
        (tmp_path / "items.json").write_text("{}")
        read_manifest(tmp_path / "items.json")


def test_adopt_takes_features_across_shards_and_checks_their_count(tmp_path):
    table = pa.table({"id": np.arange(7), "uri": [f"{i}.png" for i in range(7)]})
    features = np.random.default_rng(0).normal(size=(7, 4)).astype(np.float32)
    np.save(tmp_path / "a.npy", features[:3])
    np.save(tmp_path / "b.npy", features[3:])
    adopt(open_store(tmp_path / "g"), table, OLD, (1, 4, 4), root=str(tmp_path),
          features=npy_rows([tmp_path / "a.npy", tmp_path / "b.npy"]), part_size=2)
    gallery = PartsGallery(open_store(tmp_path / "g"))
    assert gallery.num_parts == 4 and gallery.adopted and gallery.labels() is None
    np.testing.assert_array_equal(gallery.all_features(OLD), features)
    np.testing.assert_array_equal(gallery.ids(), np.arange(7))

    pq.write_table(pa.table({"features": [list(map(float, row)) for row in features]}), tmp_path / "f.parquet")
    adopt(open_store(tmp_path / "p"), table, OLD, (1, 4, 4), features=parquet_rows(tmp_path / "f.parquet", "features"))
    np.testing.assert_allclose(PartsGallery(open_store(tmp_path / "p")).all_features(OLD), features)

    with pytest.raises(GalleryError, match="fewer feature rows"):
        adopt(open_store(tmp_path / "short"), table, OLD, (1, 4, 4), features=npy_rows([tmp_path / "a.npy"]))
    with pytest.raises(GalleryError, match="more feature rows"):
        adopt(open_store(tmp_path / "long"), table, OLD, (1, 4, 4),
              features=npy_rows([tmp_path / "a.npy", tmp_path / "b.npy", tmp_path / "a.npy"]))
    assert not PartsGallery(open_store(tmp_path / "long")).exists()  # nothing half-made: no manifest
    with pytest.raises(GalleryError, match="no column 'emb'"):
        list(parquet_rows(tmp_path / "f.parquet", "emb"))
    with pytest.raises(GalleryError, match="dimension 4, but the model's is 5"):
        adopt(open_store(tmp_path / "dim"), table, ModelRef("embedder", "1", 5), (1, 4, 4),
              features=npy_rows([tmp_path / "a.npy", tmp_path / "b.npy"]))


def test_failed_images_past_the_limit_stop_new_chunks():
    assert failure_limit(0.01, 1000) == 10 and failure_limit(3, 1000) == 3 and failure_limit(0.0, 50) == 0
    plan = planning.Plan("u", OLD, ModelRef("embedder", "2", 4), "models:/m/1", "sigma", 2, 10, 0, "l2")
    state = Backfill(plan, set(), limit=10, max_concurrency=1, max_failed_images=1)
    assert state.to_start() == [0]
    state.landed(0, 2, [{"id": 4, "uri": "s3://b/4.png", "reason": "missing: no such object", "position": 0}])
    assert state.failure is None and state.to_start() == [1]
    state.landed(1, 2, [{"id": 9, "uri": "9.png", "reason": "undecodable: x", "position": 3}])
    assert isinstance(state.failure, GalleryError) and state.to_start() == []
    assert "2 images could not be read" in str(state.failure) and "item 4 at s3://b/4.png" in str(state.failure)
    assert state.summary().failed_images == 2


@pytest.mark.parametrize("text, ids", [
    ("id,uri\n7,a.png\n-3,b.png\n", [7, -3]),  # integers stay integers
    ("id,uri\n1,a.png\nx,b.png\n", ["1", "x"]),  # one text id: all are text
    ("id,uri\n00123,a.png\n123,b.png\n", ["00123", "123"]),  # zeros are part of an id
    ("id,uri\nSKU-9 ,a.png\n3f2b6c1e-8a1d-4c3e-9b7f-0e2d4c6a8b10,b.png\n",
     ["SKU-9", "3f2b6c1e-8a1d-4c3e-9b7f-0e2d4c6a8b10"]),
])
def test_ids_are_kept_as_the_team_has_them(tmp_path, text, ids):
    path = tmp_path / "items.csv"
    path.write_text(text)
    assert read_manifest(path).column("id").to_pylist() == ids


def test_a_sample_none_of_whose_images_can_be_read_is_one_line_saying_so(tmp_path):
    """An adopted gallery whose images are all gone: the map sample is refused in one line (how many
    were tried, the first few and why, what to check), not later by the map's validation split
    (which asked to raise validation_fraction 0.5 to 0.50)."""
    from fastfill.cli.command_support import INPUT, outcome
    from fastfill.components.gallery.upgrade.samples import readable_images

    table = pa.table({"id": np.arange(7), "uri": [f"{i}.png" for i in range(7)]})
    features = np.random.default_rng(0).normal(size=(7, 4)).astype(np.float32)
    adopt(open_store(tmp_path / "g"), table, OLD, (1, 4, 4), root=str(tmp_path / "photos"), features=iter([features]))
    gallery = PartsGallery(open_store(tmp_path / "g"))
    lines: list[str] = []
    with pytest.raises(GalleryError) as refused:
        readable_images(gallery, np.arange(7), 2, "map sample", lines.append)
    message = str(refused.value)
    assert message.startswith("map sample: none of its 7 images could be read (0.png: missing: no such file "
                              f"{tmp_path / 'photos' / '0.png'}; 1.png: "), message
    assert "; and 4 more)" in message and "validation_fraction" not in message and "\n" not in message
    assert f"the gallery's image root {tmp_path / 'photos'} (`fastfill gallery adopt --root`)" in message
    assert "the items' URIs" in message and "credentials" in message
    assert outcome(refused.value) == (INPUT, message)

    # some readable: the others are left out and said so; none readable where other images of the
    # upgrade were read (``refuse_none=False``): left out too
    (tmp_path / "photos").mkdir()
    for i in (2, 5):
        _save(tmp_path / "photos" / f"{i}.png", np.full((4, 4), i, dtype=np.uint8))
    positions, images = readable_images(gallery, np.arange(7), 2, "map sample", lines.append)
    assert positions.tolist() == [2, 5] and images.shape == (2, 1, 4, 4)
    assert lines == ["map sample: 5 of 7 images could not be read and are left out (first: 0.png: missing: no such "
                     f"file {tmp_path / 'photos' / '0.png'})"]
    positions, images = readable_images(gallery, np.array([0, 1]), 2, "evaluation sample", lines.append,
                                        refuse_none=False)
    assert positions.tolist() == [] and len(images) == 0
