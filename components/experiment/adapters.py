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

And online backfilling's reverse transformation ``metric_compatible`` (``fit_metric_compatible``):
the residual MLP's shape trained with a metric-compatible contrastive term, so that distances in
the old space and in the new space rank one merged list.

Each adapter maps ``(n, d_new) -> (n, d_old)`` float32 arrays through ``adapter(x)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

from fastfill.components.platform.vocabulary import ADAPTERS

if TYPE_CHECKING:
    import torch


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
    """The low-rank affine map plus an MLP on what it leaves: ``affine(x) + mlp(x)``.
    ``new_scale``: what the new space's features are multiplied by where its distances meet the
    old space's (1 but for the metric-compatible reverse transformation)."""

    kind = "residual_mlp"
    new_scale = 1.0

    def __init__(self, affine: AffineAdapter, mlp, mean: np.ndarray, std: np.ndarray, history: list[dict]):
        self.affine, self.mlp, self.mean, self.std, self.history = affine, mlp, mean, std, history

    def __call__(self, new: np.ndarray) -> np.ndarray:
        import torch

        base = self.affine(new)
        scaled = (_features(new, "new", self.affine.weight.shape[0]) - self.mean) / self.std
        with torch.no_grad():
            residual = self.mlp(torch.as_tensor(scaled, dtype=torch.float32)).numpy()
        return (base + residual).astype(np.float32)


