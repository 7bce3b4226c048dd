"""Undoing upgrades for real (`fastfill upgrade abort`, `fastfill gallery rollback`: the tiny
pipeline's registry, a local store, Prefect runs through the test harness), the flows' readable
run names and parameters, and a registry watcher that starts no flow run when nothing changed."""

import json
import os
import time

import numpy as np
import pytest
import yaml

from fastfill.components.gallery.layouts.catalog import GalleryError
from fastfill.components.gallery.layouts.opening import gallery_at
from fastfill.components.gallery.search.index import GallerySearch
from fastfill.components.gallery.store import open_store
from fastfill.components.gallery.triggers.claims import claim, claimed
from fastfill.components.gallery.upgrade import garbage, planning, reversal
from fastfill.components.gallery.upgrade.status import gallery_status
from tests.integration.helpers import in_layout, layouts, registry_models, split_images


def _flow_run(flow_name: str):
    """The newest run of the flow named ``flow_name``, read back through the Prefect API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])),
                                     sort=FlowRunSort.START_TIME_DESC, limit=1)
    return runs[0]


def _logs(flow_run_id) -> list[str]:
    """Everything the run logged (its tasks included), as the Prefect API has it."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200)
    return [entry.message for entry in logs]


def _assert_readable(run, expected: dict) -> None:
    """Small parameters a person reads in the Prefect UI: the given values, not the configuration."""
    text = json.dumps(run.parameters)
    for key, value in expected.items():
        assert run.parameters[key] == value, (key, run.parameters)
    assert run.parameters.get("params") is None and "tracking_uri" not in text and len(text) < 600, text


def _finds_itself(gallery, model, params) -> None:
    """Each of the first items, embedded by ``model``, finds itself first: the gallery serves that
    model's features."""
    from fastfill.components.experiment.inference import embed

    searcher = GallerySearch(gallery)
    assert searcher.query_model.version == str(model_version(gallery)) and searcher.upgrade_id is None
    ids, _ = searcher.search(embed(model, split_images(params).images[:4]), k=1)
    assert list(ids[:, 0]) == [0, 1, 2, 3]


def model_version(gallery) -> str:
    return gallery.manifest(refresh=True)["model"]["version"]


