"""What the flows that the CLI and the deployments start take instead of the whole configuration:
a params file and a few overrides by dotted key, readable in the Prefect UI; and the names of
their runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastfill.components.platform.config import ConfigError, Params, load_params, parse_params


def apply_overrides(params: Params, overrides: dict[str, Any] | None, source: str = "the overrides") -> Params:
    """``params`` with each dotted key of ``overrides`` set (``{"gallery.upgrade.chunk_size": 4}``),
    checked as params.yaml is; an unknown section is an error naming the key."""
    if not overrides:
        return params
    data = params.model_dump(mode="json")
    for dotted, value in overrides.items():
        *sections, leaf = dotted.split(".")
        target = data
        for name in sections:
            if not isinstance(target.get(name), dict):
                raise ConfigError(f"{source}: {dotted}: there is no section {name!r} there")
            target = target[name]
        target[leaf] = value
    return parse_params(data, Path(source))


def resolve_params(params: Params | None, params_path: str | None, overrides: dict[str, Any] | None) -> Params:
    """The configuration of a flow run: ``params`` when the Python API gave one, else the file at
    ``params_path`` (default params.yaml); with ``overrides`` applied."""
    if params is None:
        params = load_params(params_path or "params.yaml")
    return apply_overrides(params, overrides)


def run_parameters() -> dict[str, Any]:
    """The parameters of the flow run this is called in (a run-name function's input)."""
    from prefect.runtime import flow_run

    return flow_run.parameters or {}


def store_of(parameters: dict[str, Any]) -> str:
    """The store a flow run works on, as its parameters give it (``store_uri`` or ``store``, else
    the given configuration's gallery.store)."""
    for key in ("store_uri", "store"):
        if parameters.get(key):
            return str(parameters[key])
    given = parameters.get("params")
    return str(getattr(getattr(given, "gallery", None), "store", None) or "gallery.store")
