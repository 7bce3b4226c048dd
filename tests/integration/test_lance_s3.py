"""The Lance gallery table on S3 (moto's server over HTTP): an upgrade end to end, chunks
committed by several processes at once, a commit whose reply is lost, injected 5xx answers and
dropped connections, and an adopted table upgraded, then read by pyarrow and DuckDB and searched
by LanceDB by name."""

from __future__ import annotations

import multiprocessing
import os

import numpy as np
import pyarrow as pa
import pytest

from components.gallery.layouts.lance_table import LanceGallery, storage_options
from testkit.s3_fault_proxy import FaultProxy
from components.platform.registry import ModelRef
from tests.environment import new_bucket

N, OLD_DIM, NEW_DIM, CHUNK = 400, 8, 12, 100
TOKEN = "plan-1"
OLD = ModelRef("embedder", "1", OLD_DIM)
NEW = ModelRef("embedder", "2", NEW_DIM)


@pytest.fixture
def s3_table(s3_endpoint):
    rng = np.random.default_rng(0)
    data = {"old": rng.normal(size=(N, OLD_DIM)).astype(np.float32),
            "mapped": rng.normal(size=(N, NEW_DIM)).astype(np.float32),
            "new": rng.normal(size=(N, NEW_DIM)).astype(np.float32), "rank": rng.permutation(N)}
    uri = f"s3://{new_bucket(s3_endpoint)}/galleries/main"
    items = pa.table({"id": pa.array([f"item-{i}" for i in range(N)]),
                      "image": pa.array([f"s3://images/{i}.png" for i in range(N)])})
    table = LanceGallery.create(uri, items, data["old"], OLD)
    table.begin_upgrade("u1", NEW, data["mapped"], data["rank"], token=TOKEN)
    return uri, table, data


def _positions(data, chunk: int) -> np.ndarray:
    return np.argsort(data["rank"])[chunk * CHUNK:(chunk + 1) * CHUNK]


def _commit(uri: str, endpoint: str, chunk: int, positions: list[int], rows: list) -> int:
    os.environ["AWS_ENDPOINT_URL_S3"] = endpoint
    return LanceGallery(uri).commit_chunk("u1", chunk, np.asarray(positions), np.asarray(rows, np.float32), TOKEN)["rows"]


