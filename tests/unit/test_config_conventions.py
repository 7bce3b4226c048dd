"""Configuration by the ecosystem's conventions: --params, else FASTFILL_PARAMS, else
./params.yaml; a gallery host's configuration without the pipeline's sections; MLflow's
MLFLOW_REGISTRY_URI; the schedules' time zone; DVC's own hash as data_version."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from fastfill.cli import app
from fastfill.components.platform import registry
from fastfill.components.platform.config import ConfigError, MlflowConfig, load_params, needs_train, parse_params

ROOT = Path(__file__).resolve().parents[2]
HOST = {"gallery": {"store": "s3://team-bucket/gallery"}, "mlflow": {"tracking_uri": "http://mlflow.internal:5000"}}


def _error_of(result) -> str:
    return (result.stderr if hasattr(result, "stderr") else result.output) or result.output


def test_params_come_from_the_option_then_the_environment_then_the_folder(tmp_path, monkeypatch):
    """Each source in turn, told apart by the file a broken configuration names."""
    for name in ("from-option.yaml", "from-env.yaml"):
        (tmp_path / name).write_text("compute: {threads: -1}\n")
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    monkeypatch.setenv("FASTFILL_PARAMS", str(tmp_path / "from-env.yaml"))
    result = runner.invoke(app, ["gallery", "info", "--params", str(tmp_path / "from-option.yaml")])
    assert result.exit_code == 2 and "from-option.yaml: invalid configuration" in _error_of(result)
    result = runner.invoke(app, ["gallery", "info"])
    assert result.exit_code == 2 and "from-env.yaml: invalid configuration" in _error_of(result)
    monkeypatch.delenv("FASTFILL_PARAMS")
    result = runner.invoke(app, ["gallery", "info"])  # no params.yaml in the folder: the defaults
    assert result.exit_code == 6 and "no gallery at gallery: gallery.json is missing" in _error_of(result)


def test_a_gallery_hosts_configuration_needs_no_pipeline_sections():
    host = parse_params(HOST)
    assert host.train is None
    # the map the upgrade trains where the registry has none is the pipeline's own FastFill map
    pipeline = load_params(ROOT / "params.yaml")
    assert host.align["fastfill"] == pipeline.align["fastfill"]
    assert host.align["fct"] == pipeline.align["fct"]
    assert host.gallery.upgrade.method == "fastfill"
    with pytest.raises(ConfigError, match="the pipeline needs the train section"):
        needs_train(host, "the pipeline")
    assert needs_train(pipeline, "the pipeline") is pipeline.train
    # the copies a comparison seed makes still work without a train section
    assert host.with_seed(3).align["fastfill"].seed == 3


def test_the_registry_follows_mlflow_registry_uri(tmp_path, monkeypatch):
    """A registry apart from the tracking store (MLflow's own variable, then mlflow.registry_uri):
    a model registered through the product's client lands there, not in the tracking store."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    tracking, models = f"sqlite:///{tmp_path / 'tracking.db'}", f"sqlite:///{tmp_path / 'models.db'}"
    config = MlflowConfig(tracking_uri=tracking, artifact_location=str(tmp_path / "artifacts"))
    assert registry.registry_uri(config) == tracking
    assert registry.registry_uri(config.model_copy(update={"registry_uri": "sqlite:///other.db"})) == "sqlite:///other.db"
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", models)
    assert registry.registry_uri(config.model_copy(update={"registry_uri": "sqlite:///other.db"})) == models
    client, _ = registry.setup(config)
    client.create_registered_model("team-embedder")
    from mlflow import MlflowClient

    assert [m.name for m in MlflowClient(tracking_uri=models, registry_uri=models).search_registered_models()] \
        == ["team-embedder"]
    assert MlflowClient(tracking_uri=tracking, registry_uri=tracking).search_registered_models() == []
    assert registry.identity(config) == models  # what a gallery records: the registry's store
    assert os.environ["MLFLOW_REGISTRY_URI"] == models  # the user's setting stays as it was


def test_the_schedules_take_the_configured_time_zone():
    from fastfill.flows.deployments import deployments

    params = parse_params({**HOST, "triggers": {"timezone": "Europe/Paris", "comparison_cron": "0 3 * * 0"}})
    scheduled = {d.name: d for d in deployments(params) if d.schedules}
    assert set(scheduled) == {"nightly", "weekly"}
    for deployment in scheduled.values():
        assert [s.schedule.timezone for s in deployment.schedules] == ["Europe/Paris"]
    with pytest.raises(ConfigError, match="not an IANA time zone"):
        parse_params({"triggers": {"timezone": "Mars/Olympus"}})


@pytest.mark.skipif(shutil.which("git") is None, reason="dvc needs git")
def test_data_version_is_dvcs_own_hash_of_the_folder(tmp_path):
    """The real dvc CLI hashes a folder; data_version gives the same value."""
    folder = tmp_path / "splits"
    (folder / "nested").mkdir(parents=True)
    (folder / "train_images.npy").write_bytes(bytes(range(256)) * 10)
    (folder / "labels.txt").write_text("0\n1\n")
    (folder / "nested" / "meta.json").write_text('{"a": 1}')
    dvc = str(Path(os.environ.get("VIRTUAL_ENV", ROOT / ".venv")) / "bin" / "dvc")
    if not Path(dvc).exists():
        dvc = str(ROOT / ".venv" / "bin" / "dvc")
    for command in (["git", "init", "-q"], [dvc, "init", "-q"], [dvc, "add", "-q", "splits"]):
        subprocess.run(command, cwd=tmp_path, check=True, capture_output=True, timeout=120)
    recorded = yaml.safe_load((tmp_path / "splits.dvc").read_text())["outs"][0]["md5"]
    assert registry.data_version(folder) == recorded
    (folder / "labels.txt").write_text("0\n2\n")
    assert registry.data_version(folder) != recorded
