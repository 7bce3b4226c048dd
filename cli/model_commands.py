"""Commands of the registry's embedding models: register a team's own model (an ONNX file, a
torchvision architecture and its weights, or a model already in an MLflow registry), list the
versions, show one."""

from __future__ import annotations

import json
import logging
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from fastfill.cli import app, json_output
from fastfill.cli.command_support import INPUT, USAGE, ParamsOption, call, fail, load, outcome
from fastfill.cli.json_output import JsonOption, answer, answers_json
from fastfill.components.model_store import catalogue
from fastfill.components.platform import registry
from fastfill.components.platform.registry import RegistryError

model_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                        help="The registry's embedding models: register a team's own, list, show.")
app.add_typer(model_app, name="model", short_help="Register your own embedding models; list and show versions.")

def _quiet_mlflow() -> None:
    """MLflow's INFO lines (a new store's tables, the input example's validation) are not this
    command's answer: warnings and errors still show."""
    import mlflow  # noqa: F401 - imported first: its import sets its loggers' levels, which would undo this

    logging.getLogger("mlflow").setLevel(logging.WARNING)


Alias = Enum("Alias", {"champion": "champion", "challenger": "challenger"}, type=str)
Resize = Enum("Resize", {"stretch": "stretch", "shorter-then-crop": "shorter-then-crop"}, type=str)
Interpolation = Enum("Interpolation", {"bilinear": "bilinear", "bicubic": "bicubic", "nearest": "nearest"}, type=str)


@model_app.command("register", short_help="A model you already serve as a new registry version.")
@answers_json
def model_register(
        onnx: Annotated[Path | None, typer.Option(help="an ONNX graph: images (N, C, H, W) in, embeddings out")] = None,
        torchvision: Annotated[str | None, typer.Option(help="a torchvision architecture name (resnet50, vit_b_16, "
                                                             "...), with --weights")] = None,
        weights: Annotated[Path | None, typer.Option(help="its weights: .safetensors, or a state dict saved with "
                                                          "torch.save (read with weights_only=True)")] = None,
        mlflow_uri: Annotated[str | None, typer.Option("--mlflow", help="a model in an MLflow registry "
                                                                         "(models:/NAME/VERSION, runs:/...)")] = None,
        layer: Annotated[str | None, typer.Option(help="the layer whose output is the embedding; default: the "
                                                       "input of the classifier, which is kept as the head")] = None,
        output: Annotated[str | None, typer.Option(help="ONNX: the output holding the embedding; default the "
                                                        "first")] = None,
        preset: Annotated[str | None, typer.Option(help="imagenet: 3x224x224 RGB, shorter side 256 then centre "
                                                        "crop, ImageNet mean and std (options below override)")] = None,
        size: Annotated[str | None, typer.Option(help="the input's HEIGHT,WIDTH (or one number)")] = None,
        channels: Annotated[int | None, typer.Option(help="1 (grey) or 3 (RGB)")] = None,
        resize: Annotated[Resize | None, typer.Option(help="stretch to the size, or the shorter side to "
                                                           "--resize-to then a centre crop")] = None,
        resize_to: Annotated[int | None, typer.Option(help="the shorter side before the crop (default size/0.875)")] = None,
        interpolation: Annotated[Interpolation | None, typer.Option(help="the resize's filter (default bilinear)")] = None,
        mean: Annotated[str | None, typer.Option(help="per-channel mean of pixels/255, e.g. 0.485,0.456,0.406")] = None,
        std: Annotated[str | None, typer.Option(help="per-channel std of pixels/255, e.g. 0.229,0.224,0.225")] = None,
        dim: Annotated[int | None, typer.Option(help="the embedding size you expect (checked on a probe batch)")] = None,
        name: Annotated[str | None, typer.Option(help="the registered model; default mlflow.registered_model")] = None,
        alias: Annotated[Alias | None, typer.Option(help="give the new version this alias")] = None,
        as_json: JsonOption = False,
        params: ParamsOption = Path("params.yaml")) -> None:
    """Register a model you already serve. A probe batch runs through it first: a file that is
    not what it claims, weights that do not fit the architecture, an output that is not one finite
    vector per image, or another size than --dim are refused in one line, with nothing registered.
    The version is an MLflow model holding the weights or graph and the preprocessing, never
    pickled code, with the loader and its requirements: mlflow.pyfunc.load_model and mlflow
    models serve run it, also where this product is not installed."""
    _check_source_options(onnx, torchvision, weights, mlflow_uri, layer, output)
    config = load(params)
    _quiet_mlflow()
    try:
        preprocessing = catalogue.preprocessing_from_options(
            preset, channels, size, resize.value if resize else None, resize_to, mean, std,
            interpolation.value if interpolation else None)
    except ValueError as error:
        fail(error, USAGE)
    client, experiment = call(registry.setup, config.mlflow)
    source, origin = _probed_source(onnx, torchvision, weights, mlflow_uri, preprocessing, layer, output, dim)
    target = name or config.mlflow.registered_model
    version = call(catalogue.register, client, experiment, source, target, alias.value if alias else None,
                   origin=origin)
    if as_json:
        tags = catalogue.version_tags(source.description)
        row = {"version": version, "aliases": [alias.value] if alias else [], "source": tags[catalogue.TAG_SOURCE],
               "embedding_dim": tags[catalogue.TAG_DIM], "head": tags[catalogue.TAG_HEAD],
               "input": tags.get(catalogue.TAG_INPUT)}
        return answer("fastfill.model.register/1", {**json_output.version_fields(target, row),
                                                    "alias": alias.value if alias else None, "tags": tags})
    head = source.description.get("head")
    typer.echo(f"registered {target} v{version} ({source.description['source']}, {source.embedder.embedding_dim}-d, "
               f"{'a head over ' + str(head) + ' classes' if head else 'no head'})"
               + (f" as {alias.value}" if alias else ""))
    typer.echo(f"  input: {preprocessing.describe()}")
    typer.echo(f"  load it anywhere: mlflow.pyfunc.load_model('models:/{target}/{version}').predict(images)")


