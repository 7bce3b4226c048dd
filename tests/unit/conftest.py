"""The unit tier's shared fixtures: the tiny models and images of tests/gallery_cases.py."""

import pytest

from tests.gallery_cases import make_data, make_models


@pytest.fixture
def models():
    """(old embedder, new embedder, alignment map), tiny and seeded."""
    return make_models()


@pytest.fixture
def data():
    """(images, labels) of the tiny gallery."""
    return make_data()
