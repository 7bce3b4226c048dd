"""Losses of docs/methods.md, per sample where a method needs per-sample values."""

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


def orthogonality_penalty(weight: torch.Tensor) -> torch.Tensor:
    """||W^T W - I||_F^2 of an affine map's ``weight`` W (``(d_new, d_old)``, as torch's Linear
    stores it): 0 when W's columns are orthonormal (a rotation, or an isometric embedding where
    d_new > d_old). The lambda-orthogonality regulariser is lambda times this (Ricci et al., 2025)."""
    gram = weight.t() @ weight
    return (gram - torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)).pow(2).sum()


WEIGHTINGS = ("joint", "normalized", "detached", "separate")


def uncertainty_objective(per_sample_loss: torch.Tensor, log_sigma2: torch.Tensor, lam: float = 1.0,
                          weighting: str = "joint", warm: bool = False) -> torch.Tensor:
    """The batch loss of a map with an uncertainty head, by how psi's weight reaches the map.

    ``joint`` is FastFill's loss as written: mean(0.5 exp(-s) L + 0.5 s / lambda). Its minimum
    over s is s = log(lambda L), so once psi has learnt that, the map's gradient is divided by
    about lambda L; Adam's second-moment estimate still remembers the large early gradients, so
    with few optimiser steps the map barely moves. ``normalized`` keeps the per-sample weights
    exp(-s) but rescales them to mean 1 and holds them constant for the map, so the map trains at
    the unweighted loss's scale while easy samples still count more than hard ones. ``detached``
    trains the map on the unweighted loss. In both, psi's term sees the loss detached, so it
    predicts the same log sigma^2 without scaling the map's gradient; its gradient still reaches
    the map through psi's input. ``separate`` trains the map on its terms' plain mean, as a map
    without a head does, and the caller gives psi the map's outputs detached: the map trains
    exactly as it would without psi, and psi learns beside it.
    ``warm``: the map sees the unweighted loss whatever the weighting (a warm-up).
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"uncertainty weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    if weighting == "joint" and not warm:
        return uncertainty_weighted(per_sample_loss, log_sigma2, lam).mean()
    head = uncertainty_weighted(per_sample_loss.detach(), log_sigma2, lam).mean()
    if weighting == "separate":  # the map's loss exactly as without a head
        return per_sample_loss.mean() + head
    if warm or weighting == "detached":
        return 0.5 * per_sample_loss.mean() + head
    weights = torch.exp(-log_sigma2).detach()
    weights = weights / weights.mean()
    return 0.5 * (weights * per_sample_loss).mean() + head


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
    weighting: str = "joint",
    warm: bool = False,
) -> AlignmentLoss:
    """FCT (l2), FastFill (l2 + disc [+ uncertainty]) and their ablations, by switches.

    ``classifier`` is the new model's frozen head kappa_new and ``targets`` its rows for the
    labels; both are needed only when ``disc`` is on. With ``log_sigma2`` the per-sample sum
    of the terms is weighted by the predicted uncertainty (see ``uncertainty_objective``).
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
    total = per_sample.mean() if log_sigma2 is None else uncertainty_objective(per_sample, log_sigma2, lam,
                                                                                weighting, warm)
    return AlignmentLoss(
        total=total,
        l2=None if l2_term is None else l2_term.mean(),
        disc=None if disc_term is None else disc_term.mean(),
        log_sigma2=None if log_sigma2 is None else log_sigma2.mean(),
    )


# ------------------------------------------------------------------------------------------------
# Methods that train the new model to be compatible (BCT, RACT) and the unified space


def match_dimension(features: torch.Tensor, dim: int) -> torch.Tensor:
    """Truncate or zero-pad features to ``dim`` columns (BCT when the two models' dimensions differ)."""
    if features.shape[1] >= dim:
        return features[:, :dim]
    return F.pad(features, (0, dim - features.shape[1]))


def synthesized_classifier(old_weight: torch.Tensor, old_classes: list[int], class_means: dict[int, torch.Tensor]
                           ) -> tuple[torch.Tensor, list[int]]:
    """BCT's old classifier extended to classes it never saw: one row per new class, the mean
    old-model feature of that class. Returns the weight and the global class of each row."""
    rows, classes = [old_weight], list(old_classes)
    for label in sorted(set(class_means) - set(old_classes)):
        rows.append(class_means[label].reshape(1, -1).to(old_weight))
        classes.append(label)
    return torch.cat(rows), classes


def bct_influence_per_sample(new_features: torch.Tensor, old_weight: torch.Tensor, rows: torch.Tensor,
                             label_smoothing: float = 0.0) -> torch.Tensor:
    """CE(kappa_old(phi_new(x)), y) with the frozen (synthesised) old classifier ``old_weight``
    (rows x d_old); ``rows`` are the targets' rows in it."""
    logits = match_dimension(new_features, old_weight.shape[1]) @ old_weight.detach().t()
    return F.cross_entropy(logits, rows, label_smoothing=label_smoothing, reduction="none")


