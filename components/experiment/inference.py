"""Inference: features of images (``embed``) and a trained map applied to stored features
(``apply_alignment``, ``apply_unified``), batched, on CUDA when present. What the gallery
upgrade and search need at serving time, without the training loops."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from fastfill.components.experiment.models import AlignmentMap, Embedder, UnifiedMaps
from fastfill.components.platform.vocabulary import PRECISIONS

CHANNELS_LAST = torch.channels_last


def pick_device() -> torch.device:
    """CUDA when present, CPU otherwise; FASTFILL_DEVICE forces one."""
    forced = os.environ.get("FASTFILL_DEVICE")
    if forced:
        return torch.device(forced)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def autocast_dtype(device: torch.device, precision: str = "auto") -> torch.dtype | None:
    """The dtype ``embed`` computes in under autocast, or None for plain float32. ``auto``:
    bfloat16 on a CUDA device that supports it (float16 on one that does not), float32 on the
    CPU; ``fp32`` turns mixed precision off."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "fp32":
        return None
    if device.type != "cuda":
        if precision == "auto":
            return None
        raise ValueError(f"precision {precision} needs a CUDA device; on {device} use auto or fp32")
    if precision == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if precision == "bf16" else torch.float16


@torch.no_grad()
def embed(model: Embedder, images: np.ndarray, *, batch_size: int = 1024, device: torch.device | None = None,
          precision: str = "auto", on_batch: Callable[[int], None] | None = None) -> np.ndarray:
    """Features of uint8 images (N, C, H, W), float32 (N, d); images of another shape than the
    model's ``preprocessing`` takes are resized by its rule first.

    ``on_batch``: called after each batch, its features copied back, with the number of images
    that batch embedded (an increment: ``on_batch=bar.advance`` of
    ``components.platform.progress`` counts up to N).

    On CUDA the uint8 batches go through pinned host memory and a copy stream of their own,
    so the next batch's host-to-device copy overlaps this batch's forward pass, and the model
    runs under autocast (``precision``, see ``autocast_dtype``); features are always returned
    in float32."""
    preprocessing: Any = getattr(model, "preprocessing", None)  # a registered model's (model_store)
    reshape = preprocessing is not None and tuple(images.shape[1:]) != preprocessing.shape
    if hasattr(model, "embed_uint8"):  # a graph runtime (ONNX): uint8 batches straight to it, no torch
        graph: Any = model
        out = np.empty((len(images), graph.embedding_dim), dtype=np.float32)
        for start in range(0, len(images), batch_size):
            rows = images[start: start + batch_size]
            out[start: start + len(rows)] = graph.embed_uint8(preprocessing.adapt(rows) if reshape else rows)
            if on_batch is not None:
                on_batch(len(rows))
        return out
    device = device or pick_device()
    model = model.to(device).eval()
    out = np.empty((len(images), model.embedding_dim), dtype=np.float32)
    if not len(images):
        return out
    dtype = autocast_dtype(device, precision)
    copies = torch.cuda.Stream(device) if device.type == "cuda" else None
    # images of another shape than the model takes (a gallery's stored pixels, query arrays) go
    # through the model's own colour and resize rule, a batch at a time (``reshape`` above)
    # torch's convolutions are faster channels-last; a graph runtime takes plain (N, C, H, W)
    layout = CHANNELS_LAST if getattr(model, "channels_last", True) else torch.contiguous_format

    def load(start: int) -> torch.Tensor:
        rows = images[start: start + batch_size]
        batch = torch.from_numpy(np.ascontiguousarray(preprocessing.adapt(rows) if reshape else rows))
        if copies is None:
            return batch
        batch = batch.pin_memory()
        with torch.cuda.stream(copies):
            return batch.to(device, non_blocking=True)

    pending = load(0)
    for start in range(0, len(images), batch_size):
        batch = pending
        if copies is not None:
            compute = torch.cuda.current_stream(device)
            compute.wait_stream(copies)  # this batch has arrived
            batch.record_stream(compute)  # allocated on the copy stream, used on this one
        batch = batch.float().div_(255.0).contiguous(memory_format=layout)
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            features = model(batch)  # queued on the GPU; the next copy is queued beside it
        if start + batch_size < len(images):
            pending = load(start + batch_size)
        out[start: start + len(batch)] = features.float().cpu().numpy()
        if on_batch is not None:
            on_batch(len(batch))
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
