"""Held-out feature pairs for maps trained on stored features: the seeded split, and what one
validation measures (l2, disc, and retrieval at 0% backfill: queries phi_new, gallery h(phi_old)).

The split depends only on (seed, fraction, number of pairs), so every map trained with the same
seed on the same pairs (the method's map and its l2-only reference) holds out the same pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
from threadpoolctl import ThreadpoolController

from fastfill.components.evaluation import retrieval_metrics
from fastfill.components.platform.config import ConfigError

MIN_VALIDATION_PAIRS = 20
MIN_TRAINING_PAIRS = 2


def validation_split(num_pairs: int, fraction: float, seed: int, *, key: str = "validation_fraction"
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(training indices, validation indices), both sorted; no validation when ``fraction`` is 0.
    ``key`` names the setting in errors (e.g. ``align.fastfill.validation_fraction``)."""
    if not 0 <= fraction < 1:
        raise ConfigError(f"{key} = {fraction} must be in [0, 1)")
    if fraction == 0:
        return np.arange(num_pairs), np.arange(0)
    count = int(round(fraction * num_pairs))
    if count < MIN_VALIDATION_PAIRS:
        raise ConfigError(
            f"{key} = {fraction} holds out {count} of {num_pairs} feature pairs; validation needs at least "
            f"{MIN_VALIDATION_PAIRS}: raise it to {min(0.5, MIN_VALIDATION_PAIRS / max(num_pairs, 1) + 0.01):.2f} "
            f"or set it to 0 (no validation, no map check)")
    if num_pairs - count < MIN_TRAINING_PAIRS:
        raise ConfigError(f"{key} = {fraction} leaves {num_pairs - count} of {num_pairs} feature pairs to train "
                         "on; lower it")
    permutation = np.random.default_rng([seed, 0x5EED]).permutation(num_pairs)
    return np.sort(permutation[count:]), np.sort(permutation[:count])


@dataclass(frozen=True)
class ValidationPairs:
    """Held-out pairs: old and new features and the new classifier's row of each label (which
    is also the label retrieval uses)."""

    old: np.ndarray
    new: np.ndarray
    rows: np.ndarray

    def __len__(self) -> int:
        return len(self.old)

    def sample(self, size: int, seed: int) -> ValidationPairs:
        """At most ``size`` pairs, seeded (retrieval cost grows with the square of the count)."""
        if len(self) <= size:
            return self
        keep = np.sort(np.random.default_rng([seed, 0xE7A1]).choice(len(self), size, replace=False))
        return ValidationPairs(self.old[keep], self.new[keep], self.rows[keep])


@cache
def _blas() -> ThreadpoolController:
    return ThreadpoolController()


def retrieval_at_zero(transformed: np.ndarray, new: np.ndarray, labels: np.ndarray, distance: str = "l2") -> dict:
    """Top-1 and mAP with every gallery item still on its transformed old feature (0% backfill).

    It runs once per epoch between training steps, with numpy's BLAS held to one thread: left on
    its own threads, they spin after the product and take the cores from the next steps (the
    training loop ran at about 2x a bare one; benchmarks/map_speed.py)."""

    with _blas().limit(limits=1, user_api="blas"):
        metrics = retrieval_metrics(new, transformed, labels, distance=distance)
    return {"top1": float(metrics["top1"]), "map": float(metrics["map"])}


def held_out(config, old: np.ndarray, new: np.ndarray, rows: np.ndarray, method: str = "") -> ValidationPairs | None:
    """The pairs a map never trains on (the same ones its l2-only reference never trains on),
    at most ``config.validation_items`` of them, or None when ``validation_fraction`` is 0."""
    key = f"align.{method}.validation_fraction" if method else "validation_fraction"
    _, val_index = validation_split(len(old), config.validation_fraction, config.seed, key=key)
    if not len(val_index):
        return None
    return ValidationPairs(old[val_index], new[val_index], rows[val_index]).sample(config.validation_items, config.seed)
