"""A team's own models: an ONNX export and a torchvision architecture with its weights, registered
with `fastfill model register`, embed as their frameworks do; what the product registers is a
real MLflow model (pyfunc, served over HTTP); pickled models and bad files are refused in one line
with nothing registered or run; and a gallery of RGB JPEGs of mixed sizes is upgraded from one to
the other."""

import io
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from torch import nn

from fastfill.components.experiment.inference import apply_alignment, embed
from fastfill.components.model_store import registered
from fastfill.components.model_store.preprocessing import Preprocessing
from testkit.tiny_demo import tiny_params

OLD_INPUT = Preprocessing(channels=3, height=20, width=20, mean=(0.5,), std=(0.5,))
NEW_INPUT = Preprocessing(channels=3, height=32, width=32, resize="shorter_then_crop", resize_to=36,
                          mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))


def _old_network() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 12, 3, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(12, 10)).eval()


def _new_network():
    from fastfill.components.experiment.vision import torchvision

    torch.manual_seed(2)
    return torchvision.models.resnet18(num_classes=6).eval()


def _export(net: nn.Module, shape, path: Path) -> Path:
    torch.onnx.export(net, (torch.zeros(1, *shape),), str(path), dynamo=False, input_names=["images"],
                      output_names=["embedding"], dynamic_axes={"images": {0: "batch"}, "embedding": {0: "batch"}})
    return path


