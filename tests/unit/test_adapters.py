"""Query-side adapters (components.experiment.adapters): each recovers a map it can represent,
the residual MLP improves on its affine start where the relation is not affine, and bad pairs
are refused with a message."""

import numpy as np
import pytest

from fastfill.components.evaluation import retrieval_metrics
from fastfill.components.experiment.adapters import (
    ADAPTERS,
    AdapterError,
    fit_adapter,
    fit_low_rank,
    fit_procrustes,
    fit_residual_mlp,
)


def _rotation(d: int, seed: int) -> np.ndarray:
    q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(d, d)))
    return q


def test_procrustes_recovers_a_similarity_transform():
    rng = np.random.default_rng(0)
    new = rng.normal(size=(500, 16)).astype(np.float32)
    rotation, shift = _rotation(16, 1), rng.normal(size=16)
    old = (2.5 * new @ rotation + shift).astype(np.float32)
    adapter = fit_procrustes(new, old)
    np.testing.assert_allclose(adapter(new), old, atol=1e-4)
    np.testing.assert_allclose(adapter.weight, 2.5 * rotation, atol=1e-5)


def test_procrustes_between_different_dimensions_keeps_distances_up_to_scale():
    rng = np.random.default_rng(2)
    new = rng.normal(size=(400, 8))
    embed = _rotation(12, 3)[:, :8].T  # 8 -> 12, orthonormal rows
    old = new @ embed
    adapter = fit_procrustes(new.astype(np.float32), old.astype(np.float32))
    assert adapter(new.astype(np.float32)).shape == (400, 12)
    np.testing.assert_allclose(adapter(new.astype(np.float32)), old, atol=1e-4)


def test_low_rank_recovers_a_low_rank_map_and_caps_the_rank():
    rng = np.random.default_rng(4)
    new = rng.normal(size=(800, 20))
    weight = rng.normal(size=(20, 3)) @ rng.normal(size=(3, 10))  # rank 3
    old = new @ weight + 1.0
    exact = fit_low_rank(new.astype(np.float32), old.astype(np.float32), rank=3, ridge=0.0)
    np.testing.assert_allclose(exact(new.astype(np.float32)), old, atol=1e-3)
    assert np.linalg.matrix_rank(exact.weight, tol=1e-6) == 3
    capped = fit_low_rank(new.astype(np.float32), old.astype(np.float32), rank=1)
    assert np.linalg.matrix_rank(capped.weight, tol=1e-6) == 1
    assert np.mean((capped(new.astype(np.float32)) - old) ** 2) > np.mean((exact(new.astype(np.float32)) - old) ** 2)


def test_the_residual_mlp_improves_on_its_affine_start_where_the_relation_bends():
    rng = np.random.default_rng(5)
    new = rng.normal(size=(2000, 8)).astype(np.float32)
    old = (np.tanh(2 * new) @ _rotation(8, 6) + 0.3 * new).astype(np.float32)
    adapter = fit_residual_mlp(new, old, rank=8, hidden=64, epochs=20, seed=0)
    assert adapter.history[0]["epoch"] == 0
    best = min(record["val_mse"] for record in adapter.history)
    assert best < 0.5 * adapter.history[0]["val_mse"], adapter.history  # the MLP learned the bend
    test = rng.normal(size=(500, 8)).astype(np.float32)
    truth = np.tanh(2 * test) @ _rotation(8, 6) + 0.3 * test
    mlp_error = np.mean((adapter(test) - truth) ** 2)
    affine_error = np.mean((adapter.affine(test) - truth) ** 2)
    assert mlp_error < 0.5 * affine_error, (mlp_error, affine_error)


def test_adapted_queries_search_the_old_gallery_as_well_as_old_queries():
    """Classes in the old space, the new model a rotated and rescaled copy plus noise: new
    queries through the adapter find the old gallery's neighbours about as old queries do, and
    far better than unadapted."""
    rng = np.random.default_rng(7)
    labels = np.repeat(np.arange(10), 60)
    centres = rng.normal(size=(10, 16)) * 3
    old = (centres[labels] + rng.normal(size=(600, 16))).astype(np.float32)
    new = (0.5 * old @ _rotation(16, 8) + 0.05 * rng.normal(size=(600, 16))).astype(np.float32)
    baseline = retrieval_metrics(old, old, labels)["top1"]
    raw = retrieval_metrics(new, old, labels)["top1"]
    for kind in ADAPTERS:
        adapter = fit_adapter(kind, new, old, rank=16)
        adapted = retrieval_metrics(adapter(new), old, labels)["top1"]
        assert adapted >= baseline - 0.03 and adapted > raw + 0.2, (kind, adapted, baseline, raw)


@pytest.mark.parametrize("new, old, message", [
    (np.zeros((5, 4), np.float32), np.zeros((6, 4), np.float32), "5 new features but 6 old ones"),
    (np.zeros((1, 4), np.float32), np.zeros((1, 4), np.float32), "at least 2 pairs"),
    (np.full((5, 4), np.nan, np.float32), np.zeros((5, 4), np.float32), "NaN or infinite"),
    (np.zeros(5, np.float32), np.zeros((5, 4), np.float32), "2-D float array"),
])
def test_bad_pairs_are_refused_with_a_message(new, old, message):
    for kind in ADAPTERS:
        with pytest.raises(AdapterError, match=message):
            fit_adapter(kind, new, old)


def test_an_unknown_adapter_and_a_wrong_dimension_are_named():
    with pytest.raises(AdapterError, match="unknown adapter 'affine'; expected one of procrustes"):
        fit_adapter("affine", np.zeros((4, 2), np.float32), np.zeros((4, 2), np.float32))
    adapter = fit_procrustes(np.eye(4, dtype=np.float32), np.eye(4, dtype=np.float32))
    with pytest.raises(AdapterError, match="dimension 3, but the adapter takes 4"):
        adapter(np.zeros((2, 3), np.float32))
