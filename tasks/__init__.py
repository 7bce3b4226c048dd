"""Prefect task wrappers over components: retries, tags and caching are declared here."""

from fastfill.components.platform.runtime import apply_defaults

apply_defaults()
