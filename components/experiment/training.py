"""Training the embedding models, and what every training loop shares (seeding, the warm-up
cosine schedule, checkpoints). Maps are trained in ``map_training``. Plain loops, seeded, on
CUDA when present.

Each loop checkpoints at the end of every epoch when given a checkpoint path, and resumes from
it (model, optimiser, scheduler, epoch, history) when the same configuration is run again, so a
killed training loses at most one epoch.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel
from torch import nn

from fastfill.components.experiment.data import Split
from fastfill.components.experiment.inference import CHANNELS_LAST, pick_device
from fastfill.components.experiment.losses import classification_per_sample
from fastfill.components.experiment.models import Embedder
from fastfill.components.experiment.optimizers import ExactAdam
from fastfill.components.platform.config import TrainConfig
from fastfill.components.platform.layout import save_torch
from fastfill.components.platform.progress import progress
from fastfill.components.platform.runtime import onednn_below_bf16

Log = Callable[[str], None]
Progress = Callable[[int, int], None]  # (epochs done, epochs in all)


class EpochProgress:
    """A training's ``on_epoch`` callback, made to end at 100% whenever the training ends: after
    every epoch, a stop on divergence or the step budget, or a resume of a finished run (which
    trains no epoch). ``end()`` reports the end unless the last report already was it."""

    def __init__(self, callback: Progress | None):
        self.callback = callback
        self.last: tuple[int, int] | None = None

    def __call__(self, done: int, total: int) -> None:
        if self.callback is not None:
            self.last = (done, total)
            self.callback(done, total)

    def end(self, total: int) -> None:
        if self.callback is not None and self.last != (total, total):
            self(total, total)


@dataclass(frozen=True)
class TrainingRun:
    """How a training runs, apart from what it learns: the device (None: ``pick_device``), the
    checkpoint it resumes from and saves to each epoch (None: none), its log and per-epoch
    progress callback."""

    device: torch.device | None = None
    checkpoint: Path | None = None
    log: Log = print
    on_epoch: Progress | None = None


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (avx512_bf16 or AMX): there
    bfloat16 autocast trains about twice as fast (benchmarks/cpu_bf16_training.py); elsewhere it
    is emulated and slower than float32. False under compute.cpu_kernels avx2 (the default), which
    holds oneDNN below those instructions so that every CPU computes the same bytes."""
    if onednn_below_bf16():  # compute.cpu_kernels holds oneDNN to AVX2: bfloat16 would be emulated
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def training_dtype(device: torch.device, precision: str) -> torch.dtype | None:
    """The autocast dtype of a training's forward passes, or None for float32. ``fp32``: none;
    ``bf16``: bfloat16 on any device; ``auto``: bfloat16 where the hardware runs it fast (a
    CUDA device that supports it, a CPU with avx512_bf16/AMX), float32 elsewhere."""
    if precision == "fp32":
        return None
    if precision == "bf16":
        return torch.bfloat16
    if precision != "auto":
        raise ValueError(f"training precision must be fp32, bf16 or auto, got {precision!r}")
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    return torch.bfloat16 if device.type == "cpu" and cpu_has_fast_bf16() else None


def forward_precision(device: torch.device, dtype: torch.dtype | None):
    """Autocast for the forward passes of a training step; weights, optimiser state, gradients
    and every loss stay float32 (callers take ``.float()`` of the outputs before the loss)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def announced_dtype(precision: str, device: torch.device, log: Log, what: str) -> torch.dtype | None:
    """``training_dtype``, said in the log when it is not float32 (``what``: whose forward passes)."""
    dtype = training_dtype(device, precision)
    if dtype is not None:
        log(f"precision {precision}: {what} forward passes in bfloat16 autocast on {device}")
    return dtype


def seed_everything(seed: int) -> torch.Generator:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def run_key(config: BaseModel, *arrays: np.ndarray) -> str:
    """What a checkpoint must match to be resumed: the config and a fingerprint of the data."""
    digest = hashlib.md5()
    for array in arrays:
        digest.update(str(array.shape).encode())
        digest.update(np.ascontiguousarray(array[:: max(1, len(array) // 512)]).tobytes())
    return json.dumps(config.model_dump(mode="json"), sort_keys=True) + digest.hexdigest()


def discard_checkpoint(path: Path) -> None:
    """Called once a training's outputs are saved: the next run starts afresh."""
    path.unlink(missing_ok=True)


