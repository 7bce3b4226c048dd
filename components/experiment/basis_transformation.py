"""BT^2's basis transformation (Zhou et al., ICCV 2023): the new model's feature grows extra
dimensions, and two learnable orthogonal transformations decide which part of it is compatible
with the old model and which is free (docs/methods.md, "BT^2").

The embedding layer gives ``e = [f, g]``: ``f`` (``d_new`` dims) is the new representation,
matched to an independently trained new model, and ``g`` (``extra`` dims) the extra branch. Then

    z   = [g, B_new f]                       (extra + d_new dims)
    out = [B_old z[:d_old], z[d_old:]]       (d_new + extra dims)

with ``B_new`` (d_new x d_new) and ``B_old`` (d_old x d_old) orthogonal. ``out[:d_old]`` is the
compatible part (trained against the old model), the rest the extra dimensions. ``out`` is an
orthogonal transform of ``e``, so nothing of ``f`` is lost and ``f`` reads back from ``out``
exactly. The head is linear, so after training it folds into one embedding layer: the trained
model is an ordinary Embedder of dimension ``d_new + extra`` (saved, registered and served as any).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from torch.nn.utils.parametrizations import orthogonal


class BasisTransformedEmbedding(nn.Module):
    """An embedding layer of ``new_dim + extra`` outputs followed by BT^2's two orthogonal basis
    transformations; ``old_dim`` is the old model's feature dimension (the compatible part)."""

    def __init__(self, embedding: nn.Linear, new_dim: int, old_dim: int):
        super().__init__()
        extra = embedding.out_features - new_dim
        if extra < 1:
            raise ValueError(f"BT^2 needs extra dimensions: the embedding has {embedding.out_features} outputs for a "
                             f"{new_dim}-dimensional new representation")
        if not extra < old_dim <= new_dim + extra:
            raise ValueError(f"BT^2's compatible part (the old dimension, {old_dim}) must be larger than the extra "
                             f"dimensions ({extra}) and fit in the feature ({new_dim + extra})")
        self.linear = embedding
        # orthogonal() returns the Linear it parametrises (typed as any Module)
        self.new_basis = cast(nn.Linear, orthogonal(nn.Linear(new_dim, new_dim, bias=False)))
        self.old_basis = cast(nn.Linear, orthogonal(nn.Linear(old_dim, old_dim, bias=False)))
        self.new_dim, self.old_dim, self.extra = new_dim, old_dim, extra

    @property
    def out_features(self) -> int:
        return self.new_dim + self.extra

    def transform(self, e: torch.Tensor) -> torch.Tensor:
        """``e = [f, g]`` -> ``[B_old z[:d_old], z[d_old:]]`` with ``z = [g, B_new f]``."""
        z = torch.cat([e[:, self.new_dim:], self.new_basis(e[:, :self.new_dim])], dim=1)
        return torch.cat([self.old_basis(z[:, :self.old_dim]), z[:, self.old_dim:]], dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.transform(self.linear(x))

    def new_part(self, out: torch.Tensor) -> torch.Tensor:
        """``f`` read back from the output (an orthogonal matrix's inverse is its transpose;
        ``nn.Linear`` computes ``x W^T``, so ``y W`` undoes it)."""
        z = torch.cat([out[:, :self.old_dim] @ self.old_basis.weight, out[:, self.old_dim:]], dim=1)
        return z[:, self.extra:] @ self.new_basis.weight

    @torch.no_grad()
    def folded(self) -> nn.Linear:
        """One linear layer computing the same function: ``out = P (W x + b)`` with ``P`` the
        orthogonal matrix of ``transform``, so the weight is ``P W`` and the bias ``P b``."""
        weight = self.linear.weight
        rotation = self.transform(torch.eye(self.out_features, dtype=weight.dtype, device=weight.device)).t()
        layer = nn.Linear(self.linear.in_features, self.out_features, device=weight.device, dtype=weight.dtype)
        layer.weight.copy_(rotation @ weight)
        layer.bias.copy_(rotation @ self.linear.bias)
        return layer


def fold_basis_transformation(model: nn.Module) -> nn.Module:
    """A trained BT^2 model made an ordinary Embedder: its basis-transformed embedding layer
    replaced by the one linear layer it equals (no-op on a model without one)."""
    if isinstance(model.embedding, BasisTransformedEmbedding):
        model.embedding = model.embedding.folded()
    return model
