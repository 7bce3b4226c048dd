"""Marks every test under tests/integration with ``integration``, so the tiers can be chosen
with ``-m`` as well as by folder."""

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/integration/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.integration)
