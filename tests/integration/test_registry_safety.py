"""Registry versions are data, never code: what is registered loads back as the same network,
and nothing a writer to the registry (or to a checkpoint) can put there runs when it is loaded.
A real MLflow store (SQLite and a local artifact folder)."""

import hashlib
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from fastfill.components.experiment.models import AlignmentMap, Embedder, UnifiedMaps, load_embedder, save_embedder
from fastfill.components.model_store import registered
from fastfill.components.platform import registry
from fastfill.components.platform.config import MlflowConfig, TrainConfig
from fastfill.components.platform.registry import RegistryError


class _Payload:
    """A pickle that creates a file when it is unpickled: what an attacker would register."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv(registry.PICKLE_OPT_IN, raising=False)
    config = MlflowConfig(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                          artifact_location=str(tmp_path / "artifacts"))
    client, experiment = registry.setup(config)
    run_id = client.create_run(experiment).info.run_id
    return config, client, run_id


def _embedder():
    torch.manual_seed(0)
    return Embedder(TrainConfig(backbone="cnn_small", width=4, embedding_dim=8), 1, [0, 3, 5], 0.3, 0.2).eval()


def test_registered_models_load_back_as_the_same_networks(mlflow_store):
    _, client, run_id = mlflow_store
    model = _embedder()
    version = registered.register_embedder(client, run_id, model, np.zeros((1, 1, 12, 12), np.float32), "embedder",
                                         "champion", {"role": "old"})
    loaded = registered.load_model("models:/embedder@champion")
    images = torch.rand(4, 1, 12, 12)
    with torch.no_grad():
        np.testing.assert_array_equal(loaded(images).numpy(), model(images).numpy())
        np.testing.assert_array_equal(loaded.classify(loaded(images)).numpy(), model.classify(model(images)).numpy())
    assert loaded.classes.tolist() == [0, 3, 5] and float(loaded.pixel_std) == pytest.approx(0.2)
    assert registered.input_shape(f"models:/embedder/{version}") == (1, 12, 12)
    assert client.get_model_version("embedder", version).tags["role"] == "old"

    registered_maps = []
    for module in (AlignmentMap(8, 6, [16], uncertainty=True), AlignmentMap(8, 8, [], True, "rbt", 2),
                   UnifiedMaps(8, 12, 4, blocks=2)):
        module = module.eval()
        v = registered.register_alignment(client, run_id, module, np.zeros((2, 8), np.float32), "maps", {})
        registered_maps.append((v, module))
    # every version registered from the one run keeps its own files (a later one overwrote them before)
    for v, module in registered_maps:
        back = registered.load_model(f"models:/maps/{v}")
        assert type(back) is type(module)
        x = torch.randn(5, 8)
        with torch.no_grad():
            np.testing.assert_array_equal(back(x).numpy(), module(x).numpy())


def _version_folder(client, name: str, version: str) -> Path:
    """The folder of the version's description and weights (inside the MLflow model)."""
    logged = client.get_logged_model(client.get_model_version(name, version).source.removeprefix("models:/"))
    return Path(logged.artifact_location.removeprefix("file://")) / registered.DATA_PATH


@pytest.mark.parametrize("weights_file, refused_as", [(registered.WEIGHTS_FILE, "SafetensorError"),
                                                     (registered.LEGACY_WEIGHTS_FILE, "UnpicklingError")])
def test_weights_carrying_a_pickled_object_are_refused_and_run_nothing(mlflow_store, tmp_path, weights_file,
                                                                      refused_as):
    _, client, run_id = mlflow_store
    version = registered.register_embedder(client, run_id, _embedder(), np.zeros((1, 1, 12, 12), np.float32),
                                         "embedder", None, {})
    folder = _version_folder(client, "embedder", version)
    assert (folder / registered.WEIGHTS_FILE).is_file()  # what this release writes
    marker = tmp_path / "code-ran"
    # the attacker rewrites the weights (in today's file, or as an earlier release's weights.pt) and
    # their recorded sha256 both
    (folder / weights_file).write_bytes(pickle.dumps({"weight": _Payload(marker)}))
    description = json.loads((folder / registered.MODEL_FILE).read_text())
    description["weights"] = weights_file
    description["sha256"] = hashlib.sha256((folder / weights_file).read_bytes()).hexdigest()
    (folder / registered.MODEL_FILE).write_text(json.dumps(description))
    with pytest.raises(RegistryError, match=f"could not be loaded as data: {refused_as}"):
        registered.load_model(f"models:/embedder/{version}")
    assert not marker.exists()


