"""Each loss against values computed by hand."""

import math

import pytest
import torch

from fastfill.components.experiment.losses import (
    alignment_loss,
    classification_per_sample,
    l2_per_sample,
    uncertainty_weighted,
)

TARGET = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
PREDICTION = torch.tensor([[0.0, 0.0], [3.0, 4.0]])


def test_l2_sum_is_the_squared_distance():
    assert l2_per_sample(TARGET, PREDICTION, "sum").tolist() == [5.0, 25.0]


def test_l2_mean_averages_over_dimensions():
    assert l2_per_sample(TARGET, PREDICTION, "mean").tolist() == [2.5, 12.5]


def test_l2_rejects_unknown_reduction():
    with pytest.raises(ValueError, match="'max'"):
        l2_per_sample(TARGET, PREDICTION, "max")


def test_label_smoothed_cross_entropy_by_hand():
    # softmax([0, ln 3]) = [1/4, 3/4]; smoothed target for class 1 with eps 0.1, K 2: [0.05, 0.95]
    logits = torch.tensor([[0.0, math.log(3.0)]])
    expected = -(0.05 * math.log(0.25) + 0.95 * math.log(0.75))
    value = classification_per_sample(logits, torch.tensor([1]), 0.1)
    assert value.item() == pytest.approx(expected, rel=1e-6)
    plain = classification_per_sample(logits, torch.tensor([1]), 0.0)
    assert plain.item() == pytest.approx(-math.log(0.75), rel=1e-6)


def test_uncertainty_weighting_by_hand():
    loss = torch.tensor([2.0, 2.0, 2.0])
    s = torch.tensor([0.0, math.log(2.0), math.log(2.0)])
    out = uncertainty_weighted(loss[:2], s[:2], lam=1.0).tolist()
    assert out[0] == pytest.approx(1.0)                              # 0.5*e^0*2 + 0
    assert out[1] == pytest.approx(0.5 + 0.5 * math.log(2.0))       # 0.5*(1/2)*2 + 0.5 ln 2
    lam2 = uncertainty_weighted(loss[2:], s[2:], lam=2.0).item()
    assert lam2 == pytest.approx(0.5 + 0.25 * math.log(2.0))


def test_uncertainty_gradient_pushes_sigma_towards_the_loss():
    # d/ds [0.5 e^-s L + 0.5 s] = 0 at s = ln L: the head learns log sigma^2 = the per-sample loss
    s = torch.tensor([0.0], requires_grad=True)
    uncertainty_weighted(torch.tensor([4.0]), s).sum().backward()
    assert s.grad.item() == pytest.approx(-0.5 * 4.0 + 0.5)
    at_optimum = torch.tensor([math.log(4.0)], requires_grad=True)
    uncertainty_weighted(torch.tensor([4.0]), at_optimum).sum().backward()
    assert at_optimum.grad.item() == pytest.approx(0.0, abs=1e-6)


def _identity_classifier():
    head = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(2))
    return head


def test_fct_loss_is_the_mean_l2():
    parts = alignment_loss(PREDICTION, TARGET, l2=True, disc=False)
    assert parts.total.item() == pytest.approx(15.0)
    assert parts.disc is None and parts.log_sigma2 is None


def test_fastfill_loss_combines_terms_per_sample():
    transformed = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]])
    new = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    rows = torch.tensor([1, 0])
    s = torch.tensor([0.0, math.log(2.0)])
    parts = alignment_loss(transformed, new, l2=True, disc=True, classifier=_identity_classifier(),
                           targets=rows, label_smoothing=0.1, log_sigma2=s, lam=1.0)
    l2 = [math.log(3.0) ** 2, 2.0]
    disc = [-(0.05 * math.log(0.25) + 0.95 * math.log(0.75)), math.log(2.0)]  # second: uniform softmax
    per = [0.5 * (l2[0] + disc[0]) + 0.0, 0.5 * 0.5 * (l2[1] + disc[1]) + 0.5 * math.log(2.0)]
    assert parts.total.item() == pytest.approx(sum(per) / 2, rel=1e-5)
    assert parts.l2.item() == pytest.approx(sum(l2) / 2, rel=1e-6)
    assert parts.disc.item() == pytest.approx(sum(disc) / 2, rel=1e-5)


def test_disc_needs_the_classifier():
    with pytest.raises(ValueError, match="classifier"):
        alignment_loss(PREDICTION, TARGET, l2=True, disc=True)
