"""A registered model version's folder: a real MLflow model whose network is data. It carries
the loader's code for other environments (``mlflow.pyfunc.load_model`` in a clean virtualenv,
``mlflow models serve``); the product itself builds the network from the description and never
runs code found in a version.

    MLmodel                   flavours python_function (loader_module fastfill.components.model_store.pyfunc)
                              and fastfill (the description below); signature; input example;
                              the logged model's id and its run
    input_example.json, serving_input_example.json, requirements.txt, python_env.yaml, conda.yaml
    code/fastfill/components/...  the loader and the product's modules it imports (MLflow's code_paths),
                              so a clean environment with requirements.txt loads the version
    data/fastfill/fastfill-model.json   the typed description (format fastfill-model/2)
    data/fastfill/weights.safetensors   a state dict, tensors only   (or)
    data/fastfill/model.onnx            an ONNX graph

The description says where the network comes from (``source``): ``fastfill`` (this project's own
architectures, ``components.experiment.models.describe``), ``torchvision`` (an architecture by
name and the layer the embedding is read at), ``onnx`` (a graph), or ``mlflow`` (a model in a
registry whose flavour is a pickle: a reference, loaded only where its writers are trusted); and,
for an embedder, its preprocessing, embedding size and head. Folders of the previous format
(``fastfill-model.json`` beside ``weights.safetensors``/``weights.pt``, no ``MLmodel``) still load.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import TypeVar

import numpy as np

from fastfill.components.experiment.models import build
from fastfill.components.model_store.embedders import ModelSourceError, OnnxEmbedder, TorchvisionEmbedder
from fastfill.components.model_store.preprocessing import Preprocessing
from fastfill.components.model_store.sources import load_trusted_mlflow
from fastfill.components.platform.registry import RegistryError

MODEL_FILE = "fastfill-model.json"
DATA_DIR = "fastfill"
DATA_PATH = Path("data") / DATA_DIR  # where MLflow puts a pyfunc model's data folder
WEIGHTS_FILE = "weights.safetensors"
ONNX_FILE = "model.onnx"
LEGACY_WEIGHTS_FILE = "weights.pt"  # format 1 of earlier releases: torch.load(weights_only=True)
FORMAT_1, FORMAT = "fastfill-model/1", "fastfill-model/2"
LOADER_MODULE = "fastfill.components.model_store.pyfunc"
PACKAGE = "fastfill.components"  # the loader imports nothing of the product outside it
SOURCES = ("fastfill", "torchvision", "onnx", "mlflow")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def requirements() -> list[str]:
    """What loading a version needs besides the loader's own code (``loader_code``), pinned as
    installed here: a clean environment holding these and the version's ``code/`` loads it."""
    from importlib.metadata import PackageNotFoundError, version

    pins = []
    for name in ("mlflow", "torch", "torchvision", "numpy", "safetensors", "onnxruntime", "pillow", "pydantic",
                 "pyyaml"):
        try:
            pins.append(f"{name}=={version(name).split('+')[0]}")
        except PackageNotFoundError:
            continue
    return pins


def _imported_modules(source: str) -> set[str]:
    """The product's modules ``source`` imports (module level and inside functions alike)."""
    import ast

    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name == PACKAGE or name.startswith(f"{PACKAGE}.")}


def loader_code(target: Path) -> Path:
    """Copy the loader (``LOADER_MODULE``) and every module of the product it imports, directly or
    not, with their packages' ``__init__.py``, into ``target/fastfill/components`` (a version's
    ``code/``), so the version loads where the product is not installed. Returns
    ``target/fastfill``, the folder MLflow's ``code_paths`` copies."""
    root = Path(__file__).resolve().parents[1]  # the folder of fastfill.components
    depth = PACKAGE.count(".") + 1
    copied: set[Path] = set()
    pending = [LOADER_MODULE]
    while pending:
        parts = pending.pop().split(".")[depth:]
        for path in (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")):
            if path.is_file() and path not in copied:
                copied.add(path)
                pending.extend(_imported_modules(path.read_text(encoding="utf-8")))
                pending.extend(".".join([PACKAGE, *parts[:level]]) for level in range(len(parts)))  # its packages
    for path in sorted(copied):
        destination = target.joinpath(*PACKAGE.split("."), path.relative_to(root))
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, destination)
    return target / PACKAGE.split(".")[0]


