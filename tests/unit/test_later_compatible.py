"""Compatible training since FastFill: stationary representations (a fixed d-Simplex classifier
and the HOC term, Biondi et al., CVPR 2024) and BT^2 (extra dimensions through an orthogonal
basis transformation, Zhou et al., ICCV 2023), on tiny data."""

import math

import numpy as np
import pytest
import torch

from fastfill.components.experiment.basis_transformation import BasisTransformedEmbedding, fold_basis_transformation
from fastfill.components.experiment.compatibility import (
    BT2Compatibility,
    StationaryCompatibility,
    fix_simplex_classifier,
    old_class_means,
    old_items_beside_new_features,
)
from fastfill.components.experiment.data import Split
from fastfill.components.experiment.inference import embed
from fastfill.components.experiment.losses import bt2_per_sample, hoc_per_sample, simplex_prototypes
from fastfill.components.experiment.models import Embedder
from fastfill.components.experiment.training import TrainingRun, train_embedder
from fastfill.components.platform.config import CompatibleConfig, TrainConfig
from tests.synthetic import SQUARE_CLASSES, square_images

CPU = torch.device("cpu")
CLASSES = SQUARE_CLASSES


def _run() -> TrainingRun:
    return TrainingRun(CPU, log=lambda message: None)


def _lowered(history: list[dict], key: str) -> bool:
    return history[-1][key] < history[0][key]


OLD = TrainConfig(backbone="cnn_small", width=4, embedding_dim=8, epochs=2, batch_size=16, augment=False)
NEW = TrainConfig(backbone="cnn", width=4, embedding_dim=8, epochs=5, batch_size=16, augment=False, lr=3e-3)


# ---- the d-Simplex fixed classifier

def test_the_simplex_prototypes_of_three_and_four_classes():
    # K = 3 in the plane: unit vectors 120 degrees apart, at -15, 105 and 225 degrees
    c, s = math.cos(math.radians(15)), math.sin(math.radians(15))
    assert torch.allclose(simplex_prototypes(2), torch.tensor([[c, -s], [-s, c], [-0.5 ** 0.5, -0.5 ** 0.5]]),
                          atol=1e-6)
    # K = 4 in 3 dimensions (a regular tetrahedron)
    big, small, corner = 5 / (3 * 3 ** 0.5), -1 / (3 * 3 ** 0.5), -1 / 3 ** 0.5
    expected = torch.tensor([[big, small, small], [small, big, small], [small, small, big], [corner] * 3])
    assert torch.allclose(simplex_prototypes(3), expected, atol=1e-6)


@pytest.mark.parametrize("dim", [2, 3, 8, 127])
def test_the_prototypes_are_unit_norm_equiangular_and_centred(dim):
    prototypes = simplex_prototypes(dim).double()
    assert prototypes.shape == (dim + 1, dim)
    assert torch.allclose(prototypes.norm(dim=1), torch.ones(dim + 1, dtype=torch.float64), atol=1e-6)
    cosines = prototypes @ prototypes.t()
    off_diagonal = cosines[~torch.eye(dim + 1, dtype=torch.bool)]
    assert torch.allclose(off_diagonal, torch.full_like(off_diagonal, -1 / dim), atol=1e-6)  # -1 / (K - 1)
    assert torch.allclose(prototypes.sum(dim=0), torch.zeros(dim, dtype=torch.float64), atol=1e-5)


def test_the_fixed_classifier_holds_each_class_prototype_and_has_no_gradient():
    old = fix_simplex_classifier(Embedder(OLD, 1, [0, 1]))
    new = fix_simplex_classifier(Embedder(NEW, 1, [0, 1, 2, 3]))
    assert not new.classifier.weight.requires_grad
    assert torch.equal(new.classifier.weight, simplex_prototypes(8)[:4])
    assert torch.equal(old.classifier.weight, new.classifier.weight[:2])  # shared classes, shared prototypes
    features = torch.randn(5, 8, requires_grad=True)
    new.classify(features).sum().backward()
    assert new.classifier.weight.grad is None and features.grad is not None
    with pytest.raises(ValueError, match="too few for class 9"):
        fix_simplex_classifier(Embedder(NEW, 1, list(range(10))))


