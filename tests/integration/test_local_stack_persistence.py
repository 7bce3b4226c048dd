"""infra/local-stack.sh keeps its data: after `stop` and `start` (or a kill and `start`) the S3
endpoint has every bucket and object it had, so the gallery, the MLflow server's artifacts and
the DVC remote `stack` are still there, and what the MLflow database points at can be read."""

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from testkit.process_state import restored_environ

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "infra" / "local-stack.sh")
DVC = str(Path(sys.executable).with_name("dvc"))
AWS_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL_S3",
            "AWS_ENDPOINT_URL", "AWS_PROFILE", "MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Stack:
    """infra/local-stack.sh with its own state folder and free ports."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.env = {**os.environ, "FASTFILL_STACK_DIR": str(directory), "FASTFILL_S3_PORT": str(_free_port()),
                    "FASTFILL_MLFLOW_PORT": str(_free_port()), "FASTFILL_PREFECT_PORT": str(_free_port()),
                    "FASTFILL_VENV": str(Path(sys.executable).parent.parent)}

    def __call__(self, command: str, *services: str) -> str:
        done = subprocess.run([SCRIPT, command, *services], env=self.env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{command} {services}: {done.stdout}{done.stderr}{self.log('s3')}"
        return done.stdout

    def log(self, name: str) -> str:
        path = self.directory / "logs" / f"{name}.log"
        return path.read_text()[-3000:] if path.is_file() else ""

    def kill(self, name: str) -> None:
        """What a crash or a power cut does: SIGKILL, no chance to write anything."""
        pid = int((self.directory / "pids" / f"{name}.pid").read_text())
        os.killpg(pid, signal.SIGKILL)
        for _ in range(100):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)

    @property
    def variables(self) -> dict:
        out = {}
        for line in (self.directory / "env").read_text().splitlines():
            if line.startswith("export "):
                key, value = line[len("export "):].split("=", 1)
                out[key] = value
        return out

    @contextmanager
    def use(self):
        """os.environ pointed at the stack for the block (boto3, the gallery store, MLflow)."""
        variables = self.variables
        with restored_environ(*AWS_KEYS, *variables):
            for key in AWS_KEYS:
                os.environ.pop(key, None)
            os.environ.update(variables)
            yield


@pytest.fixture
def stack(tmp_path):
    stack = Stack(tmp_path / "stack")
    try:
        yield stack
    finally:
        subprocess.run([SCRIPT, "stop"], env=stack.env, capture_output=True, text=True, timeout=120)


def _objects(client) -> dict:
    out = {}
    for bucket in sorted(b["Name"] for b in client.list_buckets()["Buckets"]):
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for item in page.get("Contents", []):
                out[(bucket, item["Key"])] = client.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
    return out


def test_the_s3_endpoint_keeps_buckets_and_objects_across_a_stop_and_a_kill(stack):
    import boto3
    from boto3.s3.transfer import TransferConfig

    from fastfill.components.gallery.store import open_store

    stack("start", "s3")
    rng = np.random.default_rng(0)
    features = rng.normal(size=(50, 8)).astype(np.float32)
    big = rng.bytes(11 * 2**20)  # uploaded in 5 MiB parts
    with stack.use():
        client = boto3.client("s3")
        store = open_store("s3://gallery/persist")
        store.put_json("gallery.json", {"model": {"version": "1"}})
        store.put_array("features/v1/part-00000.npy", features)
        lock = store.swap("upgrades/u1/lock.json", b'{"owner": "a"}', expected=None)
        store.put_json("upgrades/u1/chunks/00000.done", {"ok": True})
        store.delete("upgrades/u1/chunks/00000.done")  # deleted before the restart: stays deleted
        store.put_json("triggers/embedder-v2.json", {"source": "old"})
        store.put_json("triggers/embedder-v2.json", {"source": "webhook"})  # the last write wins
        client.upload_fileobj(__import__("io").BytesIO(big), "mlflow-artifacts", "1/abc/artifacts/weights.pt",
                              Config=TransferConfig(multipart_threshold=5 * 2**20, multipart_chunksize=5 * 2**20))
        client.put_object(Bucket="dvc-cache", Key="odd key/ä+%20.bin", Body=b"odd")
        before = _objects(client)
    assert len(before) == 6

    stack("stop")
    stack("start", "s3")
    assert "restored 3 buckets and 6 objects" in stack.log("s3"), stack.log("s3")
    with stack.use():
        client = boto3.client("s3")
        assert _objects(client) == before
        assert {b["Name"] for b in client.list_buckets()["Buckets"]} == {"mlflow-artifacts", "gallery", "dvc-cache"}
        store = open_store("s3://gallery/persist")
        assert store.get_json("gallery.json") == {"model": {"version": "1"}}  # its sha256 metadata checked
        np.testing.assert_array_equal(store.get_array("features/v1/part-00000.npy"), features)
        assert store.get_json("triggers/embedder-v2.json") == {"source": "webhook"}
        assert not store.exists("upgrades/u1/chunks/00000.done")
        # the lock taken before the restart is still held, under the same ETag
        lock = store.swap("upgrades/u1/lock.json", b'{"owner": "a", "renewed": 1}', expected=lock)
        store.put_json("after-restart.json", {"n": 1})
        after = _objects(client)

    stack.kill("s3")  # no stop: what was answered before the kill is on disk
    stack("start", "s3")
    with stack.use():
        client = boto3.client("s3")
        assert _objects(client) == after
        assert open_store("s3://gallery/persist").get("upgrades/u1/lock.json") == b'{"owner": "a", "renewed": 1}'
    # the request log holds the live data once: one line per bucket and per object
    lines = (stack.directory / "s3" / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 3 + len(after), len(lines)


def test_dvc_push_and_pull_through_the_stack_remote_survive_a_restart(stack, tmp_path):
    """The repository's remote `stack` (bucket dvc-cache, which the stack creates), pointed at
    this stack's port with `dvc remote modify --local`, as docs/pipeline.md says for another port."""
    stack("start", "s3")
    repo = tmp_path / "repo"
    repo.mkdir()
    env = {**stack.env, **stack.variables, "DVC_NO_ANALYTICS": "1"}

    def run(*args):
        done = subprocess.run(args, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{args}: {done.stdout}{done.stderr}"
        return done.stdout

    run("git", "init", "-q")
    run(DVC, "init", "-q")
    (repo / ".dvc" / "config").write_text((ROOT / ".dvc" / "config").read_text())
    default = subprocess.run([DVC, "remote", "default"], cwd=repo, env=env, capture_output=True, text=True)
    assert "No default remote set" in default.stdout  # a fresh clone's dvc commands never need the stack
    assert "s3://dvc-cache/" in run(DVC, "remote", "list")
    run(DVC, "remote", "modify", "--local", "stack", "endpointurl", env["AWS_ENDPOINT_URL_S3"])
    data = np.random.default_rng(1).bytes(300_000)
    (repo / "splits").mkdir()
    (repo / "splits" / "test.bin").write_bytes(data)
    run(DVC, "add", "-q", "splits")
    run(DVC, "push", "-r", "stack")

    stack("stop")
    stack("start", "s3")
    (repo / "splits" / "test.bin").unlink()
    subprocess.run(["rm", "-rf", str(repo / ".dvc" / "cache")], check=True)
    run(DVC, "pull", "-r", "stack")
    assert (repo / "splits" / "test.bin").read_bytes() == data


@pytest.mark.slow  # an MLflow server starts twice: about a minute on 2 cores
def test_the_registry_still_loads_its_models_after_the_stack_restarts(stack):
    """MLflow's database (a file) and its artifacts (in S3) both come back: a version registered
    before the restart loads after it, with the same weights."""
    import mlflow
    import torch
    from mlflow import MlflowClient

    from fastfill.components.experiment.models import Embedder
    from fastfill.components.model_store import registered
    from fastfill.components.platform.config import TrainConfig

    stack("start", "s3", "mlflow")
    model = Embedder(TrainConfig(backbone="cnn_small", width=4, embedding_dim=8), 1, [0, 1, 2]).eval()
    images = torch.rand(4, 1, 16, 16)
    with torch.no_grad():
        expected = model(images)
    with stack.use():
        uri = stack.variables["MLFLOW_TRACKING_URI"]
        mlflow.set_tracking_uri(uri)
        mlflow.set_registry_uri(uri)
        client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        experiment = client.create_experiment("persistence")
        with mlflow.start_run(experiment_id=experiment) as run:
            version = registered.register_embedder(client, run.info.run_id, model, np.zeros((1, 1, 16, 16), np.float32),
                                                   "embedder", "champion", {})

    stack("stop")
    stack("start", "s3", "mlflow")
    with stack.use():
        mlflow.set_tracking_uri(uri)
        mlflow.set_registry_uri(uri)
        loaded = registered.load_model("models:/embedder@champion")
        assert str(MlflowClient(tracking_uri=uri, registry_uri=uri).get_model_version_by_alias(
            "embedder", "champion").version) == version
    with torch.no_grad():
        torch.testing.assert_close(loaded(images), expected)
