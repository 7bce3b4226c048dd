"""The unit tier's shared fixtures: the tiny models and images of tests/gallery_cases.py, and no
Prefect server in effect."""

import sys

import pytest

from fastfill.components.gallery.upgrade import backfill
from tests.gallery_cases import _gallery, _plan, make_data, make_models


@pytest.fixture(autouse=True)
def _no_prefect_server():
    """A unit test sees the settings of a host without PREFECT_API_URL, wherever it runs: on a
    pytest-xdist worker that ran an integration test before it, the session's Prefect test
    harness (a server, named in the process's settings) would otherwise still be in effect, and
    `fastfill serve` would serve on it instead of refusing. Only then are the settings swapped
    (44 ms a test): where Prefect is not loaded, or names no server, there is nothing to undo."""
    settings = sys.modules.get("prefect.settings")
    if settings is None or settings.get_current_settings().api.url is None:
        yield
        return
    with settings.temporary_settings(restore_defaults={settings.PREFECT_API_URL}):
        yield


@pytest.fixture
def models():
    """(old embedder, new embedder, alignment map), tiny and seeded."""
    return make_models()


@pytest.fixture
def data():
    """(images, labels) of the tiny gallery."""
    return make_data()


@pytest.fixture
def mid_upgrade(tmp_path):
    """(gallery, plan, models, data): the tiny gallery mid-upgrade, its first 3 chunks (21 of 53
    items) re-embedded. (tests/unit/test_cli_json.py has a mid_upgrade of its own: a store URI.)"""
    models, data = make_models(), make_data()
    gallery = _gallery(str(tmp_path / "store"), models, data)
    plan = _plan(gallery, models[2])
    for chunk in (0, 1, 2):
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, models[1])
    return gallery, plan, models, data


@pytest.fixture
def pg_team(tmp_path, models, data):
    """``pg_team(tag, store="store", table=None, adopted=True)``: a team's table in the tests'
    PostgreSQL and the store that adopts it (``tests.pg_team.TeamGallery``), the opening of the
    pgvector ownership and held-table tests."""
    from tests.pg_team import team_gallery

    def make(tag: str, **options):
        return team_gallery(tmp_path, models, data, tag, **options)

    return make
