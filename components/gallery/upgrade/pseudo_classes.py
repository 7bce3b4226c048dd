"""Classes for FastFill's discriminative term when the new model has no classifier.

A team's feature extractor (an ONNX export, a backbone cut before its head) has no kappa_new, and
its gallery seldom has labels: the disc term would be off, and without it the FastFill map
collapses (reports/disc_term.md, reports/disc_term_bars.md: top1_auc 62.80 and 73.77 off, against
70.30 and 97.88 with K-means pseudo-classes on two data sets). The substitute: cluster the new
features of the map sample with K-means (seeded), and fit a linear head on those clusters; the
clusters are the term's targets and the head is its kappa_new. Where the new model has a
classifier, its predicted classes measure as well or better, so they stay the targets there.
"""

from __future__ import annotations

import numpy as np

ITEMS_PER_CLASS = 20  # the fewest sample items per pseudo-class: K shrinks for a small sample
HEAD_STEPS = 300


def class_count(wanted: int, items: int) -> int:
    """K for ``items`` pairs: ``wanted``, lowered so that each class has ITEMS_PER_CLASS items on
    average, and at least 2."""
    return max(2, min(int(wanted), items // ITEMS_PER_CLASS))


def cluster(new_features: np.ndarray, k: int, seed: int) -> np.ndarray:
    """The K-means cluster (0..k-1) of each row of ``new_features`` (seeded, so the same sample
    gives the same clusters)."""
    import faiss

    x = np.ascontiguousarray(new_features, dtype=np.float32)
    kmeans = faiss.Kmeans(x.shape[1], k, niter=25, nredo=2, seed=int(seed), verbose=False,
                          min_points_per_centroid=1, max_points_per_centroid=max(256, len(x) // k + 1))
    kmeans.train(x)
    _, assigned = kmeans.index.search(x, 1)
    return assigned[:, 0].astype(np.int64)


def fit_head(new_features: np.ndarray, rows: np.ndarray, k: int, seed: int):
    """A linear head (no bias) over the new features that predicts ``rows``: cross-entropy,
    full-batch Adam, seeded. Frozen and in eval mode."""
    import torch

    generator = torch.Generator().manual_seed(int(seed))
    head = torch.nn.Linear(new_features.shape[1], k, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * 0.01)
    x = torch.from_numpy(np.ascontiguousarray(new_features, dtype=np.float32))
    y = torch.from_numpy(np.asarray(rows, dtype=np.int64))
    from fastfill.components.experiment.optimizers import ExactAdam
    optimiser = ExactAdam(head.parameters(), lr=1e-2)
    for _ in range(HEAD_STEPS):
        optimiser.zero_grad()
        torch.nn.functional.cross_entropy(head(x), y).backward()
        optimiser.step()
    return head.eval().requires_grad_(False)


def cluster_classes(new_features: np.ndarray, wanted: int, seed: int) -> tuple[np.ndarray, object, int]:
    """(cluster per row, a head fitted on them, K) for the map sample's new features."""
    k = class_count(wanted, len(new_features))
    rows = cluster(new_features, k, seed)
    return rows, fit_head(new_features, rows, k, seed), k
