"""The gallery flows for real: the tiny pipeline's registry (champion, challenger, maps), a
local folder and a real S3 HTTP endpoint, Prefect runs, a Dask cluster, the CLI in
subprocesses killed with SIGKILL and resumed."""

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fastfill.components.gallery.layouts.catalog import GalleryError, PartsGallery
from fastfill.components.gallery.layouts.opening import gallery_at
from fastfill.components.gallery.search.index import GallerySearch
from fastfill.components.gallery.store import StoreUnreachable, open_store
from fastfill.components.gallery.store import lock as locking
from fastfill.components.gallery.upgrade import backfill, ending, planning
from fastfill.components.gallery.upgrade.status import gallery_status
from fastfill.components.platform.registry import RegistryError
from tests.integration.helpers import in_layout, killed_when, layouts, registry_models, split_images


def _index_against_exact(gallery, queries, labels, mixed) -> float:
    """Leave-one-out top-1 accuracy of every item as a query, measured from the index's own answers
    (the Lance serving table, the pgvector view or the Milvus alias), checked against an exact
    search of the product's ``mixed`` gallery: the same within the ANN's error (95% of top-1 hits
    equal, accuracy within 2 points). Returns it."""
    from fastfill.components.gallery.search.served import IndexSearch

    searcher = IndexSearch(gallery)
    ids, _ = searcher.search(queries, k=2)
    position = {int(i): p for p, i in enumerate(gallery.ids())}
    found = np.array([[position[int(i)] for i in row] for row in ids])
    top = np.where(found[:, 0] == np.arange(len(found)), found[:, 1], found[:, 0])
    distances = ((queries[:, None] - mixed[None]) ** 2).sum(-1)
    np.fill_diagonal(distances, np.inf)
    exact = np.argmin(distances, axis=1)
    assert (top == exact).mean() >= 0.95
    accuracy, expected = (labels[top] == labels).mean(), (labels[exact] == labels).mean()
    assert abs(accuracy - expected) <= 0.02, (accuracy, expected)
    return float(accuracy)


def test_upgrade_with_budget_search_resume_and_measure(store_uri, layout, upgrade_env, prefect_harness):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from fastfill.components.evaluation import curve_at_counts
    from fastfill.components.experiment.inference import embed
    from fastfill.flows.ingest import ingest_flow
    from fastfill.flows.upgrade import progress_key, upgrade_flow

    params, tmp_path = upgrade_env
    params = in_layout(params, tmp_path, layout)
    client, old_model, new_model, old_version, new_version = registry_models(params)
    split = split_images(params)
    n = len(split.labels)

    manifest = ingest_flow(params, store_uri)
    assert manifest["layout"] == layout
    assert manifest["num_items"] == n and manifest["model"]["version"] == old_version

    paused = upgrade_flow(params, store_uri, budget=0.4)
    assert paused.state == "paused"
    assert paused.items_done == int(np.ceil(0.4 * n))  # exact: the chunk the budget falls in was cut
    gallery = gallery_at(open_store(store_uri))
    assert gallery.layout == layout
    state = gallery_status(gallery)
    assert state.state == "paused" and state.lock is None
    assert state.upgrade.items_done == paused.items_done

    # queries during the upgrade: the new model against the mixed gallery, by faiss, by id
    searcher = GallerySearch(gallery)
    assert searcher.query_model.version == new_version and searcher.backfilled == paused.items_done
    plan = planning.load_plan(gallery.store, state.upgrade.upgrade_id)
    mixed, backfilled = backfill.mixed_features(gallery, plan)
    assert backfilled.sum() == paused.items_done
    queries = embed(new_model, split.images[:5])
    ids, _ = searcher.search(queries, k=3)
    distances = ((queries[:, None] - mixed[None]) ** 2).sum(-1)
    np.testing.assert_array_equal(ids, gallery.ids()[np.argsort(distances, axis=1, kind="stable")[:, :3]])

    if gallery.serves_queries:  # the team's index answers as the product's mixed gallery does
        half_way = _index_against_exact(gallery, embed(new_model, split.images), split.labels, mixed)

    done = upgrade_flow(params, store_uri)  # the same command resumes and completes
    assert done.state == "complete" and done.items_done == n
    if gallery.serves_queries:
        finished = _index_against_exact(gallery, embed(new_model, split.images), split.labels,
                                        gallery.all_features(plan.new))
        print(f"top-1 from the index's own answers: {half_way:.3f} at {paused.items_done}/{n}, {finished:.3f} "
              "after the finish")
    assert gallery.manifest(refresh=True)["model"]["version"] == new_version
    assert searcher.refresh() > 0 and searcher.rebuilds == 0  # updated in place, never rebuilt
    final = gallery.all_features(plan.new)
    np.testing.assert_allclose(final, embed(new_model, split.images), rtol=1e-5, atol=1e-5)

    # measured along the way == the simulated curve of the same features, at the same counts
    history = {name: {m.step: m.value for m in client.get_metric_history(plan.mlflow_run_id, name)}
               for name in ("top1", "top5", "map")}
    steps = sorted(history["top1"])
    plan = planning.load_plan(gallery.store, plan.upgrade_id)
    # the evaluation sample was embedded while planning: the first chunks, backfilled from the start
    assert plan.prefilled == 24 and plan.chunk_bounds(2) == (16, 24) and steps[1] == plan.prefilled
    assert steps[0] == 0 and steps[-1] == n and len(steps) >= 3
    positions = gallery.store.get_array(f"upgrades/{plan.upgrade_id}/eval/positions.npy")
    order = planning.order_of(gallery.store, plan.upgrade_id)
    assert set(order[:plan.prefilled]) == set(positions)
    # ... and stands for the gallery: its items count as backfilled at their stand-in places
    ranks = gallery.store.get_array(f"upgrades/{plan.upgrade_id}/eval/ranks.npy")
    local = np.argsort(ranks, kind="stable")
    transformed = planning.transformed_all(gallery, plan.upgrade_id)
    labels = split.labels[positions]
    counts = [int((ranks < s).sum()) for s in steps]
    curve = curve_at_counts(gallery.store.get_array(f"upgrades/{plan.upgrade_id}/eval/queries.npy"), final[positions],
                            transformed[positions], labels, local, counts)
    for i, step in enumerate(steps):
        assert history["top1"][step] == pytest.approx(curve.top1[i], abs=1e-6)
        assert history["top5"][step] == pytest.approx(curve.top5[i], abs=1e-6)
        assert history["map"][step] == pytest.approx(curve.map[i], abs=1e-6)
    # the budget advisor's prediction, made when planning: the sample's own curve at the same stand-in
    # places, every 5% (top-1 then scaled to the whole gallery's size), before the backfill began
    advice = gallery.store.get_json(f"upgrades/{plan.upgrade_id}/advice.json")
    cuts = [int(np.floor(round(f * n, 9))) for f in advice["fractions"]]
    exact = curve_at_counts(gallery.store.get_array(f"upgrades/{plan.upgrade_id}/eval/queries.npy"), final[positions],
                            transformed[positions], labels, local, [int((ranks < c).sum()) for c in cuts])
    np.testing.assert_allclose(advice["sample_top1"], exact.top1, atol=1e-9)
    np.testing.assert_allclose(advice["map"], exact.map, atol=1e-9)
    predicted = {m.step: m.value for m in client.get_metric_history(plan.mlflow_run_id, "predicted_top1")}
    assert sorted(predicted) == sorted(set(cuts)) and state.upgrade.predicted.top1["100%"] == \
        pytest.approx(100 * advice["top1"][-1], abs=0.01)
    fraction = client.get_metric_history(plan.mlflow_run_id, "backfill_fraction")
    assert max(m.value for m in fraction) == 1.0
    assert client.get_run(plan.mlflow_run_id).info.status == "FINISHED"
    with get_client(sync_client=True) as prefect:
        key = progress_key(store_uri, plan.upgrade_id)
        found = prefect.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    assert len(found) == 2  # one per flow run: the budgeted one, then the resumed one
    latest = max(found, key=lambda artifact: artifact.created)
    assert latest.type == "progress" and float(latest.data) == 100.0
    assert float(min(found, key=lambda artifact: artifact.created).data) == pytest.approx(100 * paused.fraction)