@pytest.mark.parametrize("layout", layouts("parts", "lance"))
def test_abort_mid_backfill_serves_the_champion_and_the_same_upgrade_plans_again(layout, upgrade_env, prefect_harness):
    from typer.testing import CliRunner

    from fastfill.cli import app
    from fastfill.components.gallery.store.lock import UpgradeLocked, acquire_lock
    from fastfill.flows.deployments import upgrade_entry
    from fastfill.flows.ingest import ingest_flow
    from fastfill.flows.undo import abort_flow
    from fastfill.flows.upgrade import run_upgrade_file

    params, tmp_path = upgrade_env
    params = in_layout(params, tmp_path, layout)
    params_path = str(tmp_path / "params.yaml")
    client, old_model, _, old_version, new_version = registry_models(params)
    uri = str(tmp_path / "g")
    ingest_flow(store_uri=uri, params_path=params_path)  # the CLI's way: the file, not the configuration
    run = _flow_run("gallery-ingest")
    assert run.name == f"ingest into {uri} with champion"
    _assert_readable(run, {"store_uri": uri, "params_path": params_path})

    paused = upgrade_entry(params_path=params_path, store=uri, budget=0.4)  # what the deployment runs
    assert paused["state"] == "paused"
    entry_run = _flow_run("upgrade-gallery")  # the deployment's run tells what its upgrade did
    assert entry_run.state.name == "Paused" and entry_run.state.is_completed(), entry_run.state
    upgrade_run = _flow_run("gallery-upgrade")
    assert upgrade_run.name == f"upgrade {uri} to challenger"
    # stopped by its budget: the run did its work, and the upgrade is not over
    assert upgrade_run.state.name == "Paused" and upgrade_run.state.is_completed(), upgrade_run.state
    assert "(budget); run the same command to go on" in upgrade_run.state.message
    store = open_store(uri)
    gallery = gallery_at(store)
    assert gallery.layout == layout
    plan = planning.load_plan(store, paused["upgrade"])
    assert 0 < paused["items_done"] < plan.num_items

    held = acquire_lock(store, "another-upgrade", log=lambda m: None)  # a live process works on the gallery
    try:
        with pytest.raises(UpgradeLocked, match=f"cannot abort upgrade {plan.upgrade_id} now: .* is being upgraded: upgrade "
                                                f"another-upgrade by process {os.getpid()}"):
            abort_flow(params, uri)
    finally:
        held.release()
    assert gallery.manifest(refresh=True)["upgrade"] == plan.upgrade_id  # refused: nothing changed

    runner = CliRunner()
    args = ["--params", params_path, "--store", uri]
    result = runner.invoke(app, ["upgrade", "abort", *args])
    assert result.exit_code == 0, result.output
    assert f"aborted upgrade {plan.upgrade_id} to models:/embedder/{new_version} (backfilling: " in result.output
    assert f"the gallery serves models:/embedder/{old_version}'s features again" in result.output
    _assert_readable(_flow_run("gallery-upgrade-abort"), {"store_uri": uri, "params_path": params_path})
    assert _flow_run("gallery-upgrade-abort").name == f"abort the upgrade of {uri}"

    # the champion's features are served again, by a fresh search and in `upgrade status`
    assert gallery.manifest(refresh=True)["upgrade"] is None and model_version(gallery) == old_version
    _finds_itself(gallery, old_model, params)
    assert gallery_status(gallery).state == "idle"
    record = store.get_json(planning.upgrade_key(plan.upgrade_id, reversal.ABORTED))
    assert (record["items_done"], record["chunks"], record["stage"]) == (paused["items_done"], plan.num_chunks,
                                                                          "backfilling")
    assert record["by"]["pid"] == os.getpid() and record["to"] == f"models:/embedder/{new_version}"
    aborted_run = client.get_run(plan.mlflow_run_id)
    assert aborted_run.info.status == "KILLED" and "by " in aborted_run.data.tags["fastfill.aborted"]
    assert claimed(store, "embedder", new_version)["source"] == "abort"  # the watcher will not restart it

    result = runner.invoke(app, ["upgrade", "abort", *args])  # nothing left to abort
    assert result.exit_code != 0 and "is in progress" in result.output and "nothing to abort" in result.output

    assert garbage.collect_garbage(gallery)["upgrade_objects"] > 0  # its working data is garbage
    assert sorted(store.list(f"upgrades/{plan.upgrade_id}/")) == [planning.upgrade_key(plan.upgrade_id, reversal.ABORTED),
                                                         planning.plan_key(plan.upgrade_id)]

    # asked for again: planned from scratch (a new plan and MLflow run), then completed
    to = f"models:/embedder/{new_version}"
    done = run_upgrade_file(params, params_path, uri, to, overrides={"gallery.upgrade.chunk_size": 10})
    assert done.state == "complete" and done.items_done == plan.num_items
    again = planning.load_plan(store, plan.upgrade_id)
    assert again.mlflow_run_id != plan.mlflow_run_id and again.chunk_size == 10 and again.created >= plan.created
    assert reversal.aborted(store, plan.upgrade_id) is None and model_version(gallery) == new_version
    run = _flow_run("gallery-upgrade")
    assert run.name == f"upgrade {uri} to {to}"
    _assert_readable(run, {"store_uri": uri, "to_uri": to, "params_path": params_path,
                           "overrides": {"gallery.upgrade.chunk_size": 10}})
    assert any(f"upgrade {plan.upgrade_id} was aborted on {record['aborted']}" in line and "from scratch" in line
               for line in _logs(run.id))


