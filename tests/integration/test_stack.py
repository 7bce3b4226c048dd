"""End to end on real services: infra/local-stack.sh starts an S3 endpoint, an MLflow server
(SQLite, artifacts in S3, webhooks) and a Prefect server; `fastfill serve` serves the
deployments and `fastfill webhook serve` receives MLflow's webhooks. Registering a model version
with the alias `challenger` is all a platform team does; the tests check what follows."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml

from testkit.process_state import restored_environ, stop_group
from testkit.tiny_demo import tiny_params

pytestmark = pytest.mark.slow  # minutes on 2 cores; `-m 'not slow'` skips them

ROOT = Path(__file__).resolve().parents[2]
FASTFILL = str(Path(sys.executable).with_name("fastfill"))
STORE = "s3://gallery/e2e"
# the registry watcher's interval (triggers.poll_seconds): a check is one registry read, no flow run
POLL_SECONDS = 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _read_env(path: Path) -> dict:
    out = {}
    for line in path.read_text().splitlines():
        if line.startswith("export "):
            key, value = line[len("export "):].split("=", 1)
            out[key] = value
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    directory = tmp_path_factory.mktemp("stack")
    env = {**os.environ, "FASTFILL_STACK_DIR": str(directory), "FASTFILL_S3_PORT": str(_free_port()),
           "FASTFILL_MLFLOW_PORT": str(_free_port()), "FASTFILL_PREFECT_PORT": str(_free_port()),
           "FASTFILL_VENV": str(Path(sys.executable).parent.parent)}
    script = str(ROOT / "infra" / "local-stack.sh")
    started = subprocess.run([script, "start"], env=env, capture_output=True, text=True, timeout=300)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        yield _read_env(directory / "env")
    finally:
        subprocess.run([script, "stop"], env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def platform(stack, tiny_pipeline, tmp_path_factory):
    """The stack plus: v1 registered as champion, a gallery in S3 built with it, `fastfill serve`
    and the webhook receiver running, the webhook registered with MLflow."""
    _, _, pipeline_dir = tiny_pipeline
    workdir = tmp_path_factory.mktemp("platform")
    data = tiny_params(Path("unused"))
    data["paths"] = {"data": str(pipeline_dir / "data"), "artifacts": str(workdir / "artifacts"),
                     "reports": str(workdir / "reports")}
    data["mlflow"]["tracking_uri"] = stack["MLFLOW_TRACKING_URI"]
    data["gallery"] = {"store": STORE, "part_size": 20,  # the split's pairs: the pipeline's maps passed on them
                       "upgrade": {"chunk_size": 8, "eval_queries": "all", "map_pairs": "splits"}}
    # tiny models on tiny data are a small upgrade (top-1 along the backfill about 19 points below
    # the old model's, 36% negative flips on 72 queries); a broken model is far worse on every gate
    data["promotion"] = {"gate": True, "min_top1_auc_gain": -0.4, "max_nfr1": 0.6, "max_relative_nfr1": 10.0,
                         "max_fraction_to_gain": 1.0}
    webhook_port = _free_port()
    data["triggers"] = {"poll_seconds": POLL_SECONDS, "webhook_port": webhook_port, "nightly_cron": None,
                        "comparison_cron": None}
    params_path = workdir / "params.yaml"
    params_path.write_text(yaml.safe_dump(data))
    env = {**os.environ, **stack, "PREFECT_HOME": str(workdir / "prefect-home")}
    env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)

    _register(stack, pipeline_dir / "artifacts" / "models" / "old" / "model.pt", alias="champion")
    ingest = subprocess.run([FASTFILL, "gallery", "ingest", "-p", str(params_path)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert ingest.returncode == 0, ingest.stdout + ingest.stderr

    logs = {name: open(workdir / f"{name}.log", "w") for name in ("serve", "webhook")}
    processes = {
        "serve": subprocess.Popen([FASTFILL, "serve", "-p", str(params_path)], cwd=ROOT, env=env,
                                  stdout=logs["serve"], stderr=subprocess.STDOUT, start_new_session=True),
        "webhook": subprocess.Popen([FASTFILL, "webhook", "serve", "-p", str(params_path)], cwd=ROOT, env=env,
                                    stdout=logs["webhook"], stderr=subprocess.STDOUT, start_new_session=True),
    }
    try:
        _wait(lambda: _http_ok(f"http://127.0.0.1:{webhook_port}/health"), 120, "the webhook receiver", workdir)
        _wait(lambda: len(_deployments(stack)) >= 2, 180, "the served deployments", workdir)
        register = subprocess.run([FASTFILL, "webhook", "register", "-p", str(params_path),
                                   "--url", f"http://127.0.0.1:{webhook_port}/"], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=120)
        assert register.returncode == 0, register.stdout + register.stderr
        yield {"params": params_path, "env": env, "workdir": workdir, "processes": processes,
               "pipeline": pipeline_dir}
    finally:
        for process in processes.values():
            stop_group(process, timeout=30)
        for handle in logs.values():
            handle.close()


def _client(stack):
    from mlflow import MlflowClient

    uri = stack["MLFLOW_TRACKING_URI"]
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _register(stack, model_or_path, alias: str | None, tags: dict | None = None) -> str:
    """Register an embedder version on the stack's MLflow server, as a platform team would."""
    import mlflow

    from fastfill.components.experiment.models import load_embedder
    from fastfill.components.model_store import registered

    model = load_embedder(model_or_path) if isinstance(model_or_path, Path) else model_or_path
    uri = stack["MLFLOW_TRACKING_URI"]
    with restored_environ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):  # mlflow.set_*_uri export them
        mlflow.set_tracking_uri(uri)
        mlflow.set_registry_uri(uri)
        client = _client(stack)
        experiment = client.get_experiment_by_name("platform") or client.get_experiment(
            client.create_experiment("platform"))
        with mlflow.start_run(experiment_id=experiment.experiment_id) as run:
            return registered.register_embedder(client, run.info.run_id, model.eval(),
                                              np.zeros((1, 1, 16, 16), np.float32), "embedder", alias, tags or {})


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3):
            return True
    except Exception:  # noqa: BLE001 - not up yet
        return False