@pytest.fixture
def team(tmp_path, monkeypatch, image_folder):
    """A folder with the team's files and a params.yaml over a fresh MLflow store."""
    from safetensors.torch import save_file

    data = tiny_params(image_folder)
    data["mlflow"]["tracking_uri"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    data["mlflow"]["registered_model"] = "team-embedder"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("FASTFILL_ALLOW_PICKLED_MODELS", raising=False)
    _export(_old_network(), OLD_INPUT.shape, tmp_path / "old.onnx")
    save_file(_new_network().state_dict(), str(tmp_path / "new.safetensors"))
    return tmp_path


def _cli(team: Path, *args: str):
    from typer.testing import CliRunner

    from fastfill.cli import app

    return CliRunner().invoke(app, [*args, "--params", str(team / "params.yaml")])


def _register_both(team: Path) -> tuple[str, str]:
    old = _cli(team, "model", "register", "--onnx", str(team / "old.onnx"), "--size", "20", "--channels", "3",
               "--mean", "0.5", "--std", "0.5", "--alias", "champion", "--json")
    assert old.exit_code == 0, old.output
    new = _cli(team, "model", "register", "--torchvision", "resnet18", "--weights", str(team / "new.safetensors"),
               "--preset", "imagenet", "--size", "32", "--resize-to", "36", "--alias", "challenger", "--json")
    assert new.exit_code == 0, new.output
    return json.loads(old.stdout)["uri"], json.loads(new.stdout)["uri"]


def _photos(count: int, seed: int = 0) -> list:
    """RGB pictures of mixed sizes with some structure (bars on noise)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        height, width = int(rng.integers(24, 70)), int(rng.integers(24, 70))
        pixels = rng.integers(0, 80, (height, width, 3)).astype(np.int32)
        pixels[:, :, i % 3] += 120
        bar = int(rng.integers(0, height - 4))
        pixels[bar: bar + 4] += 100
        out.append(Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB"))
    return out


def _encoded(picture, fmt="JPEG") -> bytes:
    buffer = io.BytesIO()
    picture.save(buffer, format=fmt, quality=90)
    return buffer.getvalue()


def _adopted(team: Path, pictures: list, rows: list, upgrade: dict) -> Path:
    """The team's JPEGs in ``team/photos`` with a manifest of ``rows`` (id, file name), params.yaml
    pointing at a gallery there with no pipeline files (the map's pairs from the gallery, half of
    them held out; ``upgrade``: more gallery.upgrade settings), adopted; returns the photos' folder."""
    photos = team / "photos"
    photos.mkdir()
    for picture, (_, name) in zip(pictures, rows):
        picture.save(photos / name, quality=90)
    (photos / "items.csv").write_text("id,uri\n" + "".join(f"{item},{name}\n" for item, name in rows))
    data = yaml.safe_load((team / "params.yaml").read_text())
    data["paths"]["data"] = str(team / "no-pipeline-here")
    data["gallery"] = {"store": str(team / "gallery"), "part_size": 40,
                       "upgrade": {"map_pairs": "gallery", **upgrade}}
    data["align"]["fastfill"]["validation_fraction"] = 0.5
    (team / "params.yaml").write_text(yaml.safe_dump(data))
    adopted = _cli(team, "gallery", "adopt", "--manifest", str(photos / "items.csv"), "--store", str(team / "gallery"))
    assert adopted.exit_code == 0, adopted.output
    return photos


def test_each_source_registers_and_embeds_as_its_framework_does(team):
    import onnxruntime as ort

    old_uri, new_uri = _register_both(team)
    old, new = registered.load_model(old_uri), registered.load_model(new_uri)
    assert (old.fastfill_source, old.embedding_dim, old.classifier) == ("onnx", 10, None)
    assert (new.fastfill_source, new.embedding_dim) == ("torchvision", 512) and new.classifier.out_features == 6
    assert old.preprocessing == OLD_INPUT and new.preprocessing == NEW_INPUT

    files = [_encoded(p) for p in _photos(6)]
    for model, prep in ((old, OLD_INPUT), (new, NEW_INPUT)):
        pixels = np.stack([prep.decode(data) for data in files])
        features = embed(model, pixels)
        scaled = prep.normalise(torch.from_numpy(pixels).float() / 255)
        if model is old:
            session = ort.InferenceSession(str(team / "old.onnx"), providers=["CPUExecutionProvider"])
            direct = session.run(None, {"images": scaled.numpy()})[0]
            np.testing.assert_allclose(features, direct, rtol=1e-5, atol=1e-6)  # the same runtime
            with torch.no_grad():  # the ONNX graph against torch: a stated tolerance
                np.testing.assert_allclose(features, _old_network()(scaled).numpy(), rtol=1e-4, atol=1e-5)
        else:
            net = _new_network()
            head = net.fc
            net.fc = nn.Identity()  # what feeds the classifier
            with torch.no_grad():
                direct = net(scaled)
                np.testing.assert_allclose(features, direct.numpy(), rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(new.classify(torch.from_numpy(features)).numpy(), head(direct).numpy(),
                                           rtol=1e-5, atol=1e-5)

    listed = _cli(team, "model", "list", "--json")
    assert listed.exit_code == 0, listed.output
    rows = {row["version"]: row for row in json.loads(listed.stdout)["versions"]}
    assert rows["1"]["aliases"] == ["champion"] and rows["1"]["source"] == "onnx" and rows["1"]["head"] is None
    assert rows["2"]["aliases"] == ["challenger"] and rows["2"]["embedding_dim"] == 512 and rows["2"]["head"] == 6
    assert "shorter side 36 then centre crop" in rows["2"]["input"]
    shown = _cli(team, "model", "show", "challenger")
    assert shown.exit_code == 0, shown.output
    described = json.loads(shown.stdout)
    assert described["description"]["preprocessing"]["resize_to"] == 36
    assert described["signature"]["inputs"] and "uint8" in described["signature"]["inputs"]


def test_mlflow_loads_what_the_product_registers(team):
    """mlflow.pyfunc.load_model of a registered embedder (each source) and of a map gives the
    product's own numbers."""
    import mlflow

    from fastfill.components.experiment.models import AlignmentMap, Embedder
    from fastfill.components.platform import registry
    from fastfill.components.platform.config import TrainConfig, load_params

    old_uri, new_uri = _register_both(team)
    client, experiment = registry.setup(load_params(team / "params.yaml").mlflow)
    run = client.create_run(experiment)
    own = Embedder(TrainConfig(backbone="cnn_small", width=4, embedding_dim=8), 1, [0, 1, 2]).eval()
    own_uri = "models:/own/" + registered.register_embedder(client, run.info.run_id, own,
                                                            np.zeros((1, 1, 16, 16), np.float32), "own", None, {})
    files = [_encoded(p) for p in _photos(5, seed=3)]
    for uri in (old_uri, new_uri, own_uri):
        model = registered.load_model(uri)
        pixels = np.stack([model.preprocessing.decode(f) for f in files])  # the signature's shape
        product = embed(model, pixels)
        served = mlflow.pyfunc.load_model(uri).predict(pixels)
        np.testing.assert_array_equal(served, product)
        assert mlflow.models.get_model_info(uri).signature.inputs.to_dict()[0]["tensor-spec"]["dtype"] == "uint8"

    torch.manual_seed(0)
    h = AlignmentMap(10, 512, [32], uncertainty=True).eval()
    map_uri = "models:/maps/" + registered.register_alignment(client, run.info.run_id, h,
                                                              np.zeros((2, 10), np.float32), "maps", {})
    old_features = np.random.default_rng(0).normal(size=(7, 10)).astype(np.float32)
    predicted = mlflow.pyfunc.load_model(map_uri).predict(old_features)
    transformed, log_sigma2 = apply_alignment(registered.load_model(map_uri), old_features)
    np.testing.assert_array_equal(predicted["features"], transformed)
    np.testing.assert_array_equal(predicted["log_sigma2"], log_sigma2)

    from fastfill.components.experiment.models import UnifiedMaps

    unified = UnifiedMaps(10, 16, 4, blocks=2).eval()
    unified_uri = "models:/maps/" + registered.register_alignment(client, run.info.run_id, unified,
                                                                  np.zeros((2, 10), np.float32), "maps", {})
    with torch.no_grad():
        np.testing.assert_allclose(mlflow.pyfunc.load_model(unified_uri).predict(old_features),
                                   unified(torch.from_numpy(old_features)).numpy(), rtol=1e-6, atol=1e-6)


_OUTSIDE_THE_PRODUCT = """
import json, sys
import numpy as np
# the product out of reach: no editable-install finder, no repository on the path
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__ + getattr(f, "__name__", "")]
sys.path[:] = [p for p in sys.path if p not in ("", sys.argv[1]) and "__editable__" not in p]
import mlflow.pyfunc
model = mlflow.pyfunc.load_model(sys.argv[2])
out = model.predict(np.load(sys.argv[3]))
np.save(sys.argv[4], out)
print(json.dumps({"loader": sys.modules["fastfill.components"].__file__,
                  "example": np.asarray(model.metadata.load_input_example(model.metadata.artifact_path
                                                                          or sys.argv[5])).shape}))
"""


def test_a_version_carries_what_loads_it(team, tmp_path_factory):
    """A registered version is an MLflow 3 logged model with its run, an input example of a few
    bytes, and the loader in its code/: a Python without the product on its path loads it with
    mlflow.pyfunc and predicts the product's numbers."""
    import mlflow
    import mlflow.artifacts

    from fastfill.components.platform import registry
    from fastfill.components.platform.config import load_params

    old_uri, new_uri = _register_both(team)
    registry.setup(load_params(team / "params.yaml").mlflow)
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    for uri in (old_uri, new_uri):
        folder = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(elsewhere / uri[-1])))
        mlmodel = yaml.safe_load((folder / "MLmodel").read_text())
        assert mlmodel["run_id"] and mlmodel["model_id"], mlmodel
        assert (folder / "code" / "fastfill" / "components" / "model_store" / "pyfunc.py").is_file()
        assert not list((folder / "code").rglob("*.pyc"))
        pins = (folder / "requirements.txt").read_text().split()
        assert {p.split("==")[0] for p in pins} >= {"mlflow", "torch", "torchvision", "numpy", "safetensors",
                                                    "onnxruntime", "pydantic"}, pins
        for example in ("input_example.json", "serving_input_example.json"):
            assert (folder / example).stat().st_size < 4096, example
        model = registered.load_model(uri)
        pixels = np.stack([model.preprocessing.decode(_encoded(p)) for p in _photos(3, seed=4)])
        np.save(elsewhere / "pixels.npy", pixels)
        answer = subprocess.run([sys.executable, "-c", _OUTSIDE_THE_PRODUCT, str(Path.cwd()), str(folder),
                                 str(elsewhere / "pixels.npy"), str(elsewhere / "out.npy"), str(folder)],
                                cwd=elsewhere, capture_output=True, text=True, timeout=300,
                                env={**os.environ, "PYTHONPATH": ""})
        assert answer.returncode == 0, answer.stderr[-3000:]
        loaded = json.loads(answer.stdout.strip().splitlines()[-1])
        assert Path(loaded["loader"]).is_relative_to(folder / "code"), loaded  # the version's own copy
        assert loaded["example"][1] == model.preprocessing.channels
        np.testing.assert_array_equal(np.load(elsewhere / "out.npy"), embed(model, pixels))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_served_model_answers_over_http(team):
    old_uri, _ = _register_both(team)
    port = _free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{team / 'mlflow.db'}"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    log = open(team / "serve.log", "wb")
    server = subprocess.Popen(["mlflow", "models", "serve", "-m", old_uri, "--env-manager", "local", "-h",
                               "127.0.0.1", "-p", str(port), "-w", "1"], env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None, (team / "serve.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "mlflow models serve did not answer in 120 s"
            time.sleep(0.5)
        pixels = np.stack([OLD_INPUT.decode(_encoded(p)) for p in _photos(3)])
        request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations",
                                         data=json.dumps({"inputs": pixels.tolist()}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            served = np.asarray(json.loads(answer.read())["predictions"], dtype=np.float32)
        np.testing.assert_allclose(served, embed(registered.load_model(old_uri), pixels), rtol=1e-6, atol=1e-6)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


class _Payload:
    """Unpickling this writes the marker: proof that a pickle's code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "ran"))


def _pickled_mlflow_model(team: Path, marker: Path) -> str:
    """A model in the team's registry whose pytorch flavour is a pickle carrying a payload."""
    from fastfill.components.platform import registry
    from fastfill.components.platform.config import load_params

    folder = team / "pickled-model"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "model.pth").write_bytes(pickle.dumps(_Payload(marker)))
    (folder / "MLmodel").write_text(yaml.safe_dump({"flavors": {
        "pytorch": {"model_data": "data", "pytorch_version": str(torch.__version__)},
        "python_function": {"loader_module": "mlflow.pytorch", "data": "data", "python_version": "3.11"}}}))
    client, experiment = registry.setup(load_params(team / "params.yaml").mlflow)
    run = client.create_run(experiment)
    client.log_artifacts(run.info.run_id, str(folder), "model")
    client.create_registered_model("theirs")
    source = f"{client.get_run(run.info.run_id).info.artifact_uri}/model"
    return "models:/theirs/" + str(client.create_model_version("theirs", source, run_id=run.info.run_id).version)


def test_a_pickled_mlflow_model_is_refused_and_its_code_never_runs(team):
    marker = team / "code-ran"
    uri = _pickled_mlflow_model(team, marker)
    refused = _cli(team, "model", "register", "--mlflow", uri, "--preset", "imagenet")
    assert refused.exit_code == 6, refused.output
    assert "mlflow.allow_pickled_models" in refused.output and "nothing was registered" in refused.output
    assert refused.output.count("\n") == 1 and "Traceback" not in refused.output
    assert not marker.exists()
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{team / 'mlflow.db'}")
    assert client.search_model_versions("name = 'team-embedder'") == []


def test_an_onnx_model_from_an_mlflow_registry_is_copied_as_data(team):
    """A model already in the team's registry as an onnx flavour registers without running code."""
    from fastfill.components.platform import registry
    from fastfill.components.platform.config import load_params

    folder = team / "their-onnx"
    folder.mkdir()
    (folder / "model.onnx").write_bytes((team / "old.onnx").read_bytes())
    (folder / "MLmodel").write_text(yaml.safe_dump({"flavors": {"onnx": {"data": "model.onnx",
                                                                          "onnx_version": "1.23.2"}}}))
    client, experiment = registry.setup(load_params(team / "params.yaml").mlflow)
    run = client.create_run(experiment)
    client.log_artifacts(run.info.run_id, str(folder), "model")
    client.create_registered_model("serving")
    source = f"{client.get_run(run.info.run_id).info.artifact_uri}/model"
    version = client.create_model_version("serving", source, run_id=run.info.run_id).version
    done = _cli(team, "model", "register", "--mlflow", f"models:/serving/{version}", "--size", "20", "--channels",
                "3", "--mean", "0.5", "--std", "0.5", "--json")
    assert done.exit_code == 0, done.output
    ours = registered.load_model(json.loads(done.stdout)["uri"])
    pixels = np.stack([OLD_INPUT.decode(_encoded(p)) for p in _photos(4)])
    np.testing.assert_allclose(embed(ours, pixels), embed(registered.load_model(_register_both(team)[0]), pixels),
                               rtol=0, atol=0)


def _nan_onnx(path: Path) -> Path:
    class Broken(nn.Module):
        def forward(self, x):
            return x.mean(dim=(2, 3)) / 0.0 * 0.0  # NaN everywhere

    return _export(Broken(), OLD_INPUT.shape, path)


def _per_image_map(path: Path) -> Path:
    return _export(nn.Conv2d(3, 2, 3), OLD_INPUT.shape, path)  # (N, 2, 18, 18): no vector per image


def test_each_bad_file_ends_in_one_line_with_nothing_registered(team):
    from mlflow import MlflowClient

    (team / "garbage.onnx").write_bytes(b"\x08\x07 not a graph")
    torch.save(_new_network(), team / "whole-module.pt")  # a pickled module, not a state dict
    from fastfill.components.experiment.vision import torchvision
    torch.save(torchvision.models.resnet34(num_classes=6).state_dict(), team / "resnet34.pt")
    _nan_onnx(team / "nan.onnx")
    small = ["--size", "20", "--channels", "3"]
    cases = [
        (["--onnx", str(team / "garbage.onnx"), *small], "not an ONNX graph"),
        (["--onnx", str(team / "missing.onnx"), *small], "no ONNX file"),
        (["--onnx", str(team / "old.onnx"), "--size", "24", "--channels", "3"], "the ONNX graph takes images of"),
        (["--onnx", str(team / "nan.onnx"), *small], "non-finite values"),
        (["--onnx", str(_per_image_map(team / "conv.onnx")), *small, "--output", "embedding"], "must be one vector per image"),
        (["--onnx", str(team / "old.onnx"), *small, "--dim", "64"], "have 10 dimensions, not the 64 expected"),
        (["--onnx", str(team / "old.onnx"), *small, "--output", "logits"], "has no output 'logits'"),
        (["--torchvision", "resnet18", "--weights", str(team / "resnet34.pt"), "--preset", "imagenet"],
         "the weights do not fit torchvision's resnet18"),
        (["--torchvision", "resnet18", "--weights", str(team / "whole-module.pt"), "--preset", "imagenet"],
         "pickled objects besides tensors"),
        (["--torchvision", "resnet81", "--weights", str(team / "new.safetensors"), "--preset", "imagenet"],
         "torchvision has no architecture 'resnet81'"),
        (["--torchvision", "resnet18", "--weights", str(team / "new.safetensors"), "--preset", "imagenet",
          "--layer", "layer9"], "has no layer 'layer9'"),
        (["--torchvision", "resnet18", "--weights", str(team / "old.onnx"), "--preset", "imagenet"],
         "is not a torch file"),
    ]
    for args, says in cases:
        result = _cli(team, "model", "register", *args)
        assert result.exit_code == 6, (args, result.output)
        assert says in result.output and "nothing was registered" in result.output, (args, result.output)
        assert result.output.count("\n") == 1 and "Traceback" not in result.output, (args, result.output)
    assert MlflowClient(f"sqlite:///{team / 'mlflow.db'}").search_registered_models() == []
    usage = _cli(team, "model", "register", "--onnx", str(team / "old.onnx"))
    assert usage.exit_code == 2 and "give --size and --channels" in usage.output
    usage = _cli(team, "model", "register", "--onnx", str(team / "old.onnx"), *small, "--layer", "fc")
    assert usage.exit_code == 2 and "--layer is for --torchvision or --mlflow" in usage.output


def test_an_upgrade_between_two_team_models_of_different_sizes_completes(team, prefect_harness):
    """Old: an ONNX graph on 20x20 stretched RGB; new: a torchvision ResNet-18 on 32x32 crops with
    ImageNet scaling. A gallery of RGB JPEGs of mixed sizes, adopted without labels, ends with
    exactly the new model's features of each file as its preprocessing decodes it."""
    from fastfill.components.gallery.layouts.catalog import PartsGallery
    from fastfill.components.gallery.store import open_store
    from fastfill.components.platform.config import load_params
    from fastfill.flows.upgrade import upgrade_flow

    old_uri, new_uri = _register_both(team)
    pictures = _photos(90, seed=5)
    photos = _adopted(team, pictures, [(7000 + i, f"sku-{i:03d}.jpg") for i in range(len(pictures))],
                      {"chunk_size": 16, "eval_queries": 20, "map_sample": 40})

    gallery = PartsGallery(open_store(str(team / "gallery")))
    old_model, new_model = registered.load_model(old_uri), registered.load_model(new_uri)
    files = [(photos / f"sku-{i:03d}.jpg").read_bytes() for i in range(len(pictures))]
    as_old = np.stack([OLD_INPUT.decode(f) for f in files])
    np.testing.assert_allclose(gallery.all_features(gallery.model), embed(old_model, as_old), rtol=1e-5, atol=1e-5)

    done = upgrade_flow(load_params(team / "params.yaml"), str(team / "gallery"), gate=False)
    assert done.state == "complete" and done.items_done == len(pictures), done
    gallery.manifest(refresh=True)
    assert gallery.model.uri == new_uri and gallery.model.dim == 512
    as_new = np.stack([NEW_INPUT.decode(f) for f in files])
    np.testing.assert_allclose(gallery.all_features(gallery.model), embed(new_model, as_new), rtol=1e-5, atol=1e-5)
    # the images a search sends are the new model's: the input shape moved with the model, and back on rollback
    assert gallery.manifest()["image_shape"] == list(NEW_INPUT.shape)
    from fastfill.flows.undo import rollback_flow

    rollback_flow(load_params(team / "params.yaml"), str(team / "gallery"))
    assert gallery.manifest(refresh=True)["image_shape"] == list(OLD_INPUT.shape) and gallery.model.uri == old_uri


def _headless_network() -> nn.Module:
    """A feature extractor with no classifier: its last layer is the 16-d embedding."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Conv2d(3, 10, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(10, 16, 3, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 16)).eval()


def test_a_new_model_without_a_classifier_trains_its_map_on_pseudo_classes(team, prefect_harness):
    """Both models ONNX exports (no head), a gallery without labels whose ids are text: K-means
    pseudo-classes of the map sample are the check's classes, outside the disc term by default
    (recorded on the map's version), the upgrade completes with the new model's features, and the search answers
    with the team's ids."""
    import mlflow

    from fastfill.components.gallery.layouts.catalog import PartsGallery
    from fastfill.components.gallery.store import open_store
    from fastfill.components.platform.config import load_params
    from fastfill.flows.upgrade import upgrade_flow

    _export(_headless_network(), (3, 24, 24), team / "new.onnx")
    old = _cli(team, "model", "register", "--onnx", str(team / "old.onnx"), "--size", "20", "--channels", "3",
               "--mean", "0.5", "--std", "0.5", "--alias", "champion", "--json")
    new = _cli(team, "model", "register", "--onnx", str(team / "new.onnx"), "--size", "24", "--channels", "3",
               "--alias", "challenger", "--json")
    assert old.exit_code == 0 and new.exit_code == 0, old.output + new.output
    assert json.loads(new.stdout).get("head") in (None, False, 0), new.stdout
    # the team's ids are text: SKUs with their leading zeros
    # 60 of 100 sampled for the map (at three quarters or more, the upgrade would re-embed instead)
    _adopted(team, _photos(100, seed=9), [(f"SKU-{i:05d}", f"p{i:02d}.jpg") for i in range(100)],
             {"chunk_size": 20, "eval_queries": 0, "map_sample": 60})

    params = load_params(team / "params.yaml")
    done = upgrade_flow(params, str(team / "gallery"), gate=False)
    assert done.state == "complete" and done.items_done == 100, done
    gallery = PartsGallery(open_store(str(team / "gallery")))
    assert gallery.model.uri == json.loads(new.stdout)["uri"] and gallery.model.dim == 16
    client = mlflow.MlflowClient(params.mlflow.tracking_uri)
    versions = client.search_model_versions(f"name = '{params.mlflow.alignment_model}'")
    trained = min(versions, key=lambda v: int(v.version))
    # 60 sampled items: K is lowered to 60 // 20 = 3 classes
    assert trained.tags["disc_targets"] == ("off (gallery.upgrade.pseudo_disc is false); the check's classes: "
                                            "pseudo-classes: 3 K-means clusters of the new features, with a head "
                                            "fitted on them"), trained.tags
    assert trained.tags["pairs.count"] == "60"

    # the search answers with the team's own ids
    np.testing.assert_array_equal(gallery.ids(), [f"SKU-{i:05d}" for i in range(100)])
    queries = gallery.all_features(gallery.model)[[3, 41, 77]]
    np.save(team / "queries.npy", queries)
    found = _cli(team, "search", "--features", str(team / "queries.npy"), "-k", "2", "--store", str(team / "gallery"))
    assert found.exit_code == 0, found.output
    answer = json.loads(found.stdout)
    assert [row[0] for row in answer["ids"]] == ["SKU-00003", "SKU-00041", "SKU-00077"], answer
    assert answer["sources"][0][0] == gallery.model.uri


def test_a_team_model_ingests_grey_images_of_another_size_and_names_what_it_cannot(team, prefect_harness):
    """`gallery ingest` with a team's ONNX model (RGB 20x20): grey 28x28 pixels are converted and
    resized by its preprocessing and stored with exactly the features it gives them; pixels of
    two channels are refused in one line that says what it takes, with nothing stored."""
    from fastfill.components.gallery.layouts.catalog import PartsGallery
    from fastfill.components.gallery.store import open_store

    old_uri, _ = _register_both(team)
    rng = np.random.default_rng(4)
    grey = rng.integers(0, 255, (30, 1, 28, 28)).astype(np.uint8)
    np.save(team / "grey.npy", grey)
    done = _cli(team, "gallery", "ingest", "--model", old_uri, "--images", str(team / "grey.npy"),
                "--store", str(team / "grey"))
    assert done.exit_code == 0, done.output
    gallery = PartsGallery(open_store(str(team / "grey")))
    assert gallery.model.uri == old_uri and gallery.num_items == 30
    expected = embed(registered.load_model(old_uri), grey)
    np.testing.assert_allclose(gallery.all_features(gallery.model), expected, rtol=1e-5, atol=1e-5)

    # the real command, as a team runs it (a process of its own), on the tests' Prefect server
    from prefect.settings import get_current_settings

    np.save(team / "two.npy", rng.integers(0, 255, (5, 2, 28, 28)).astype(np.uint8))
    command = [sys.executable, "-m", "fastfill.cli", "gallery", "ingest", "--model", old_uri, "--images",
               str(team / "two.npy"), "--store", str(team / "two"), "--params", str(team / "params.yaml")]
    env = {**os.environ, "PREFECT_API_URL": get_current_settings().api.url}
    refused = subprocess.run(command, cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True,
                             text=True, timeout=300, check=False)
    assert refused.returncode != 0, refused.stdout + refused.stderr
    said = refused.stdout + refused.stderr
    assert "images must be uint8 (N, 1 or 3, H, W)" in said and "Traceback" not in said, said[-3000:]
    assert not (team / "two").exists() or not any((team / "two").rglob("gallery.json"))