def test_a_version_with_an_earlier_release_s_weights_pt_still_loads(mlflow_store):
    _, client, run_id = mlflow_store
    model = _embedder()
    version = registered.register_embedder(client, run_id, model, np.zeros((1, 1, 12, 12), np.float32),
                                         "embedder", None, {})
    folder = _version_folder(client, "embedder", version)
    (folder / registered.WEIGHTS_FILE).unlink()  # the folder as an earlier release wrote it
    torch.save(model.state_dict(), folder / registered.LEGACY_WEIGHTS_FILE)
    description = json.loads((folder / registered.MODEL_FILE).read_text())
    description["weights"] = registered.LEGACY_WEIGHTS_FILE
    description["sha256"] = hashlib.sha256((folder / registered.LEGACY_WEIGHTS_FILE).read_bytes()).hexdigest()
    (folder / registered.MODEL_FILE).write_text(json.dumps(description))
    back = registered.load_model(f"models:/embedder/{version}")
    x = torch.rand(3, 1, 12, 12)
    with torch.no_grad():
        np.testing.assert_array_equal(back(x).numpy(), model.eval()(x).numpy())


def test_altered_weights_or_description_are_refused_with_a_message(mlflow_store):
    _, client, run_id = mlflow_store
    version = registered.register_embedder(client, run_id, _embedder(), np.zeros((1, 1, 12, 12), np.float32),
                                         "embedder", None, {})
    folder = _version_folder(client, "embedder", version)
    weights = folder / registered.WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:-10])
    with pytest.raises(RegistryError, match="does not match its recorded sha256"):
        registered.load_model(f"models:/embedder/{version}")

    version = registered.register_embedder(client, run_id, _embedder(), np.zeros((1, 1, 12, 12), np.float32),
                                         "embedder", None, {})
    folder = _version_folder(client, "embedder", version)
    description = json.loads((folder / registered.MODEL_FILE).read_text())
    description["spec"]["backbone"] = "os.system"
    (folder / registered.MODEL_FILE).write_text(json.dumps(description))
    with pytest.raises(RegistryError, match="backbone"):
        registered.load_model(f"models:/embedder/{version}")


def test_a_pickled_version_of_an_older_release_is_refused_unless_trusted(mlflow_store, monkeypatch):
    import mlflow
    import mlflow.pytorch

    config, client, run_id = mlflow_store
    model = _embedder()
    with mlflow.start_run(run_id=run_id):
        info = mlflow.pytorch.log_model(model, name="legacy", registered_model_name="embedder",
                                        pip_requirements=["torch==2.13.0"], serialization_format="pickle")
    uri = f"models:/embedder/{info.registered_model_version}"
    with pytest.raises(RegistryError, match="stored as a pickled module .* mlflow.allow_pickled_models: true"):
        registered.load_model(uri)
    monkeypatch.setenv(registry.PICKLE_OPT_IN, "1")
    images = torch.rand(2, 1, 12, 12)
    with torch.no_grad():
        np.testing.assert_array_equal(registered.load_model(uri)(images).numpy(), model(images).numpy())
    monkeypatch.delenv(registry.PICKLE_OPT_IN)
    registry.setup(config.model_copy(update={"allow_pickled_models": True}))  # the setting, not the variable
    try:
        assert isinstance(registered.load_model(uri), Embedder)
    finally:
        registry.setup(config)


def test_local_checkpoints_load_as_data_only(tmp_path):
    path = tmp_path / "model.pt"
    save_embedder(_embedder(), TrainConfig(backbone="cnn_small", width=4, embedding_dim=8), path)
    assert load_embedder(path).classes.tolist() == [0, 3, 5]
    marker = tmp_path / "code-ran"
    torch.save({"config": {}, "state_dict": _Payload(marker)}, path)
    with pytest.raises(pickle.UnpicklingError):
        load_embedder(path)
    assert not marker.exists() and os.path.exists(path)


