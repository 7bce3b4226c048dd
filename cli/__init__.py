"""The `fastfill` command, by command group: experiment (the pipeline and its reports), gallery
(the stored gallery), upgrade (its upgrade and undoing it), services (upgrades that run
themselves: deployments, the registry watcher, webhooks), doctor (the services' health and the
gallery's state at a glance). The commands read params.yaml and call the flows in flows/ and the
long-running processes in services/."""

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Upgrade an embedding model without re-indexing: FastFill pipeline, backfill and evaluation.")

# each module registers its commands on ``app``, in this order
from cli import (  # noqa: E402, I001
    experiment_commands, gallery_commands, upgrade_commands, service_commands, doctor_commands,
)

__all__ = ["app", "experiment_commands", "gallery_commands", "upgrade_commands", "service_commands",
           "doctor_commands"]