def _residual_start(x: np.ndarray, y: np.ndarray, *, rank: int, hidden: int, seed: int, min_held: int):
    """What the residual MLP and the metric-compatible transformation start from: a seeded
    held-out tenth of the pairs (at least ``min_held``), the low-rank map on the rest, the
    standardised inputs and an MLP whose output starts at zero. Returns (fit rows, held-out rows,
    affine map, mean, std, inputs, mlp)."""
    import torch
    from torch import nn

    from fastfill.components.experiment.dense import Dense  # late: torch loads only where an MLP adapter is built

    rows = np.random.default_rng(seed).permutation(x.shape[0])
    held = max(min_held, x.shape[0] // 10)
    val, fit = rows[:held], rows[held:]
    if fit.size < 2:
        raise AdapterError(f"{x.shape[0]} pairs are too few to hold some out: give at least {min_held + 2}")
    affine = fit_low_rank(x[fit], y[fit], rank=rank)
    mean, std = x[fit].mean(0), x[fit].std(0) + 1e-6
    inputs = torch.as_tensor((x - mean) / std, dtype=torch.float32)
    torch.manual_seed(seed)
    mlp = nn.Sequential(Dense(x.shape[1], hidden), nn.GELU(), Dense(hidden, y.shape[1]))
    last = cast(Dense, mlp[-1])
    nn.init.zeros_(last.weight)
    nn.init.zeros_(last.bias)
    return fit, val, affine, mean, std, inputs, mlp


def fit_residual_mlp(new, old, *, rank: int = 32, hidden: int = 256, epochs: int = 30, batch_size: int = 256,
                     min_steps: int = 1000, lr: float = 3e-3, weight_decay: float = 1e-4,
                     seed: int = 0) -> ResidualMLPAdapter:
    """The low-rank map fitted on nine tenths of the pairs, then an MLP (one hidden layer of
    ``hidden`` units, its output starting at zero) trained on the residual for ``epochs``, or
    more on few pairs so that it takes at least ``min_steps`` steps; the epoch with the lowest
    error on the held-out tenth (measured about 50 times) is kept (epoch 0: the affine map alone)."""
    import torch

    x, y = _pairs(new, old)
    fit, val, affine, mean, std, inputs, mlp = _residual_start(x, y, rank=rank, hidden=hidden, seed=seed, min_held=1)
    residual = torch.as_tensor(y - affine(x).astype(np.float64), dtype=torch.float32)
    from fastfill.components.experiment.optimizers import ExactAdam  # late: torch loads when a command needs it
    optimizer = ExactAdam(mlp.parameters(), lr=lr, weight_decay=weight_decay, decoupled=True)
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


def metric_compatible_loss(reverse: torch.Tensor, new: torch.Tensor, old: torch.Tensor, labels: torch.Tensor,
                           *, scale: float, temperature: float = 0.1, new_gain=1.0) -> torch.Tensor:
    """Online backfilling's metric-compatible contrastive term, per anchor of a batch.

    Anchor ``i`` is a query embedded by the new model. Its candidates are the batch's other items
    in the new space (``-||new_i - new_j||^2``, j != i, fixed) and every item of the batch in the
    old space through the reverse transformation (``-||reverse_i - old_j||^2``), both divided by
    ``temperature * scale`` (``scale``: the mean squared distance between new features). The
    positives are the candidates of the anchor's class in either space: a supervised contrastive
    loss (the mean over positives of -log softmax over all candidates). ``new_gain`` multiplies
    the new space's squared distances (the paper's learnable new embedding, reduced to one
    scale: it changes no ranking within the new space). Its gradient moves the old-space
    distances and that gain, so that the two spaces' distances rank one merged list: what
    merging by raw distance needs."""
    import torch

    d_new = torch.cdist(new, new).pow(2) * new_gain
    d_old = torch.cdist(reverse, old).pow(2)
    n = new.shape[0]
    eye = torch.eye(n, dtype=torch.bool, device=new.device)
    logits = torch.cat([-d_new.masked_fill(eye, float("inf")), -d_old], dim=1) / (temperature * scale)
    same = labels[:, None] == labels[None, :]
    positive = torch.cat([same & ~eye, same], dim=1)
    log_p = logits - torch.logsumexp(logits, dim=1, keepdim=True)
    log_p = log_p.masked_fill(~positive, 0.0)
    return -(log_p.sum(1) / positive.sum(1).clamp(min=1))


def fit_metric_compatible(new, old, labels, *, rank: int = 32, hidden: int = 256, epochs: int = 30,
                          batch_size: int = 256, min_steps: int = 1000, lr: float = 1e-3, weight_decay: float = 1e-4,
                          temperature: float = 0.1, seed: int = 0) -> ResidualMLPAdapter:
    """Online backfilling's reverse transformation (new -> old) trained to make the two spaces'
    distances comparable: the residual MLP adapter's shape (the low-rank affine map plus an MLP,
    its output starting at zero) and one gain on the new space's distances (``new_scale`` on its
    features), trained by ``metric_compatible_loss`` on the pairs and their class ``labels`` plus
    the squared error to the old features (on the same scale), for
    ``epochs`` (or ``min_steps`` steps); the epoch with the lowest loss on a held-out tenth of the
    pairs (measured about 50 times) is kept."""
    import torch

    x, y = _pairs(new, old)
    labels = np.asarray(labels)
    if labels.shape != (x.shape[0],):
        raise AdapterError(f"the metric-compatible reverse transformation needs one class label per pair: "
                           f"{x.shape[0]} pairs, labels of shape {labels.shape}")
    fit, val, affine, mean, std, inputs, mlp = _residual_start(x, y, rank=rank, hidden=hidden, seed=seed, min_held=2)
    loss_of, log_gain = _metric_compatible_objective(x, y, labels, fit, affine, inputs, mlp, temperature)
    optimizer = torch.optim.AdamW([{"params": mlp.parameters()},  # the gain free to move by orders of magnitude
                                   {"params": [log_gain], "weight_decay": 0.0, "lr": 20 * lr}],
                                  lr=lr, weight_decay=weight_decay)
    best, history = _train_metric_compatible(mlp, log_gain, loss_of, optimizer, fit, val, epochs=epochs,
                                             batch_size=batch_size, min_steps=min_steps, seed=seed)
    kept = dict(best[2])
    gain = float(kept.pop("log_gain").exp())
    mlp.load_state_dict(kept)
    mlp.eval()
    adapter = ResidualMLPAdapter(affine, mlp, mean, std, history)
    adapter.kind = "metric_compatible"
    # new features are stored and searched times this (the square root of the distances' gain)
    adapter.new_scale = gain ** 0.5
    return adapter


def _metric_compatible_objective(x: np.ndarray, y: np.ndarray, labels: np.ndarray, fit: np.ndarray,
                                 affine: AffineAdapter, inputs, mlp, temperature: float):
    """The reverse transformation's training loss on a batch of pair rows (``loss_of(rows)``:
    ``metric_compatible_loss`` plus the squared error to the old features, both on the new
    features' scale), and the new space's log gain it learns. Returns (loss_of, log_gain)."""
    import torch
    from torch import nn

    new_t = torch.as_tensor(x, dtype=torch.float32)
    base = torch.as_tensor(affine(x), dtype=torch.float32)
    old_t = torch.as_tensor(y, dtype=torch.float32)
    labels_t = torch.as_tensor(labels)
    sample = new_t[torch.as_tensor(fit[:2048])]
    scale = float(torch.cdist(sample, sample).pow(2).mean()) or 1.0
    log_gain = nn.Parameter(torch.zeros(()))  # the new space's squared distances times exp(log_gain)

    def loss_of(rows_t) -> torch.Tensor:
        reverse = base[rows_t] + mlp(inputs[rows_t])
        contrastive = metric_compatible_loss(reverse, new_t[rows_t], old_t[rows_t], labels_t[rows_t], scale=scale,
                                             temperature=temperature, new_gain=log_gain.exp())
        return (contrastive + (reverse - old_t[rows_t]).pow(2).sum(1) / scale).mean()

    return loss_of, log_gain


def _train_metric_compatible(mlp, log_gain, loss_of, optimizer, fit: np.ndarray, val: np.ndarray, *, epochs: int,
                             batch_size: int, min_steps: int, seed: int) -> tuple[tuple, list[dict]]:
    """The reverse transformation's epochs over the ``fit`` rows in a seeded order, measured on the
    ``val`` rows about 50 times; returns the best measurement (loss, epoch, weights and log gain)
    and the history."""
    import torch

    val_t = torch.as_tensor(val)

    def val_loss() -> float:
        with torch.no_grad():
            return float(np.mean([float(loss_of(b)) for b in val_t.split(batch_size) if b.numel() > 1]))

    def state() -> dict:
        return {**{k: v.clone() for k, v in mlp.state_dict().items()}, "log_gain": log_gain.detach().clone()}

    best = (val_loss(), 0, state())
    history = [{"epoch": 0, "val_loss": best[0]}]
    generator = torch.Generator().manual_seed(seed)
    fit_t = torch.as_tensor(fit)
    epochs = max(epochs, math.ceil(min_steps / math.ceil(fit.size / batch_size)))
    validate_every = max(1, epochs // 50)
    for epoch in range(1, epochs + 1):
        mlp.train()
        for batch in fit_t[torch.randperm(fit_t.numel(), generator=generator)].split(batch_size):
            if batch.numel() < 2:
                continue
            loss = loss_of(batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if epoch % validate_every and epoch != epochs:
            continue
        mlp.eval()
        error = val_loss()
        history.append({"epoch": epoch, "val_loss": error, "new_gain": float(log_gain.detach().exp())})
        if error < best[0]:
            best = (error, epoch, state())
    return best, history


def fit_adapter(kind: str, new, old, *, rank: int = 32, seed: int = 0, labels=None):
    """One of ADAPTERS, or online backfilling's ``metric_compatible`` reverse transformation
    (which needs the pairs' class ``labels``), fitted on the pairs (``new[i]``, ``old[i]``)."""
    if kind == "metric_compatible":
        if labels is None:
            raise AdapterError("the metric_compatible reverse transformation needs the pairs' class labels")
        return fit_metric_compatible(new, old, labels, rank=rank, seed=seed)
    if kind == "procrustes":
        return fit_procrustes(new, old)
    if kind == "low_rank":
        return fit_low_rank(new, old, rank=rank)
    if kind == "residual_mlp":
        return fit_residual_mlp(new, old, rank=rank, seed=seed)
    raise AdapterError(f"unknown adapter {kind!r}; expected one of {', '.join(ADAPTERS)}")


def adapter_arrays(adapter) -> dict[str, np.ndarray]:
    """A fitted adapter as named arrays (``np.savez`` writes them; ``adapter_from_arrays`` reads
    them back): no pickled code, so a stored reverse transformation is safe to load."""
    if isinstance(adapter, AffineAdapter):
        return {"kind": np.array(adapter.kind), "weight": adapter.weight, "bias": adapter.bias}
    if not isinstance(adapter, ResidualMLPAdapter):
        raise AdapterError(f"cannot store an adapter of type {type(adapter).__name__}")
    arrays = {"kind": np.array(adapter.kind), "weight": adapter.affine.weight, "bias": adapter.affine.bias,
              "mean": np.asarray(adapter.mean), "std": np.asarray(adapter.std),
              "new_scale": np.array(float(adapter.new_scale))}
    arrays.update({f"mlp.{name}": value.detach().cpu().numpy() for name, value in adapter.mlp.state_dict().items()})
    return arrays


def adapter_from_arrays(arrays) -> AffineAdapter | ResidualMLPAdapter:
    """The adapter that ``adapter_arrays`` wrote (a mapping of arrays, or an ``np.load`` file)."""
    import torch
    from torch import nn

    from fastfill.components.experiment.dense import Dense  # late: torch loads only where an MLP adapter is built

    kind = str(np.asarray(arrays["kind"]))
    affine = AffineAdapter(np.asarray(arrays["weight"]), np.asarray(arrays["bias"]),
                           kind if kind in ("procrustes", "low_rank") else "low_rank")
    if kind in ("procrustes", "low_rank"):
        return affine
    if kind not in ("residual_mlp", "metric_compatible"):
        raise AdapterError(f"stored adapter of unknown kind {kind!r}")
    first, last = np.asarray(arrays["mlp.0.weight"]), np.asarray(arrays["mlp.2.weight"])
    mlp = nn.Sequential(Dense(first.shape[1], first.shape[0]), nn.GELU(), Dense(last.shape[1], last.shape[0]))
    mlp.load_state_dict({name: torch.as_tensor(np.asarray(arrays[f"mlp.{name}"])) for name in mlp.state_dict()})
    mlp.eval()
    adapter = ResidualMLPAdapter(affine, mlp, np.asarray(arrays["mean"]), np.asarray(arrays["std"]), [])
    adapter.kind = kind
    adapter.new_scale = float(np.asarray(arrays["new_scale"]))
    return adapter
