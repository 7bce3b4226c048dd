"""Training alignment maps: the feature-pair loop of FCT, FastFill (with its uncertainty head)
and the unified maps, and their held-out validation. Checkpoints and seeding are ``training``'s;
the uncertainty head fitted on a fixed map is ``uncertainty_head_fit``'s (re-exported here).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fastfill.components.experiment.inference import pick_device
from fastfill.components.experiment.losses import (
    alignment_loss,
    classification_per_sample,
    l2_per_sample,
    orthogonality_penalty,
    unified_loss,
)
from fastfill.components.experiment.map_validation import held_out, retrieval_at_zero, validation_split
from fastfill.components.experiment.models import AlignmentMap, UnifiedMaps
from fastfill.components.experiment.optimizers import ExactAdam
from fastfill.components.experiment.training import (
    EpochProgress,
    Log,
    Progress,
    announced_dtype,
    forward_precision,
    resume_checkpoint,
    run_key,
    save_checkpoint,
    seed_everything,
    warmup_cosine,
)
from fastfill.components.experiment.uncertainty_head_fit import fit_uncertainty_head, true_alignment_loss
from fastfill.components.platform.config import AlignConfig

__all__ = ["PROGRESS_SECONDS", "Validate", "divergence", "feature_schedule", "fit_uncertainty_head", "split_pairs",
           "train_alignment", "train_unified", "true_alignment_loss", "unified_validation_record", "validation_record"]

PROGRESS_SECONDS = 30.0  # the longest a map's training goes without a line in its log


def _set_batchnorm_eval(module: nn.Module) -> None:
    for child in module.modules():
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            child.eval()


def _check_same_images(old_features: np.ndarray, new_features: np.ndarray, class_rows: np.ndarray) -> None:
    if len(old_features) != len(new_features) or len(old_features) != len(class_rows):
        raise ValueError(
            f"old features ({len(old_features)}), new features ({len(new_features)}) and labels "
            f"({len(class_rows)}) must describe the same images"
        )


def feature_schedule(config: AlignConfig, num_items: int) -> dict[str, int]:
    """Epochs, steps and warm-up of a map trained on ``num_items`` pairs: ``config.epochs``, or
    more when that would be fewer than ``config.min_steps`` optimiser steps (small data), with
    the warm-up and the validations kept at the same fractions of the run. With
    ``config.patience`` those epochs are the most it trains (it stops earlier once the held-out
    score stops improving): the held-out pairs are measured every epoch, and the learning rate
    and (under conditioning) the uncertainty term warm up over ``warmup_epochs`` real epochs."""
    steps_per_epoch = math.ceil(num_items / config.batch_size)
    epochs = max(config.epochs, math.ceil(config.min_steps / steps_per_epoch))
    total = steps_per_epoch * epochs
    if config.patience is not None:
        return {"steps_per_epoch": steps_per_epoch, "epochs": epochs, "total_steps": total,
                "warmup_steps": min(config.warmup_epochs * steps_per_epoch, total - 1), "validate_every": 1}
    return {"steps_per_epoch": steps_per_epoch, "epochs": epochs, "total_steps": total,
            "warmup_steps": round(total * config.warmup_epochs / config.epochs),
            "validate_every": max(1, epochs // config.epochs)}


# Conditioning (align.<m>.conditioning: scale): the mean squared norm the scaled new features
# have, and the bound on the gradient's norm
SCALED_SQUARED_NORM = 16.0
GRADIENT_NORM_BOUND = 10.0


def feature_scales(old_features: np.ndarray, new_features: np.ndarray) -> tuple[float, float]:
    """(input scale, output scale) of a conditioned map: the RMS norms of the old and of the new
    features, over sqrt(SCALED_SQUARED_NORM), so that the map sees old features and predicts new
    features of mean squared norm SCALED_SQUARED_NORM whatever the models' own scales; a scale
    that cannot be measured (all zeros, not finite) is 1."""

    def scale(features: np.ndarray) -> float:
        value = math.sqrt(float(np.mean(np.square(features, dtype=np.float64).sum(axis=1))) / SCALED_SQUARED_NORM)
        return value if math.isfinite(value) and value > 0 else 1.0

    return scale(old_features), scale(new_features)


class _ScaledInput(nn.Module):
    """A frozen classifier applied to features given divided by ``scale``."""

    def __init__(self, classifier: nn.Module, scale: float):
        super().__init__()
        self.classifier, self.scale = classifier, scale

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.classifier(features * self.scale)


Validate = Callable[[], dict[str, float]]


def _score(record: dict) -> float:
    """What picks the best epoch: retrieval at 0% backfill on the held-out pairs."""
    return 0.5 * (record["val_top1"] + record["val_map"])


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def _finite_weights(module: nn.Module) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in module.state_dict().values() if v.is_floating_point())


def _rankable(*features: torch.Tensor) -> bool:
    """Features retrieval can rank: finite, and not so large that their float32 distances
    overflow (NaN compares False)."""
    limit = float(torch.finfo(torch.float32).max) / 4
    return all(bool((f.float().pow(2).sum(dim=1) < limit).all()) for f in features)


def divergence(loss: float, best: float, first: float, factor: float | None) -> str | None:
    """Why an epoch's mean ``loss`` says the training diverged, or None when it does not.

    The rule: the loss is not finite; or, with a ``factor`` (align.<m>.divergence_factor), it
    exceeds the best epoch's loss ``best`` by more than ``factor`` times the loss's scale,
    max(|best|, |first|), ``first`` being the first epoch's loss:

        loss - best > factor * max(|best|, |first|)

    The scale is a magnitude, so the rule holds for a loss that is negative (FastFill's joint
    loss has a log sigma^2 term); the first epoch's magnitude keeps a best that happens to lie
    near zero from turning an ordinary wobble into a "divergence"."""
    if not math.isfinite(loss):
        return f"loss {loss}"
    if factor is not None and math.isfinite(best):
        scale = max(abs(best), abs(first) if math.isfinite(first) else 0.0)
        if loss - best > factor * scale:
            return f"loss {loss:.6g} exceeds the best epoch's {best:.6g} by more than {factor:g} x {scale:.6g}"
    return None


def _train_on_features(
    module: nn.Module, config: AlignConfig, num_items: int, generator: torch.Generator, key: str,
    batch_loss: Callable[[torch.Tensor, bool], dict[str, torch.Tensor | None]], terms: tuple[str, ...],
    describe: Callable[[dict], str], *, device: torch.device, checkpoint: Path | None, log: Log,
    on_epoch: Progress | None, validate: Validate | None = None,
) -> list[dict]:
    """The loop shared by maps trained on stored features: Adam with warm-up + cosine over
    ``feature_schedule``'s steps, BatchNorm statistics frozen for the second half (as the
    reference does), per-epoch checkpoints and resume. ``batch_loss(index, warm)`` returns
    ``{"loss": total, term: value or None}`` (``warm``: inside the uncertainty warm-up); the
    history holds each term's per-item epoch mean (0 for a term that is None). With
    ``validate``, the held-out pairs are measured every ``validate_every`` epochs and at the
    end, and the module ends with the weights of the best validation.

    Divergence (see ``divergence``): a batch whose loss is not finite ends its epoch at once; an
    epoch whose mean loss diverges, or whose weights or held-out outputs are not finite, ends
    the training. The module then gets the best validation's weights (without one yet, those of
    the epoch with the lowest loss, or the initial ones), which are always finite, the log says
    so in one line, and the diverged epoch's record, last in the history, has ``diverged``:
    {"reason", "restored_epoch"}."""
    # Tiny gradients (the joint uncertainty loss divides them by ~lambda L) reach denormal
    # floats in Adam's state; on CPU those run many times slower. Flushing them changes nothing
    # that a float32 result can show.
    torch.set_flush_denormal(True)
    plan = feature_schedule(config, num_items)
    on_epoch = EpochProgress(on_epoch)
    epochs, warm_steps = plan["epochs"], round(config.uncertainty_warmup * plan["total_steps"])
    if config.conditioned:  # the uncertainty term warms in after the learning rate's warm-up
        warm_steps = max(warm_steps, plan["warmup_steps"])
    optimizer = ExactAdam(module.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    scheduler = warmup_cosine(optimizer, plan["total_steps"], plan["warmup_steps"])
    history, start_epoch, step, best, lowest = _resumed(checkpoint, key, module, optimizer, scheduler, generator, log)
    _announce_training(log, config, plan, num_items, start_epoch, validate is not None)
    started = last_said = time.monotonic()

    for epoch in range(start_epoch, epochs):
        sums, step = _train_one_epoch(module, optimizer, scheduler, generator, batch_loss, terms, config=config,
                                      num_items=num_items, device=device, epoch=epoch, epochs=epochs, step=step,
                                      warm_steps=warm_steps)
        record: dict[str, Any] = {"epoch": epoch + 1, "step": step, **{k: v / num_items for k, v in sums.items()}}
        reason, best = _epoch_verdict(module, record, history, lowest, best, validate, config=config, plan=plan,
                                      epoch=epoch, epochs=epochs)
        if reason is not None:
            _restore_after_divergence(module, record, history, reason, best, lowest, epochs, log)
            break
        if record["loss"] < lowest["loss"]:
            lowest = {"epoch": epoch + 1, "loss": record["loss"], "state": _snapshot(module)}
        history.append(record)
        last_said = _say_epoch(log, record, describe, epoch=epoch,
                               start_epoch=start_epoch, epochs=epochs, started=started, last_said=last_said)
        save_checkpoint(checkpoint, config_key=key, model=module.state_dict(), optimizer=optimizer.state_dict(),
                         scheduler=scheduler.state_dict(), generator=generator.get_state(),
                         history=history, epoch=epoch + 1, step=step, best=best, lowest=lowest)
        on_epoch(epoch + 1, epochs)
        if _no_better(config, best, epoch + 1, epochs, log):
            break
    on_epoch.end(epochs)
    if best is not None:
        _keep_best(module, history, best, epochs, log)
    module.eval()
    return history


def _no_better(config: AlignConfig, best: dict | None, epoch: int, epochs: int, log: Log) -> bool:
    """Early stopping: with ``config.patience``, the held-out score has not improved for that many
    epochs after the best one (the log says so)."""
    if config.patience is None or best is None or epoch - best["epoch"] < config.patience or epoch >= epochs:
        return False
    log(f"stopped at epoch {epoch}/{epochs}: the held-out score has not improved for {config.patience} epochs "
        f"(patience) since epoch {best['epoch']}")
    return True


def _resumed(checkpoint: Path | None, key: str, module: nn.Module, optimizer, scheduler, generator: torch.Generator,
             log: Log) -> tuple[list[dict], int, int, dict | None, dict]:
    """The loop's state from a matching checkpoint, else a fresh start's: (history, first epoch,
    step, best validation or None, lowest-loss epoch)."""
    history, start_epoch, step, best, lowest = [], 0, 0, None, None
    state = resume_checkpoint(checkpoint, key, module, optimizer, scheduler, generator, log)
    if state is not None:
        history, start_epoch, step, best = state["history"], state["epoch"], state.get("step", 0), state.get("best")
        lowest = state.get("lowest")
    if lowest is None:  # what a divergence restores without a validation: epoch 0 = the initial weights
        lowest = {"epoch": start_epoch, "loss": history[-1]["loss"] if history else math.inf,
                  "state": _snapshot(module)}
    return history, start_epoch, step, best, lowest


def _announce_training(log: Log, config: AlignConfig, plan: dict[str, int], num_items: int, start_epoch: int,
                       validated: bool) -> None:
    epochs = plan["epochs"]
    if config.patience is not None and validated:
        log(f"training at most {epochs - start_epoch} epochs of {plan['steps_per_epoch']} steps on {num_items} pairs"
            + (f" (from epoch {start_epoch + 1})" if start_epoch else "")
            + f", measured on the held-out pairs every epoch; stops once their score has not improved for "
              f"{config.patience} epochs")
        return
    if start_epoch == 0 and epochs > config.epochs:
        log(f"{num_items} training pairs make {plan['steps_per_epoch']} steps an epoch: training {epochs} epochs "
            f"to reach min_steps {config.min_steps}")
    log(f"training {epochs - start_epoch} epochs of {plan['steps_per_epoch']} steps on {num_items} pairs"
        + (f" (from epoch {start_epoch + 1})" if start_epoch else "")
        + (f", measured on the held-out pairs every {plan['validate_every']} epochs" if validated else ""))


def _train_one_epoch(module: nn.Module, optimizer, scheduler, generator: torch.Generator, batch_loss, terms, *,
                     config: AlignConfig, num_items: int, device: torch.device, epoch: int, epochs: int, step: int,
                     warm_steps: int) -> tuple[dict[str, float], int]:
    """One pass over the pairs in a seeded order: the loss and each term summed over the items,
    and the step count after it. A batch whose loss is not finite ends the pass before its step."""
    module.train()
    if epoch >= epochs // 2:
        _set_batchnorm_eval(module)
    permutation = torch.randperm(num_items, generator=generator).to(device)
    sums = dict.fromkeys(("loss", *terms), 0.0)
    for start in range(0, num_items, config.batch_size):
        index = permutation[start: start + config.batch_size]
        if len(index) < 2:
            continue  # BatchNorm cannot train on one sample
        parts = batch_loss(index, step < warm_steps)
        for name, value in parts.items():
            if value is not None:
                sums[name] += value.item() * len(index)
        if not math.isfinite(sums["loss"]):
            break  # no step on a non-finite loss: the epoch ends here, and the training with it
        optimizer.zero_grad(set_to_none=True)
        loss = parts["loss"]
        assert loss is not None  # the total: only the terms a map has not can be None
        loss.backward()
        if config.conditioned:  # each part bounded on its own: psi's gradients never scale the map's
            for part in module.children():
                nn.utils.clip_grad_norm_(part.parameters(), GRADIENT_NORM_BOUND)
        optimizer.step()
        scheduler.step()
        step += 1
    return sums, step


def _epoch_verdict(module: nn.Module, record: dict, history: list[dict], lowest: dict, best: dict | None,
                   validate: Validate | None, *, config: AlignConfig, plan: dict[str, int], epoch: int,
                   epochs: int) -> tuple[str | None, dict | None]:
    """Why the epoch diverged (None when it did not), and the best validation so far: the
    held-out pairs are measured into ``record`` when due."""
    first = history[0]["loss"] if history else record["loss"]
    reason = divergence(record["loss"], lowest["loss"], first, config.divergence_factor)
    if reason is None and not _finite_weights(module):
        reason = "the weights are not finite"
    if reason is None and validate is not None and (
            (epoch + 1) % plan["validate_every"] == 0 or epoch + 1 == epochs):
        module.eval()
        record.update(validate())
        if not math.isfinite(_score(record)):
            reason = "the outputs on the held-out pairs are not finite"
        elif best is None or _score(record) > best["score"]:
            best = {"score": _score(record), "epoch": epoch + 1, "state": _snapshot(module)}
    return reason, best


def _restore_after_divergence(module: nn.Module, record: dict, history: list[dict], reason: str, best: dict | None,
                              lowest: dict, epochs: int, log: Log) -> None:
    """The diverged epoch's record goes last in the history, and the module gets the best
    validation's weights (without one, the lowest loss's)."""
    restored = best if best is not None else lowest
    record["diverged"] = {"reason": reason, "restored_epoch": restored["epoch"]}
    history.append(record)
    module.load_state_dict(restored["state"])
    which = ("the initial weights" if not restored["epoch"] else f"the weights of epoch {restored['epoch']}"
             + (", the best on the held-out pairs" if best is not None else ", the lowest loss"))
    low = f"; the lowest loss was {lowest['loss']:.6g}, at epoch {lowest['epoch']}" if lowest["epoch"] else ""
    log(f"training diverged at epoch {record['epoch']}/{epochs} ({reason}{low}): stopped, and restored {which}")


def _say_epoch(log: Log, record: dict, describe: Callable[[dict], str], *, epoch: int, start_epoch: int, epochs: int,
               started: float, last_said: float) -> float:
    """The epoch's line in the log when one is due; returns when the last line was said."""
    clock = time.monotonic()
    # every epoch of a usual run; of a long run of short epochs, each validation, every
    # tenth, and at least one line every PROGRESS_SECONDS, so a long training is seen alive
    if ("val_top1" in record or epochs <= 100 or (epoch + 1) % 10 == 0 or epoch + 1 == epochs
            or clock - last_said >= PROGRESS_SECONDS):
        last_said = clock
        elapsed, done = clock - started, epoch + 1 - start_epoch
        left = elapsed / done * (epochs - epoch - 1)
        log(f"epoch {epoch + 1}/{epochs} ({elapsed:.0f} s" + (f", about {left:.0f} s left" if left >= 1 else "")
            + f"): {describe(record)}")
    return last_said


