"""compute.threads: a fixed thread count for the pipeline's stages, OMP_NUM_THREADS winning."""

import pytest
import torch

from fastfill.components.platform.config import ConfigError, load_params, parse_params
from fastfill.components.platform.runtime import use_threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_configured_count_is_used(monkeypatch, restore_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert use_threads(1) == 1 == torch.get_num_threads()
    assert use_threads(3) == 3


def test_omp_num_threads_wins(monkeypatch, restore_threads):
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert use_threads(3) == 1


def test_null_keeps_torchs_default(monkeypatch, restore_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(1)
    assert use_threads(None) == 1


def test_the_default_is_fixed_and_the_dual_sigma_needs_an_uncertainty_map():
    params = load_params()
    assert params.compute.threads == 2
    data = params.model_dump(mode="json")
    data["evaluate"]["dual"] = ["rrf"]
    data["evaluate"]["dual_sigma_from"] = "fct"  # trained without an uncertainty head
    with pytest.raises(ConfigError, match="dual_sigma_from"):
        parse_params(data)
    data["evaluate"]["dual_orders"] = ["random"]
    assert parse_params(data).evaluate.headlines["dual_rrf"] == "random"