def test_the_hoc_term_of_a_tiny_batch():
    new = torch.tensor([[2.0, 0.0], [0.0, 3.0]])
    old = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    # each sample's positive at cosine 1, the other class's old feature at cosine 0, mu = 2
    expected = torch.full((2,), math.log(1 + math.exp(-2)))
    assert torch.allclose(hoc_per_sample(new, old, torch.tensor([0, 1]), scale=2.0), expected, atol=1e-6)
    # same class: no negative at all
    assert torch.allclose(hoc_per_sample(new, old, torch.tensor([1, 1]), scale=2.0), torch.zeros(2))


@pytest.fixture(scope="module")
def stationary_old():
    split = square_images()
    part = Split(split.images[split.labels < 2], split.labels[split.labels < 2])
    old, history = train_embedder(OLD, part, [0, 1], (0.2, 0.3), run=_run(), prepare=fix_simplex_classifier)
    assert torch.equal(old.classifier.weight, simplex_prototypes(8)[:2])  # not moved by training
    return split, old


def test_stationary_training_keeps_the_simplex_and_lowers_both_terms(stationary_old):
    split, old = stationary_old
    term = StationaryCompatibility(old, lam=0.1, scale=10.0)
    assert term.classification_weight == 0.1
    frozen = {k: v.clone() for k, v in old.state_dict().items()}
    new, history = train_embedder(NEW, split, list(range(CLASSES)), (0.2, 0.3), run=_run(), compatibility=term)
    assert _lowered(history, "loss") and _lowered(history, "compatibility"), history
    assert torch.equal(new.classifier.weight, simplex_prototypes(8)[:CLASSES])  # fixed at init, never trained
    assert all(torch.equal(frozen[k], v) for k, v in old.state_dict().items())
    # the term is (1 - lambda) HOC against the old model's features
    images = torch.from_numpy(split.images[:16]).float() / 255
    with torch.no_grad():
        features, old_features = new(images), old(images)
        labels = torch.from_numpy(split.labels[:16])
        assert torch.allclose(term(images, features, labels),
                              0.9 * hoc_per_sample(features, old_features, labels, scale=10.0).mean())


# ---- BT^2

def test_the_bt2_loss_of_a_tiny_batch():
    compatible = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    old = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    new_part = torch.tensor([[3.0, 4.0], [1.0, 0.0]])
    reference = torch.tensor([[3.0, 4.0], [0.0, 1.0]])
    weight, rows = torch.eye(2), torch.tensor([0, 1])
    # sample 0: logits (1, 0), target 0; cos 1/sqrt(2) with old; cos 1 with the reference
    first = 2 * math.log(1 + math.exp(-1)) + 5 * (1 - 1 / math.sqrt(2)) + 1 * 0
    # sample 1: logits (0, 2), target 1; cos 1 with old; cos 0 with the reference
    second = 2 * math.log(1 + math.exp(-2)) + 5 * 0 + 1 * 1
    value = bt2_per_sample(compatible, new_part, old, reference, weight, rows, lam=2, match_old=5, match_new=1)
    assert torch.allclose(value, torch.tensor([first, second]), atol=1e-6)
    assert value.mean().item() == pytest.approx((first + second) / 2, abs=1e-6)


def _head(seed: int = 0) -> BasisTransformedEmbedding:
    torch.manual_seed(seed)
    return BasisTransformedEmbedding(torch.nn.Linear(10, 12 + 4), new_dim=12, old_dim=8)


def _orthogonal(matrix: torch.Tensor) -> bool:
    return torch.allclose(matrix @ matrix.t(), torch.eye(len(matrix)), atol=1e-5)


