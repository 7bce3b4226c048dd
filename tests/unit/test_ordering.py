import numpy as np
import pytest

from fastfill.components.evaluation.ordering import (
    check_permutation,
    descending_order,
    distance_order,
    kendall_tau,
    oracle_order,
    random_order,
    sigma_order,
)


def is_permutation(order: np.ndarray, n: int) -> bool:
    """Whether ``check_permutation`` accepts ``order`` as a permutation of 0..n-1."""
    try:
        check_permutation(order, n)
    except ValueError:
        return False
    return True


def test_random_order_is_a_seeded_permutation():
    a, b, c = random_order(100, 3), random_order(100, 3), random_order(100, 4)
    assert is_permutation(a, 100)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_sigma_order_puts_the_least_certain_first_and_breaks_ties_by_index():
    log_sigma2 = np.array([0.1, 2.0, -1.0, 2.0, 0.5])
    assert sigma_order(log_sigma2).tolist() == [1, 3, 4, 0, 2]


def test_oracle_order_sorts_by_true_loss():
    assert oracle_order(np.array([3.0, 1.0, 2.0])).tolist() == [0, 2, 1]


def test_distance_order_uses_the_alignment_error():
    new = np.array([[0.0, 0.0], [1.0, 0.0], [5.0, 0.0]])
    transformed = np.zeros((3, 2))
    assert distance_order(new, transformed).tolist() == [2, 1, 0]


def test_scores_must_be_finite_and_flat():
    with pytest.raises(ValueError, match="NaN"):
        descending_order(np.array([1.0, np.nan]))
    with pytest.raises(ValueError, match="one value per gallery item"):
        descending_order(np.zeros((2, 2)))


def test_is_permutation():
    assert is_permutation(np.array([2, 0, 1]), 3)
    assert not is_permutation(np.array([0, 0, 1]), 3)
    assert not is_permutation(np.array([0, 1]), 3)
    assert not is_permutation(np.array([0.0, 1.0, 2.0]), 3)


def test_kendall_tau_known_values():
    x = np.arange(10.0)
    assert kendall_tau(x, x) == pytest.approx(1.0)
    assert kendall_tau(x, -x) == pytest.approx(-1.0)
    # one discordant pair out of 3: (C - D) / 3 = (2 - 1) / 3
    assert kendall_tau(np.array([1.0, 2.0, 3.0]), np.array([1.0, 3.0, 2.0])) == pytest.approx(1 / 3)
