"""Small report inputs the tests make. The synthetic ImageFolder and the tiny whole-pipeline
configuration are testkit.tiny_demo's."""

from __future__ import annotations

import numpy as np


def tiny_curves() -> tuple[dict, dict]:
    """(reference points, curves[method][order]) of a 30-item gallery in 3 classes: the inputs of
    the report writers (metrics, plot data, summaries, the plot)."""
    from components.evaluation import backfill_curve, retrieval_metrics

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, 30)
    new = rng.normal(size=(30, 4)).astype(np.float32) + labels[:, None]
    old = new + rng.normal(size=(30, 4)).astype(np.float32)
    reference = {"old_old": retrieval_metrics(old, old, labels), "new_new": retrieval_metrics(new, new, labels)}
    curves = {"fct": {"random": backfill_curve(new, new, old, labels, rng.permutation(30), num_intermediate=3).to_dict()},
              "fastfill": {o: backfill_curve(new, new, old, labels, rng.permutation(30), num_intermediate=3).to_dict()
                           for o in ("random", "sigma")}}
    return reference, curves
