"""Registered models as MLflow logged models whose network is data (``components.model_store.artifact``):
each version is an ``MLmodel`` (pyfunc flavour over this package's loader, carried in its
``code/`` with the requirements that load it; signature; an input example of a few pixels; the
logged model's run) beside a typed description of the network and its weights (safetensors, or an
ONNX graph), so ``mlflow.pyfunc.load_model`` and ``mlflow models serve`` run it anywhere, and the
product's own loading builds the network from the description: nothing a writer to the registry
puts there runs in the product. Versions written
by earlier releases (the description and ``weights.safetensors``/``weights.pt`` with no
``MLmodel``) still load. Versions stored as pickled modules by earlier releases are refused
unless ``mlflow.allow_pickled_models`` says their writers are trusted."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fastfill.components.experiment.models import Embedder, describe
from fastfill.components.model_store.artifact import (  # noqa: F401
    DATA_PATH,
    LEGACY_WEIGHTS_FILE,
    MODEL_FILE,
    WEIGHTS_FILE,
    load_folder,
    log_version,
    preprocessing_of,
    read_description,
)
from fastfill.components.platform import registry
from fastfill.components.platform.registry import RegistryError


def _new_version(client, run_id: str, name: str, info, tags: Mapping[str, str]) -> str:
    """Register the model the run logged (``info``: its ``ModelInfo``, from ``log_version``) as a
    new version of ``name``, tagged as it is created (no version without its tags: a write tried
    again finds its own by them); returns the version."""
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
    return str(client.create_model_version(name, f"models:/{info.model_id}", run_id=run_id, model_id=info.model_id,
                                           tags={key: str(value) for key, value in tags.items()}).version)


def _example_pixels(channels: int) -> np.ndarray:
    """An embedder's input example: one grey 8 x 8 image (the signature takes any size, and the
    model resizes it by its own rule), a few hundred bytes in the version."""
    return np.full((1, channels, 8, 8), 128, dtype=np.uint8)


def _register(client, run_id: str, module, example: np.ndarray, name: str, artifact: str,
              tags: Mapping[str, str]) -> str:
    """A module of this project's own architectures as a version of ``name``: its typed
    description (``models.describe``) and its weights (a state_dict in safetensors)."""
    from safetensors.torch import save

    module = module.cpu().eval()
    weights = save({k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()})
    spec = describe(module)
    embedder = isinstance(module, Embedder)
    description: dict[str, Any] = {"kind": "embedder" if embedder else "alignment", "source": "fastfill", "spec": spec,
                   "input_shape": list(example.shape[1:])}
    if embedder:
        shape = tuple(int(x) for x in example.shape[1:])
        description.update(
            preprocessing=dict(channels=shape[0], height=shape[1], width=shape[2], resize="stretch",
                               mean=[float(module.pixel_mean)], std=[float(module.pixel_std)]),
            embedding_dim=module.embedding_dim, head=len(module.classes))
        info = log_version(run_id, artifact, description, {WEIGHTS_FILE: weights}, _example_pixels(shape[0]),
                           module.embedding_dim)
    else:
        sigma = getattr(module, "uncertainty", None) is not None
        info = log_version(run_id, artifact, description, {WEIGHTS_FILE: weights},
                           np.zeros((1, module.old_dim), np.float32), module.new_dim, sigma=sigma)
    return _new_version(client, run_id, name, info, tags)


def register_source(client, run_id: str, source, name: str, alias: str | None, tags: Mapping[str, str]) -> str:
    """A team's embedder (``components.model_store.sources.Source``, probed) as a version of ``name``."""
    embedder = source.embedder
    info = log_version(run_id, "embedder", source.description, source.files,
                       _example_pixels(embedder.preprocessing.shape[0]), embedder.embedding_dim)
    version = _new_version(client, run_id, name, info, tags)
    if alias:
        client.set_registered_model_alias(name, alias, version)
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


def load_model(uri: str):
    """A registered model by URI, e.g. ``models:/embedder@champion``, built from its typed
    description with its weights read as tensors (or its ONNX graph), so loading runs no code from
    the registry; an embedder carries its ``preprocessing``. A version stored as a pickled module
    (an older format) is refused unless ``mlflow.allow_pickled_models`` (or
    FASTFILL_ALLOW_PICKLED_MODELS=1) says its writers are trusted."""
    folder = _model_folder(uri)
    if read_description(folder) is None:
        if not (folder / "MLmodel").is_file():
            raise RegistryError(f"{uri} is not a model this product wrote: no {MODEL_FILE} and no MLmodel in it")
        if not registry.pickled_models_allowed():
            raise RegistryError(
                f"{uri} is stored as a pickled module (an older format), and loading a pickle runs any code in "
                f"it. Register it again from weights (fastfill model register), or, if you trust everyone who "
                f"can write to this registry, set mlflow.allow_pickled_models: true (or {registry.PICKLE_OPT_IN}=1)")
        import mlflow.pytorch

        return mlflow.pytorch.load_model(uri, map_location="cpu")
    return load_folder(folder, uri)


def description(uri: str) -> dict | None:
    """A registered version's description (``components.model_store.artifact``), or None for a
    version this product did not write."""
    return read_description(_model_folder(uri))


def input_shape(uri: str) -> tuple[int, ...] | None:
    """The (C, H, W) a registered embedder takes, e.g. (1, 28, 28) for a grey 28x28 model; None
    if it records none."""
    described = description(uri)
    if described is not None:
        preprocessing = preprocessing_of(described)
        return preprocessing.shape if preprocessing is not None else None
    import mlflow.models

    signature = mlflow.models.get_model_info(uri).signature  # an older, pickled version: its signature
    try:
        shape = signature.inputs.inputs[0].shape
    except (AttributeError, IndexError, TypeError):
        return None
    return tuple(int(x) for x in shape[1:]) if shape and all(int(x) > 0 for x in shape[1:]) else None
