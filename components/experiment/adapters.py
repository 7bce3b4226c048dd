"""Query-side adapters: map the new model's features into the old model's space, so that queries
embedded by the new model search the stored old gallery as it is, with no stored vector written
(the zero-write alternative to a gallery-side map; docs/methods.md, "Query-side adapters").

Three adapters, fitted on the same (old, new) feature pairs as the alignment maps:

- ``procrustes``: a similarity transform, ``s * (x - mu_new) @ R + mu_old`` with ``R`` orthogonal
  (semi-orthogonal when the dimensions differ) and one scale ``s``; closed form (SVD).
- ``low_rank``: an affine map whose linear part has rank at most ``rank``; ridge least squares,
  then reduced-rank regression (the fitted values projected on their top ``rank`` directions).
- ``residual_mlp``: the low-rank affine map plus a small MLP on the residual, trained by mean
  squared error with a held-out tenth of the pairs choosing the best epoch.

Each adapter maps ``(n, d_new) -> (n, d_old)`` float32 arrays through ``adapter(x)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from components.platform.vocabulary import ADAPTERS


class AdapterError(ValueError):
    """Pairs an adapter cannot be fitted on; the message says what is wrong."""


@dataclass(frozen=True)
class AffineAdapter:
    """``x @ weight + bias``: weight ``(d_new, d_old)``, bias ``(d_old,)``."""

    weight: np.ndarray
    bias: np.ndarray
    kind: str

    def __call__(self, new: np.ndarray) -> np.ndarray:
        new = _features(new, "new", self.weight.shape[0])
        return (new.astype(np.float64) @ self.weight + self.bias).astype(np.float32)


def _features(x, name: str, dim: int | None = None) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 2 or not np.issubdtype(x.dtype, np.floating):
        raise AdapterError(f"{name} features must be a 2-D float array, got shape {x.shape} of {x.dtype}")
    if dim is not None and x.shape[1] != dim:
        raise AdapterError(f"{name} features have dimension {x.shape[1]}, but the adapter takes {dim}")
    if not np.isfinite(x).all():
        raise AdapterError(f"{name} features hold NaN or infinite values")
    return x


def _pairs(new, old) -> tuple[np.ndarray, np.ndarray]:
    new, old = _features(new, "new"), _features(old, "old")
    if new.shape[0] != old.shape[0]:
        raise AdapterError(f"{new.shape[0]} new features but {old.shape[0]} old ones: the pairs must be the same "
                           "images, row for row")
    if new.shape[0] < 2:
        raise AdapterError("an adapter needs at least 2 pairs of features")
    return new.astype(np.float64), old.astype(np.float64)


def fit_procrustes(new, old) -> AffineAdapter:
    """The similarity transform (rotation or reflection, one scale, a shift) that best maps the
    centred new features onto the centred old ones in least squares."""
    x, y = _pairs(new, old)
    mu_x, mu_y = x.mean(0), y.mean(0)
    xc, yc = x - mu_x, y - mu_y
    u, singular, vt = np.linalg.svd(xc.T @ yc, full_matrices=False)
    rotation = u @ vt  # (d_new, d_old), orthonormal columns or rows
    energy = float((xc ** 2).sum())
    scale = float(singular.sum() / energy) if energy > 0 else 1.0
    weight = scale * rotation
    return AffineAdapter(weight, mu_y - mu_x @ weight, "procrustes")


def fit_low_rank(new, old, rank: int = 32, ridge: float = 1e-3) -> AffineAdapter:
    """An affine map of rank at most ``rank``: ridge regression (``ridge`` times the mean
    variance of the new features on the diagonal), then the fitted values' top ``rank``
    directions."""
    x, y = _pairs(new, old)
    if rank < 1:
        raise AdapterError(f"rank {rank}: give a positive rank")
    mu_x, mu_y = x.mean(0), y.mean(0)
    xc, yc = x - mu_x, y - mu_y
    gram = xc.T @ xc
    gram[np.diag_indices_from(gram)] += ridge * max(float(np.trace(gram)) / gram.shape[0], 1e-12)
    full = np.linalg.solve(gram, xc.T @ yc)  # (d_new, d_old)
    _, _, vt = np.linalg.svd(xc @ full, full_matrices=False)
    top = vt[:rank].T  # (d_old, r)
    weight = full @ top @ top.T
    return AffineAdapter(weight, mu_y - mu_x @ weight, "low_rank")


class ResidualMLPAdapter:
    """The low-rank affine map plus an MLP on what it leaves: ``affine(x) + mlp(x)``."""

    kind = "residual_mlp"

    def __init__(self, affine: AffineAdapter, mlp, mean: np.ndarray, std: np.ndarray, history: list[dict]):
        self.affine, self.mlp, self.mean, self.std, self.history = affine, mlp, mean, std, history

    def __call__(self, new: np.ndarray) -> np.ndarray:
        import torch

        base = self.affine(new)
        scaled = (_features(new, "new", self.affine.weight.shape[0]) - self.mean) / self.std
        with torch.no_grad():
            residual = self.mlp(torch.as_tensor(scaled, dtype=torch.float32)).numpy()
        return (base + residual).astype(np.float32)


def fit_residual_mlp(new, old, *, rank: int = 32, hidden: int = 256, epochs: int = 30, batch_size: int = 256,
                     min_steps: int = 1000, lr: float = 3e-3, weight_decay: float = 1e-4,
                     seed: int = 0) -> ResidualMLPAdapter:
    """The low-rank map fitted on nine tenths of the pairs, then an MLP (one hidden layer of
    ``hidden`` units, its output starting at zero) trained on the residual for ``epochs``, or
    more on few pairs so that it takes at least ``min_steps`` steps; the epoch with the lowest
    error on the held-out tenth (measured about 50 times) is kept (epoch 0: the affine map alone)."""
    import torch
    from torch import nn

    x, y = _pairs(new, old)
    rng = np.random.default_rng(seed)
    rows = rng.permutation(x.shape[0])
    held = max(1, x.shape[0] // 10)
    val, fit = rows[:held], rows[held:]
    if fit.size < 2:
        raise AdapterError(f"{x.shape[0]} pairs are too few to hold some out: give at least 3")
    affine = fit_low_rank(x[fit], y[fit], rank=rank)
    mean, std = x[fit].mean(0), x[fit].std(0) + 1e-6
    inputs = torch.as_tensor((x - mean) / std, dtype=torch.float32)
    residual = torch.as_tensor(y - affine(x).astype(np.float64), dtype=torch.float32)
    torch.manual_seed(seed)
    mlp = nn.Sequential(nn.Linear(x.shape[1], hidden), nn.GELU(), nn.Linear(hidden, y.shape[1]))
    nn.init.zeros_(mlp[-1].weight)
    nn.init.zeros_(mlp[-1].bias)
    optimizer = torch.optim.AdamW(mlp.parameters(), lr=lr, weight_decay=weight_decay)
    fit_t, val_t = torch.as_tensor(fit), torch.as_tensor(val)

    def val_error() -> float:
        with torch.no_grad():
            return float(((mlp(inputs[val_t]) - residual[val_t]) ** 2).sum(1).mean())

    best = (val_error(), 0, {k: v.clone() for k, v in mlp.state_dict().items()})
    history = [{"epoch": 0, "val_mse": best[0]}]
    generator = torch.Generator().manual_seed(seed)
    epochs = max(epochs, math.ceil(min_steps / math.ceil(fit.size / batch_size)))
    validate_every = max(1, epochs // 50)  # about 50 measurements, however many short epochs
    for epoch in range(1, epochs + 1):
        mlp.train()
        for batch in fit_t[torch.randperm(fit_t.numel(), generator=generator)].split(batch_size):
            loss = ((mlp(inputs[batch]) - residual[batch]) ** 2).sum(1).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if epoch % validate_every and epoch != epochs:
            continue
        mlp.eval()
        error = val_error()
        history.append({"epoch": epoch, "val_mse": error})
        if error < best[0]:
            best = (error, epoch, {k: v.clone() for k, v in mlp.state_dict().items()})
    mlp.load_state_dict(best[2])
    mlp.eval()
    return ResidualMLPAdapter(affine, mlp, mean, std, history)


def fit_adapter(kind: str, new, old, *, rank: int = 32, seed: int = 0):
    """One of ADAPTERS fitted on the pairs (``new[i]``, ``old[i]``)."""
    if kind == "procrustes":
        return fit_procrustes(new, old)
    if kind == "low_rank":
        return fit_low_rank(new, old, rank=rank)
    if kind == "residual_mlp":
        return fit_residual_mlp(new, old, rank=rank, seed=seed)
    raise AdapterError(f"unknown adapter {kind!r}; expected one of {', '.join(ADAPTERS)}")