@pytest.mark.parametrize("layout", layouts("parts"))
def test_rollback_of_a_finished_upgrade_and_not_once_gc_collected_the_old_features(layout, upgrade_env, prefect_harness):
    from typer.testing import CliRunner

    from fastfill.cli import app
    from fastfill.flows.ingest import ingest_flow
    from fastfill.flows.undo import rollback_flow
    from fastfill.flows.upgrade import upgrade_flow

    params, tmp_path = upgrade_env
    params = in_layout(params, tmp_path, layout)
    params_path = str(tmp_path / "params.yaml")
    client, old_model, new_model, old_version, new_version = registry_models(params)
    client.delete_registered_model(params.mlflow.alignment_model)  # the upgrade trains its map
    name = params.mlflow.registered_model
    uri = str(tmp_path / "g")
    ingest_flow(params, uri)
    store = open_store(uri)
    gallery = gallery_at(store)
    assert gallery.layout == layout
    champion = gallery.model
    before = gallery.all_features(champion)

    state = upgrade_flow(params, uri, return_state=True)
    first = state.result()
    assert first.state == "complete" and model_version(gallery) == new_version
    assert str(client.get_model_version_by_alias(name, "champion").version) == new_version
    # the map trained inside the upgrade talked, through the flow's logger, every epoch
    lines = _logs(state.state_details.flow_run_id)
    epochs = [line for line in lines if line.startswith("epoch ")]
    assert epochs and all("loss " in line for line in epochs), lines
    assert any("held out: l2" in line and "top-1" in line for line in epochs), epochs
    assert any(line.startswith("training ") and " epochs of " in line for line in lines)

    runner = CliRunner()
    args = ["--params", params_path, "--store", uri]
    result = runner.invoke(app, ["upgrade", "abort", *args])  # finished: too late to abort
    assert result.exit_code != 0
    assert "finished on" in result.output and "a finished upgrade cannot be aborted" in result.output
    assert "fastfill gallery rollback" in result.output

    result = runner.invoke(app, ["gallery", "rollback", *args])
    assert result.exit_code == 0, result.output
    assert (f"rolled back from models:/embedder/{new_version} to models:/embedder/{old_version}; champion moved back"
            in result.output)
    assert model_version(gallery) == old_version and gallery.manifest()["history"][-1]["by"] == "rollback"
    np.testing.assert_array_equal(gallery_at(store).all_features(champion), before)
    _finds_itself(gallery, old_model, params)
    assert str(client.get_model_version_by_alias(name, "champion").version) == old_version
    tags = client.get_model_version(name, new_version).tags
    assert tags["promotion"] == "rolled-back" and tags["promotion.rolled_back_to"] == old_version
    assert client.get_run(first.mlflow_run_id).data.tags["promotion"] == "rolled-back"
    assert store.get_json(planning.upgrade_key(first.upgrade_id, reversal.ROLLED_BACK))["registry_recorded"]
    assert claimed(store, name, new_version) is not None  # neither the watcher nor the webhook starts it again
    assert _flow_run("gallery-rollback").name == f"roll back {uri}"
    with pytest.raises(GalleryError, match="already a rollback"):
        rollback_flow(params, uri)

    # the same version again, by hand: planned from scratch, complete; then gc; then no rollback
    again = upgrade_flow(params, uri, f"models:/{name}/{new_version}")
    assert again.state == "complete" and again.mlflow_run_id != first.mlflow_run_id
    assert model_version(gallery) == new_version
    assert str(client.get_model_version_by_alias(name, "champion").version) == new_version
    garbage.collect_garbage(gallery)
    result = runner.invoke(app, ["gallery", "rollback", *args])
    assert result.exit_code != 0
    assert "the old features were collected" in result.output and "Re-ingest the gallery" in result.output
    assert model_version(gallery) == new_version
    assert str(client.get_model_version_by_alias(name, "champion").version) == new_version


# ---- the registry watcher ------------------------------------------------------------------------