def test_the_registry_conventions(mlflow_store):
    """Artifacts go through a tracking server (never the client's disk), promotion clears
    `challenger` when it named the promoted version, and a curve's steps can be its fractions."""
    config, client, run_id = mlflow_store
    assert registry.artifact_location(config, "http://mlflow.internal:5000") is None
    assert registry.artifact_location(config, "sqlite:///x.db").startswith("file://")
    model = _embedder()
    example = np.zeros((1, 1, 12, 12), np.float32)
    v1 = registered.register_embedder(client, run_id, model, example, "embedder", "champion", {})
    v2 = registered.register_embedder(client, run_id, model, example, "embedder", "challenger", {})
    v3 = registered.register_embedder(client, run_id, model, example, "embedder", None, {})
    registry.record_promotion(client, "embedder", v2, run_id, {"promotion": "passed"}, promote=True)
    assert registry.alias_version(client, "embedder", "champion") == v2
    assert registry.alias_version(client, "embedder", "challenger") is None
    client.set_registered_model_alias("embedder", "challenger", v3)  # a newer candidate keeps its alias
    registry.record_promotion(client, "embedder", v1, run_id, {"promotion": "passed"}, promote=True)
    assert registry.alias_version(client, "embedder", "challenger") == v3

    # the verdict is written last: a reader polling for `promotion` finds its reason already there
    seen = []
    set_tag = client.set_model_version_tag

    def recording(name, version, key, value):
        seen.append((key, dict(client.get_model_version(name, version).tags)))
        set_tag(name, version, key, value)

    client.set_model_version_tag = recording
    registry.record_promotion(client, "embedder", v3, run_id,
                             {"promotion": "rejected", "promotion.reason": "r", "promotion.champion_version": v1},
                             promote=False)
    del client.set_model_version_tag
    assert seen[-1][0] == "promotion" and seen[-1][1]["promotion.reason"] == "r"
    assert client.get_model_version("embedder", v3).tags["promotion"] == "rejected"

    registry.log_series(client, run_id, {"top1": [0.5, 0.6, 0.7]}, steps=[0, 500, 1000])
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "top1")] == [(0, 0.5), (500, 0.6), (1000, 0.7)]


def test_a_version_in_the_previous_release_s_format_still_loads(mlflow_store, tmp_path):
    """The folder an earlier release registered: its description and weights.safetensors at the
    root, no MLmodel."""
    from safetensors.torch import save_file

    from fastfill.components.experiment.models import describe

    _, client, run_id = mlflow_store
    model = _embedder()
    folder = tmp_path / "earlier-release"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "weights.safetensors"))
    (folder / registered.MODEL_FILE).write_text(json.dumps({
        "format": "fastfill-model/1", "spec": describe(model), "input_shape": [1, 12, 12],
        "weights": "weights.safetensors",
        "sha256": hashlib.sha256((folder / "weights.safetensors").read_bytes()).hexdigest()}))
    client.log_artifacts(run_id, str(folder), "embedder")
    client.create_registered_model("old-release")
    source = f"{client.get_run(run_id).info.artifact_uri}/embedder"
    version = client.create_model_version("old-release", source, run_id=run_id).version
    back = registered.load_model(f"models:/old-release/{version}")
    assert back.preprocessing.shape == (1, 12, 12) and registered.input_shape(f"models:/old-release/{version}") == \
        (1, 12, 12)
    x = torch.rand(3, 1, 12, 12)
    with torch.no_grad():
        np.testing.assert_array_equal(back(x).numpy(), model(x).numpy())


def test_a_pickled_mlflow_model_registers_where_its_writers_are_trusted(mlflow_store, monkeypatch):
    """mlflow.allow_pickled_models (here FASTFILL_ALLOW_PICKLED_MODELS=1): a team's pytorch
    flavour model is referred to and embeds as the module does."""
    import mlflow.pytorch

    from fastfill.components.model_store import catalogue, sources
    from fastfill.components.model_store.preprocessing import Preprocessing

    config, client, run_id = mlflow_store
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()).eval()
    with mlflow.start_run(run_id=run_id):
        info = mlflow.pytorch.log_model(net, name="theirs", registered_model_name="theirs",
                                        serialization_format="pickle")
    uri = f"models:/theirs/{info.registered_model_version}"
    prep = Preprocessing(channels=3, height=10, width=10)
    with pytest.raises(sources.ModelSourceError, match="allow_pickled_models"):
        sources.from_mlflow(uri, prep)
    monkeypatch.setenv(registry.PICKLE_OPT_IN, "1")
    source = sources.from_mlflow(uri, prep)
    version = catalogue.register(client, client.get_run(run_id).info.experiment_id, source, "embedder", None,
                                 origin=uri)
    ours = registered.load_model(f"models:/embedder/{version}")
    assert ours.fastfill_source == "mlflow" and ours.embedding_dim == 4
    x = torch.rand(2, 3, 10, 10)
    with torch.no_grad():
        np.testing.assert_allclose(ours(x).numpy(), net(x).numpy(), rtol=1e-6, atol=1e-6)
    monkeypatch.delenv(registry.PICKLE_OPT_IN)  # the trust is checked again at every load
    with pytest.raises(RegistryError, match="allow_pickled_models"):
        registered.load_model(f"models:/embedder/{version}")
