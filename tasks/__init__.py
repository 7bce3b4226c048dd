"""Prefect task wrappers over components: retries, tags and caching are declared here."""

from components.platform.runtime import apply_defaults

apply_defaults()
