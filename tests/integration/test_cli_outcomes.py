"""What a command says and how it ends, run as a user runs it (the `fastfill` executable in a
subprocess): a known failure is one `error:` line and an exit code of its kind (2 usage, 5 a
service, 6 bad input), never a traceback; services are checked up front, so an unreachable one
ends the command in seconds; a gate rejection exits 3 and its flow run ends in the state
"Rejected" with the event fastfill.upgrade.rejected; `fastfill status` and `fastfill doctor`."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fastfill.components.gallery.store import open_store
from tests.integration.helpers import registry_models

FASTFILL = str(Path(sys.executable).with_name("fastfill"))


def _run(args: list[str], env: dict, cwd: Path, timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = subprocess.run([FASTFILL, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return result, time.monotonic() - started


def _error_line(result: subprocess.CompletedProcess, code: int, *fragments: str) -> str:
    """The exit code is ``code``, there is no traceback, and stderr has exactly one `error:` line
    (holding ``fragments``); returns it."""
    both = result.stdout + result.stderr
    assert result.returncode == code, both[-3000:]
    assert "Traceback" not in both and "╭─" not in both, both[-3000:]  # neither Python's nor rich's
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def prefect_env(cli_env, prefect_harness) -> dict:
    """The CLI's environment pointed at the tests' Prefect server (no temporary server per command,
    and its flow runs can be read afterwards)."""
    from prefect.settings import get_current_settings

    return {**cli_env, "PREFECT_API_URL": get_current_settings().api.url}


def _snapshot(store) -> dict:
    return {key: store.get(key) for key in store.list("")}


def test_a_bad_option_is_a_usage_error_naming_the_option(tiny_workdir, cli_env):
    result, _ = _run(["upgrade", "--concurrency", "0", "--order", "bogus", "--dry-run"], cli_env, tiny_workdir)
    assert result.returncode == 2 and "Traceback" not in result.stdout + result.stderr
    assert "validation error for" not in result.stderr  # pydantic's own wording, which named no option
    assert "gallery.upgrade.max_concurrency: Input should be greater than 0 (got 0); set by --concurrency" in result.stderr
    assert ("gallery.upgrade.order: Input should be 'sigma', 'random', 'usage' or 'usage_sigma' (got 'bogus'); "
            "set by --order") in result.stderr
    result, _ = _run(["upgrade", "--budget", "2x"], cli_env, tiny_workdir)
    _error_line(result, 2, "--budget '2x'")
    result, _ = _run(["upgrade", "--chunk-size", "many"], cli_env, tiny_workdir)  # refused by the parser itself
    assert result.returncode == 2 and "Invalid value for '--chunk-size'" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr


# Unbounded, MLflow's and Prefect's own retries take minutes (MLflow: about 270 s); the commands
# cap them at about 15 s. The bound leaves room for a busy machine (a loaded 2-core run measured
# 23 s for the Prefect check, whose own retries are part of it) and still tells the two apart.
QUICK = 60


def test_an_unreachable_service_ends_the_command_in_seconds_with_one_line(s3_endpoint, tiny_workdir, prefect_env):
    """Each service down, the command that needs it first: the MLflow server, the Prefect API, the
    S3 endpoint (the slow test below: the other commands and ways of being unreachable)."""
    closed = _closed_port()
    # the MLflow server: nothing listens on the port
    env = {**prefect_env, "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{closed}"}
    result, seconds = _run(["upgrade"], env, tiny_workdir)
    _error_line(result, 5, f"cannot reach the MLflow tracking server at http://127.0.0.1:{closed}",
                "check that the server is running")
    assert seconds < QUICK, seconds

    # the Prefect API
    env = {**prefect_env, "PREFECT_API_URL": f"http://127.0.0.1:{closed}/api"}
    result, seconds = _run(["gallery", "ingest"], env, tiny_workdir)
    _error_line(result, 5, f"cannot reach the Prefect API at http://127.0.0.1:{closed}/api", "prefect server start")
    assert seconds < QUICK, seconds

    # the S3 endpoint: nothing listens
    env = {**prefect_env, "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{closed}"}
    result, seconds = _run(["upgrade", "--store", "s3://some-bucket/g"], env, tiny_workdir)
    _error_line(result, 5, "s3://some-bucket/g: cannot connect to the S3 endpoint")
    assert seconds < QUICK, seconds


@pytest.mark.slow  # five more commands: about a minute on 2 cores
def test_a_silent_server_and_a_missing_bucket_end_the_command_in_seconds_too(s3_endpoint, tiny_workdir, prefect_env):
    closed = _closed_port()
    env = {**prefect_env, "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{closed}"}
    result, _ = _run(["gallery", "ingest"], env, tiny_workdir)
    _error_line(result, 5, "cannot reach the MLflow tracking server")

    # the MLflow server: the port accepts connections but nothing ever answers
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        env = {**prefect_env, "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{silent.getsockname()[1]}"}
        result, seconds = _run(["upgrade"], env, tiny_workdir)
    _error_line(result, 5, "did not answer within 5 s")
    assert seconds < QUICK, seconds

    # a bucket that does not exist
    result, _ = _run(["gallery", "ingest", "--store", "s3://no-such-bucket-here/g"], prefect_env, tiny_workdir)
    _error_line(result, 5, "bucket 'no-such-bucket-here' does not exist")
    result, _ = _run(["status", "--store", "s3://no-such-bucket-here/g"], prefect_env, tiny_workdir)
    _error_line(result, 5, "bucket 'no-such-bucket-here' does not exist")


def _ingested(upgrade_env):
    """A gallery ingested for the commands: (params, tmp_path, its store, a snapshot of the store,
    the commands' --params/--store arguments, champion version, challenger version)."""
    from fastfill.flows.ingest import ingest_flow

    params, tmp_path = upgrade_env
    uri = str(tmp_path / "g")
    ingest_flow(params, uri)
    _, _, _, old_version, new_version = registry_models(params)
    store = open_store(uri)
    args = ["--params", str(tmp_path / "params.yaml"), "--store", uri]
    return params, tmp_path, store, _snapshot(store), args, old_version, new_version


def test_bad_input_exits_6_and_a_paused_upgrade_shows_in_status(upgrade_env, prefect_env):
    _, tmp_path, store, before, args, old_version, new_version = _ingested(upgrade_env)

    result, _ = _run(["upgrade", *args, "--to", "models:/embedder/999"], prefect_env, tmp_path)
    _error_line(result, 6, "unknown model 'models:/embedder/999'", f"champion -> v{old_version}")
    result, _ = _run(["upgrade", *args, "--store", str(tmp_path / "nothing")], prefect_env, tmp_path)
    _error_line(result, 6, f"no gallery at {tmp_path / 'nothing'}", "fastfill gallery ingest")
    result, _ = _run(["gallery", "ingest", *args], prefect_env, tmp_path)  # a second ingest into the same place
    _error_line(result, 6, "already holds a gallery")
    assert _snapshot(store) == before

    # a paused upgrade, as `fastfill status` shows it
    result, _ = _run(["upgrade", *args, "--budget", "25%", "--no-progress"], prefect_env, tmp_path)
    assert result.returncode == 0 and result.stdout.startswith("paused: "), result.stdout + result.stderr[-3000:]
    result, _ = _run(["status", *args], prefect_env, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    lines = {line.split()[0]: line.split(None, 1)[1] for line in result.stdout.splitlines()}
    upgrade = f"embedder-v{old_version}-to-embedder-v{new_version}"
    assert lines["upgrade"].startswith(f"paused: {upgrade} (models:/embedder/{old_version} -> models:/embedder/"
                                       f"{new_version}, "), lines["upgrade"]
    assert lines["upgrade"].endswith(" order), 3/9 chunks, 24/72 items (33.3%)"), lines["upgrade"]
    assert lines["gate"] == "no promotion decision recorded in this gallery"
    assert "experiment " in lines["mlflow"] and "run " in lines["mlflow"]
    assert lines["prefect"].endswith(", Paused)"), lines["prefect"]  # its flow run says it is not over


@pytest.mark.slow  # three more commands: about a minute on 2 cores
def test_nothing_to_upgrade_exits_0_and_says_why(upgrade_env, prefect_env):
    params, tmp_path, store, before, args, old_version, _ = _ingested(upgrade_env)

    result, _ = _run(["upgrade", *args, "--to", f"models:/embedder/{old_version}", "--no-progress"], prefect_env,
                     tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.strip().splitlines() == [
        f"up-to-date: the gallery is already built with models:/embedder/{old_version}; nothing to upgrade"]
    assert _snapshot(store) == before

    # no challenger (the convention clears it once its version is promoted) and nothing in progress
    from fastfill.components.platform import registry

    client, _ = registry.setup(params.mlflow)
    client.delete_registered_model_alias("embedder", "challenger")
    said = (f"embedder has no `challenger` (champion is version {old_version}, which the gallery serves); nothing to "
            "upgrade. Set the alias `challenger` on a new version, or pass --to models:/embedder/VERSION")
    result, _ = _run(["upgrade", *args, "--no-progress"], prefect_env, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.strip().splitlines() == [f"up-to-date: {said}"]
    result, _ = _run(["upgrade", *args, "--dry-run"], prefect_env, tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == f"dry run: nothing written. {said}", result.stdout
    assert _snapshot(store) == before


def _worse_version(params) -> str:
    """A further embedder version that knows nothing (same architecture, untrained, its embedding
    layer zeroed: every image gets the same feature; an untrained network alone still sorts these
    synthetic images better than the tiny champion), registered without an alias: the gate
    rejects it."""
    import torch

    from fastfill.components.experiment.models import Embedder
    from fastfill.components.model_store import registered
    from fastfill.components.platform import registry
    from fastfill.components.platform.config import TrainConfig

    _, _, new_model, _, _ = registry_models(params)
    torch.manual_seed(3)
    fresh = Embedder(TrainConfig(backbone="cnn", width=4, embedding_dim=16), new_model.in_channels,
                     new_model.classes.tolist(), float(new_model.pixel_mean), float(new_model.pixel_std)).eval()
    client, experiment = registry.setup(params.mlflow)
    run = client.create_run(experiment, run_name="register")
    example = np.zeros((1, fresh.in_channels, 16, 16), np.float32)
    with torch.no_grad():
        fresh.embedding.weight.zero_()
        version = registered.register_embedder(client, run.info.run_id, fresh, example,
                                               params.mlflow.registered_model, None, {"role": "new"})
    return str(version)


def _upgrade_runs(uri: str) -> list:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["gallery-upgrade"])))
    return [run for run in runs if (run.parameters.get("store_uri") or run.parameters.get("store")) == uri]


def _events(name: str, flow_run_id, as_resource: bool = False) -> list[dict]:
    """The events called ``name`` about the flow run (its resource, or one of its related ones)."""
    from prefect import get_client

    about = {"resource" if as_resource else "related": {"id": [f"prefect.flow-run.{flow_run_id}"]}}
    with get_client(sync_client=True) as client:
        for _ in range(20):  # the server stores events a moment after they arrive
            answer = client.request("POST", "/events/filter", json={
                "filter": {"event": {"name": [name]}, **about}, "limit": 10})
            events = answer.json()["events"]
            if events:
                return events
            time.sleep(0.5)
    return []


@pytest.mark.slow  # two minutes on 2 cores; the exit code 3 of a rejection is test_cli_json's too
def test_a_rejected_upgrade_exits_3_in_a_rejected_flow_run_and_status_and_doctor_show_it(s3_endpoint, upgrade_env,
                                                                                         prefect_env):
    from fastfill.components.platform import registry
    from fastfill.flows.ingest import ingest_flow

    params, tmp_path = upgrade_env
    worse = _worse_version(params)
    uri = str(tmp_path / "gallery")  # gallery.store of this params.yaml
    ingest_flow(params, uri)
    _, _, _, old_version, new_version = registry_models(params)
    args = ["--params", str(tmp_path / "params.yaml"), "--store", uri]

    result, seconds = _run(["upgrade", *args, "--to", f"models:/embedder/{worse}", "--gate", "--no-progress"],
                           prefect_env, tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 3, output[-3000:]
    assert "Traceback" not in output and "promotion gate: REJECTED" in result.stdout
    print(f"\nrejected upgrade: {seconds:.0f} s")

    # Prefect: the flow run ended in the state named Rejected, and the event names it
    runs = _upgrade_runs(uri)
    assert len(runs) == 1, [(r.name, r.parameters) for r in runs]
    run = runs[0]
    assert run.state.name == "Rejected" and run.state.is_completed(), run.state
    assert f"models:/embedder/{worse} rejected by the promotion gate" in run.state.message
    assert len(_events("prefect.flow-run.Rejected", run.id, as_resource=True)) == 1  # the server's own event
    events = _events("fastfill.upgrade.rejected", run.id)
    assert len(events) == 1, events
    assert events[0]["resource"]["prefect.resource.id"] == f"fastfill.gallery.{uri}"
    payload = events[0]["payload"]
    assert payload["model"] == f"models:/embedder/{worse}" and payload["reasons"], payload

    # status: the gallery, no upgrade, the decision and where it is recorded, links to both runs
    result, _ = _run(["status", *args], prefect_env, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    print(f"fastfill status:\n{result.stdout}")
    lines = {line.split()[0]: line.split(None, 1)[1] for line in result.stdout.splitlines() if line.strip()}
    assert lines["gallery"] == f"{uri}: 72 items, model models:/embedder/{old_version}", result.stdout
    assert lines["upgrade"] == "none in progress"
    assert lines["gate"].startswith("rejected on ") and f"models:/embedder/{worse} against champion " \
        f"models:/embedder/{old_version}: " in lines["gate"], lines["gate"]
    assert lines["registry"] == f"embedder v{worse}: promotion=rejected"
    assert f"run {payload['mlflow_run_id']} in sqlite:///{tmp_path / 'mlflow.db'}" in lines["mlflow"], lines["mlflow"]
    assert lines["prefect"].endswith(f"/runs/flow-run/{run.id} ({run.name}, Rejected)"), lines["prefect"]
    assert lines["trigger"].startswith(f"embedder v{new_version} (challenger) waits: no upgrade"), lines["trigger"]

    # a claim of the challenger whose flow run ended cancelled before the gallery started upgrading
    # (a deployment's lost concurrency slot): status says so, and that the next check starts it again
    from prefect import get_client
    from prefect.states import Cancelled

    from fastfill.components.gallery.store import open_store
    from fastfill.components.gallery.triggers.claims import claim, record_start, release

    claim(open_store(uri), "embedder", new_version, "registry-watcher", starting=True)
    record_start(open_store(uri), "embedder", new_version, "registry-watcher", str(run.id))
    with get_client(sync_client=True) as prefect:
        prefect.set_flow_run_state(run.id, Cancelled(message="Deployment concurrency slot lost"), force=True)
    result, _ = _run(["status", *args], prefect_env, tmp_path)
    trigger = next(line for line in result.stdout.splitlines() if line.startswith("trigger"))
    assert "claimed by registry-watcher on " in trigger and f"its flow run {run.id} ended cancelled" in trigger, trigger
    assert "the next registry check starts it again" in trigger
    release(open_store(uri), "embedder", new_version)

    # doctor: what is set up passes; the optional parts not set up here (no deployments served, no
    # webhook registered) are "--", not failures; a bad store FAILs and says what to do
    env = {**prefect_env, "FASTFILL_WEBHOOK_SECRET": "s3cret"}
    result, _ = _run(["doctor", *args], env, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    print(f"fastfill doctor:\n{result.stdout}")
    checks = [line.split()[:2] for line in result.stdout.splitlines()]
    assert checks == [["ok", "tracking"], ["ok", "registry"], ["ok", "store"], ["--", "prefect"], ["--", "webhook"]]
    report = {line.split()[1]: line for line in result.stdout.splitlines()}
    assert "no deployment upgrade-gallery/upgrade" in report["prefect"] and "fastfill serve" in report["prefect"]
    assert "no webhook is registered" in report["webhook"] and "fastfill webhook register" in report["webhook"]
    assert f"embedder: champion -> v{old_version}, challenger -> v{new_version}" in result.stdout
    assert f"{uri}: 72 items, model models:/embedder/{old_version}, idle" in result.stdout
    assert "FASTFILL_WEBHOOK_SECRET is set" in result.stdout and "s3cret" not in result.stdout
    # the challenger that the gate rejected is named as such, with what to do
    client, _ = registry.setup(params.mlflow)
    client.set_registered_model_alias("embedder", "challenger", worse)
    result, _ = _run(["doctor", *args], env, tmp_path)
    report = {line.split()[1]: line for line in result.stdout.splitlines()}
    assert f"challenger -> v{worse} (v{worse} was rejected by the promotion gate: " in report["registry"], report
    assert report["registry"].startswith("ok") and "register a better version" in report["registry"]
    client.set_registered_model_alias("embedder", "challenger", new_version)

    env.pop("FASTFILL_WEBHOOK_SECRET")
    closed = _closed_port()
    result, seconds = _run(["doctor", *args[:2], "--store", "s3://some-bucket/g"],
                           {**env, "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{closed}"}, tmp_path)
    assert result.returncode == 5 and "Traceback" not in result.stdout + result.stderr, result.stdout + result.stderr
    print(f"fastfill doctor, a bad store and no secret ({seconds:.0f} s):\n{result.stdout}")
    report = {line.split()[1]: line for line in result.stdout.splitlines()}
    assert report["store"].startswith("FAIL") and "cannot connect to the S3 endpoint" in report["store"]
    assert report["webhook"].startswith("--") and "no webhook registered and no secret" in report["webhook"]
    assert all(report[name].startswith("ok") for name in ("tracking", "registry")), result.stdout
    assert seconds < 60, seconds  # a retry loop against the closed port would take minutes; a loaded 2-core machine took 38 s


def test_doctor_and_status_without_a_registry_or_a_gallery(tiny_workdir, cli_env):
    (tiny_workdir / "empty").mkdir()
    env = {**cli_env, "FASTFILL_WEBHOOK_SECRET": "x"}
    env.pop("PREFECT_API_URL", None)
    result, _ = _run(["doctor", "--store", "empty"], env, tiny_workdir)
    assert result.returncode == 5 and "Traceback" not in result.stdout + result.stderr, result.stdout + result.stderr
    report = {line.split()[1]: line for line in result.stdout.splitlines()}
    assert report["tracking"].startswith("FAIL") and f"no MLflow store at {tiny_workdir / 'mlflow.db'}" in \
        report["tracking"] and "fastfill model register" in report["tracking"]  # not the repository: a team's advice
    assert not (tiny_workdir / "mlflow.db").exists()  # the check created nothing
    assert report["registry"].startswith("FAIL")
    assert report["store"].startswith("--") and "holds no gallery yet" in report["store"]
    assert "fastfill gallery ingest" in report["store"]
    assert report["prefect"].startswith("--") and "PREFECT_API_URL is not set" in report["prefect"]
    assert report["webhook"].startswith("--")
    result, _ = _run(["status", "--store", "empty"], env, tiny_workdir)  # no gallery: how to make one
    assert result.returncode == 5 and "Traceback" not in result.stdout + result.stderr, result.stdout + result.stderr
    lines = {line.split()[0]: line.split(None, 1)[1] for line in result.stdout.splitlines() if line.strip()}
    assert lines["gallery"].startswith("no gallery at ") and "fastfill gallery ingest" in lines["gallery"]
    assert lines["registry"].startswith("unavailable: no MLflow store")
    assert os.listdir(tiny_workdir / "empty") == []
