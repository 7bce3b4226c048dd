"""The `fastfill` command, by command group: experiment (the pipeline and its reports), gallery
(the stored gallery), model (embedding models in the registry, a team's own included), upgrade
(its upgrade and undoing it), services (upgrades that run themselves: deployments, the registry
watcher, webhooks), doctor (the services' health and the gallery's state at a glance). The
commands read params.yaml and call the flows in flows/ and the long-running processes in services/.

Each command's module imports what its commands need at its top (the flows, torch, Prefect...),
so it is loaded only when one of its commands runs or shows its help (``COMMANDS``): `fastfill
--help` and a light command never load another command's libraries. The CPU kernels are pinned
from the command's params.yaml before its module loads (numpy and torch choose theirs on import)."""

import difflib
import importlib
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from typer.core import CompletionItem, TyperGroup

from fastfill.components.platform.runtime import cpu_kernels_of, pin_cpu_kernels

# Each top-level command: its module (fastfill.cli.<module>) and its line in `fastfill --help`,
# in the order listed there.
COMMANDS = {
    "run": ("experiment_commands", "Run the whole pipeline on params.yaml."),
    "seeds": ("experiment_commands", "Run the pipeline once per seed; reports/seeds.json."),
    "sweep": ("experiment_commands", "FastFill against FCT by data size and seed."),
    "compare": ("experiment_commands", "Every method over seeds; reports/comparison.*."),
    "evaluate": ("feature_commands", "The backfill curve of your own features (JSON)."),
    "search": ("gallery_commands", "Nearest gallery items of each query, mid-upgrade too."),
    "serve": ("service_commands", "Serve the deployments and poll the registry."),
    "deploy": ("service_commands", "Put the deployments on Prefect work pools."),
    "watch": ("service_commands", "Check the registry once; start an upgrade if due."),
    "doctor": ("doctor_commands", "Check the services, registry and store; say what to fix."),
    "status": ("doctor_commands", "Where the gallery and its upgrade stand."),
    "stage": ("experiment_commands", "Run one pipeline stage (what DVC calls)."),
    "gallery": ("gallery_commands", "The stored gallery: ingest, adopt, convert, info, gc, rollback."),
    "upgrade": ("upgrade_commands", "Upgrade the gallery to a new model; status, unlock, abort."),
    "webhook": ("webhook_commands", "MLflow webhooks: serve, register, list, delete."),
    "model": ("model_commands", "Register your own embedding models; list and show versions."),
}

owns_process = False  # set by the `fastfill` executable (``run``): a command may end its process


def params_named(args: list[str]) -> Path:
    """The configuration file a command line names, as ``ParamsOption`` reads it (--params or -p,
    else FASTFILL_PARAMS, else ./params.yaml), before the command's module is loaded."""
    for position, arg in enumerate(args):
        if arg == "--":
            break
        if arg in ("--params", "-p") and position + 1 < len(args):
            return Path(args[position + 1])
        if arg.startswith("--params="):
            return Path(arg.removeprefix("--params="))
        if arg.startswith("-p") and not arg.startswith("--") and len(arg) > 2:
            return Path(arg[2:])
    return Path(os.environ.get("FASTFILL_PARAMS") or "params.yaml")


class CommandGroups(TyperGroup):
    """The top-level group: its commands are listed from ``COMMANDS`` and a command's module is
    imported when that command is looked up (it registers its commands on ``app`` then)."""

    def list_commands(self, ctx) -> list[str]:
        return [*COMMANDS, *(name for name in self.commands if name not in COMMANDS)]

    def get_command(self, ctx, cmd_name: str):
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            importlib.import_module(f"fastfill.cli.{COMMANDS[cmd_name][0]}")
            self.commands.update((name, command) for name, command in typer.main.get_group(app).commands.items()
                                 if name not in self.commands)
        return self.commands.get(cmd_name)

    def resolve_command(self, ctx, args: list[str]):
        name = args[0] if args else ""
        if name in COMMANDS and name not in self.commands:
            pin_cpu_kernels(cpu_kernels_of(params_named(args[1:])))
        elif name not in self.commands and not name.startswith("-") and not ctx.resilient_parsing:
            close = difflib.get_close_matches(name, list(COMMANDS))
            ctx.fail(f"No such command {name!r}." + (f" Did you mean {', '.join(map(repr, close))}?" if close else ""))
        return super().resolve_command(ctx, args)

    def format_commands(self, ctx, formatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, COMMANDS[name][1] if name in COMMANDS else self.commands[name].get_short_help_str())
                                for name in self.list_commands(ctx)])

    def shell_complete(self, ctx, incomplete: str) -> list[CompletionItem]:
        return [*(CompletionItem(name, help=COMMANDS[name][1]) for name in COMMANDS if name.startswith(incomplete)),
                *super(TyperGroup, self).shell_complete(ctx, incomplete)]


# Plain help (no rich panels): option names and defaults are never cut at 80 columns, and
# docstrings are reflowed as paragraphs. Each command has a one-line summary (short_help).
# Shell completion: `fastfill --install-completion` (bash, zsh, fish, PowerShell), or
# `fastfill --show-completion` to see the script.
app = typer.Typer(cls=CommandGroups, add_completion=True, no_args_is_help=True, rich_markup_mode=None,
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


def run() -> None:
    """The `fastfill` executable: the commands, in a process of their own. Only here do the
    commands end the process themselves (a deadline after answering, the stop on SIGTERM or
    SIGINT; cli/command_support.py); ``app`` called in another program's process never does. A
    command that SIGTERM stopped ends with 143, not the 130 Typer gives any interrupted command."""
    global owns_process
    owns_process = True
    try:
        app()
    except SystemExit as end:
        support = sys.modules.get("fastfill.cli.command_support")  # where the signals' handlers are set
        if support is None:
            raise
        raise SystemExit(support.exit_status(end.code)) from None


__all__ = ["COMMANDS", "app", "owns_process", "params_named", "run"]