def _keep_best(module: nn.Module, history: list[dict], best: dict, epochs: int, log: Log) -> None:
    """The module gets the best validation's weights, and each record says whether it was the best."""
    module.load_state_dict(best["state"])
    for record in history:
        record["best"] = record["epoch"] == best["epoch"]
    log(f"kept the weights of epoch {best['epoch']}/{epochs}, best on the held-out pairs "
        f"(top-1 {100 * history[best['epoch'] - 1]['val_top1']:.2f}%, "
        f"mAP {100 * history[best['epoch'] - 1]['val_map']:.2f}% at 0% backfill)")


def _describe_validation(record: dict) -> str:
    if "val_top1" not in record:
        return ""
    return (f"; held out: l2 {record['val_l2']:.4f}, disc {record['val_disc']:.4f}, top-1 "
            f"{100 * record['val_top1']:.2f}%, mAP {100 * record['val_map']:.2f}%")


def split_pairs(config: AlignConfig, num_pairs: int, method: str = "") -> tuple[np.ndarray, np.ndarray]:
    """The map's training and held-out pairs (see components.experiment.map_validation)."""

    key = f"align.{method}.validation_fraction" if method else "validation_fraction"
    return validation_split(num_pairs, config.validation_fraction, config.seed, key=key)


def train_alignment(
    config: AlignConfig,
    old_features: np.ndarray,
    new_features: np.ndarray,
    class_rows: np.ndarray,
    new_classifier: nn.Module,
    *,
    device: torch.device | None = None,
    checkpoint: Path | None = None,
    log: Log = print,
    on_epoch: Progress | None = None,
    method: str = "",
) -> tuple[AlignmentMap, list[dict]]:
    """Train h (and psi) on stored features; ``class_rows`` index kappa_new's rows. A seeded
    ``config.validation_fraction`` of the pairs is held out: measured every epoch, and the best
    epoch's weights are kept."""
    _check_same_images(old_features, new_features, class_rows)
    device = device or pick_device()
    generator = seed_everything(config.seed)
    train_index, _ = split_pairs(config, len(old_features), method)
    h = AlignmentMap.from_config(config, old_features.shape[1], new_features.shape[1])
    classifier = new_classifier.to(device).eval().requires_grad_(False)
    old = torch.from_numpy(old_features[train_index]).to(device)
    new = torch.from_numpy(new_features[train_index]).to(device)
    rows = torch.from_numpy(class_rows[train_index]).to(device)
    judge: nn.Module = classifier
    if config.conditioned:  # the loss sees scaled features; kappa_new sees h(old) in the new model's space
        input_scale, output_scale = feature_scales(old_features[train_index], new_features[train_index])
        h.set_scale(input_scale, output_scale)
        new = new / output_scale
        judge = _ScaledInput(classifier, output_scale)
        log(f"conditioning: the map trains on old features / {input_scale:.4g} and predicts new features / "
            f"{output_scale:.4g} (mean squared norm {SCALED_SQUARED_NORM:g})")
    h = h.to(device)

    dtype = announced_dtype(config.precision, device, log, "the map's")

    def batch_loss(index: torch.Tensor, warm: bool) -> dict:
        with forward_precision(device, dtype):
            transformed = h.normalized(old[index])
        transformed = transformed.float()
        # psi's own term reaches h through psi's input in every weighting but separate: on the demo's
        # pairs that makes the transformed features carry the uncertainty (detaching it leaves sigma
        # near random); on a team's pairs it costs the map top-1 (benchmarks/team_map_conditioning.py)
        psi_input = transformed.detach() if config.uncertainty_weighting == "separate" else transformed
        log_sigma2 = h.uncertainty(psi_input).squeeze(-1) if h.uncertainty is not None else None
        parts = alignment_loss(
            transformed, new[index], l2=config.l2, disc=config.disc, l2_reduction=config.l2_reduction,
            classifier=judge, targets=rows[index], label_smoothing=config.disc_label_smoothing,
            log_sigma2=log_sigma2, lam=config.uncertainty_lambda, weighting=config.uncertainty_weighting, warm=warm,
        )
        total, orthogonality = parts.total, None
        if config.architecture == "affine":  # lambda-orthogonality: lambda ||W^T W - I||_F^2, once per batch
            orthogonality = orthogonality_penalty(h.affine_weight)
            total = total + config.orthogonality_weight * orthogonality
        return {"loss": total, "l2": parts.l2, "disc": parts.disc, "log_sigma2": parts.log_sigma2,
                "orthogonality": orthogonality}

    pairs = held_out(config, old_features, new_features, class_rows, method)
    validate = None if pairs is None else functools.partial(validation_record, config, h, pairs, classifier, device)

    history = _train_on_features(
        h, config, len(train_index), generator, run_key(config, old_features, new_features, class_rows), batch_loss,
        ("l2", "disc", "log_sigma2") + (("orthogonality",) if config.architecture == "affine" else ()),
        lambda r: (f"loss {r['loss']:.4f} (l2 {r['l2']:.4f}, disc {r['disc']:.4f}, "
                   f"mean log sigma^2 {r['log_sigma2']:.3f}"
                   + (f", ||W^T W - I||_F^2 {r['orthogonality']:.4f}" if config.architecture == "affine" else "")
                   + ")" + _describe_validation(r)),
        device=device, checkpoint=checkpoint, log=log, on_epoch=on_epoch, validate=validate)
    return h, history