def _api(stack, path: str, body: dict) -> list:
    request = urllib.request.Request(stack["PREFECT_API_URL"] + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        data = response.read()
    return json.loads(data) if data else []


def _deployments(stack) -> dict:
    try:
        return {d["name"]: d for d in _api(stack, "/deployments/filter", {})}
    except Exception:  # noqa: BLE001 - the server may still be starting
        return {}


def _upgrade_runs(stack) -> list:
    deployment = _deployments(stack)["upgrade"]
    return _api(stack, "/flow_runs/filter", {"deployments": {"id": {"any_": [deployment["id"]]}}})


def _wait(check, seconds: float, what: str, workdir: Path) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if check():
            return
        time.sleep(1)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(workdir.glob("*.log")))
    pytest.fail(f"{what} did not happen within {seconds:.0f} s\n{logs}")


def _gallery(stack):
    from fastfill.components.gallery.layouts.catalog import PartsGallery
    from fastfill.components.gallery.store import open_store

    with restored_environ(*stack):
        os.environ.update(stack)
        store = open_store(STORE)
        return PartsGallery(store), store.get_json("gallery.json")


def _champion(stack) -> str:
    return str(_client(stack).get_model_version_by_alias("embedder", "champion").version)


def _set_paused(stack, deployment: str, paused: bool) -> None:
    target = _deployments(stack)[deployment]["id"]
    action = "pause_deployment" if paused else "resume_deployment"
    _api(stack, f"/deployments/{target}/{action}", {})


def test_a_registered_challenger_is_upgraded_and_promoted_by_the_webhook(stack, platform):
    """The watcher is paused: the webhook's delivery starts this upgrade."""
    client = _client(stack)
    _set_paused(stack, "poll", True)
    time.sleep(15)  # a poll already running when the pause came finishes first
    v1 = _champion(stack)
    v2 = _register(stack, platform["pipeline"] / "artifacts" / "models" / "new" / "model.pt", alias="challenger")

    _wait(lambda: _champion(stack) == v2, 300, f"champion moving to version {v2}", platform["workdir"])

    _wait(lambda: [r["state"]["type"] for r in _upgrade_runs(stack)] == ["COMPLETED"], 120,
          "the upgrade's flow run completing", platform["workdir"])
    runs = _upgrade_runs(stack)
    assert len(runs) == 1, runs  # the webhook and the watcher both saw it; one upgrade started
    assert runs[0]["parameters"]["to"] == f"models:/embedder/{v2}"
    tags = client.get_model_version("embedder", v2).tags
    assert tags["promotion"] == "passed" and tags["promotion.champion_version"] == v1
    gallery, manifest = _gallery(stack)
    assert manifest["model"]["version"] == v2 and manifest["upgrade"] is None
    assert gallery.store.get_json(f"triggers/embedder-v{v2}.json")["source"] == "webhook"
    assert f"started upgrade-gallery/upgrade for embedder version {v2}" in (platform["workdir"] / "webhook.log").read_text()
    _set_paused(stack, "poll", False)
    time.sleep(3 * POLL_SECONDS + 1)  # the watcher polls again, thrice: it sees the gallery on v2 and starts nothing
    assert len(_upgrade_runs(stack)) == 1


def test_the_gate_rejects_a_broken_model_found_by_the_watcher(stack, platform):
    """The webhook receiver is stopped: the registry watcher's poll starts this upgrade."""
    import torch

    from fastfill.components.experiment.models import load_embedder

    webhook = platform["processes"]["webhook"]
    os.killpg(webhook.pid, signal.SIGTERM)
    webhook.wait(timeout=30)
    champion = _champion(stack)
    broken = load_embedder(platform["pipeline"] / "artifacts" / "models" / "new" / "model.pt")
    with torch.no_grad():  # every image gets the same feature: a model that has lost its input
        broken.embedding.weight.zero_()
    before = len(_upgrade_runs(stack))
    v3 = _register(stack, broken, alias="challenger")

    def rejected() -> bool:
        return _client(stack).get_model_version("embedder", v3).tags.get("promotion") == "rejected"

    _wait(rejected, 300, f"version {v3} being rejected", platform["workdir"])
    tags = _client(stack).get_model_version("embedder", v3).tags
    assert "never exceeds" in tags["promotion.reason"] or "below the minimum" in tags["promotion.reason"]
    assert _champion(stack) == champion
    gallery, manifest = _gallery(stack)
    assert manifest["model"]["version"] == champion and manifest["upgrade"] is None
    assert gallery.store.get_json(f"triggers/embedder-v{v3}.json")["source"] == "registry-watcher"
    time.sleep(3 * POLL_SECONDS + 1)  # three more polls: the rejected version is not started again
    assert len(_upgrade_runs(stack)) == before + 1
