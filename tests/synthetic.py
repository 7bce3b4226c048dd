"""Small report inputs the tests make. The synthetic ImageFolder and the tiny whole-pipeline
configuration are testkit.tiny_demo's."""

from __future__ import annotations

import numpy as np


def tiny_curves() -> tuple[dict, dict]:
    """(reference points, curves[method][order]) of a 30-item gallery in 3 classes: the inputs of
    the report writers (metrics, plot data, summaries, the plot)."""
    from fastfill.components.evaluation import backfill_curve, retrieval_metrics

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, 30)
    new = rng.normal(size=(30, 4)).astype(np.float32) + labels[:, None]
    old = new + rng.normal(size=(30, 4)).astype(np.float32)
    reference = {"old_old": retrieval_metrics(old, old, labels), "new_new": retrieval_metrics(new, new, labels)}
    curves = {"fct": {"random": backfill_curve(new, new, old, labels, rng.permutation(30), num_intermediate=3).to_dict()},
              "fastfill": {o: backfill_curve(new, new, old, labels, rng.permutation(30), num_intermediate=3).to_dict()
                           for o in ("random", "sigma")}}
    return reference, curves


SQUARE_CLASSES = 4


def square_images(per_class: int = 24, seed: int = 0):
    """A Split of 8x8 images in SQUARE_CLASSES classes: class c is a bright 3x3 square at a
    class-specific place, plus noise (tiny trainings that must learn something)."""
    from fastfill.components.experiment.data import Split

    rng = np.random.default_rng(seed)
    images, labels = [], []
    for label in range(SQUARE_CLASSES):
        for _ in range(per_class):
            image = rng.integers(0, 60, size=(1, 8, 8))
            row, col = divmod(label, 2)
            image[0, 4 * row: 4 * row + 3, 4 * col: 4 * col + 3] += 180
            images.append(image)
            labels.append(label)
    return Split(np.clip(np.stack(images), 0, 255).astype(np.uint8), np.array(labels, dtype=np.int64))
