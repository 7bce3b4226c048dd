"""The `fastfill` command, by command group: experiment (the pipeline and its reports), gallery
(the stored gallery and its upgrade), triggers (upgrades that run themselves), doctor (the
services' health and the gallery's state at a glance)."""

from flows.cli import experiment, gallery, triggers, doctor  # noqa: F401, I001 - each registers its commands, in this order
from flows.cli.common import app

__all__ = ["app"]