@pytest.fixture
def watched(tmp_path, monkeypatch, prefect_harness):
    """A registry (SQLite) with embedder versions 1-3, champion and challenger on 1; a gallery on
    version 1; params.yaml; and the upgrade and poll deployments on the harness's Prefect API (no
    process serves them: a started run stays scheduled, to be counted)."""
    from fastfill.components.gallery.layouts.catalog import ingest
    from fastfill.components.platform import registry
    from fastfill.components.platform.config import parse_params
    from fastfill.components.platform.registry import ModelRef
    from fastfill.flows.deployments import upgrade_entry, watch_flow
    from testkit.tiny_demo import tiny_params

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    data = tiny_params(tmp_path)
    data["mlflow"]["tracking_uri"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    uri = str(tmp_path / "gallery")
    data["gallery"] = {"store": uri, "upgrade": {"map_pairs": "splits"}}
    params_path = tmp_path / "params.yaml"
    params_path.write_text(yaml.safe_dump(data))
    params = parse_params(data)
    client, _ = registry.setup(params.mlflow)
    client.create_registered_model("embedder")
    for _ in range(3):
        client.create_model_version("embedder", source=str(tmp_path / "unused"))
    client.set_registered_model_alias("embedder", "champion", "1")
    client.set_registered_model_alias("embedder", "challenger", "1")
    rng = np.random.default_rng(0)
    ingest(open_store(uri), rng.integers(0, 256, (12, 1, 8, 8), dtype=np.uint8),
           rng.normal(size=(12, 4)).astype(np.float32), ModelRef("embedder", "1", 4), part_size=6)
    parameters = {"params_path": str(params_path)}
    upgrade_id = upgrade_entry.to_deployment(name="upgrade", parameters=parameters).apply()
    poll_id = watch_flow.to_deployment(name="poll", parameters=parameters).apply()
    yield params, str(params_path), uri, client, upgrade_id, poll_id
    # the harness's server is shared by the whole session: later tests expect no deployments there
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as prefect:
        for deployment in (upgrade_id, poll_id):
            for run in prefect.read_flow_runs(deployment_filter=_deployment_is(deployment)):
                prefect.delete_flow_run(run.id)
            prefect.delete_deployment(deployment)


def _deployment_is(deployment_id):
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    return DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))


def _runs_of(deployment_id=None) -> int:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with get_client(sync_client=True) as client:
        if deployment_id is None:
            return client.count_flow_runs()
        return client.count_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))


def test_the_watcher_starts_no_flow_run_until_the_challenger_moves(watched):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    from fastfill.services.registry_watcher import RegistryWatcher

    params, params_path, uri, client, upgrade_id, poll_id = watched
    said: list[str] = []
    watcher = RegistryWatcher(params, params_path, uri, interval=0.05, say=said.append)
    before = _runs_of()
    watcher.start()
    deadline = time.monotonic() + 60
    while watcher.ticks < 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    watcher.stop()
    assert watcher.ticks >= 8
    assert _runs_of() == before  # eight checks, nothing changed: not one flow run of any kind
    assert watcher.last == {"started": False, "reason": "the gallery is already on version 1"}
    assert len(said) == 1  # the reason is said once, not once per check

    # a process that stopped between its claim and its start (a webhook receiver killed mid-start)
    # left the claim "starting": the next check starts the version anyway, once
    claim(open_store(uri), "embedder", "2", "webhook", starting=True)
    client.set_registered_model_alias("embedder", "challenger", "2")
    started = watcher.tick()
    assert started["started"] and started["version"] == "2"
    assert claimed(open_store(uri), "embedder", "2")["flow_run_id"] == started["flow_run_id"]
    for _ in range(5):  # claimed: later checks start nothing more
        assert not watcher.tick()["started"]
    assert _runs_of() == before + 1 and _runs_of(upgrade_id) == 1
    with get_client(sync_client=True) as prefect:
        run = prefect.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[upgrade_id])))[0]
    assert str(run.id) == started["flow_run_id"]
    assert run.name == f"upgrade {uri} to models:/embedder/2"
    assert run.parameters == {"params_path": params_path, "store": uri, "to": "models:/embedder/2"}
    assert claimed(open_store(uri), "embedder", "2")["source"] == "registry-watcher"

    # that run ends cancelled before the gallery started upgrading (a lost concurrency slot, a
    # person in the UI): the next check starts the version again, once, as a new attempt
    from prefect.states import Cancelled

    with get_client(sync_client=True) as prefect:
        prefect.set_flow_run_state(run.id, Cancelled(message="Deployment concurrency slot lost"), force=True)
    again = watcher.tick()
    assert again["started"] and again["flow_run_id"] != started["flow_run_id"], again
    assert claimed(open_store(uri), "embedder", "2")["attempt"] == 2
    assert not watcher.tick()["started"]  # the new run is scheduled, not ended: claimed
    assert _runs_of(upgrade_id) == 2

    # the poll deployment paused in the UI pauses the checks; resumed, the next one starts version 3
    with get_client(sync_client=True) as prefect:
        prefect.pause_deployment(poll_id)
    client.set_registered_model_alias("embedder", "challenger", "3")
    assert watcher.tick()["paused"] and _runs_of(upgrade_id) == 2
    with get_client(sync_client=True) as prefect:
        prefect.resume_deployment(poll_id)
    assert watcher.tick()["started"] and _runs_of(upgrade_id) == 3
