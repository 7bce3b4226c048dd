"""Inference: features of images (``embed``) and a trained map applied to stored features
(``apply_alignment``, ``apply_unified``), batched, on CUDA when present. What the gallery
upgrade and search need at serving time, without the training loops."""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

from components.experiment.models import AlignmentMap, Embedder, UnifiedMaps

CHANNELS_LAST = torch.channels_last


def pick_device() -> torch.device:
    """CUDA when present, CPU otherwise; FASTFILL_DEVICE forces one."""
    forced = os.environ.get("FASTFILL_DEVICE")
    if forced:
        return torch.device(forced)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@torch.no_grad()
def embed(model: Embedder, images: np.ndarray, *, batch_size: int = 1024, device: torch.device | None = None) -> np.ndarray:
    """Features of uint8 images (N, C, H, W), float32 (N, d)."""
    device = device or pick_device()
    model = model.to(device).eval()
    out = np.empty((len(images), model.embedding_dim), dtype=np.float32)
    for start in range(0, len(images), batch_size):
        batch = torch.from_numpy(images[start: start + batch_size]).to(device).float().div_(255.0)
        batch = batch.contiguous(memory_format=CHANNELS_LAST)
        out[start: start + len(batch)] = model(batch).cpu().numpy()
    return out


@torch.no_grad()
def apply_alignment(h: AlignmentMap, old_features: np.ndarray, *, batch_size: int = 4096,
                    device: torch.device | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """h(old) and, when h has an uncertainty head, log sigma^2 per item."""
    device = device or pick_device()
    h = h.to(device).eval()
    transformed, log_sigma2 = [], []
    for start in range(0, len(old_features), batch_size):
        batch = h(torch.from_numpy(old_features[start: start + batch_size]).to(device))
        transformed.append(batch.cpu().numpy())
        if h.uncertainty is not None:
            log_sigma2.append(h.log_sigma2(batch).cpu().numpy())
    sigma = np.concatenate(log_sigma2).astype(np.float32) if log_sigma2 else None
    return np.concatenate(transformed).astype(np.float32), sigma


@torch.no_grad()
def apply_unified(maps: UnifiedMaps, old_features: np.ndarray, new_features: np.ndarray, *, batch_size: int = 4096,
                  device: torch.device | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The unified space: T_g(old) for items not yet backfilled, T_q(new) for queries and
    backfilled items."""
    device = device or pick_device()
    maps = maps.to(device).eval()

    def run(module: nn.Module, features: np.ndarray) -> np.ndarray:
        parts = [module(torch.from_numpy(features[s: s + batch_size]).to(device)).cpu().numpy()
                 for s in range(0, len(features), batch_size)]
        return np.concatenate(parts).astype(np.float32)

    return run(maps.gallery, old_features), run(maps.query, new_features)