def log_version(run_id: str, name: str, description: dict, files: dict[str, Path | bytes], example: np.ndarray,
                output_dim: int, *, sigma: bool = False):
    """Log a version's MLflow model in run ``run_id`` as MLflow 3 logs models (a logged model
    named ``name`` with the run as its source, so its metadata, input example and lineage work in
    MLflow's API and UI) and return its ``ModelInfo``: ``files`` (name -> path or bytes) in
    ``data/fastfill/``, the description with the first file's sha256, the loader's code in
    ``code/`` and the requirements that load it. The signature is a tensor of ``example``'s dtype:
    for images (N, C, H, W) any batch size and any height and width (the model resizes by its own
    rule, so the input example is a few pixels), for features (N, d); it returns float32
    (N, ``output_dim``), plus ``log_sigma2`` for a map with ``sigma``."""
    import mlflow.pyfunc
    from mlflow.models import Model
    from mlflow.models.signature import ModelSignature
    from mlflow.types.schema import Schema, TensorSpec

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / DATA_DIR
        data.mkdir()
        for file_name, content in files.items():
            if isinstance(content, bytes):
                (data / file_name).write_bytes(content)
            else:
                shutil.copyfile(content, data / file_name)
        first = next(iter(files), None)
        described = {"format": FORMAT, **description}
        if first is not None:
            described.update(weights=first, sha256=_sha256(data / first))
        (data / MODEL_FILE).write_text(json.dumps(described, indent=2, sort_keys=True))
        shape = (-1, example.shape[1], -1, -1) if example.ndim == 4 else (-1, *example.shape[1:])
        inputs = Schema([TensorSpec(example.dtype, shape)])
        if sigma:
            outputs = Schema([TensorSpec(np.dtype(np.float32), (-1, output_dim), "features"),
                              TensorSpec(np.dtype(np.float32), (-1,), "log_sigma2")])
        else:
            outputs = Schema([TensorSpec(np.dtype(np.float32), (-1, output_dim))])
        flavour = {k: v for k, v in described.items() if k in ("format", "kind", "source")}

        class _Described(Model):  # the fastfill flavour beside python_function, in the MLmodel
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.add_flavor("fastfill", **flavour)

        return _Described.log(None, mlflow.pyfunc, name=name, run_id=run_id, loader_module=LOADER_MODULE,
                              data_path=str(data), code_paths=[str(loader_code(Path(tmp) / "code"))],
                              signature=ModelSignature(inputs, outputs), input_example=example,
                              pip_requirements=requirements())


def read_description(folder: Path) -> dict | None:
    """The description of a version's folder (format 2 in ``data/fastfill/``, format 1 at its root),
    or None for a folder this product did not write."""
    folder = Path(folder)
    for path in (folder / DATA_PATH / MODEL_FILE, folder / MODEL_FILE):
        if path.is_file():
            described = json.loads(path.read_text())
            described["_folder"] = str(path.parent)
            return described
    return None


def preprocessing_of(described: dict) -> Preprocessing | None:
    """The preprocessing a description records; format 1 recorded only the input shape, which
    it had as a stretch with the model's own scaling."""
    if described.get("preprocessing"):
        return Preprocessing(**described["preprocessing"])
    shape = described.get("input_shape") or []
    if len(shape) == 3 and all(int(x) > 0 for x in shape):
        return Preprocessing.plain(shape)
    return None


def load_folder(folder, uri: str):
    """The module a version's folder (or its ``data/fastfill/`` folder) describes, built as data:
    a ModelSourceError (a RegistryError upstream) says what is wrong."""

    folder = Path(folder)
    described = read_description(folder)
    if described is None:
        raise RegistryError(f"{uri} is not a model this product wrote: no {MODEL_FILE} in it")
    if described.get("format") not in (FORMAT, FORMAT_1):
        raise RegistryError(f"{uri} is in format {described.get('format')!r}; this release reads {FORMAT} "
                            f"and {FORMAT_1}")
    data = Path(described["_folder"])
    weights = data / described["weights"] if described.get("weights") else None
    if weights is not None and _sha256(weights) != described["sha256"]:
        raise RegistryError(f"{uri}: {described['weights']} does not match its recorded sha256; the artifact "
                            f"was altered or torn: register the model again")
    try:
        module = _build(described, weights, uri)
    except ModelSourceError as error:
        raise RegistryError(f"{uri} could not be loaded as data: {error}") from error
    module.fastfill_kind = described.get("kind") or described.get("spec", {}).get("kind", "embedder")
    if module.fastfill_kind in ("alignment", "unified"):
        module.fastfill_kind = "alignment"
    else:
        preprocessing = preprocessing_of(described)
        if preprocessing is not None:
            module.preprocessing = preprocessing
    module.fastfill_source = described.get("source", "fastfill")
    return module.eval()


T = TypeVar("T")


def _recorded(value: T | None, what: str) -> T:
    """A part of the description that this model's source needs."""
    if value is None:
        raise ModelSourceError(f"the description records no {what}")
    return value


def _build(described: dict, weights: Path | None, uri: str):
    import torch
    from pydantic import ValidationError
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    source = described.get("source", "fastfill")
    preprocessing = preprocessing_of(described)
    if source == "fastfill":

        try:
            module = build(described["spec"])
            path = _recorded(weights, "weights file")
            state = load_file(path, device="cpu") if path.suffix == ".safetensors" else \
                torch.load(path, map_location="cpu", weights_only=True)
            module.load_state_dict(state)
        except (ValidationError, pickle.UnpicklingError, SafetensorError, RuntimeError, KeyError, TypeError) as error:
            raise ModelSourceError(f"{type(error).__name__}: {error}") from error
        return module
    if source == "torchvision":

        module = TorchvisionEmbedder(described["architecture"], load_file(_recorded(weights, "weights file"), device="cpu"),
                                     _recorded(preprocessing, "preprocessing"), described.get("layer"))
    elif source == "onnx":

        module = OnnxEmbedder(_recorded(weights, "weights file").read_bytes(), _recorded(preprocessing, "preprocessing"),
                              described.get("output"))
    elif source == "mlflow":

        module = load_trusted_mlflow(described["reference"], _recorded(preprocessing, "preprocessing"), described.get("layer"))
    else:
        raise ModelSourceError(f"unknown source {source!r}; this release reads {', '.join(SOURCES)}")
    module.embedding_dim = int(described["embedding_dim"])
    if not described.get("head"):
        module.classifier = None
    return module