_ONE_SOURCE = "give exactly one source: --onnx FILE, --torchvision NAME --weights FILE, or --mlflow URI"
_TORCHVISION_WEIGHTS = "--torchvision needs --weights FILE (.safetensors or a torch state dict)"


def _check_source_options(onnx: Path | None, torchvision: str | None, weights: Path | None, mlflow_uri: str | None,
                          layer: str | None, output: str | None) -> None:
    """Exactly one source, and only the options that go with it; else a usage error."""
    given = [flag for flag, value in (("--onnx", onnx), ("--torchvision", torchvision), ("--mlflow", mlflow_uri))
             if value is not None]
    if len(given) != 1:
        fail(_ONE_SOURCE + (f" (got {', '.join(given)})" if given else ""), USAGE)
    if torchvision is not None and weights is None:
        fail(_TORCHVISION_WEIGHTS, USAGE)
    if weights is not None and torchvision is None:
        fail("--weights goes with --torchvision NAME", USAGE)
    if layer is not None and onnx is not None:
        fail("--layer is for --torchvision or --mlflow; an ONNX graph's embedding is an output: --output NAME", USAGE)
    if output is not None and torchvision is not None:
        fail("--output is for --onnx or --mlflow; a torchvision network's embedding is a layer: --layer NAME", USAGE)


def _probed_source(onnx: Path | None, torchvision: str | None, weights: Path | None, mlflow_uri: str | None,
                   preprocessing, layer: str | None, output: str | None, dim: int | None):
    """(the model source, where it came from), its probe batch passed; a source that fails it
    ends the command as bad input, with nothing registered."""
    from fastfill.components.model_store import sources

    try:
        if onnx is not None:
            source, origin = sources.from_onnx(onnx, preprocessing, output=output, dim=dim), str(onnx.resolve())
        elif torchvision is not None:
            if weights is None:  # refused by _check_source_options already
                fail(_TORCHVISION_WEIGHTS, USAGE)
            source = sources.from_torchvision(torchvision, weights, preprocessing, layer=layer, dim=dim)
            origin = f"{torchvision} {weights.resolve()}"
        elif mlflow_uri is not None:
            source = call(sources.from_mlflow, mlflow_uri, preprocessing, layer=layer, output=output, dim=dim)
            origin = mlflow_uri
        else:  # refused by _check_source_options already
            fail(_ONE_SOURCE, USAGE)
    except sources.ModelSourceError as error:
        fail(f"{error}; nothing was registered", INPUT)
    return source, origin