@torch.no_grad()
def validation_record(config: AlignConfig, h: AlignmentMap, pairs, classifier: nn.Module,
                      device: torch.device) -> dict[str, float]:
    """l2 and disc (per-item means, the map's own reduction) and retrieval at 0% backfill on
    held-out pairs; all NaN when the map's outputs are not finite."""

    transformed = h(torch.from_numpy(pairs.old).to(device))
    if not _rankable(transformed):
        return dict.fromkeys(("val_l2", "val_disc", "val_top1", "val_map"), math.nan)  # a diverged map
    new = torch.from_numpy(pairs.new).to(device)
    rows = torch.from_numpy(pairs.rows).to(device)
    l2 = l2_per_sample(new, transformed, config.l2_reduction).mean().item()
    disc = classification_per_sample(classifier(transformed), rows, config.disc_label_smoothing).mean().item()
    retrieval = retrieval_at_zero(transformed.cpu().numpy(), pairs.new, pairs.rows)
    return {"val_l2": l2, "val_disc": disc, "val_top1": retrieval["top1"], "val_map": retrieval["map"]}


def train_unified(
    config: AlignConfig,
    old_features: np.ndarray,
    new_features: np.ndarray,
    class_rows: np.ndarray,
    num_classes: int,
    *,
    device: torch.device | None = None,
    checkpoint: Path | None = None,
    log: Log = print,
    on_epoch: Progress | None = None,
    method: str = "",
) -> tuple[UnifiedMaps, list[dict]]:
    """The unified space: T_q (new side) and T_g (old side) of ``config.rbt_blocks`` RBT blocks
    each and a shared classifier, trained with similarity + dual classification + 0.25 KL.
    Held-out pairs as in ``train_alignment`` (retrieval: T_q(new) against T_g(old))."""
    _check_same_images(old_features, new_features, class_rows)
    device = device or pick_device()
    generator = seed_everything(config.seed)
    train_index, _ = split_pairs(config, len(old_features), method)
    maps = UnifiedMaps(old_features.shape[1], new_features.shape[1], num_classes, config.rbt_blocks).to(device)
    old = torch.from_numpy(old_features[train_index]).to(device)
    new = torch.from_numpy(new_features[train_index]).to(device)
    rows = torch.from_numpy(class_rows[train_index]).to(device)

    dtype = announced_dtype(config.precision, device, log, "the map's")

    def batch_loss(index: torch.Tensor, warm: bool) -> dict:
        with forward_precision(device, dtype):
            query, gallery = maps.query(new[index]), maps.gallery(old[index])
        parts = unified_loss(query.float(), gallery.float(), maps.classifier, rows[index],
                             label_smoothing=config.disc_label_smoothing)
        return {"loss": parts.total, "similarity": parts.similarity, "classification": parts.classification,
                "kl": parts.kl}

    pairs = held_out(config, old_features, new_features, class_rows, method)
    validate = None if pairs is None else functools.partial(unified_validation_record, config, maps, pairs, device)

    history = _train_on_features(
        maps, config, len(train_index), generator,
        run_key(config, old_features, new_features, class_rows) + "unified", batch_loss,
        ("similarity", "classification", "kl"),
        lambda r: (f"loss {r['loss']:.4f} (similarity {r['similarity']:.4f}, "
                   f"classification {r['classification']:.4f}, kl {r['kl']:.4f})" + _describe_validation(r)),
        device=device, checkpoint=checkpoint, log=log, on_epoch=on_epoch, validate=validate)
    return maps, history


@torch.no_grad()
def unified_validation_record(config: AlignConfig, maps: UnifiedMaps, pairs, device: torch.device) -> dict[str, float]:
    """A unified space on held-out pairs: l2 between T_q(new) and T_g(old), disc of T_g(old),
    and retrieval at 0% backfill (queries T_q(new), gallery T_g(old))."""

    query = maps.query(torch.from_numpy(pairs.new).to(device))
    gallery = maps.gallery(torch.from_numpy(pairs.old).to(device))
    if not _rankable(query, gallery):
        return dict.fromkeys(("val_l2", "val_disc", "val_top1", "val_map"), math.nan)  # diverged maps
    l2 = l2_per_sample(query, gallery, "sum").mean().item()
    disc = classification_per_sample(maps.classifier(gallery), torch.from_numpy(pairs.rows).to(device),
                                     config.disc_label_smoothing).mean().item()
    retrieval = retrieval_at_zero(gallery.cpu().numpy(), query.cpu().numpy(), pairs.rows)
    return {"val_l2": l2, "val_disc": disc, "val_top1": retrieval["top1"], "val_map": retrieval["map"]}
