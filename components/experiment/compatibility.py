"""Terms that train a new model to be compatible with the old one (BCT, RACT, stationary
representations, BT^2), added to the new model's classification loss by
``train_embedder(..., compatibility=...)``. The old model is frozen; each term is a callable
``(images, new_features, labels) -> scalar loss``. A term may also carry ``prepare(model)``
(``train_embedder`` runs it on the fresh model before its optimiser is built: a fixed classifier,
a basis-transformation head) and ``classification_weight`` (the weight of the classification loss,
1 when absent)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fastfill.components.experiment.basis_transformation import BasisTransformedEmbedding
from fastfill.components.experiment.inference import embed
from fastfill.components.experiment.losses import (
    bct_influence_per_sample,
    bt2_per_sample,
    hoc_per_sample,
    match_dimension,
    ract_per_sample,
    simplex_prototypes,
    synthesized_classifier,
)
from fastfill.components.experiment.models import Embedder


@torch.no_grad()
def old_class_means(old_model: Embedder, images: np.ndarray, labels: np.ndarray, *, batch_size: int = 1024
                    ) -> dict[int, torch.Tensor]:
    """Mean old-model feature of every class in ``labels`` (BCT's rows for classes the old
    classifier never saw)."""

    features = torch.from_numpy(embed(old_model, images, batch_size=batch_size, device=torch.device("cpu")))
    labels_t = torch.from_numpy(labels)
    return {int(c): features[labels_t == c].mean(dim=0) for c in np.unique(labels)}


class BCTInfluence:
    """lambda * CE(kappa_old(phi_new(x)), y) through the frozen old classifier, extended with
    synthesised rows (class means of old features) for the classes it never saw."""

    def __init__(self, old_model: Embedder, class_means: dict[int, torch.Tensor], lam: float = 1.0,
                 label_smoothing: float = 0.0):
        weight, classes = synthesized_classifier(old_model.classifier.weight.detach().cpu(),
                                                 old_model.classes.tolist(), class_means)
        self.weight = weight
        self.row = torch.full((max(classes) + 1,), -1, dtype=torch.long)
        self.row[torch.tensor(classes)] = torch.arange(len(classes))
        self.lam, self.label_smoothing = lam, label_smoothing
        self.key = f"bct(lam={lam},ls={label_smoothing},rows={len(classes)})"

    def to(self, device: torch.device) -> BCTInfluence:
        self.weight, self.row = self.weight.to(device), self.row.to(device)
        return self

    def __call__(self, images: torch.Tensor, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        rows = self.row[labels]
        if (rows < 0).any():
            raise ValueError("BCT: a training label has no row in the (synthesised) old classifier")
        return self.lam * bct_influence_per_sample(features, self.weight, rows, self.label_smoothing).mean()


class RACTCompatibility:
    """lambda * the regression-alleviating compatible loss against the frozen old model's
    features of the same (augmented) batch; ``new_to_new=False`` is the vanilla compatible loss."""

    def __init__(self, old_model: Embedder, *, tau: float = 0.05, new_to_new: bool = True, lam: float = 1.0):
        self.old_model = old_model.eval().requires_grad_(False)
        self.tau, self.new_to_new, self.lam = tau, new_to_new, lam
        self.key = f"ract(tau={tau},n2n={new_to_new},lam={lam})"

    def to(self, device: torch.device) -> RACTCompatibility:
        self.old_model = self.old_model.to(device)
        return self

    def __call__(self, images: torch.Tensor, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # zero-padded or truncated to the new dimension when they differ
            old = match_dimension(self.old_model(images), features.shape[1])
        return self.lam * ract_per_sample(features, old, labels, tau=self.tau, new_to_new=self.new_to_new).mean()


def fix_simplex_classifier(model: Embedder) -> Embedder:
    """The d-Simplex fixed classifier: the model's classifier rows become the prototypes of its
    classes (``simplex_prototypes(d)[c]`` for global class ``c``, ``d`` the feature dimension),
    never trained. Every model of the same ``d`` gets the same prototype for the same class, so
    an old model and a new model trained this way share their classifier."""
    dim, classes = model.embedding_dim, model.classes
    if int(classes.max()) > dim:
        raise ValueError(f"a d-Simplex classifier in {dim} dimensions has {dim + 1} prototypes, too few for class "
                         f"{int(classes.max())}; raise train.*.embedding_dim to at least {int(classes.max())}")
    with torch.no_grad():
        model.classifier.weight.copy_(simplex_prototypes(dim)[classes.cpu()].to(model.classifier.weight))
    model.classifier.weight.requires_grad_(False)
    return model


class StationaryCompatibility:
    """Stationary representations: the new model trains against the fixed d-Simplex classifier
    (``prepare``) with ``lam * CE + (1 - lam) * HOC``, HOC the contrastive term against the frozen
    old model's features (itself trained with the same fixed classifier), similarity scale
    ``scale``."""

    def __init__(self, old_model: Embedder, *, lam: float = 0.1, scale: float = 10.0):
        if not 0 < lam <= 1:
            raise ValueError(f"stationary: lambda is the convex weight of the cross-entropy, in (0, 1]; got {lam}")
        self.old_model = old_model.eval().requires_grad_(False)
        self.classification_weight, self.scale = lam, scale
        self.key = f"stationary(lam={lam},scale={scale})"

    def prepare(self, model: Embedder) -> None:
        fix_simplex_classifier(model)

    def to(self, device: torch.device) -> StationaryCompatibility:
        self.old_model = self.old_model.to(device)
        return self

    def __call__(self, images: torch.Tensor, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            old = self.old_model(images)
        return (1.0 - self.classification_weight) * hoc_per_sample(features, old, labels, scale=self.scale).mean()


class BT2Compatibility:
    """BT^2's terms on a model whose embedding ``prepare`` turns into a basis-transformed one
    (``components.experiment.basis_transformation``), its feature ``out`` of ``d_new + extra``
    dimensions, ``out[:d_old]`` the compatible part:

        lam * CE(kappa_old(out[:d_old]), y)              BCT's influence loss (synthesised rows)
      + match_old * (1 - cos(out[:d_old], phi_old(x)))   matching the frozen old model
      + match_new * (1 - cos(f, phi'_new(x)))            matching the independently trained new model

    with ``f`` the new representation before the basis transformation (read back from ``out``)."""

    def __init__(self, old_model: Embedder, reference_new: Embedder, class_means: dict[int, torch.Tensor], *,
                 lam: float = 10.0, match_old: float = 5.0, match_new: float = 1.0, label_smoothing: float = 0.0):
        self.influence = BCTInfluence(old_model, class_means, lam=lam, label_smoothing=label_smoothing)
        self.old_model = old_model.eval().requires_grad_(False)
        self.reference = reference_new.eval().requires_grad_(False)
        self.old_dim, self.new_dim = old_model.embedding_dim, reference_new.embedding_dim
        self.match_old, self.match_new = match_old, match_new
        self.head: BasisTransformedEmbedding | None = None
        self.key = f"bt2(lam={lam},old={match_old},new={match_new},ls={label_smoothing})"

    def prepare(self, model: Embedder) -> None:
        """Puts the basis transformation after the model's embedding layer (``d_new + extra``
        outputs, ``d_new`` the reference new model's dimension)."""
        if not isinstance(model.embedding, nn.Linear):
            raise ValueError("this model's embedding layer has a basis transformation already")
        head = BasisTransformedEmbedding(model.embedding, self.new_dim, self.old_dim)
        model.embedding = head
        self.head = head

    def to(self, device: torch.device) -> BT2Compatibility:
        self.influence = self.influence.to(device)
        self.old_model, self.reference = self.old_model.to(device), self.reference.to(device)
        return self

    def __call__(self, images: torch.Tensor, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.head is None:
            raise ValueError("BT^2: the model has no basis transformation; train it with prepare=term.prepare")
        with torch.no_grad():
            old, reference = self.old_model(images), self.reference(images)
        rows = self.influence.row[labels]
        if (rows < 0).any():
            raise ValueError("BT^2: a training label has no row in the (synthesised) old classifier")
        return bt2_per_sample(features[:, :self.old_dim], self.head.new_part(features), old, reference,
                              self.influence.weight, rows, lam=self.influence.lam, match_old=self.match_old,
                              match_new=self.match_new, label_smoothing=self.influence.label_smoothing).mean()


def old_items_beside_new_features(old_features: torch.Tensor, new_dim: int) -> torch.Tensor:
    """An item not yet backfilled as the evaluation stores it beside a compatible model's
    features: the old feature in the first ``d_old`` coordinates, zeros after (BCT and RACT with
    a smaller old model: zero-padding; a larger one: truncation).

    For BT^2, whose feature is ``[compatible part (d_old), extra dims]``, this is how old items are
    compared with the compatible part: ``||q - [o, 0]||^2 = ||q[:d_old] - o||^2 + ||q[d_old:]||^2``
    (cosine: ``<q[:d_old], o> / (|q| |o|)``), the second factor the same for every old item, so a
    query ranks old items by its old-space part alone and backfilled items by the full feature."""
    return match_dimension(old_features, new_dim)
