"""Prefect flows: one per stage, the pipeline that composes them, and the CLI."""

from components.platform.runtime import apply_defaults

apply_defaults()
