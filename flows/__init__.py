"""Prefect flows: one per stage, the pipeline that composes them, and the CLI."""

from fastfill.components.platform.runtime import apply_defaults
from fastfill.tasks.temporary_server import tether_temporary_server

apply_defaults()
tether_temporary_server()  # a process killed hard takes its temporary Prefect server with it
