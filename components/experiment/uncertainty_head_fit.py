"""The uncertainty head fitted on a fixed map: ``fit_uncertainty_head`` gives an l2-only map a
head psi trained on its frozen outputs, to the per-item loss ``true_alignment_loss`` measures
(what a fallback map orders by, and what the oracle order sorts by).
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from fastfill.components.experiment.inference import pick_device
from fastfill.components.experiment.losses import classification_per_sample, l2_per_sample, uncertainty_weighted
from fastfill.components.experiment.map_validation import validation_split
from fastfill.components.experiment.models import AlignmentMap
from fastfill.components.experiment.optimizers import ExactAdam
from fastfill.components.experiment.training import seed_everything
from fastfill.components.platform.config import AlignConfig


@torch.no_grad()
def true_alignment_loss(config: AlignConfig, transformed: np.ndarray, new_features: np.ndarray,
                        class_rows: np.ndarray, new_classifier: nn.Module) -> np.ndarray:
    """The per-item loss the map was trained on (l2 and/or disc, unweighted), measured with the
    new features: what the oracle order sorts by. Needs phi_new, so analysis only."""
    transformed_t = torch.from_numpy(transformed)
    new_classifier = new_classifier.cpu().eval()
    per_item = torch.zeros(len(transformed))
    if config.l2:
        per_item += l2_per_sample(torch.from_numpy(new_features), transformed_t, config.l2_reduction)
    known = torch.from_numpy(class_rows) >= 0  # classes the new model never saw have no disc term
    if config.disc and known.any():
        per_item[known] += classification_per_sample(new_classifier(transformed_t[known]),
                                                     torch.from_numpy(class_rows)[known], config.disc_label_smoothing)
    return per_item.numpy().astype(np.float32)


def fit_uncertainty_head(h: AlignmentMap, config: AlignConfig, old_features: np.ndarray, new_features: np.ndarray,
                         class_rows: np.ndarray, new_classifier: nn.Module, *, steps: int = 500,
                         device: torch.device | None = None) -> AlignmentMap:
    """A copy of an l2-only map ``h`` with an uncertainty head psi fitted on its frozen outputs
    to the loss terms of ``config`` (what a fallback map orders by). The map is unchanged."""
    device = device or pick_device()
    generator = seed_everything(config.seed)
    shape = h.architecture  # the same network as h, so the fitted map is described (and registered) as it is
    fitted = AlignmentMap(h.old_dim, h.new_dim, shape["hidden"], True, shape["architecture"],
                          shape["rbt_blocks"]).to(device)
    fitted.transform = copy.deepcopy(h.transform).to(device).eval().requires_grad_(False)
    if h.scaled:  # a map trained with conditioning: the same scales
        fitted.set_scale(float(h.input_scale), float(h.output_scale))
        fitted.to(device)
    # the pairs the map trained on (map_training.split_pairs without a method)
    train_index, _ = validation_split(len(old_features), config.validation_fraction, config.seed)
    with torch.no_grad():
        transformed = fitted(torch.from_numpy(old_features[train_index]).to(device))
    per_item = torch.from_numpy(true_alignment_loss(config, transformed.cpu().numpy(), new_features[train_index],
                                                    class_rows[train_index], new_classifier)).to(device)
    assert fitted.uncertainty is not None  # made with uncertainty=True above
    optimizer = ExactAdam(fitted.uncertainty.parameters(), lr=1e-2)
    batch = min(1024, len(transformed))
    for _ in range(steps):
        index = torch.randint(0, len(transformed), (batch,), generator=generator).to(device)
        loss = uncertainty_weighted(per_item[index], fitted.log_sigma2(transformed[index]),
                                    config.uncertainty_lambda).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return fitted.eval()