def test_the_basis_transformation_is_orthogonal_and_stays_so_while_it_trains():
    head = _head()
    x, target = torch.randn(32, 10), torch.randn(32, 16)
    optimizer = torch.optim.Adam(head.parameters(), lr=0.05)
    for _ in range(20):
        optimizer.zero_grad()
        (head(x) - target).pow(2).mean().backward()
        optimizer.step()
    assert _orthogonal(head.new_basis.weight) and _orthogonal(head.old_basis.weight)
    with torch.no_grad():
        e, out = head.linear(x), head(x)
        assert torch.allclose(out.norm(dim=1), e.norm(dim=1), atol=1e-4)  # nothing of e is lost
        assert torch.allclose(head.new_part(out), e[:, :12], atol=1e-4)  # f reads back exactly
        assert torch.allclose(head.folded()(x), out, atol=1e-4)  # one linear layer after training


def test_the_head_refuses_dimensions_it_cannotsquare_images():
    with pytest.raises(ValueError, match="needs extra dimensions"):
        BasisTransformedEmbedding(torch.nn.Linear(10, 12), new_dim=12, old_dim=8)
    with pytest.raises(ValueError, match="larger than the extra"):
        BasisTransformedEmbedding(torch.nn.Linear(10, 20), new_dim=12, old_dim=8)


@pytest.fixture(scope="module")
def bt2_setting():
    split = square_images()
    part = Split(split.images[split.labels < 2], split.labels[split.labels < 2])
    old, _ = train_embedder(OLD, part, [0, 1], (0.2, 0.3), run=_run())
    reference, _ = train_embedder(NEW.model_copy(update={"embedding_dim": 12}), split, list(range(CLASSES)),
                                  (0.2, 0.3), run=_run())
    return split, old, reference


def test_bt2_training_lowers_its_losses_and_folds_into_an_ordinary_model(bt2_setting):
    split, old, reference = bt2_setting
    term = BT2Compatibility(old, reference, old_class_means(old, split.images, split.labels), lam=10, match_old=5,
                            match_new=1)
    config = NEW.model_copy(update={"embedding_dim": 12 + 4})
    model, history = train_embedder(config, split, list(range(CLASSES)), (0.2, 0.3), run=_run(), compatibility=term)
    assert _lowered(history, "loss") and _lowered(history, "compatibility"), history
    head = model.embedding
    assert isinstance(head, BasisTransformedEmbedding)
    assert _orthogonal(head.new_basis.weight.detach()) and _orthogonal(head.old_basis.weight.detach())
    before = embed(model, split.images, device=CPU)
    fold_basis_transformation(model)
    assert isinstance(model.embedding, torch.nn.Linear) and model.embedding_dim == 16
    assert np.allclose(embed(model, split.images, device=CPU), before, atol=1e-4)


def test_old_items_are_ranked_by_the_compatible_part_alone():
    generator = torch.Generator().manual_seed(0)
    query, old = torch.randn(1, 6, generator=generator), torch.randn(20, 4, generator=generator)
    stored = old_items_beside_new_features(old, 6)
    assert stored.shape == (20, 6) and torch.equal(stored[:, :4], old) and not stored[:, 4:].any()
    full = torch.cdist(query, stored)[0]
    compatible = torch.cdist(query[:, :4], old)[0]
    assert torch.equal(full.argsort(), compatible.argsort())
    assert torch.allclose(full.pow(2) - compatible.pow(2), query[0, 4:].pow(2).sum().expand(20), atol=1e-5)


def test_the_configuration_of_the_two_methods():
    assert CompatibleConfig(loss="bt2").bt2 == {"extra_dims": 32, "match_old": 5.0, "match_new": 1.0}
    assert CompatibleConfig(loss="stationary", lam=0.1, tau=0.1).trains_own_old_model
    assert not CompatibleConfig(loss="bt2").trains_own_old_model
    with pytest.raises(ValueError, match="extra_dims apply to loss: bt2 only"):
        CompatibleConfig(loss="stationary", extra_dims=8)
    with pytest.raises(ValueError, match="at most 1"):
        CompatibleConfig(loss="stationary", lam=2.0)
    with pytest.raises(ValueError, match="new_to_new applies to loss: ract only"):
        CompatibleConfig(loss="bt2", new_to_new=False)