def resume_checkpoint(path: Path | None, key: str, model: nn.Module, optimizer, scheduler, generator: torch.Generator,
            log: Log) -> dict | None:
    """Restore model, optimiser, scheduler and random state from a matching checkpoint; returns
    the checkpoint (its ``history``, ``epoch``, ...) or None when there is nothing to resume."""
    if path is None or not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("config_key") != key:
        return None
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    generator.set_state(state["generator"])
    log(f"resuming from {path} after epoch {state['epoch']}")
    return state


def save_checkpoint(path: Path | None, **state) -> None:
    if path is not None:
        save_torch(path, state)


def _augment(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random horizontal flip per image and a random shift of up to 2 pixels per batch."""
    flip = torch.rand(len(images), generator=generator) < 0.5
    images = torch.where(flip.to(images.device)[:, None, None, None], images.flip(-1), images)
    dx, dy = (int(v) for v in torch.randint(-2, 3, (2,), generator=generator))
    padded = nn.functional.pad(images, (2, 2, 2, 2))
    h, w = images.shape[-2:]
    return padded[..., 2 + dy: 2 + dy + h, 2 + dx: 2 + dx + w]


def train_embedder(
    config: TrainConfig,
    split: Split,
    classes: list[int],
    pixel_stats: tuple[float, float],
    *,
    run: TrainingRun = TrainingRun(),
    compatibility=None,
    prepare: Callable[[Embedder], object] | None = None,
) -> tuple[Embedder, list[dict]]:
    """Classification training of backbone + embedding + classifier over ``classes``, on images
    normalised by ``pixel_stats`` (mean, std); with ``compatibility`` (see
    components.experiment.compatibility) its term is added to every batch's loss, and the
    classification loss is weighted by its ``classification_weight`` when it has one.
    ``prepare`` changes the fresh model before its optimiser is built (a fixed classifier, a
    basis-transformation head); without one, the compatibility term's own ``prepare`` if it has one."""
    device = run.device or pick_device()
    prepare = prepare or getattr(compatibility, "prepare", None)
    checkpoint, log, on_epoch = run.checkpoint, run.log, EpochProgress(run.on_epoch)
    generator = seed_everything(config.seed)
    # channels-last convolutions are 15-30% faster on CPU (oneDNN) and use tensor cores on GPU
    model = Embedder(config, split.images.shape[1], classes, *pixel_stats)
    if prepare is not None:
        prepare(model)
    model = model.to(device, memory_format=CHANNELS_LAST)  # type: ignore[call-overload]  # torch's stubs omit memory_format
    rows = _class_rows(classes, split.labels)
    dtype = announced_dtype(config.precision, device, log, "the model's")
    images = torch.from_numpy(split.images).to(device)
    targets = torch.from_numpy(rows[split.labels]).to(device)
    labels = torch.from_numpy(split.labels).to(device)
    if compatibility is not None:
        compatibility = compatibility.to(device)
    optimizer, scheduler, total_steps = _embedder_optimizer(config, model, len(split))
    key, history, start_epoch, step = _embedder_key(config, split, compatibility, prepare), [], 0, 0
    batch_loss = functools.partial(_embedder_batch_loss, model, labels, compatibility,
                                   getattr(compatibility, "classification_weight", 1.0), config.label_smoothing,
                                   device, dtype)
    state = resume_checkpoint(checkpoint, key, model, optimizer, scheduler, generator, log)
    if state is not None:
        history, start_epoch, step = state["history"], state["epoch"], state["step"]

    # a bar on a terminal, else a line with the rate and the time left every FASTFILL_PROGRESS_SECONDS
    with progress(f"training the {config.backbone} model", total=total_steps, unit="step", log=log,
                  initial=step) as bar:
        for epoch in range(start_epoch, config.epochs):
            if step >= total_steps:
                break
            record, step = _embedder_epoch(model, optimizer, scheduler, generator, batch_loss, images, targets, bar,
                                           config=config, device=device, num_items=len(split), epoch=epoch,
                                           step=step, total_steps=total_steps, with_term=compatibility is not None)
            history.append(record)
            log(f"epoch {epoch + 1}/{config.epochs}: loss {record['loss']:.4f}, "
                f"train accuracy {100 * record['train_accuracy']:.2f}%")
            save_checkpoint(checkpoint, config_key=key, model=model.state_dict(), optimizer=optimizer.state_dict(),
                             scheduler=scheduler.state_dict(), generator=generator.get_state(),
                             history=history, epoch=epoch + 1, step=step)
            on_epoch(epoch + 1, config.epochs)
    on_epoch.end(config.epochs)
    model.eval()
    return model, history


def _class_rows(classes: list[int], labels: np.ndarray) -> np.ndarray:
    """Each global label's row of the classifier (-1: not one of ``classes``); an error when the
    training split has a label outside them."""
    rows = np.full(max(classes) + 1, -1, dtype=np.int64)
    rows[classes] = np.arange(len(classes))
    if (labels > max(classes)).any() or (rows[labels] < 0).any():
        raise ValueError(f"the training split has labels outside the model's classes {classes}")
    return rows


def _embedder_optimizer(config: TrainConfig, model: Embedder, num_items: int):
    """The embedder's optimiser (Adam or Nesterov SGD), its warm-up + cosine schedule, and the
    number of steps (``config.epochs`` of ``num_items``, at most ``config.max_steps``)."""
    steps_per_epoch = math.ceil(num_items / config.batch_size)
    total_steps = steps_per_epoch * config.epochs
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)
    optimizer: torch.optim.Optimizer
    if config.optimizer == "adam":
        optimizer = ExactAdam(model.parameters(), lr=config.lr, weight_decay=config.weight_decay, decoupled=True)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9,
                                    weight_decay=config.weight_decay, nesterov=True)
    scheduler = warmup_cosine(optimizer, total_steps, warmup_steps=min(steps_per_epoch // 4, total_steps // 10))
    return optimizer, scheduler, total_steps


def _embedder_key(config: TrainConfig, split: Split, compatibility, prepare) -> str:
    """What the embedder's checkpoint must match: the configuration, the data, the compatibility
    term and the fresh model's preparation."""
    key = run_key(config, split.images, split.labels)
    if compatibility is not None:
        key += compatibility.key
    if prepare is not None:
        key += f"prepare={getattr(prepare, '__qualname__', type(prepare).__name__)}"
    return key


def _embedder_batch_loss(model: Embedder, labels: torch.Tensor, compatibility, classification_weight: float,
                         label_smoothing: float, device: torch.device, dtype: torch.dtype | None,
                         batch: torch.Tensor, targets: torch.Tensor, index: torch.Tensor):
    """A batch's loss (the weighted classification loss, plus the compatibility term when there
    is one), its logits and the term (None without one)."""
    with forward_precision(device, dtype):
        features = model(batch)
        logits = model.classify(features)
    features, logits = features.float(), logits.float()
    loss = classification_weight * classification_per_sample(logits, targets, label_smoothing).mean()
    term = None
    if compatibility is not None:
        term = compatibility(batch, features, labels[index])
        loss = loss + term
    return loss, logits, term


def _embedder_epoch(model: Embedder, optimizer, scheduler, generator: torch.Generator, batch_loss, images: torch.Tensor,
                    targets: torch.Tensor, bar, *, config: TrainConfig, device: torch.device, num_items: int,
                    epoch: int, step: int, total_steps: int, with_term: bool) -> tuple[dict, int]:
    """One pass over the split in a seeded order, stopping at ``total_steps``: the epoch's record
    (mean loss, training accuracy, the compatibility term's mean) and the step count after it."""
    model.train()
    permutation = torch.randperm(num_items, generator=generator).to(device)
    loss_sum, compat_sum, correct, seen = 0.0, 0.0, 0, 0
    for start in range(0, num_items, config.batch_size):
        if step >= total_steps:
            break
        index = permutation[start: start + config.batch_size]
        batch = images[index].float().div_(255.0)
        if config.augment:
            batch = _augment(batch, generator)
        batch = batch.contiguous(memory_format=CHANNELS_LAST)
        loss, logits, term = batch_loss(batch, targets[index], index)
        if term is not None:
            compat_sum += term.item() * len(index)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        step += 1
        bar.advance()
        loss_sum += loss.item() * len(index)
        correct += int((logits.argmax(1) == targets[index]).sum())
        seen += len(index)
    record = {"epoch": epoch + 1, "loss": loss_sum / seen, "train_accuracy": correct / seen, "step": step}
    if with_term:
        record["compatibility"] = compat_sum / seen
    return record, step