def ract_per_sample(new_features: torch.Tensor, old_features: torch.Tensor, labels: torch.Tensor, *,
                    tau: float = 0.05, new_to_new: bool = True) -> torch.Tensor:
    """RACT's regression-alleviating compatible loss per sample (``new_to_new=False``: the
    "vanilla" compatible loss). Features are L2-normalised here; the positive is the sample's
    own old feature, the negatives the old (and new) features of other classes in the batch."""
    n = F.normalize(new_features, dim=1)
    o = F.normalize(old_features.detach(), dim=1)
    to_old = n @ o.t() / tau
    positive = to_old.diagonal()
    other_class = labels[:, None] != labels[None, :]
    masked = [positive[:, None], to_old.masked_fill(~other_class, float("-inf"))]
    if new_to_new:
        masked.append((n @ n.t() / tau).masked_fill(~other_class, float("-inf")))
    return torch.logsumexp(torch.cat(masked, dim=1), dim=1) - positive


@dataclass
class UnifiedLoss:
    total: torch.Tensor
    similarity: torch.Tensor
    classification: torch.Tensor
    kl: torch.Tensor


def unified_loss(query_side: torch.Tensor, gallery_side: torch.Tensor, classifier: torch.nn.Module,
                 targets: torch.Tensor, *, weights: tuple[float, float, float] = (1.0, 1.0, 0.25),
                 label_smoothing: float = 0.0) -> UnifiedLoss:
    """The unified space: T_q(phi_new) and T_g(phi_old) pulled together (summed squared
    distance), both classified by one shared head K, and KL(K(T_q) || K(T_g)). Batch means."""
    similarity = l2_per_sample(query_side, gallery_side, "sum").mean()
    logits_q, logits_g = classifier(query_side), classifier(gallery_side)
    classification = (F.cross_entropy(logits_q, targets, label_smoothing=label_smoothing)
                      + F.cross_entropy(logits_g, targets, label_smoothing=label_smoothing))
    log_p, log_q = F.log_softmax(logits_q, dim=1), F.log_softmax(logits_g, dim=1)
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=1).mean()
    total = weights[0] * similarity + weights[1] * classification + weights[2] * kl
    return UnifiedLoss(total, similarity, classification, kl)


# ------------------------------------------------------------------------------------------------
# Stationary representations (a fixed d-Simplex classifier) and BT^2 (basis transformation)


def simplex_prototypes(dim: int) -> torch.Tensor:
    """The d-Simplex: ``dim + 1`` unit vectors in ``dim`` dimensions, centred on the origin, every
    pair at cosine ``-1 / dim`` (the vertices of a regular simplex). Row ``c`` is class ``c``'s
    fixed prototype; a deterministic closed form, so every model built with the same ``dim`` gets
    the same prototypes. Built in float64: the standard basis ``e_1 .. e_dim`` and the point
    ``a (1, ..., 1)`` with ``a = (1 - sqrt(dim + 1)) / dim`` are equidistant from one another;
    centring and normalising them gives the simplex."""
    if dim < 1:
        raise ValueError(f"a d-Simplex needs at least one dimension, got {dim}")
    points = torch.cat([torch.eye(dim, dtype=torch.float64),
                        torch.full((1, dim), (1.0 - (dim + 1) ** 0.5) / dim, dtype=torch.float64)])
    points = points - points.mean(dim=0)
    return (points / points.norm(dim=1, keepdim=True)).float()


def hoc_per_sample(new_features: torch.Tensor, old_features: torch.Tensor, labels: torch.Tensor, *,
                   scale: float = 10.0) -> torch.Tensor:
    """The stationary representations' contrastive term between the new features and the frozen
    old model's features of the same batch, on L2-normalised features with similarity scale
    ``scale`` (mu): the positive is the sample's own old feature, the negatives the old features
    of the other classes in the batch (same-class items are never negatives). This is RACT's
    vanilla compatible loss with ``tau = 1 / scale``."""
    return ract_per_sample(new_features, old_features, labels, tau=1.0 / scale, new_to_new=False)


def cosine_mismatch_per_sample(features: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``1 - cos(features, target)`` per sample: BT^2's matching term (``target`` frozen)."""
    return 1.0 - F.cosine_similarity(features, target.detach(), dim=1)


def bt2_per_sample(compatible: torch.Tensor, new_part: torch.Tensor, old_features: torch.Tensor,
                   reference_features: torch.Tensor, old_weight: torch.Tensor, rows: torch.Tensor, *,
                   lam: float = 10.0, match_old: float = 5.0, match_new: float = 1.0,
                   label_smoothing: float = 0.0) -> torch.Tensor:
    """BT^2's compatibility terms per sample: BCT's influence loss on the compatible part
    (``old_weight`` the frozen, synthesised old classifier, ``rows`` the targets' rows), its
    cosine mismatch with the old model's feature, and the cosine mismatch of the new
    representation ``new_part`` (before the basis transformation) with the independently trained
    new model's feature ``reference_features``."""
    return (lam * bct_influence_per_sample(compatible, old_weight, rows, label_smoothing)
            + match_old * cosine_mismatch_per_sample(compatible, old_features)
            + match_new * cosine_mismatch_per_sample(new_part, reference_features))