def test_an_upgrade_end_to_end_with_chunks_from_several_processes(s3_table, s3_endpoint):
    uri, table, data = s3_table
    assert table.uri == f"{uri}/gallery.lance"
    work = [(uri, s3_endpoint, c, _positions(data, c).tolist(), data["new"][_positions(data, c)].tolist())
            for c in range(N // CHUNK)]
    with multiprocessing.get_context("spawn").Pool(len(work)) as pool:
        assert pool.starmap(_commit, work) == [CHUNK] * len(work)
    assert table.landed_chunks() == set(range(N // CHUNK))
    assert table.finish("u1") == "serving-2"
    assert table.model() == NEW and np.array_equal(table.features(), data["new"])

    import duckdb
    import lancedb

    served = lancedb.connect(uri, storage_options=storage_options(uri)).open_table("gallery")
    hit = served.search(data["new"][5], vector_column_name="features").limit(1).to_arrow()
    assert hit.column("id").to_pylist() == ["item-5"]
    ds = table.dataset()  # noqa: F841 - DuckDB finds the dataset by its variable name
    assert duckdb.sql("select count(*) from ds where image like 's3://images/%'").fetchall() == [(N,)]

    assert table.rollback() == (NEW, OLD)
    assert np.array_equal(table.features(), data["old"])


def test_a_commit_whose_reply_is_lost_leaves_each_row_once(s3_table, s3_endpoint, monkeypatch):
    """The manifest of the chunk's commit reaches S3 but its answer never comes back: Lance's
    retry finds the version taken and commits again on top, or the commit fails and the chunk
    is run again. Either way every row is there once with the chunk's features."""
    uri, table, data = s3_table
    dropped = []

    def lose_the_commit_reply(method: str, path: str) -> str | None:
        if method == "PUT" and "/_versions/" in path and not dropped:
            dropped.append(path)
            return "drop-reply"
        return None

    with FaultProxy(s3_endpoint, rate=0.0) as proxy:
        proxy.rules.append(lose_the_commit_reply)
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
        positions = _positions(data, 0)
        through_proxy = LanceGallery(uri)
        try:
            through_proxy.commit_chunk("u1", 0, positions, data["new"][positions], TOKEN)
        except Exception as error:  # noqa: BLE001 - the caller's answer to a failed commit: run the chunk again
            print(f"the commit failed: {error}")
            through_proxy.commit_chunk("u1", 0, positions, data["new"][positions], TOKEN)
    assert dropped, "the proxy saw no commit"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)
    vectors, backfilled, _ = table.mixed()
    assert set(np.flatnonzero(backfilled)) == set(positions.tolist())
    assert np.array_equal(vectors[positions], data["new"][positions])
    assert table.fold("u1") == 1  # one merge of each row, however often the append landed
    assert sorted(table.dataset().to_table(columns=["position"]).column("position").to_pylist()) == list(range(N))
    new = table.features("new")
    assert set(np.flatnonzero(~np.isnan(new[:, 0]))) == set(positions.tolist())
    assert np.array_equal(new[positions], data["new"][positions])


@pytest.mark.parametrize("kinds", ["5xx", "dropped connections"])
def test_chunks_commit_through_injected_faults(s3_table, s3_endpoint, monkeypatch, kinds):
    """Each chunk committed through a proxy that answers 5xx, or drops and resets connections and
    cuts replies short; a commit that fails is run again, as the chunk's task retries. Then every
    item has its new features once."""
    from components.gallery.layouts.catalog import GalleryError
    from testkit.s3_fault_proxy import STATUS_FAULTS

    uri, table, data = s3_table
    faults = STATUS_FAULTS if kinds == "5xx" else ("drop-request", "drop-reply", "reset-reply", "truncate-reply")
    failed = 0
    with FaultProxy(s3_endpoint, rate=0.3, kinds=faults, seed=3) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
        through_proxy = LanceGallery(uri)
        for chunk in range(N // CHUNK):
            positions = _positions(data, chunk)
            for _ in range(5):
                try:
                    through_proxy.commit_chunk("u1", chunk, positions, data["new"][positions], TOKEN)
                    break
                except GalleryError:
                    failed += 1
            else:
                pytest.fail(f"chunk {chunk} did not commit in 5 tries through {kinds}")
        assert proxy.injected > 0
    print(f"{kinds}: {proxy.injected} faults injected, {failed} commits failed and were run again")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)
    vectors, backfilled, _ = table.mixed()
    assert backfilled.all() and np.array_equal(vectors, data["new"])
    positions, _, chunks = table._landed(table.upgrade())
    assert chunks == list(range(N // CHUNK)) and np.array_equal(positions, np.arange(N))


def test_a_gallery_adopted_and_one_ingested_on_s3_as_lance_tables(upgrade_env, s3_endpoint, prefect_harness):
    """gallery.layout: lance: `gallery adopt` embeds the images where they are with the champion
    and writes the table on S3; `gallery info` and `search` read it back; `upgrade` re-embeds the
    images read by URI (a missing one keeps its h(old)). `gallery ingest` puts images into a table
    with the champion's features."""
    import json

    import yaml
    from typer.testing import CliRunner

    from cli import app
    from components.experiment.inference import embed
    from tests.integration.helpers import photo_folder, registry_models, split_images

    params, tmp_path = upgrade_env
    _, old_model, new_model, old_version, new_version = registry_models(params)
    split = split_images(params)
    photos = tmp_path / "photos"
    photo_folder(photos, split.images, 500 + np.arange(len(split.images)), split.labels)
    settings = yaml.safe_load((tmp_path / "params.yaml").read_text())
    settings["gallery"]["layout"] = "lance"
    (tmp_path / "lance.yaml").write_text(yaml.safe_dump(settings))
    store = f"s3://{new_bucket(s3_endpoint)}/adopted"
    common = ["--store", store, "--params", str(tmp_path / "lance.yaml")]
    runner = CliRunner()

    adopted = runner.invoke(app, ["gallery", "adopt", "--manifest", str(photos / "items.csv"), *common])
    assert adopted.exit_code == 0 and f"{len(split.labels)} items adopted" in adopted.output, adopted.output
    table = LanceGallery(store)
    assert table.model().version == old_version
    np.testing.assert_allclose(table.features(), embed(old_model, split.images), rtol=1e-5, atol=1e-5)
    items = table.items(["id", "image", "label"])
    assert items.column("image").to_pylist()[:2] == ["item-0000.png", "item-0001.png"]
    assert items.column("label").to_pylist() == split.labels.tolist()

    info = json.loads(runner.invoke(app, ["gallery", "info", *common]).output)
    assert info["layout"] == "lance" and info["items"] == len(split.labels) and info["state"] == "idle"
    np.save(tmp_path / "query.npy", table.features()[3:4])
    found = json.loads(runner.invoke(app, ["search", "--features", str(tmp_path / "query.npy"), "-k", "1",
                                           *common]).output)
    assert found["ids"] == [[503]] and found["sources"] == [[f"models:/{params.mlflow.registered_model}/{old_version}"]]

    # the adopted table upgraded: the backfill reads each image by its URI, under the manifest's folder
    (photos / "item-0007.png").unlink()  # gone since it was adopted: keeps its h(old)
    stopped = runner.invoke(app, ["upgrade", *common])  # max_failed_images 0.01 of 72 items: none may fail
    assert stopped.exit_code != 0 and "more than the 0 that gallery.upgrade.max_failed_images allows (first: item " \
        "507 at item-0007.png" in stopped.output, stopped.output
    assert table.upgrade() is not None and table.landed_chunks()  # the chunks that landed are kept
    settings["gallery"]["upgrade"]["max_failed_images"] = 1
    (tmp_path / "lance.yaml").write_text(yaml.safe_dump(settings))
    upgraded = runner.invoke(app, ["upgrade", *common])
    assert upgraded.exit_code == 0 and "complete: upgrade" in upgraded.output, upgraded.output
    assert table.model().version == new_version
    expected = embed(new_model, split.images)
    served = table.features()
    keep = np.arange(len(served)) != 7
    np.testing.assert_allclose(served[keep], expected[keep], rtol=1e-4, atol=1e-4)
    assert not np.allclose(served[7], expected[7], atol=1e-3)
    # read back where it is, by the tools a team uses: pyarrow, DuckDB, and LanceDB by name
    import duckdb
    import lancedb

    ds = table.dataset()  # noqa: F841 - DuckDB finds the dataset by its variable name
    assert duckdb.sql("select count(*), count(distinct id), min(position) from ds").fetchall() == \
        [(len(split.labels), len(split.labels), 0)]
    rows = ds.to_table(columns=["position", "features"]).sort_by("position")
    np.testing.assert_array_equal(np.stack(rows.column("features").to_numpy(zero_copy_only=False)), served)
    nearest = (lancedb.connect(store, storage_options=storage_options(store)).open_table("gallery")
               .search(served[11], vector_column_name="features").limit(1).select(["id"]).to_list())
    assert nearest[0]["id"] == 511

    # ingest: the prepared test split's images into a table of their own, with the champion's
    # features (the champion is the new model since the upgrade)
    ingested_at = ["--store", f"s3://{new_bucket(s3_endpoint)}/ingested", "--params", str(tmp_path / "lance.yaml")]
    ingested = runner.invoke(app, ["gallery", "ingest", *ingested_at])
    assert ingested.exit_code == 0 and f"{len(split.labels)} items" in ingested.output, ingested.output
    table = LanceGallery(ingested_at[1])
    pixels = table.items(["pixels"]).column("pixels").to_pylist()
    assert np.array_equal(np.frombuffer(b"".join(pixels), np.uint8).reshape(split.images.shape), split.images)
    np.testing.assert_allclose(table.features(), expected, rtol=1e-4, atol=1e-4)
