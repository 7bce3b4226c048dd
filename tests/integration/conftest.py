import os
import shutil
from pathlib import Path

import pytest
import yaml

from fastfill.components.platform.config import parse_params
from testkit.process_state import in_workdir, restored_environ
from testkit.tiny_demo import make_image_folder, tiny_params
from tests.environment import new_bucket
from tests.gallery_cases import LAYOUTS
from tests.integration.helpers import cli_environment, copy_repository

AWS_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL_S3",
            "AWS_ENDPOINT_URL", "AWS_PROFILE")


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on 127.0.0.1 (a free port), with fake credentials in the environment,
    so boto3 in this process and in CLI subprocesses speaks HTTP to it."""
    from moto.server import ThreadedMotoServer

    with restored_environ(*AWS_KEYS):
        for key in AWS_KEYS:
            os.environ.pop(key, None)
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        os.environ["AWS_ENDPOINT_URL_S3"] = url
        try:
            yield url
        finally:
            server.stop()


@pytest.fixture(params=list(LAYOUTS))
def layout(request) -> str:
    """Each gallery layout (gallery.layout): the tests that take it run on every one (pgvector on
    a real PostgreSQL that the test process starts, milvus on a Milvus Lite file: tests/pg.py)."""
    return request.param


@pytest.fixture(params=["local", "s3"])
def store_uri(request, tmp_path) -> str:
    """A fresh, empty store of each backend."""
    if request.param == "local":
        return str(tmp_path / "store")
    endpoint = request.getfixturevalue("s3_endpoint")
    return f"s3://{new_bucket(endpoint)}/galleries/main"


@pytest.fixture
def upgrade_env(tiny_pipeline, image_folder, tmp_path, monkeypatch):
    """params (and params.yaml in tmp_path) over a private copy of the pipeline's MLflow store and
    its prepared data; small chunks so the backfill has many."""
    _, _, pipeline_dir = tiny_pipeline
    shutil.copy(pipeline_dir / "store" / "mlflow.db", tmp_path / "mlflow.db")
    data = tiny_params(image_folder)
    data["paths"] = {"data": str(pipeline_dir / "data"), "artifacts": str(tmp_path / "artifacts"),
                     "reports": str(tmp_path / "reports")}
    data["mlflow"]["tracking_uri"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    data["gallery"] = {"store": str(tmp_path / "gallery"), "part_size": 20,
                       # the split's pairs: the pipeline's maps were checked on them, so they are used as they are
                       "upgrade": {"chunk_size": 8, "eval_queries": 24, "max_concurrency": 2, "map_pairs": "splits"}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return parse_params(data), tmp_path


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("images"), num_classes=6, train_per_class=40, test_per_class=12)


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    from fastfill.tasks.temporary_server import tether_temporary_server

    tether_temporary_server()  # a test process killed hard takes its harness's server with it
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory, image_folder, prefect_harness):
    """One tiny pipeline run (its own working directory and MLflow store) shared by the tests:
    returns (params, metrics, workdir)."""
    from fastfill.flows.pipeline import pipeline_flow

    workdir = tmp_path_factory.mktemp("pipeline")
    data = tiny_params(image_folder)
    data["mlflow"]["tracking_uri"] = f"sqlite:///{workdir / 'store' / 'mlflow.db'}"
    (workdir / "store").mkdir()
    params = parse_params(data)
    with in_workdir(workdir):
        state = pipeline_flow(params, return_state=True)
    # the Prefect flow run of this pipeline, for tests that must not read other tests' runs
    (workdir / "pipeline_flow_run").write_text(str(state.state_details.flow_run_id))
    return params, state.result(), workdir


@pytest.fixture
def tiny_workdir(tmp_path, monkeypatch, image_folder) -> Path:
    """The working directory of a CLI call: a tiny params.yaml, a private MLflow store, no
    MLflow settings from the environment."""
    data = tiny_params(image_folder)
    data["mlflow"]["tracking_uri"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


@pytest.fixture
def repo_copy(tmp_path, image_folder) -> Path:
    """The repository's tracked files in a fresh git repo, with a tiny params.yaml."""
    return copy_repository(tmp_path / "repo", tiny_params(image_folder))


@pytest.fixture
def cli_env(tmp_path) -> dict:
    """Environment for CLI subprocesses: the project's venv first on PATH, a private Prefect home."""
    return cli_environment(tmp_path / "prefect-home")