@pytest.fixture
def dask_cluster(tmp_path):
    """A real Dask cluster: a scheduler and 2 single-threaded workers, each its own process
    started with the `dask` command line; yields (scheduler address, worker pids)."""
    from distributed import Client

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    dask = str(Path(sys.executable).parent / "dask")
    scheduler_file = tmp_path / "scheduler.json"
    processes = [subprocess.Popen([dask, "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                                   "--scheduler-file", str(scheduler_file)], cwd=root, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        deadline = time.monotonic() + 60
        while not scheduler_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        for name in ("w1", "w2"):
            processes.append(subprocess.Popen([dask, "worker", "--scheduler-file", str(scheduler_file), "--name", name,
                                               "--nworkers", "1", "--nthreads", "1", "--no-dashboard"], cwd=root,
                                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        with Client(scheduler_file=str(scheduler_file), timeout=60) as client:
            client.wait_for_workers(2, timeout=120)
            info = client.scheduler_info()
            address = info["address"]
            pids = set(client.run(os.getpid).values())
        yield address, pids
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


@pytest.mark.slow  # a Dask cluster of separate processes starts: about a minute on 2 cores
def test_backfill_on_a_dask_cluster_of_separate_processes(s3_endpoint, upgrade_env, prefect_harness, dask_cluster):
    """An adopted gallery in S3 (its images in the bucket), upgraded through ``run_upgrade`` with
    task_runner dask at the cluster's address: the chunks run in the two workers, which read the
    images and write the features to the store themselves."""
    import boto3
    import pyarrow as pa
    from PIL import Image

    from fastfill.components.experiment.inference import embed
    from fastfill.components.gallery.inputs.adopt import adopt
    from fastfill.components.platform.registry import ModelRef
    from fastfill.flows.upgrade import run_upgrade
    from tests.environment import new_bucket

    address, worker_pids = dask_cluster
    params, _ = upgrade_env
    _, old_model, new_model, old_version, _ = registry_models(params)
    split = split_images(params)
    bucket = new_bucket(s3_endpoint)
    s3 = boto3.client("s3")
    for i, image in enumerate(split.images):
        buffer = io.BytesIO()
        Image.fromarray(image[0], mode="L").save(buffer, format="PNG")
        s3.put_object(Bucket=bucket, Key=f"photos/{i}.png", Body=buffer.getvalue())
    uri = f"s3://{bucket}/dask"
    table = pa.table({"id": np.arange(len(split.labels)), "uri": [f"s3://{bucket}/photos/{i}.png"
                                                                   for i in range(len(split.labels))],
                      "label": split.labels})
    adopt(open_store(uri), table, ModelRef("embedder", old_version, old_model.embedding_dim),
          split.images.shape[1:], features=iter([embed(old_model, split.images)]), part_size=20)
    on_dask = params.model_copy(update={"gallery": params.gallery.model_copy(update={
        "upgrade": params.gallery.upgrade.model_copy(update={"task_runner": "dask", "dask_address": address})})})
    result = run_upgrade(on_dask, uri, gate=False)
    assert result.state == "complete" and result.failed_images == 0
    store = open_store(uri)
    plan = planning.load_plan(store, result.upgrade_id)
    markers = [store.get_json(planning.marker_key(plan.upgrade_id, c)) for c in range(plan.num_chunks)]
    pids = {m["pid"] for m in markers if not m.get("prefilled")}
    assert pids == worker_pids and os.getpid() not in pids, (pids, worker_pids)  # both workers, not here
    # the evaluation sample's chunks were written while planning, here, from the features it embedded
    assert {m["pid"] for m in markers if m.get("prefilled")} == {os.getpid()}
    assert sum(m["count"] for m in markers if m.get("prefilled")) == plan.prefilled == 24
    gallery = PartsGallery(store)
    np.testing.assert_allclose(gallery.all_features(gallery.model), embed(new_model, split.images), rtol=1e-5,
                               atol=1e-5)


def test_bad_requests_are_refused_and_change_nothing(upgrade_env, prefect_harness, monkeypatch, s3_endpoint):
    from fastfill.flows.ingest import ingest_flow
    from fastfill.flows.upgrade import upgrade_flow

    params, tmp_path = upgrade_env
    uri = str(tmp_path / "g")
    _, _, _, old_version, new_version = registry_models(params)
    ingest_flow(params, uri)
    store = open_store(uri)

    def snapshot():
        return {key: store.get(key) for key in store.list("")}

    before = snapshot()
    with pytest.raises(RegistryError, match="unknown model 'models:/embedder@nope'.*champion -> v"):
        upgrade_flow(params, uri, "models:/embedder@nope")
    with pytest.raises(RegistryError, match="unknown model"):
        upgrade_flow(params, uri, "models:/embedder/999")
    assert upgrade_flow(params, uri, f"models:/embedder/{old_version}").state == "up-to-date"
    with pytest.raises(GalleryError, match="already holds a gallery"):
        ingest_flow(params, uri)
    assert snapshot() == before

    # the refusals that depend on the gallery's state (half done, rejected before, nothing to
    # measure against) are the decider's: tests/unit/test_decider.py

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")
    with pytest.raises(StoreUnreachable, match="cannot connect"):
        upgrade_flow(params, "s3://unreachable-bucket/g")

    bad = np.full((len(split_images(params).labels), 16), np.nan, np.float32)
    np.save(tmp_path / "nan.npy", bad)
    with pytest.raises(GalleryError, match="NaN or infinite"):
        ingest_flow(params, str(tmp_path / "g2"), features=tmp_path / "nan.npy")
    np.save(tmp_path / "wide.npy", np.zeros((len(bad), 7), np.float32))
    with pytest.raises(GalleryError, match="dimension 7, but the model's is 16"):
        ingest_flow(params, str(tmp_path / "g2"), features=tmp_path / "wide.npy")
    assert not (tmp_path / "g2").exists() or not any((tmp_path / "g2").iterdir())


def test_what_the_layout_cannot_serve_is_refused_before_any_work(upgrade_env, prefect_harness):
    """A Milvus Lite gallery asked to backfill with Dask workers (processes of their own, which
    cannot open the file): the upgrade refuses with the layout's reason, and the store and the
    collection are as they were."""
    pytest.importorskip("milvus_lite", reason="Milvus Lite comes with the cpu extra")
    from fastfill.flows.ingest import ingest_flow
    from fastfill.flows.upgrade import upgrade_flow

    params, tmp_path = upgrade_env
    params = in_layout(params, tmp_path, "milvus")
    registry_models(params)
    uri = str(tmp_path / "gallery")
    ingest_flow(params, uri)
    store = open_store(uri)
    before = {key: store.get(key) for key in store.list("")}
    dask = params.model_copy(update={"gallery": params.gallery.model_copy(update={
        "upgrade": params.gallery.upgrade.model_copy(update={"task_runner": "dask"})})})
    with pytest.raises(GalleryError, match=r"\(milvus layout\) cannot serve models:/embedder/\d+: "
                                           r"gallery.upgrade.task_runner is dask, but .*Milvus Lite.*Nothing was written"):
        upgrade_flow(dask, uri)
    assert {key: store.get(key) for key in store.list("")} == before
    assert gallery_at(store).index.serving().model == gallery_at(store).model.uri


def test_a_broken_gallery_is_refused_before_planning_writes_and_killed_plannings_are_closed(upgrade_env,
                                                                                            prefect_harness):
    from fastfill.components.gallery.layouts.catalog import features_key
    from fastfill.components.platform import registry
    from fastfill.flows.ingest import ingest_flow
    from fastfill.flows.upgrade import upgrade_flow

    params, tmp_path = upgrade_env
    uri = str(tmp_path / "g")
    registry_models(params)
    ingest_flow(params, uri)
    store = open_store(uri)
    gallery = PartsGallery(store)
    before = {key: store.get(key) for key in store.list("")}
    client, experiment = registry.setup(params.mlflow)

    def upgrade_runs(status=None):
        runs = client.search_runs([experiment], filter_string=f"tags.store = '{uri}'")
        return [r for r in runs if status is None or r.info.status == status]

    missing = features_key(gallery.model, 2)
    store.delete(missing)
    with pytest.raises(GalleryError, match=f"1 of {gallery.num_parts} features parts are missing .first: {missing}"):
        upgrade_flow(params, uri)
    assert store.list("upgrades/") == [] and upgrade_runs() == []  # refused before any write, no run
    store.put(missing, before[missing])

    torn = features_key(gallery.model, gallery.num_parts - 1)
    bad = store.get_array(torn).copy()
    bad[0, 0] = np.nan
    store.put_array(torn, bad)
    with pytest.raises(GalleryError, match="NaN or infinite"):
        upgrade_flow(params, uri)
    assert store.list("upgrades/") == []  # what planning had written is gone, and the lock released
    assert gallery.manifest(refresh=True)["upgrade"] is None
    (refused,) = upgrade_runs()
    assert refused.info.status == "FAILED" and "NaN" in refused.data.tags["fastfill.refused"]
    store.put(torn, before[torn])

    manifest = store.get_json("gallery.json")
    assert manifest["registry"] == registry.identity(params.mlflow)  # the gallery knows its registry
    elsewhere = params.model_copy(update={"mlflow": params.mlflow.model_copy(
        update={"tracking_uri": f"sqlite:///{tmp_path / 'another-registry.db'}"})})
    with pytest.raises(GalleryError, match="belongs to the model registry at sqlite:///.*mlflow.db, but this command "
                                           "uses sqlite:///.*another-registry.db"):
        upgrade_flow(elsewhere, uri)
    store.put_json("gallery.json", {k: v for k, v in manifest.items() if k != "model"})
    with pytest.raises(GalleryError, match="gallery.json.* lacks model: it is not a manifest this product wrote"):
        upgrade_flow(params, uri)
    store.put_json("gallery.json", manifest)

    # a planning killed outright leaves its run RUNNING: the next start marks it KILLED
    killed = client.create_run(experiment, run_name=refused.info.run_name,
                               tags={registry.STAGE_TAG: "upgrade", "store": uri}).info.run_id
    upgrade_flow(params, uri, budget=8)
    assert client.get_run(killed).info.status == "KILLED"
    assert {k: store.get(k) for k in before if not k.startswith("upgrades/") and k != "gallery.json"} == \
        {k: v for k, v in before.items() if k != "gallery.json"}


def test_a_second_upgrade_at_once_is_refused_on_every_layout(layout, upgrade_env, prefect_harness):
    """While another upgrade holds the gallery's lock (in the store, on every layout), an upgrade
    is refused before it plans, writes or moves the index; once the lock is gone it runs."""
    from fastfill.flows.ingest import ingest_flow
    from fastfill.flows.upgrade import upgrade_flow

    params, tmp_path = upgrade_env
    params = in_layout(params, tmp_path, layout)
    registry_models(params)
    uri = str(tmp_path / "gallery")
    ingest_flow(params, uri)
    store = open_store(uri)
    held = locking.acquire_lock(store, "another-upgrade", log=lambda m: None)

    def objects():  # the store's own objects (the Lance tables' files are Lance's: their version says)
        return {key: store.get(key) for key in store.list("") if ".lance/" not in key}

    def index():
        gallery = gallery_at(store)
        return gallery.index.serving() if gallery.serves_queries else None

    before, serving = objects(), index()
    with pytest.raises(locking.UpgradeLocked, match="is being upgraded: upgrade another-upgrade by process"):
        upgrade_flow(params, uri, budget=0.3)
    assert objects() == before and index() == serving  # nothing planned, the index not moved
    held.release()
    assert upgrade_flow(params, uri, budget=0.3).state == "paused"


def test_cli_refuses_a_second_upgrade_and_unlocks(upgrade_env, prefect_harness):
    from typer.testing import CliRunner

    from fastfill.cli import app
    from fastfill.flows.ingest import ingest_flow

    params, tmp_path = upgrade_env
    uri = str(tmp_path / "g")
    ingest_flow(params, uri)
    held = locking.acquire_lock(open_store(uri), "another-upgrade", log=lambda m: None)  # this live process holds it
    runner = CliRunner()
    args = ["--params", str(tmp_path / "params.yaml"), "--store", uri]
    result = runner.invoke(app, ["upgrade", *args])
    assert result.exit_code == 6  # bad input: the gallery is locked
    assert "is being upgraded: upgrade another-upgrade by process" in result.output
    assert "fastfill upgrade unlock" in result.output
    assert gallery_status(PartsGallery(open_store(uri))).upgrade is None  # refused before planning
    result = runner.invoke(app, ["upgrade", "unlock", *args])
    assert result.exit_code == 0 and "removed the lock of upgrade another-upgrade" in result.output
    store = open_store(uri)
    before = {key: store.get(key) for key in store.list("")}
    result = runner.invoke(app, ["upgrade", *args, "--dry-run", "--chunk-size", "10"])
    assert result.exit_code == 0, result.output
    assert "dry run: nothing written" in result.output and "8 chunks of 10" in result.output
    assert "object-store requests" in result.output and "estimated backfill" in result.output
    assert {key: store.get(key) for key in store.list("")} == before  # no plan, no lock, nothing
    started = time.monotonic()  # throttled: after the first chunk past the 24 prefilled, 3 items/s for the next 16
    result = runner.invoke(app, ["upgrade", *args, "--budget", "60%", "--no-progress", "--max-items-per-second", "3",
                                 "--concurrency", "1"])
    assert result.exit_code == 0, result.output
    assert "paused:" in result.output and time.monotonic() - started >= 16 / 3
    status = json.loads(runner.invoke(app, ["upgrade", "status", *args]).output)
    assert status["state"] == "paused" and status["upgrade"]["items_done"] == 44  # 60% of 72, exactly

    # search from the CLI: the new model's space, the mixed gallery
    from fastfill.components.experiment.inference import embed

    _, _, new_model, old_version, new_version = registry_models(params)
    np.save(tmp_path / "q.npy", embed(new_model, split_images(params).images[:2]))
    result = runner.invoke(app, ["search", *args, "--features", str(tmp_path / "q.npy"), "-k", "3"])
    assert result.exit_code == 0, result.output
    answer = json.loads(result.output.strip().splitlines()[-1])
    assert answer["query_model"] == f"models:/embedder/{new_version}"
    assert answer["backfilled"] == status["upgrade"]["items_done"] and len(answer["ids"][0]) == 3
    sources = {src for row in answer["sources"] for src in row}  # each hit says where its features come from
    assert sources <= {f"models:/embedder/{new_version}", f"models:/embedder/{old_version} mapped by "
                       f"{planning.load_plan(open_store(uri), status['upgrade']['id']).map_uri}"}, sources
    np.save(tmp_path / "wide.npy", np.zeros((2, 5), np.float32))
    result = runner.invoke(app, ["search", *args, "--features", str(tmp_path / "wide.npy")])
    assert result.exit_code == 6 and "dimension 5, but the model's is 16" in result.output

    result = runner.invoke(app, ["upgrade", *args, "--no-progress"])
    assert result.exit_code == 0 and "complete:" in result.output, result.output
    result = runner.invoke(app, ["gallery", "gc", *args])
    assert result.exit_code == 0 and "deleted 4 unused features" in result.output, result.output
    held.release()


# ---- SIGKILL ------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", layouts("parts"))
def test_a_sigkilled_backfill_resumes_with_the_same_command(layout, upgrade_env, cli_env, prefect_harness):
    from fastfill.flows.ingest import ingest_flow
    from fastfill.flows.upgrade import upgrade_flow

    if layout == "milvus":
        pytest.skip("Milvus Lite opens its file in one process at a time, and this test's CLI runs in a process of "
                    "its own beside the test's; a Milvus server would take both (docs/serving.md)")
    params, tmp_path = upgrade_env
    params = in_layout(params, tmp_path, layout)
    store_uri = str(tmp_path / "store")  # S3: the chaos test below
    ingest_flow(params, store_uri)
    reference_uri = str(tmp_path / "reference")
    ingest_flow(params, reference_uri)
    store = open_store(store_uri)
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "fastfill.cli", "upgrade", "--store", store_uri, "--chunk-size", "4",
               "--concurrency", "1", "--no-progress", "--params", str(tmp_path / "params.yaml")]
    # the commands run their flows on the tests' Prefect server: a temporary server of their own
    # would take seconds to start each time (test_hard_kill.py kills a command with its own)
    from prefect.settings import get_current_settings

    cli_env = {**cli_env, "PREFECT_API_URL": get_current_settings().api.url}
    log = open(tmp_path / "killed.log", "wb")
    # its own process group: the kill takes the CLI and whatever it started
    process = subprocess.Popen(command, cwd=root, env=cli_env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    deadline = time.monotonic() + 240
    upgrade_id = None
    while time.monotonic() < deadline and process.poll() is None:
        manifest = store.get_json("gallery.json") if store.exists("gallery.json") else {}
        upgrade_id = manifest.get("upgrade")
        if upgrade_id and len(backfill.done_chunks(store, upgrade_id)) >= 3:
            os.killpg(process.pid, signal.SIGKILL)
            break
        time.sleep(0.02)
    process.wait(timeout=60)
    log.close()
    output = (tmp_path / "killed.log").read_text()
    assert process.returncode == -signal.SIGKILL, f"the backfill ended before it could be killed:\n{output[-3000:]}"
    plan = planning.load_plan(store, upgrade_id)
    before = {c: store.get_json(planning.marker_key(upgrade_id, c)) for c in backfill.done_chunks(store, upgrade_id)}
    assert 3 <= len(before) < plan.num_chunks
    assert store.exists(locking.LOCK)  # left behind by the killed process

    resumed = subprocess.run(command, cwd=root, env=cli_env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "that process is gone" in resumed.stdout + resumed.stderr
    assert "complete:" in resumed.stdout
    # finished chunks were not redone; every chunk has one marker; every item has its features
    after = {c: store.get_json(planning.marker_key(upgrade_id, c)) for c in backfill.done_chunks(store, upgrade_id)}
    assert sorted(after) == list(range(plan.num_chunks))
    assert all(after[c]["token"] == before[c]["token"] for c in before)
    assert sum(m["count"] for m in after.values()) == plan.num_items
    order = planning.order_of(store, upgrade_id)
    assert sorted(np.concatenate([order[m["start"]:m["stop"]] for m in after.values()])) == list(range(plan.num_items))
    gallery = gallery_at(store)
    assert gallery.layout == layout
    assert gallery.manifest(refresh=True)["model"] == plan.new.to_dict() and not store.exists(locking.LOCK)

    # the same features as an uninterrupted run with the same chunking
    changed = params.model_copy(update={"gallery": params.gallery.model_copy(update={
        "upgrade": params.gallery.upgrade.model_copy(update={"chunk_size": 4, "max_concurrency": 1})})})
    upgrade_flow(changed, reference_uri, plan.new.uri)  # by version: the promotion cleared `challenger`
    reference = gallery_at(open_store(reference_uri))
    np.testing.assert_array_equal(gallery.all_features(plan.new), reference.all_features(plan.new))


@pytest.mark.slow
def test_an_upgrade_killed_while_planning_backfilling_and_ending_on_s3_completes_exactly_once(
        s3_endpoint, upgrade_env, cli_env, prefect_harness):
    """Chaos, small: the CLI's process group SIGKILLed at a random moment of each phase (planning,
    backfill, the ending), the same command run again after each kill; then every item is covered
    once, the features are bit-identical to an uninterrupted upgrade's, and the gallery, the
    registry and the lock agree."""
    import random

    from fastfill.components.platform import registry
    from fastfill.flows.ingest import ingest_flow
    from fastfill.flows.upgrade import upgrade_flow
    from tests.environment import new_bucket

    params, tmp_path = upgrade_env
    store_uri = f"s3://{new_bucket(s3_endpoint)}/galleries/chaos"
    ingest_flow(params, store_uri)
    store = open_store(store_uri)
    client, _, _, old_version, new_version = registry_models(params)
    name = params.mlflow.registered_model
    uid = planning.upgrade_id(registry.ModelRef(name, old_version), registry.ModelRef(name, new_version))
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "fastfill.cli", "upgrade", "--store", store_uri, "--chunk-size", "4",
               "--concurrency", "1", "--no-progress", "--params", str(tmp_path / "params.yaml")]
    rng = random.Random(0)

    def planning_started():
        return bool(store.list(f"upgrades/{uid}/"))

    def backfilling(at_least=rng.randint(1, 4)):  # noqa: B008 - drawn once, when the test starts
        return len(backfill.done_chunks(store, uid)) >= at_least

    def ending_started():
        plan = planning.load_plan(store, uid)
        return plan is not None and len(backfill.done_chunks(store, uid)) == plan.num_chunks

    killed_at = []
    for phase, started in (("planning", planning_started), ("backfill", backfilling), ("ending", ending_started)):
        pause = {"planning": rng.uniform(0, 0.05), "backfill": rng.uniform(0, 0.3)}.get(phase, 0)
        killed_when(command, root, cli_env, tmp_path / f"killed-{phase}.log", started, pause)
        killed_at.append((phase, len(backfill.done_chunks(store, uid)), store.exists(planning.upgrade_key(uid, "decision.json"))))
    print("killed at (phase, chunks done, decision recorded):", killed_at)

    resumed = subprocess.run(command, cwd=root, env=cli_env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    plan = planning.load_plan(store, uid)
    markers = [store.get_json(planning.marker_key(uid, c)) for c in backfill.done_chunks(store, uid)]
    assert len(markers) == plan.num_chunks and sum(m["count"] for m in markers) == plan.num_items
    order = planning.order_of(store, uid)
    assert sorted(np.concatenate([order[m["start"]:m["stop"]] for m in markers])) == list(range(plan.num_items))
    gallery = PartsGallery(store)
    assert gallery.manifest(refresh=True)["upgrade"] is None and gallery.model.version == new_version
    assert str(client.get_model_version_by_alias(name, "champion").version) == new_version
    assert ending.decision(store, uid).registry_recorded and not store.exists(locking.LOCK)
    assert gallery_status(gallery).state == "idle"

    reference_uri = str(tmp_path / "reference")
    client.set_registered_model_alias(name, "champion", old_version)  # the reference starts where the chaos did
    ingest_flow(params, reference_uri)
    assert PartsGallery(open_store(reference_uri)).model.version == old_version
    changed = params.model_copy(update={"gallery": params.gallery.model_copy(update={
        "upgrade": params.gallery.upgrade.model_copy(update={"chunk_size": 4, "max_concurrency": 1})})})
    assert upgrade_flow(changed, reference_uri, plan.new.uri).state == "complete"
    np.testing.assert_array_equal(gallery.all_features(plan.new), PartsGallery(open_store(reference_uri)).all_features(plan.new))


def test_upgrade_trains_and_registers_a_map_when_none_joins_the_versions(upgrade_env, prefect_harness):
    from fastfill.flows.ingest import ingest_flow
    from fastfill.flows.upgrade import upgrade_flow

    params, tmp_path = upgrade_env
    client, _, _, old_version, new_version = registry_models(params)
    client.delete_registered_model(params.mlflow.alignment_model)  # this private store has no maps now
    uri = str(tmp_path / "g")
    ingest_flow(params, uri)
    result = upgrade_flow(params, uri)
    assert result.state == "complete"
    plan = planning.load_plan(open_store(uri), result.upgrade_id)
    versions = sorted(client.search_model_versions(f"name = '{params.mlflow.alignment_model}'"),
                      key=lambda v: int(v.version))
    trained, tags = versions[0], versions[0].tags
    assert (tags["from_version"], tags["to_version"], tags["method"]) == (old_version, new_version, "fastfill")
    assert tags["run_id"] == plan.mlflow_run_id
    # the trained map was checked against an l2-only map on held-out pairs; the outcome is on the version and run
    run = client.get_run(plan.mlflow_run_id)
    assert tags["check"] in ("passed", "fallback", "warned") and run.data.tags["check"] == tags["check"]
    assert {"check.map.top1_auc", "check.reference.top1_auc"} <= set(run.data.metrics)
    used, order = trained, "sigma"
    if tags["check"] == "fallback":
        # the l2 map was registered and used: with a fitted uncertainty head where its sigma order was shown
        # to help on the held-out pairs (a fastfill map, sigma order), else alone (an fct map, random order)
        assert len(versions) == 2 and versions[1].tags["replaces"] == f"models:/{params.mlflow.alignment_model}/{trained.version}"
        used, order = versions[1], tags["fallback_order"]
        assert run.data.tags["fallback_order"] == order and "check.fallback.sigma_kept" in run.data.metrics
        assert used.tags["method"] == ("fastfill" if order == "sigma" else "fct")
    assert len(versions) == (2 if tags["check"] == "fallback" else 1)
    assert plan.map_uri == f"models:/{params.mlflow.alignment_model}/{used.version}"
    assert plan.order_kind == order


@pytest.mark.slow  # the later map trained and checked in the upgrade: a minute on 2 cores (the map and its
# reverse transformation alone are tests/unit/test_later_methods_maps.py's)
def test_an_upgrade_by_the_lambda_orthogonal_map_serves_online_backfilling(upgrade_env, prefect_harness):
    """gallery.upgrade.method names the comparison's affine lambda-orthogonal map and online is on:
    the upgrade trains that map (checked, warn-only), fits the metric-compatible reverse
    transformation on the map's pairs and keeps it with the plan; mid-upgrade, `search --merge
    online` answers from the new model's features alone, with hits from both parts."""
    import yaml
    from typer.testing import CliRunner

    from fastfill.cli import app
    from fastfill.components.experiment.inference import embed
    from fastfill.components.model_store.registered import load_model
    from fastfill.components.platform.config import parse_params
    from fastfill.flows.ingest import ingest_flow
    from fastfill.flows.upgrade import upgrade_flow

    base, tmp_path = upgrade_env
    client, _, new_model, old_version, new_version = registry_models(base)
    client.delete_registered_model(base.mlflow.alignment_model)  # no map joins the two versions: one is trained
    data = base.model_dump(mode="json")
    data["compare"]["align"]["lambda_orth"] = {"architecture": "affine", "orthogonality": 1.0, "disc": True,
                                               "uncertainty": False, "epochs": 3, "warmup_epochs": 1,
                                               "batch_size": 32, "min_steps": 30, "check": "warn"}
    data["compare"]["orders"]["lambda_orth"] = ["random"]
    data["gallery"]["upgrade"].update(method="lambda_orth", order="random", online=True)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data))
    params = parse_params(data)
    uri = str(tmp_path / "g")
    ingest_flow(params, uri)
    paused = upgrade_flow(params, uri, budget=0.5)
    assert paused.state == "paused", paused
    store = open_store(uri)
    plan = planning.load_plan(store, paused.upgrade_id)
    version = plan.map_uri.rsplit("/", 1)[1]
    tags = client.get_model_version(params.mlflow.alignment_model, version).tags
    assert tags["method"] == "lambda_orth" and plan.order_kind == "random"
    assert load_model(plan.map_uri).transform.__class__.__name__ == "Dense"  # W x + b (an nn.Linear on oneDNN)
    reverse = planning.load_reverse(store, plan.upgrade_id)
    assert reverse.kind == "metric_compatible" and reverse.new_scale > 0
    assert client.get_run(plan.mlflow_run_id).data.tags["online"] == "metric_compatible"

    runner = CliRunner()
    args = ["--params", str(tmp_path / "params.yaml"), "--store", uri]
    np.save(tmp_path / "q.npy", embed(new_model, split_images(params).images[:8]))
    # the queries are gallery items; half the gallery is re-embedded, so 40 hits reach into the old part
    result = runner.invoke(app, ["search", *args, "--merge", "online", "--features", str(tmp_path / "q.npy"),
                                 "-k", "40"])
    assert result.exit_code == 0, result.output
    answer = json.loads(result.output.strip().splitlines()[-1])
    assert answer["merge"] == "online" and answer["query_models"] == [f"models:/embedder/{new_version}"]
    assert all(np.all(np.diff(row) >= 0) for row in answer["scores"])  # one list, by distance
    assert {s for row in answer["sources"] for s in row} == {f"models:/embedder/{old_version}",
                                                             f"models:/embedder/{new_version}"}
    refused = runner.invoke(app, ["search", *args, "--merge", "online", "--features", str(tmp_path / "q.npy"),
                                  "--old-features", str(tmp_path / "q.npy")])
    assert refused.exit_code == 2 and "--merge online needs the new model's features alone" in refused.output


def test_with_the_check_off_the_upgrade_uses_the_map_it_trains_unchecked(upgrade_env, prefect_harness):
    """align.<method>.check: off (the comparison's setting) in an upgrade: the map is trained,
    registered and used as trained; the version and the run say the check was skipped, and why."""
    from fastfill.flows.ingest import ingest_flow
    from fastfill.flows.upgrade import upgrade_flow

    params, tmp_path = upgrade_env
    client, _, _, old_version, new_version = registry_models(params)
    client.delete_registered_model(params.mlflow.alignment_model)
    align = dict(params.align)
    align["fastfill"] = align["fastfill"].model_copy(update={"check": "off"})
    unchecked = params.model_copy(update={"align": align})
    uri = str(tmp_path / "g")
    ingest_flow(unchecked, uri)
    result = upgrade_flow(unchecked, uri)
    assert result.state == "complete"
    plan = planning.load_plan(open_store(uri), result.upgrade_id)
    versions = client.search_model_versions(f"name = '{params.mlflow.alignment_model}'")
    assert len(versions) == 1  # no l2-only fallback map was trained or registered
    tags = versions[0].tags
    assert tags["check"] == "skipped (align.fastfill.check is off)"
    run = client.get_run(plan.mlflow_run_id)
    assert run.data.tags["check"] == tags["check"]
    assert not {m for m in run.data.metrics if m.startswith("check.")}
    assert plan.map_uri == f"models:/{params.mlflow.alignment_model}/{versions[0].version}"
    assert plan.order_kind == "sigma"


def test_the_upgrade_stops_itself_where_the_advisor_recommends(upgrade_env, prefect_harness):
    """A sample of the gallery (not all of it): the dry run predicts the curve from the registry's
    map, the upgrade predicts the same one when it plans, stops at the recommended fraction, stays
    there when asked again, and goes on to 100% without the stop."""
    import yaml
    from typer.testing import CliRunner

    from fastfill.cli import app
    from fastfill.cli.upgrade_commands import estimate_upgrade
    from fastfill.components.gallery.advice.advisor import recommend
    from fastfill.components.platform.config import parse_params
    from fastfill.flows.ingest import ingest_flow
    from fastfill.flows.upgrade import upgrade_flow

    base, tmp_path = upgrade_env

    def configured(**upgrade):  # params.yaml (which the CLI reads) and the params the flows get
        data = base.model_dump(mode="json")
        data["gallery"]["upgrade"].update(eval_queries=40, **upgrade)
        data["promotion"]["gate"] = True  # the dry run predicts the gate's decision
        data["compare"]["align"]["lambda_orth"] = {  # the later map that the ways compare
            "architecture": "affine", "orthogonality": 1.0, "disc": True, "epochs": 3, "warmup_epochs": 1,
            "batch_size": 32, "min_steps": 30}
        data["compare"]["orders"]["lambda_orth"] = ["random"]
        (tmp_path / "params.yaml").write_text(yaml.safe_dump(data))
        return parse_params(data)

    params = configured()
    uri = str(tmp_path / "g")
    n = ingest_flow(params, uri)["num_items"]
    store = open_store(uri)
    before = {key: store.get(key) for key in store.list("")}
    dry = estimate_upgrade(params, uri)
    assert {key: store.get(key) for key in store.list("")} == before  # the prediction wrote nothing
    predicted = dry.advice.to_dict()
    assert predicted["sample"] == 40 and predicted["items"] == n and len(predicted["top1"]) == 21
    assert predicted["error_scale"] > 0 and all(0 <= v <= 1 for v in predicted["top1"] + predicted["map"])
    # --target-top1: every way the gallery allows, the configured one (sigma) predicted as above
    target = estimate_upgrade(params, uri, "", predicted["top1"][10]).advice.to_dict()["target"]
    assert {key: store.get(key) for key in store.list("")} == before  # still nothing written
    by = {way["way"]: way for way in target["ways"]}
    sigma = {"map, sigma order", "shadow index (rrf), sigma order",  # when the registry's map has a head
             "online backfilling (metric-compatible), sigma order", "candidate reranking (K=50), sigma order"}
    assert set(by) - sigma == {"map, random order", "lambda-orthogonal map (affine), random order",
                               "shadow index (rrf), random order", "online backfilling (metric-compatible), random order",
                               "candidate reranking (K=50), random order"}
    assert set(by) & sigma in (set(), sigma)
    own = by[f"map, {predicted['order']} order"]
    assert own["top1_at_0"] == pytest.approx(predicted["top1"][0], abs=1e-9)
    assert own["top1_full"] == pytest.approx(predicted["top1"][-1], abs=1e-9)
    assert own["fraction"] is not None and own["fraction"] <= 0.5
    assert target["best"] in by and target["line"].startswith(target["best"])
    asked = f"{100 * predicted['top1'][10]:.2f}%"
    shown = CliRunner().invoke(app, ["upgrade", "--params", str(tmp_path / "params.yaml"), "--store", uri,
                                     "--dry-run", "--target-top1", asked])
    assert shown.exit_code == 0, shown.output
    assert f"target top-1 {asked}: {target['best']} reaches top-1 {asked} first" in shown.output
    assert ("promotion gate, predicted on the 40 items of the evaluation sample as it will measure them: "
            + ("PASS" if predicted["gate"]["passed"] else "REJECT")) in shown.output, shown.output
    # a gain that stops the backfill part of the way (the tiny curve is steep: a few points per 5%)
    gains = [g for g in (0.5, 1, 2, 3, 5, 8, 13, 20) if 0 < recommend(predicted, g)["fraction"] < 1]
    # a stop past the 40 items embedded while planning shows the cut best; any stop short of 100% does
    gains.sort(key=lambda g: recommend(predicted, g)["items"] <= 40)
    assert gains, f"no gain stops this curve part of the way: {predicted['top1']}"
    gain = gains[0]
    stop = recommend(predicted, gain)
    params = configured(stop_when_gain_below=gain, chunk_size=64)  # one chunk larger than the stop's count

    paused = upgrade_flow(params, uri)
    assert paused.state == "paused" and paused.stopped == "recommended", paused
    prefilled = planning.load_plan(store, paused.upgrade_id).prefilled  # the evaluation sample, embedded while planning
    assert paused.items_done == max(stop["items"], prefilled)  # exactly there: the chunk was cut, not rounded up
    assert paused.advice.recommendation.fraction == stop["fraction"]
    stored = store.get_json(f"upgrades/{paused.upgrade_id}/advice.json")
    np.testing.assert_allclose(stored["top1"], predicted["top1"], atol=1e-9)  # the dry run predicted the plan's curve
    np.testing.assert_allclose(stored["map"], predicted["map"], atol=1e-6)
    again = upgrade_flow(params, uri)  # the same command stays at the recommended stop
    assert again.state == "paused" and again.items_done == paused.items_done

    runner = CliRunner()
    args = ["--params", str(tmp_path / "params.yaml"), "--store", uri]
    shown = runner.invoke(app, ["upgrade", *args, "--dry-run", "--stop-when-gain-below", str(gain),
                                "--target-top1", "50%"])
    assert shown.exit_code == 0, shown.output
    assert "target top-1 50.00%: the ways are compared before an upgrade starts" in shown.output
    assert "predicted backfill curve (from 40 labeled items of" in shown.output
    assert f"recommended stop for a gain below {gain:g} top-1 points per 5%: {100 * stop['fraction']:.0f}%" in shown.output
    status = json.loads(runner.invoke(app, ["upgrade", "status", *args]).output)
    assert status["upgrade"]["predicted"]["sample"] == 40 and len(status["upgrade"]["predicted"]["top1"]) == 11
    refused = runner.invoke(app, ["upgrade", *args, "--stop-when-gain-below", "-1"])
    assert refused.exit_code == 2 and "--stop-when-gain-below" in refused.output, refused.output

    done = upgrade_flow(configured(), uri)
    assert done.state in ("complete", "rejected") and done.items_done == n, done
    assert (done.state == "complete") == predicted["gate"]["passed"], (done, predicted["gate"])
    # the dry run predicted the gate's decision and its numbers as the gate then measured them
    from fastfill.components.gallery.upgrade import ending

    measured = ending.decision(store, done.upgrade_id)
    gate = predicted["gate"]
    assert gate["passed"] == measured.passed and gate["reasons"] == measured.reasons, (gate, measured)
    for key in ("champion_top1", "top1_auc", "nfr1_mean", "nfr1_end", "fraction_to_gain"):
        assert gate[key] == pytest.approx(measured.numbers[key], abs=1e-9), key


# ---- adopted in place ---------------------------------------------------------------------------


def _photos(folder: Path, images: np.ndarray) -> list[str]:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for i, image in enumerate(images):
        names.append(f"shelf-{i % 3}/item-{i:05d}.png")
        (folder / names[-1]).parent.mkdir(exist_ok=True)
        Image.fromarray(image[0], mode="L").save(folder / names[-1])
    return names


@pytest.mark.parametrize("layout", layouts("parts", "lance"))
def test_adopt_in_place_then_upgrade_reads_images_by_uri(layout, upgrade_env, prefect_harness):
    from typer.testing import CliRunner

    from fastfill.cli import app
    from fastfill.components.experiment.inference import embed
    from fastfill.flows.upgrade import upgrade_flow

    params, tmp_path = upgrade_env
    params = in_layout(params, tmp_path, layout)
    _, old_model, new_model, old_version, new_version = registry_models(params)
    split = split_images(params)
    n = len(split.labels)
    names = _photos(tmp_path / "photos", split.images)
    lines = ["id,uri,label"] + [f"{1000 + i},{name},{label}" for i, (name, label) in enumerate(zip(names, split.labels))]
    (tmp_path / "photos" / "items.csv").write_text("\n".join(lines) + "\n")
    runner = CliRunner()
    store_uri = str(tmp_path / "adopted")
    common = ["--store", store_uri, "--params", str(tmp_path / "params.yaml")]

    # without --features the champion embeds the images where they are; relative URIs are under
    # the manifest's folder; the image shape comes from the model's registered signature
    result = runner.invoke(app, ["gallery", "adopt", "--manifest", str(tmp_path / "photos" / "items.csv"), *common])
    assert result.exit_code == 0 and f"{n} items adopted" in result.output, result.output
    gallery = gallery_at(open_store(store_uri))
    assert gallery.layout == layout
    assert gallery.adopted and gallery.image_root == str(tmp_path / "photos") and gallery.store.list("images/") == []
    np.testing.assert_allclose(gallery.all_features(gallery.model), embed(old_model, split.images), rtol=1e-5,
                               atol=1e-5)
    (tmp_path / "photos" / names[7]).unlink()  # gone since it was adopted

    tolerant = params.model_copy(update={"gallery": params.gallery.model_copy(update={
        "upgrade": params.gallery.upgrade.model_copy(update={"max_failed_images": 0.05})})})  # 3 of 72
    done = upgrade_flow(tolerant, store_uri, gate=False)
    assert done.state == "complete" and done.failed_images == 1
    record = gallery.store.get_json(f"upgrades/{done.upgrade_id}/finished.json")
    assert [(f["id"], f["reason"]) for f in record["failed_images"]["items"]] == [
        (1007, f"missing: no such file {tmp_path / 'photos' / names[7]}")]
    gallery.manifest(refresh=True)
    assert gallery.model.version == new_version
    final = gallery.all_features(gallery.model)
    keep = np.arange(n) != 7
    np.testing.assert_allclose(final[keep], embed(new_model, split.images[keep]), rtol=1e-5, atol=1e-5)

    # adopted with the current features (.npy shards); past max_failed_images the upgrade stops
    # and says so, status lists the failures, and the done chunks stay
    features = embed(old_model, split.images)
    np.save(tmp_path / "f0.npy", features[:25])
    np.save(tmp_path / "f1.npy", features[25:])
    strict_uri = str(tmp_path / "strict")
    result = runner.invoke(app, ["gallery", "adopt", "--manifest", str(tmp_path / "photos" / "items.csv"),
                                 "--features", str(tmp_path / "f0.npy"), "--features", str(tmp_path / "f1.npy"),
                                 "--model", f"models:/embedder/{old_version}", "--store", strict_uri,
                                 "--params", str(tmp_path / "params.yaml")])
    assert result.exit_code == 0, result.output
    for i in (3, 11, 19):
        (tmp_path / "photos" / names[i]).unlink()
    strict = params.model_copy(update={"gallery": params.gallery.model_copy(update={
        "upgrade": params.gallery.upgrade.model_copy(update={"max_failed_images": 2, "max_concurrency": 1})})})
    with pytest.raises(GalleryError, match=r"images could not be read or decoded, more than the 2"):
        upgrade_flow(strict, strict_uri, to_uri=f"models:/embedder/{new_version}", gate=False)
    state = gallery_status(gallery_at(open_store(strict_uri)))
    assert state.state == "paused" and state.upgrade.failed_images.count == 3
    assert {f["id"] for f in state.upgrade.failed_images.items} == {1003, 1011, 1019}


def test_an_upgrade_of_an_adopted_gallery_whose_images_are_all_gone_says_so_in_one_line(upgrade_env,
                                                                                       prefect_harness):
    """Every URI points nowhere: the upgrade stops at the map sample with one line (how many were
    tried, the first few and why, what to check) and exit code 6. It used to go on: on a gallery
    large enough for a checked map, to the map's validation split (which asked for
    validation_fraction 0.5 to be raised to 0.50); on this small one, re-embedded while planning,
    to the backfill's max_failed_images limit (which raising cannot help)."""
    from typer.testing import CliRunner

    from fastfill.cli import app
    from fastfill.cli.command_support import INPUT, outcome
    from fastfill.components.experiment.inference import embed
    from fastfill.flows.upgrade import upgrade_flow

    params, tmp_path = upgrade_env
    _, old_model, _, old_version, new_version = registry_models(params)
    split = split_images(params)
    names = _photos(tmp_path / "photos", split.images)
    lines = ["id,uri,label"] + [f"{1000 + i},{name},{label}" for i, (name, label) in enumerate(zip(names, split.labels))]
    (tmp_path / "photos" / "items.csv").write_text("\n".join(lines) + "\n")
    np.save(tmp_path / "features.npy", embed(old_model, split.images))
    store_uri = str(tmp_path / "adopted")
    result = CliRunner().invoke(app, ["gallery", "adopt", "--manifest", str(tmp_path / "photos" / "items.csv"),
                                      "--features", str(tmp_path / "features.npy"), "--model",
                                      f"models:/embedder/{old_version}", "--store", store_uri,
                                      "--params", str(tmp_path / "params.yaml")])
    assert result.exit_code == 0, result.output
    for shelf in range(3):  # every image gone since it was adopted
        shutil.rmtree(tmp_path / "photos" / f"shelf-{shelf}")

    from_gallery = params.model_copy(update={"gallery": params.gallery.model_copy(update={
        "upgrade": params.gallery.upgrade.model_copy(update={"map_pairs": "gallery"})})})
    with pytest.raises(GalleryError) as refused:
        upgrade_flow(from_gallery, store_uri, to_uri=f"models:/embedder/{new_version}", gate=False)
    message = str(refused.value)
    assert message.startswith("map sample: none of its "), message
    assert re.search(r"could be read \(shelf-\d/item-\d{5}\.png: missing: no such file /", message), message
    assert re.search(r"; and \d+ more\)", message) and "\n" not in message, message
    assert f"the gallery's image root {tmp_path / 'photos'}" in message and "validation_fraction" not in message
    assert outcome(refused.value) == (INPUT, message)