@model_app.command("list", short_help="The versions: aliases, source, embedding size, input, head.")
@answers_json
def model_list(name: Annotated[str | None, typer.Option(help="default mlflow.registered_model")] = None,
               as_json: JsonOption = False,
               params: ParamsOption = Path("params.yaml")) -> None:
    config = load(params)
    _quiet_mlflow()
    client, _ = call(registry.setup, config.mlflow)
    target = name or config.mlflow.registered_model
    rows, others = call(_summaries, client, target)
    if as_json:
        return answer(*json_output.model_list_document(target, [row.to_dict() for row in rows]))
    if not rows:
        register = "fastfill model register --onnx FILE" + ("" if name is None else f" --name {target}")
        said = (f"{target} has no versions" if others is None else
                f"no model is registered as {target} in {registry.identity(config.mlflow)} yet"
                + (f" (registered: {', '.join(others)})" if others else ""))
        typer.echo(f"{said}; register one with `{register}` (or --torchvision NAME --weights FILE, or --mlflow URI)")
        return
    typer.echo(f"{'version':>7}  {'aliases':<20} {'source':<12} {'dim':>5}  {'head':>5}  input")
    for row in rows:
        typer.echo(f"{row.version:>7}  {','.join(row.aliases) or '-':<20} {row.source:<12} {row.embedding_dim:>5}  "
                   f"{row.head:>5}  {row.input}")


def _summaries(client, name: str) -> tuple[list, list[str] | None]:
    """(``name``'s versions, newest first; None, or where no model is registered as ``name``, no
    versions and the names that are registered). A registry without it answers an empty list, as
    a new one does before its first `fastfill model register`; any other error is the registry's."""
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException as error:
        if error.error_code == "RESOURCE_DOES_NOT_EXIST":
            return [], sorted(m.name for m in client.search_registered_models())
        if outcome(error) is not None:
            raise  # the service's failure (not answering, credentials refused): `call` says which
        raise RegistryError(f"cannot list registered model {name!r} ({error.error_code}): {error.message}") from None
    return catalogue.summaries(client, name), None


@model_app.command("show", short_help="One version: its description, preprocessing and MLflow signature.")
@answers_json
def model_show(version: Annotated[str, typer.Argument(help="a version number, an alias, or models:/NAME/VERSION")],
               name: Annotated[str | None, typer.Option(help="default mlflow.registered_model")] = None,
               as_json: JsonOption = False,
               params: ParamsOption = Path("params.yaml")) -> None:
    """Print one version as JSON: name, version, aliases, its description (source, embedding
    size, preprocessing, head) and the MLflow signature."""
    config = load(params)
    _quiet_mlflow()
    client, _ = call(registry.setup, config.mlflow)
    target = name or config.mlflow.registered_model
    uri = version if version.startswith("models:/") else (
        f"models:/{target}/{version}" if version.isdigit() else f"models:/{target}@{version}")
    ref = call(registry.resolve_model, client, uri)
    from fastfill.components.model_store import registered

    described = call(registered.description, ref.uri)
    if described is None:
        fail(f"{ref.uri} was not written by this product (no description); register it with "
             f"`fastfill model register --mlflow {ref.uri}`", INPUT)
    import mlflow.models

    signature = mlflow.models.get_model_info(ref.uri).signature if described.get("format") != "fastfill-model/1" \
        else None
    aliases = sorted(a for a, v in client.get_registered_model(ref.name).aliases.items() if str(v) == ref.version)
    described.pop("_folder", None)
    shown = {"name": ref.name, "version": ref.version, "uri": ref.uri, "aliases": aliases, "description": described,
             "signature": signature.to_dict() if signature is not None else None}
    if as_json:
        return answer("fastfill.model.show/1", shown)
    typer.echo(json.dumps(shown, indent=2))
