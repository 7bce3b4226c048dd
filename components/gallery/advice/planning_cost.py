"""How long an upgrade's planning takes, said before it starts (``fastfill upgrade --dry-run``):
how many gallery items planning embeds (the map sample and the evaluation sample, each item
once) and their share of the gallery, and the seconds of each part: embedding those items at
the rate the dry run measured, training the map and the check's l2-only reference when the
registry has no checked map joining the two versions.

A map's training time is measured, not guessed: a few epochs of the map the upgrade would
train (``AlignConfig.for_upgrade``, the same shapes, batch size and per-epoch validation) on
random pairs of the two models' dimensions, times the epochs such a training runs. It stops
early (``patience``), so the estimate gives the epochs the upgrade's maps ran on team pairs
(``TYPICAL_EPOCHS``, benchmarks/team_map_conditioning.py) and the most it may run.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from fastfill.components.experiment.inference import pick_device
from fastfill.components.experiment.map_check import reference_config, shares_reference
from fastfill.components.experiment.map_training import feature_schedule, train_alignment
from fastfill.components.gallery.upgrade.planning import worst_case_standard_error

# the epochs an upgrade's map trained, patience included, on the team pairs of
# benchmarks/team_map_conditioning.py (31.7 over its 5 pairs and 3 seeds, rounded up; at most 57)
TYPICAL_EPOCHS = 32
TIMED_EPOCHS = 3


@dataclass(frozen=True)
class PlannedItems:
    """What planning embeds (``embeds`` in the dry run's ``planning``; ``to_dict``: its keys)."""

    map_sample: int
    evaluation_sample: int
    evaluation_outside_map_sample: int
    total: int
    share_of_gallery: float
    evaluation_standard_error: float | None = None  # top-1 points, at worst; None without an evaluation sample

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PlanningSeconds:
    """The seconds of planning's parts (``seconds`` in the dry run's ``planning``): embedding, the
    map's and the check's reference's training where they are trained (None: not trained), all."""

    embedding: float
    total: float
    map_training: float | None = None
    reference_training: float | None = None

    def to_dict(self) -> dict:
        """The parts in their order (embedding, the trainings there are, total)."""
        return {"embedding": self.embedding, **dict(self.trainings()), "total": self.total}

    def trainings(self) -> list[tuple[str, float]]:
        """(part, seconds) of each map trained: ``map_training``, ``reference_training``."""
        return [(key, value) for key, value in (("map_training", self.map_training),
                                                ("reference_training", self.reference_training))
                if value is not None]


@dataclass(frozen=True)
class PlanningEstimate:
    """The dry run's ``planning``: what planning embeds and how long each part takes; with a map
    trained, the most it may take (``seconds_at_most``) and a ``note`` on how it was measured."""

    embeds: PlannedItems
    seconds: PlanningSeconds
    seconds_at_most: float | None = None
    note: str | None = None

    def to_dict(self) -> dict:
        """The document's ``planning`` (``seconds_at_most`` and ``note`` only where a map is trained)."""
        estimate: dict = {"embeds": self.embeds.to_dict(), "seconds": self.seconds.to_dict()}
        if self.seconds_at_most is not None:
            estimate["seconds_at_most"] = self.seconds_at_most
        if self.note is not None:
            estimate["note"] = self.note
        return estimate


def planned_items(map_positions: np.ndarray, eval_positions: np.ndarray, num_items: int) -> PlannedItems:
    """What planning embeds: the map sample, the evaluation sample's items outside it, both
    together and their share of the gallery; and the standard error (top-1 points, at worst)
    of a point measured on the evaluation sample."""
    extra = np.setdiff1d(np.asarray(eval_positions, dtype=np.int64), np.asarray(map_positions, dtype=np.int64))
    total = len(map_positions) + len(extra)
    return PlannedItems(map_sample=int(len(map_positions)), evaluation_sample=int(len(eval_positions)),
                        evaluation_outside_map_sample=int(len(extra)), total=int(total),
                        share_of_gallery=round(total / num_items, 4) if num_items else 0.0,
                        evaluation_standard_error=round(worst_case_standard_error(len(eval_positions)), 2)
                        if len(eval_positions) else None)


def epoch_seconds(config, old_dim: int, new_dim: int, pairs: int, seed: int = 0) -> float:
    """Seconds per epoch of the map ``config`` (an AlignConfig as the upgrade trains it) on
    ``pairs`` pairs of ``old_dim`` -> ``new_dim`` features, measured on this machine: the mean
    of ``TIMED_EPOCHS`` epochs after a first one (which pays one-time costs)."""
    rng = np.random.default_rng(seed)
    old = rng.standard_normal((pairs, old_dim), dtype=np.float32)
    new = rng.standard_normal((pairs, new_dim), dtype=np.float32)
    rows = np.zeros(pairs, dtype=np.int64)
    timed = config.model_copy(update={"disc": False, "epochs": 1 + TIMED_EPOCHS, "min_steps": 0, "patience": None,
                                      "warmup_epochs": 1})
    said: list[float] = []

    def on_epoch(done: int, _total: int) -> None:
        said.append(time.perf_counter())

    train_alignment(timed, old, new, rows, torch.nn.Identity(), device=pick_device(), log=lambda _: None,
                    on_epoch=on_epoch)
    if len(said) < 2:
        return 0.0
    return (said[-1] - said[0]) / (len(said) - 1)


def planning_cost(config, num_items: int, map_positions: np.ndarray, eval_positions: np.ndarray,
                  seconds_per_item: float, map_config, old_dim: int, new_dim: int, *, trains: bool,
                  checks: bool) -> PlanningEstimate:
    """The dry run's ``planning``: the items planning embeds (``planned_items``) and the seconds
    of each part. ``config``: gallery.upgrade; ``seconds_per_item``: reading and embedding one
    item, as measured; ``map_config``: the map's AlignConfig as the upgrade trains it, or None
    when no map is trained (``trains``: the registry has no map for the two versions; ``checks``:
    the check trains its l2-only reference)."""
    items = planned_items(map_positions, eval_positions, num_items)
    seconds = {"embedding": round(items.total * seconds_per_item, 1)}
    maps = []
    if map_config is not None and len(map_positions) and (trains or checks):
        train_pairs = len(map_positions) - round(map_config.validation_fraction * len(map_positions))
        train_pairs = max(train_pairs, 2)
        # a map that shares its reference's network is checked without training another
        checks = checks and not shares_reference(map_config)
        maps = ([("map", map_config)] if trains else []) + ([("reference", reference_config(map_config))]
                                                              if checks else [])
    most = 0.0
    for name, settings in maps:
        per_epoch = epoch_seconds(settings, old_dim, new_dim, len(map_positions), config.seed)
        bound = feature_schedule(settings, train_pairs)["epochs"]
        seconds[f"{name}_training"] = round(per_epoch * min(TYPICAL_EPOCHS, bound), 1)
        most += per_epoch * bound
    parts = PlanningSeconds(embedding=seconds["embedding"], total=round(sum(seconds.values()), 1),
                            map_training=seconds.get("map_training"),
                            reference_training=seconds.get("reference_training"))
    if not maps:
        return PlanningEstimate(items, parts)
    return PlanningEstimate(items, parts, seconds_at_most=round(seconds["embedding"] + most, 1),
                            note=f"map training measured here for {TIMED_EPOCHS} epochs, times the {TYPICAL_EPOCHS} "
                                 "epochs an upgrade's map runs to its early stop on the team pairs measured "
                                 "(seconds_at_most: every epoch it may run)")
