"""The `fastfill` command, by command group: experiment (the pipeline and its reports), gallery
(the stored gallery and its upgrade), triggers (upgrades that run themselves)."""

from flows.cli import experiment, gallery, triggers  # noqa: F401 - each registers its commands
from flows.cli.common import app

__all__ = ["app"]
