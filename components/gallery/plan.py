"""Transitional: ``components.gallery.planning`` under its old name, until every caller imports it."""

from components.gallery.planning import *  # noqa: F401,F403
