"""Registered models as data, never code: a version's folder holds a typed description of the
network (``models.describe``) and its weights (a state_dict in safetensors, the format that holds
tensors and nothing else), and loading builds the network from the description and reads the
weights as tensors, so nothing a writer to the registry puts there runs. Versions whose weights are
a ``weights.pt`` (earlier releases) still load, with ``torch.load(weights_only=True)``. Versions stored as pickled modules by earlier releases are
refused unless ``mlflow.allow_pickled_models`` says their writers are trusted."""

from __future__ import annotations

import hashlib
import json
import pickle
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from components.experiment.models import build, describe
from components.platform import registry
from components.platform.registry import RegistryError

MODEL_FILE = "fastfill-model.json"  # the typed description; beside it the weights, a state_dict
WEIGHTS_FILE = "weights.safetensors"
LEGACY_WEIGHTS_FILE = "weights.pt"  # earlier releases: a state_dict read with torch.load(weights_only=True)
MODEL_FORMAT = "fastfill-model/1"


def _register(client, run_id: str, module, example: np.ndarray, name: str, artifact: str,
              tags: Mapping[str, str]) -> str:
    """Log a torch module under ``artifact`` in the run as data, never as code: its typed
    description (``models.describe``) and its weights (a state_dict in safetensors); register that folder as a new version of ``name`` and
    tag the version; returns the version."""
    from safetensors.torch import save_file

    module = module.cpu().eval()
    # a folder of its own in the run: a second model registered from the same run (a fallback map
    # beside the map it replaces, two versions copied in one run) must not overwrite the first's files
    taken = {entry.path for entry in client.list_artifacts(run_id)}
    artifact = next(path for path in (artifact, *(f"{artifact}-{k}" for k in range(2, 10_000))) if path not in taken)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        save_file({k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}, folder / WEIGHTS_FILE)
        weights = hashlib.sha256((folder / WEIGHTS_FILE).read_bytes()).hexdigest()
        (folder / MODEL_FILE).write_text(json.dumps({
            "format": MODEL_FORMAT, "spec": describe(module), "input_shape": list(example.shape[1:]),
            "weights": WEIGHTS_FILE, "sha256": weights}, indent=2))
        client.log_artifacts(run_id, str(folder), artifact)
    source = f"{client.get_run(run_id).info.artifact_uri.rstrip('/')}/{artifact}"
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException as error:
        if error.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        try:
            client.create_registered_model(name)
        except MlflowException as race:  # another process registered the name first
            if race.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
    version = str(client.create_model_version(name, source, run_id=run_id).version)
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, str(value))
    return version


def register_embedder(client, run_id: str, model, example: np.ndarray, name: str, alias: str | None,
                      tags: Mapping[str, str]) -> str:
    """The embedding model (classifier head included) as a version of ``name``, with ``alias``
    unless it is None."""
    version = _register(client, run_id, model, example, name, "embedder", tags)
    if alias:
        client.set_registered_model_alias(name, alias, version)
    return version


def register_alignment(client, run_id: str, alignment_map, example: np.ndarray, name: str,
                       tags: Mapping[str, str]) -> str:
    return _register(client, run_id, alignment_map, example, name, "alignment", tags)


def _model_folder(uri: str) -> Path:
    import mlflow.artifacts
    from mlflow.exceptions import MlflowException

    try:
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=uri))
    except MlflowException as error:  # a missing version or alias, an unreachable server
        raise RegistryError(f"cannot read the model {uri}: {error}") from error


def _description(folder: Path) -> dict | None:
    path = folder / MODEL_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def load_model(uri: str):
    """A registered model by URI, e.g. ``models:/embedder@champion``: built from its typed
    description, its weights read as tensors (safetensors; a legacy ``weights.pt`` with
    ``weights_only=True``), so loading runs no code from the registry. A version stored as a pickled module (an older format) is refused unless
    ``mlflow.allow_pickled_models`` (or FASTFILL_ALLOW_PICKLED_MODELS=1) says its writers are trusted."""
    import torch
    from pydantic import ValidationError
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = _model_folder(uri)
    described = _description(folder)
    if described is None:
        if not (folder / "MLmodel").is_file():
            raise RegistryError(f"{uri} is not a model this product wrote: no {MODEL_FILE} and no MLmodel in it")
        if not registry.pickled_models_allowed():
            raise RegistryError(
                f"{uri} is stored as a pickled module (an older format), and loading a pickle runs any code in "
                f"it. Register it again from weights (fastfill train/align do), or, if you trust everyone who "
                f"can write to this registry, set mlflow.allow_pickled_models: true (or {registry.PICKLE_OPT_IN}=1)")
        import mlflow.pytorch

        return mlflow.pytorch.load_model(uri, map_location="cpu")
    if described.get("format") != MODEL_FORMAT:
        raise RegistryError(f"{uri} is in format {described.get('format')!r}; this release reads {MODEL_FORMAT}")
    weights = folder / described["weights"]
    if hashlib.sha256(weights.read_bytes()).hexdigest() != described["sha256"]:
        raise RegistryError(f"{uri}: {described['weights']} does not match its recorded sha256; the artifact "
                            f"was altered or torn: register the model again")
    try:
        module = build(described["spec"])
        if weights.suffix == ".safetensors":
            state = load_file(weights, device="cpu")
        else:
            state = torch.load(weights, map_location="cpu", weights_only=True)
        module.load_state_dict(state)
    except (ValidationError, pickle.UnpicklingError, SafetensorError, RuntimeError, KeyError, TypeError) as error:
        # a wrong description, a refused pickle, or weights that do not fit the network
        raise RegistryError(f"{uri} could not be loaded as data: {type(error).__name__}: {error}") from error
    return module.eval()


def input_shape(uri: str) -> tuple[int, ...] | None:
    """The input shape of one example that a registered model was logged with, e.g. (1, 28, 28)
    for a grey 28x28 image model; None if it records none."""
    described = _description(_model_folder(uri))
    if described is not None:
        shape = described.get("input_shape") or []
        return tuple(int(x) for x in shape) if shape and all(int(x) > 0 for x in shape) else None
    import mlflow.models

    signature = mlflow.models.get_model_info(uri).signature  # an older, pickled version: its signature
    try:
        shape = signature.inputs.inputs[0].shape
    except (AttributeError, IndexError, TypeError):
        return None
    return tuple(int(x) for x in shape[1:]) if shape and all(int(x) > 0 for x in shape[1:]) else None
