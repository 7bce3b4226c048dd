"""The flows that fill a stored gallery: ingest (images, or given features, into the store with a
registered model's features) and adopt (a gallery where it is, its images read by URI). The
upgrade is flows/upgrade.py."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import overload

import numpy as np
from prefect import flow
from torch import nn

from fastfill.components.experiment.data import load_split
from fastfill.components.gallery.inputs.adopt import adopt, npy_rows, parquet_rows, read_manifest
from fastfill.components.gallery.inputs.images import read_images
from fastfill.components.gallery.inputs.input_files import input_path, is_s3, s3_folder
from fastfill.components.gallery.layouts.catalog import GalleryError, check_empty, check_features
from fastfill.components.gallery.layouts.opening import layout_of
from fastfill.components.gallery.layouts.pg_adopt import adopt_table
from fastfill.components.gallery.layouts.pg_table import index_settings
from fastfill.components.model_store import registered
from fastfill.components.platform import registry
from fastfill.components.platform.config import Params
from fastfill.components.platform.layout import Layout, load_array
from fastfill.components.platform.registry import ModelRef
from fastfill.flows.parameters import resolve_params, run_parameters, store_of
from fastfill.tasks._policy import log
from fastfill.tasks.embedding import embed_images, load_model
from fastfill.tasks.gallery_store import store_at, write_gallery


def _resolve(params: Params, uri: str) -> ModelRef:
    client, _ = registry.setup(params.mlflow)
    return registry.resolve_model(client, uri)


@overload
def _load_array(path: Path, what: str) -> np.ndarray: ...


@overload
def _load_array(path: Path | None, what: str) -> np.ndarray | None: ...


def _load_array(path: Path | None, what: str) -> np.ndarray | None:
    if path is None:
        return None

    try:
        return load_array(path, what, missing="check the path")
    except (FileNotFoundError, ValueError) as error:
        raise GalleryError(str(error)) from None


def _embedding_dim(model: nn.Module, ref: ModelRef) -> int:
    """The size of the features ``model`` (``ref``'s, loaded) gives: every embedder the registry
    loads says it."""
    dim = getattr(model, "embedding_dim", None)
    if not isinstance(dim, int):
        raise GalleryError(f"{ref.uri} does not say the size of its features (its embedding_dim is {dim!r}); "
                           "register it again with `fastfill model register`")
    return dim


def _ingest_run_name() -> str:
    parameters = run_parameters()
    return f"ingest into {store_of(parameters)} with {parameters.get('model_uri') or 'champion'}"


@flow(name="gallery-ingest", flow_run_name=_ingest_run_name, log_prints=True)
def ingest_flow(params: Params | None = None, store_uri: str | None = None, model_uri: str = "",
                images: Path | None = None, labels: Path | None = None, groups: Path | None = None,
                ids: Path | None = None, features: Path | None = None, params_path: str | None = None) -> dict:
    """Put images (default: the prepared test split) into the store (default gallery.store)
    with the features of the ``model_uri`` model (default: the registry's champion), or with
    given features. The configuration is ``params`` (the Python API) or the file
    ``params_path`` (the CLI: small parameters, readable in the Prefect UI)."""
    params = resolve_params(params, params_path, None)
    store_uri = store_uri or params.gallery.store
    store = store_at(store_uri)
    check_empty(store, "ingest")  # before anything is embedded
    model_uri = model_uri or f"models:/{params.mlflow.registered_model}@{registry.CHAMPION}"
    ref = _resolve(params, model_uri)
    label_array: np.ndarray | None
    if images is None:

        split = load_split(Layout(params.paths).splits, "test")
        image_array, label_array = split.images, split.labels
        log(f"ingesting the prepared test split: {len(image_array)} images")
    else:
        image_array, label_array = _load_array(images, "--images"), _load_array(labels, "--labels")
    group_array, id_array = _load_array(groups, "--groups"), _load_array(ids, "--ids")
    feature_array = _load_array(features, "--features")
    if image_array.ndim == 3:
        image_array = image_array[:, None]
    model = load_model(ref)
    ref = ModelRef(ref.name, ref.version, _embedding_dim(model, ref))
    _check_images(image_array, model, ref)
    if feature_array is None:
        log(f"embedding {len(image_array)} images with {ref.uri}")
        feature_array = embed_images(model, image_array)
    else:
        feature_array = check_features(feature_array, ref.dim, f"--features {features}")
    manifest = write_gallery(store_uri, image_array, feature_array, ref, label_array, group_array, id_array,
                             params.gallery.part_size, registry.identity(params.mlflow), params.gallery.layout,
                             params.gallery)
    log(f"gallery at {store.uri} ({manifest['layout']} layout): {manifest['num_items']} items in "
        f"{manifest['num_parts']} parts, model {ref.uri}")
    return manifest


def _check_images(images: np.ndarray, model, ref: ModelRef) -> None:
    """Images the model can embed: uint8 (N, C, H, W) with the channels of a model this project
    trained, or grey or RGB pixels of any size for a registered team model (its preprocessing
    converts and resizes them)."""
    preprocessing = getattr(model, "preprocessing", None)
    channels = (1, 3) if preprocessing is not None else (model.in_channels,)
    if images.ndim != 4 or images.dtype != np.uint8 or images.shape[1] not in channels:
        wanted = " or ".join(str(c) for c in channels)
        raise GalleryError(f"images must be uint8 (N, {wanted}, H, W) for {ref.uri}, got {images.dtype} "
                           f"{images.shape}")


def _adopt_run_name() -> str:
    parameters = run_parameters()
    return f"adopt {parameters.get('manifest')} into {store_of(parameters)}"


@flow(name="gallery-adopt", flow_run_name=_adopt_run_name, log_prints=True)
def adopt_flow(params: Params, store_uri: str, manifest: str, model_uri: str = "", root: str | None = None,
               features: list[str] | None = None, features_column: str = "features",
               image_shape: tuple[int, int, int] | None = None) -> dict:
    """Adopt a gallery where it is (components.gallery.inputs.adopt): the manifest file's items, the
    current features of ``model_uri`` (default: the champion) from ``.npy`` shards or a Parquet
    column, or, without ``features``, the model's features of the images read by URI. The
    manifest and the feature files are local paths or ``s3://`` URIs alike."""

    store = store_at(store_uri)
    store.check()
    with tempfile.TemporaryDirectory(prefix="fastfill-adopt-") as scratch:
        feature_files = [input_path(f, "--features", Path(scratch) / f"features-{i}")
                         for i, f in enumerate(features or [])]
        return _adopt(params, store, str(manifest), input_path(manifest, "--manifest", Path(scratch)), model_uri,
                      root, feature_files, features_column, image_shape)


@flow(name="gallery-adopt-table", log_prints=True)
def adopt_table_flow(params: Params, store_uri: str, vector_column: str, model_uri: str = "",
                     label_column: str | None = None, root: str | None = None,
                     image_shape: tuple[int, int, int] | None = None) -> dict:
    """Adopt a team's PostgreSQL table where it is (gallery.pgvector names the server, table, id and
    image columns): no vector is copied; ``vector_column`` holds ``model_uri``'s features
    (default: the champion); the store gets the items, the view serves the column
    (components.gallery.layouts.pg_table)."""
    store = store_at(store_uri)
    store.check()
    ref = _resolve(params, model_uri or f"models:/{params.mlflow.registered_model}@{registry.CHAMPION}")
    shape = tuple(image_shape) if image_shape else registered.input_shape(ref.uri)
    if not shape or len(shape) != 3:
        raise GalleryError(f"{ref.uri} does not say what images it takes; give --image-shape C,H,W")
    if ref.dim is None:
        ref = ModelRef(ref.name, ref.version, _embedding_dim(load_model(ref), ref))
    settings = index_settings(params.gallery.pgvector, params.gallery.distance, store.uri)

    def on_part(done: int, total: int) -> None:
        log(f"adopt: items part {done}/{total} written")

    result = adopt_table(store, settings, ref, shape, vector_column=vector_column, label_column=label_column,
                         root=root, part_size=params.gallery.part_size, registry=registry.identity(params.mlflow),
                         on_part=on_part)
    log(f"gallery at {store.uri} (pgvector layout): {result['num_items']} items of {settings['table']} adopted where "
        f"they are, model {ref.uri} in column {vector_column}; the team's service queries the view {settings['view']}")
    return result


def _adopt(params: Params, store, manifest: str, manifest_file: Path, model_uri: str, root: str | None,
           features: list[Path], features_column: str, image_shape: tuple[int, int, int] | None) -> dict:
    table = read_manifest(manifest_file, shown=manifest)
    if root is None:  # relative URIs: beside the manifest
        root = s3_folder(manifest) if is_s3(manifest) else str(manifest_file.resolve().parent)
    elif not root.startswith("s3://"):
        root = str(Path(root.removeprefix("file://")).resolve())
    model_uri = model_uri or f"models:/{params.mlflow.registered_model}@{registry.CHAMPION}"
    ref = _resolve(params, model_uri)
    # the images as the model takes them: its own preprocessing, unless --image-shape says otherwise
    shape = tuple(image_shape) if image_shape else registered.input_shape(ref.uri)
    if not shape or len(shape) != 3:
        raise GalleryError(f"{ref.uri} does not say what images it takes; give --image-shape C,H,W")
    config = params.gallery.upgrade
    if features:
        first = Path(features[0])
        rows = (parquet_rows(first, features_column) if first.suffix.lower() == ".parquet"
                else npy_rows([Path(p) for p in features]))
        dim = ref.dim or None
        if dim is None:
            dim = _embedding_dim(load_model(ref), ref)
        ref = ModelRef(ref.name, ref.version, dim)
        embed_part = None
        log(f"adopting {table.num_rows} items from {manifest} with the features of {ref.uri} in {len(features)} "
            f"file(s); the images stay where they are")
    else:
        model = load_model(ref)
        ref, rows = ModelRef(ref.name, ref.version, _embedding_dim(model, ref)), None

        decoding = shape if image_shape else getattr(model, "preprocessing", None) or shape

        def embed_part(uris: list[str]) -> np.ndarray:
            images, failures = read_images(uris, decoding, root=root, workers=config.read_workers)
            if failures:
                first = failures[0]
                raise GalleryError(f"{len(failures)} of {len(uris)} images of a part could not be read (first: "
                                   f"{first.uri}: {first.reason}); fix them or leave them out of the manifest")
            return embed_images(model, images, config.batch_size, config.precision)

        log(f"adopting {table.num_rows} items from {manifest}: embedding their images with {ref.uri} "
            f"({config.read_workers} reads at a time); the images stay where they are")

    def on_part(done: int, total: int) -> None:
        log(f"adopt: part {done}/{total} written")

    result = adopt(store, table, ref, shape, root=root, features=rows, embed_part=embed_part,
                   part_size=params.gallery.part_size, on_part=on_part, registry=registry.identity(params.mlflow),
                   layout=layout_of(params.gallery.layout, params.gallery))
    log(f"gallery at {store.uri} ({result['layout']} layout): {result['num_items']} items in {result['num_parts']} "
        f"parts, model {ref.uri}, "
        f"images read by URI{f' under {root}' if root else ''}")
    return result
