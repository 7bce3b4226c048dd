"""Where a team's model comes from, checked before anything is registered.

``from_onnx``, ``from_torchvision`` and ``from_mlflow`` build the embedder from what a team has
(an ONNX file; a torchvision architecture name and a weights file; a model URI in an MLflow
registry), run a probe batch through it (``ForeignEmbedder.probe``) and return it with the files
its registered version will hold. A ModelSourceError says in one line what to fix: a file that is
not what it claims, weights that do not fit the architecture, an output that is not one finite
vector per image, a size that differs from the one expected.

An MLflow model is read as data when its flavour is ``onnx`` (the graph is copied into the new
version). Its ``pytorch`` and ``python_function`` flavours are pickles: loading one runs whatever
code it holds, so they are refused, with nothing of them loaded, unless
``mlflow.allow_pickled_models`` (or FASTFILL_ALLOW_PICKLED_MODELS=1) says the registry's writers
are trusted; the version then refers to the model and loads it each time, under the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastfill.components.model_store.embedders import (
    ModelSourceError,
    ModuleEmbedder,
    OnnxEmbedder,
    TorchvisionEmbedder,
    read_state_dict,
)
from fastfill.components.model_store.preprocessing import Preprocessing
from fastfill.components.platform import registry

PICKLED_FLAVOURS = ("pytorch", "python_function")


@dataclass
class Source:
    """A probed embedder and what its registered version records: the description's fields
    and the files (name -> bytes or path)."""

    embedder: Any  # a ModuleEmbedder, TorchvisionEmbedder or OnnxEmbedder (embedders.py)
    description: dict
    files: dict = field(default_factory=dict)


def _described(embedder, source: str, **fields) -> dict:
    return {"kind": "embedder", "source": source, "preprocessing": embedder.preprocessing.model_dump(mode="json"),
            "embedding_dim": embedder.embedding_dim,
            "head": int(embedder.classifier.out_features) if getattr(embedder.classifier, "out_features", None)
            else None, **fields}


def _check_dim(embedder, expected: int | None) -> None:
    if expected is not None and embedder.embedding_dim != expected:
        raise ModelSourceError(f"the model's embeddings have {embedder.embedding_dim} dimensions, not the "
                               f"{expected} expected: check --dim, or the layer or output the embedding is read at")


def from_onnx(path, preprocessing: Preprocessing, *, output: str | None = None, dim: int | None = None) -> Source:
    path = Path(path)
    if not path.is_file():
        raise ModelSourceError(f"no ONNX file {path}")
    graph = path.read_bytes()
    embedder = OnnxEmbedder(graph, preprocessing, output)
    embedder.probe()
    _check_dim(embedder, dim)
    return Source(embedder, _described(embedder, "onnx", output=embedder.output_name), {"model.onnx": graph})


def from_torchvision(architecture: str, weights, preprocessing: Preprocessing, *, layer: str | None = None,
                     dim: int | None = None) -> Source:
    from safetensors.torch import save

    state = read_state_dict(weights)
    embedder = TorchvisionEmbedder(architecture, state, preprocessing, layer)
    embedder.probe()
    _check_dim(embedder, dim)
    tensors = {k: v.detach().contiguous() for k, v in embedder.net.state_dict().items()}
    return Source(embedder, _described(embedder, "torchvision", architecture=architecture, layer=layer),
                  {"weights.safetensors": save(tensors)})


def mlflow_flavours(uri: str) -> tuple[Path, dict]:
    """(the downloaded model folder, its MLmodel's flavours), reading nothing but files."""
    import mlflow.artifacts
    import yaml
    from mlflow.exceptions import MlflowException

    try:
        folder = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri))
    except (MlflowException, OSError) as error:
        raise ModelSourceError(f"cannot read the MLflow model {uri}: {str(error).splitlines()[0][:300]}") from error
    mlmodel = folder / "MLmodel"
    if not mlmodel.is_file():
        raise ModelSourceError(f"{uri} is not an MLflow model: it has no MLmodel file")
    return folder, (yaml.safe_load(mlmodel.read_text()) or {}).get("flavors", {})


def from_mlflow(uri: str, preprocessing: Preprocessing, *, layer: str | None = None, output: str | None = None,
                dim: int | None = None) -> Source:
    """A model already in an MLflow registry (``models:/name/3``, ``runs:/...``): its ``onnx``
    flavour copied, or (trusted writers only) its pickled flavour referred to."""

    folder, flavours = mlflow_flavours(uri)
    if "fastfill" in flavours:
        raise ModelSourceError(f"{uri} was registered by this product already: set an alias on it "
                               "(fastfill model alias) instead of registering it again")
    if "onnx" in flavours:
        graph = folder / flavours["onnx"].get("data", "model.onnx")
        source = from_onnx(graph, preprocessing, output=output, dim=dim)
        source.description.update(origin=uri)
        return source
    pickled = [name for name in PICKLED_FLAVOURS if name in flavours]
    if not pickled:
        raise ModelSourceError(f"{uri} has flavours {', '.join(flavours) or 'none'}; this product reads onnx, "
                               f"and pytorch or python_function from trusted writers")
    if not registry.pickled_models_allowed():
        raise ModelSourceError(
            f"{uri} is a pickled {pickled[0]} model, and loading a pickle runs any code in it: nothing of it was "
            f"loaded. Export it to ONNX and register that, or, if you trust everyone who can write to that "
            f"registry, set mlflow.allow_pickled_models: true (or {registry.PICKLE_OPT_IN}=1)")
    embedder = load_trusted_mlflow(uri, preprocessing, layer)
    embedder.probe()
    _check_dim(embedder, dim)
    return Source(embedder, _described(embedder, "mlflow", reference=uri, flavour=pickled[0], layer=layer))


class _PyfuncModule(ModuleEmbedder):
    """A trusted python_function model: its ``predict`` takes the preprocessed float32 batch."""

    def __init__(self, pyfunc, preprocessing: Preprocessing):
        import torch

        super().__init__(torch.nn.Identity(), preprocessing)
        self.pyfunc = pyfunc

    def embed_pixels(self, pixels):
        import numpy as np
        import torch

        x = self.preprocessing.normalise(pixels.float()).cpu().numpy().astype(np.float32)
        out = self.pyfunc.predict(x)
        return torch.from_numpy(np.asarray(out, dtype=np.float32)).to(pixels.device)


def load_trusted_mlflow(uri: str, preprocessing: Preprocessing, layer: str | None = None):
    """A pickled MLflow model, loaded only where its writers are trusted (the caller checked;
    checked again here, since a registered reference is loaded again later)."""

    if not registry.pickled_models_allowed():
        raise ModelSourceError(f"{uri} is a pickled model; loading it needs mlflow.allow_pickled_models: true "
                               f"(or {registry.PICKLE_OPT_IN}=1)")
    _folder, flavours = mlflow_flavours(uri)
    if "pytorch" in flavours:
        import mlflow.pytorch

        # its output is the embedding, unless a layer is named
        return ModuleEmbedder(mlflow.pytorch.load_model(uri, map_location="cpu"), preprocessing, layer)
    import mlflow.pyfunc

    return _PyfuncModule(mlflow.pyfunc.load_model(uri), preprocessing)
