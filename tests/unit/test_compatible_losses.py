"""The losses of the compatible-training methods (BCT, RACT) and of the unified space, and
RACT's uncertainty orders, against values computed by hand."""

import math

import numpy as np
import pytest
import torch

from fastfill.components.evaluation.ordering import entropy_uncertainty, least_confidence, margin_uncertainty
from fastfill.components.experiment.losses import (
    bct_influence_per_sample,
    match_dimension,
    ract_per_sample,
    synthesized_classifier,
    unified_loss,
)

N = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
O = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])  # noqa: E741 - old features, as N the new


def test_ract_by_hand():
    labels = torch.tensor([0, 1])
    # sample 0: positive <n0,o0> = 1; negatives of class 1: <n0,o1> = 1, <n0,n1> = 0
    # sample 1: positive <n1,o1> = 0; negatives: <n1,o0> = 0, <n1,n0> = 0
    full = ract_per_sample(N[:2], O[:2], labels, tau=1.0).tolist()
    assert full == pytest.approx([math.log(2 * math.e + 1) - 1, math.log(3.0)], rel=1e-6)
    vanilla = ract_per_sample(N[:2], O[:2], labels, tau=1.0, new_to_new=False).tolist()
    assert vanilla == pytest.approx([math.log(2.0), math.log(2.0)], rel=1e-6)


def test_ract_never_uses_samples_of_the_same_class_as_negatives():
    with_twin = ract_per_sample(N, O, torch.tensor([0, 1, 0]), tau=1.0)
    assert with_twin[0].item() == pytest.approx(math.log(2 * math.e + 1) - 1, rel=1e-6)


def test_ract_normalises_and_divides_by_tau():
    labels = torch.tensor([0, 1])
    scaled = ract_per_sample(3 * N[:2], 5 * O[:2], labels, tau=0.5)
    # same cosines, now / 0.5: sample 1 sees exp(0) three times
    assert scaled[1].item() == pytest.approx(math.log(3.0), rel=1e-6)
    assert scaled[0].item() == pytest.approx(math.log(2 * math.e ** 2 + 1) - 2, rel=1e-6)


def test_bct_influence_by_hand_with_truncation_and_padding():
    weight = torch.eye(2)
    rows = torch.tensor([0])
    wide = torch.tensor([[math.log(3.0), 0.0, 5.0]])  # truncated to (ln 3, 0): softmax (3/4, 1/4)
    narrow = torch.tensor([[math.log(3.0)]])           # zero-padded to (ln 3, 0)
    for features in (wide, narrow):
        assert bct_influence_per_sample(features, weight, rows).item() == pytest.approx(-math.log(0.75), rel=1e-6)
    assert match_dimension(narrow, 3)[0].tolist() == pytest.approx([math.log(3.0), 0.0, 0.0])


def test_bct_synthesised_rows_are_the_class_means():
    weight, classes = synthesized_classifier(torch.eye(2), [0, 1], {
        0: torch.tensor([9.0, 9.0]), 3: torch.tensor([7.0, 8.0]), 2: torch.tensor([5.0, 6.0])})
    assert classes == [0, 1, 2, 3]
    assert weight.tolist() == [[1.0, 0.0], [0.0, 1.0], [5.0, 6.0], [7.0, 8.0]]


def test_unified_loss_by_hand():
    head = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(2))
    parts = unified_loss(torch.tensor([[0.0, 0.0]]), torch.tensor([[3.0, 4.0]]), head, torch.tensor([0]))
    ce_q, ce_g = math.log(2.0), math.log(1 + math.e)
    kl = math.log(0.5) + math.log(1 + math.e) - 0.5  # KL((1/2, 1/2) || softmax(3, 4))
    assert parts.similarity.item() == pytest.approx(25.0)
    assert parts.classification.item() == pytest.approx(ce_q + ce_g, rel=1e-6)
    assert parts.kl.item() == pytest.approx(kl, rel=1e-6)
    assert parts.total.item() == pytest.approx(25.0 + ce_q + ce_g + 0.25 * kl, rel=1e-6)


def test_ract_orders_by_hand():
    logits = np.array([[0.0, math.log(3.0)], [0.0, 0.0]])  # p = (1/4, 3/4) and (1/2, 1/2)
    assert least_confidence(logits) == pytest.approx([0.25, 0.5])
    assert margin_uncertainty(logits) == pytest.approx([0.5, 1.0])
    assert entropy_uncertainty(logits) == pytest.approx([-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)),
                                                         math.log(2.0)])
