"""The `fastfill` command, by command group: experiment (the pipeline and its reports), gallery
(the stored gallery), model (embedding models in the registry, a team's own included), upgrade
(its upgrade and undoing it), services (upgrades that run themselves: deployments, the registry
watcher, webhooks), doctor (the services' health and the gallery's state at a glance). The commands read params.yaml and call the flows in flows/ and the
long-running processes in services/."""

from typing import Annotated

import typer

# Plain help (no rich panels): option names and defaults are never cut at 80 columns, and
# docstrings are reflowed as paragraphs. Each command has a one-line summary (short_help).
# Shell completion: `fastfill --install-completion` (bash, zsh, fish, PowerShell), or
# `fastfill --show-completion` to see the script.
app = typer.Typer(add_completion=True, no_args_is_help=True, rich_markup_mode=None,
                  help="Upgrade an embedding model without re-indexing: FastFill pipeline, backfill and evaluation.")


def _version(shown: bool) -> None:
    if shown:
        from importlib.metadata import version

        typer.echo(f"fastfill {version('fastfill')}")
        raise typer.Exit()


@app.callback()
def main(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                               help="print the version and exit")] = False) -> None:
    """Upgrade an embedding model without re-indexing: FastFill pipeline, backfill and evaluation."""

# each module registers its commands on ``app``, in this order
from fastfill.cli import (  # noqa: E402, I001
    command_support, experiment_commands, gallery_commands, upgrade_commands, service_commands, doctor_commands, model_commands,
)



def run() -> None:
    """The `fastfill` executable: the commands, in a process of their own. Only here do the
    commands end the process themselves (a deadline after answering, the stop on SIGTERM or
    SIGINT; cli/command_support.py); ``app`` called in another program's process never does."""
    command_support.owns_process = True
    app()


__all__ = ["app", "run", "experiment_commands", "gallery_commands", "upgrade_commands", "service_commands",
           "doctor_commands", "model_commands"]
