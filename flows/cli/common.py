"""What every command shares: the root app, the options, loading params.yaml, running a flow
with bad input reported as one line (``fail``: the one place that prints an error and exits)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Annotated, NoReturn

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Upgrade an embedding model without re-indexing: FastFill pipeline, backfill and evaluation.")

ParamsOption = Annotated[Path, typer.Option("--params", "-p", help="the configuration file")]
StoreOption = Annotated[str | None, typer.Option("--store", help="a local folder or s3://bucket/prefix; "
                                                 "default: gallery.store in params.yaml")]


def store_uri(config, store: str | None) -> str:
    """--store, or gallery.store of params.yaml."""
    return store or config.gallery.store


def fail(error: Exception | str, code: int = 1) -> NoReturn:
    """Print ``error: ...`` in red on stderr and end the command with ``code`` (1: the work
    failed, 2: bad input, 3: refused, 4: a claim does not hold)."""
    typer.secho(f"error: {error}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code) from None


def load(path: Path):
    """params.yaml, validated; a bad file ends the command with every problem listed."""
    from components.platform.config import ConfigError, load_params

    try:
        params = load_params(path)
    except ConfigError as error:
        fail(error, 2)
    from components.gallery.store import configure_s3

    configure_s3(params.gallery.s3)  # every command's S3 clients retry as gallery.s3 says
    return params


def call(flow, *args, **kwargs):
    """Run a flow; bad or missing input ends the command with its message, not a traceback."""
    from components.experiment.data import DataError
    from components.experiment.map_check import MapCheckError
    from components.gallery.catalog import GalleryError
    from components.gallery.store import StoreError
    from components.gallery.lock import UpgradeLocked
    from components.platform.config import ConfigError
    from components.platform.registry import RegistryError

    try:
        return flow(*args, **kwargs)
    except (DataError, FileNotFoundError, GalleryError, StoreError, RegistryError, UpgradeLocked,
            MapCheckError, ConfigError) as error:
        fail(error, 1)


def record_in_dvc(params_path: Path, targets: list[str], done: str | None = None) -> None:
    """Record what a command produced in dvc.lock (``targets``: `dvc commit` arguments), so
    `dvc repro` of those stages redoes nothing. Only for the repository's own params.yaml."""
    if params_path.resolve() != Path("params.yaml").resolve() or not Path("dvc.yaml").is_file():
        return
    dvc = shutil.which("dvc") or str(Path(sys.executable).with_name("dvc"))
    result = subprocess.run([dvc, "commit", "--force", "--quiet", *targets], capture_output=True, text=True)
    if result.returncode != 0:
        typer.secho(f"warning: `dvc commit` failed, DVC does not know about this run:\n{result.stderr}",
                    fg=typer.colors.YELLOW, err=True)
    elif done:
        typer.echo(done)
