"""Losses of METHODS.md, per sample where a method needs per-sample values."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def l2_per_sample(target: torch.Tensor, prediction: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
    """||target - prediction||^2 per sample: summed over dimensions (the paper) or their mean
    (the reference code)."""
    squared = (target - prediction).pow(2)
    if reduction == "sum":
        return squared.sum(dim=1)
    if reduction == "mean":
        return squared.mean(dim=1)
    raise ValueError(f"l2 reduction must be 'sum' or 'mean', got {reduction!r}")


def classification_per_sample(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.1) -> torch.Tensor:
    """Label-smoothed cross-entropy per sample; ``targets`` are classifier rows."""
    return F.cross_entropy(logits, targets, label_smoothing=label_smoothing, reduction="none")


def uncertainty_weighted(per_sample_loss: torch.Tensor, log_sigma2: torch.Tensor, lam: float = 1.0) -> torch.Tensor:
    """FastFill's per-sample loss L / sigma^2 + (1/lambda) log sigma^2, halved as in the
    reference code: 0.5 * exp(-s) * L + 0.5 * s / lambda, with s = log sigma^2."""
    return 0.5 * torch.exp(-log_sigma2) * per_sample_loss + 0.5 * log_sigma2 / lam


@dataclass
class AlignmentLoss:
    """The loss of one batch and its parts (batch means), for logging."""

    total: torch.Tensor
    l2: torch.Tensor | None
    disc: torch.Tensor | None
    log_sigma2: torch.Tensor | None


def alignment_loss(
    transformed: torch.Tensor,
    new_features: torch.Tensor,
    *,
    l2: bool,
    disc: bool,
    l2_reduction: str = "sum",
    classifier: torch.nn.Module | None = None,
    targets: torch.Tensor | None = None,
    label_smoothing: float = 0.1,
    log_sigma2: torch.Tensor | None = None,
    lam: float = 1.0,
) -> AlignmentLoss:
    """FCT (l2), FastFill (l2 + disc [+ uncertainty]) and their ablations, by switches.

    ``classifier`` is the new model's frozen head kappa_new and ``targets`` its rows for the
    labels; both are needed only when ``disc`` is on. With ``log_sigma2`` the per-sample sum
    of the terms is weighted by the predicted uncertainty.
    """
    per_sample = torch.zeros(len(transformed), device=transformed.device)
    l2_term = disc_term = None
    if l2:
        l2_term = l2_per_sample(new_features, transformed, l2_reduction)
        per_sample = per_sample + l2_term
    if disc:
        if classifier is None or targets is None:
            raise ValueError("the disc term needs the new model's classifier and the labels")
        disc_term = classification_per_sample(classifier(transformed), targets, label_smoothing)
        per_sample = per_sample + disc_term
    if log_sigma2 is not None:
        per_sample = uncertainty_weighted(per_sample, log_sigma2, lam)
    return AlignmentLoss(
        total=per_sample.mean(),
        l2=None if l2_term is None else l2_term.mean(),
        disc=None if disc_term is None else disc_term.mean(),
        log_sigma2=None if log_sigma2 is None else log_sigma2.mean(),
    )
