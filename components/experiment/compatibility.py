"""Terms that train a new model to be compatible with the old one (BCT, RACT), added to the
new model's classification loss by ``train_embedder(..., compatibility=...)``. The old model is
frozen; each term is a callable ``(images, new_features, labels) -> scalar loss``."""

from __future__ import annotations

import numpy as np
import torch

from components.experiment.losses import bct_influence_per_sample, match_dimension, ract_per_sample, synthesized_classifier
from components.experiment.models import Embedder
from components.experiment.inference import embed


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
