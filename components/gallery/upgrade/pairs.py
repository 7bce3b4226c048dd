"""The pairs an upgrade's alignment map trains and is checked on, taken from the gallery itself.

A retrieval team's upgrade host has the registry and the gallery, and none of the demo
pipeline's files: the map learns old -> new from a seeded sample of the gallery's own items
(their old features from the store, their new ones by embedding their images), and its check
holds out pairs of the same sample, so the classes the gallery holds are the classes the map is
judged on. The sampled items' new features are not thrown away: the plan writes them as the
first, already backfilled chunks (``components.gallery.upgrade.planning``).

The discriminative term needs a class per pair (a row of the new model's classifier): the
gallery's label where the classifier knows it, else the new model's own prediction on the new
features. A new model with no classifier gets K-means pseudo-classes of the sample's new features
and a head fitted on them (``components.gallery.upgrade.pseudo_classes``); the disc term takes
them only with ``gallery.upgrade.pseudo_disc`` (on team pairs the term on clusters cost the map
top-1), and with ``gallery.upgrade.pseudo_classes: 0`` there are none. The check measures
retrieval against the gallery's labels where there are labels, else against those classes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fastfill.components.experiment.adapters import fit_metric_compatible
from fastfill.components.gallery.upgrade.pseudo_classes import class_count, cluster, cluster_classes

TARGETS_LABELS, TARGETS_PREDICTED, TARGETS_MIXED, TARGETS_NONE = (
    "labels", "the new model's predicted classes", "labels, and the new model's predicted classes where its "
    "classifier does not know the label", "none (the new model has no classifier: disc term off)")
TARGETS_PSEUDO = "pseudo-classes: {k} K-means clusters of the new features, with a head fitted on them"


def map_sample_size(sample: float | int, minimum: int, num_items: int) -> int:
    """Items to sample: a fraction of the gallery raised to ``minimum``, or a count; at most all."""
    if isinstance(sample, float):
        wanted = max(math.ceil(sample * num_items), minimum)
    else:
        wanted = int(sample)
    return min(num_items, wanted)


def sample_positions(num_items: int, size: int, seed: int) -> np.ndarray:
    """Sorted positions of a seeded uniform sample of ``size`` items (all when ``size`` >= N)."""
    if size >= num_items:
        return np.arange(num_items, dtype=np.int64)
    return np.sort(np.random.default_rng([seed, 26]).choice(num_items, size=size, replace=False)).astype(np.int64)


def predicted_rows(classifier, new_features: np.ndarray, batch: int = 8192) -> np.ndarray:
    """The new model's classifier row (its predicted class) for each new feature."""
    import torch

    rows = []
    parameter = next(classifier.parameters(), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    with torch.no_grad():
        for start in range(0, len(new_features), batch):
            logits = classifier(torch.from_numpy(np.ascontiguousarray(new_features[start:start + batch])).to(device))
            rows.append(logits.argmax(dim=1).cpu().numpy())
    return np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, dtype=np.int64)


def class_targets(new_model, labels: np.ndarray | None, new_features: np.ndarray, pseudo_classes: int = 0,
                  seed: int = 0) -> tuple[np.ndarray | None, str, object]:
    """(classifier row per pair for the disc term, where they come from, the head whose rows
    they are: the new model's classifier, or one fitted on pseudo-classes). None rows: the new
    model has no classifier and ``pseudo_classes`` is 0, so the disc term is off."""
    import torch

    classifier = getattr(new_model, "classifier", None)
    if classifier is None:
        if pseudo_classes <= 0 or len(new_features) < 2:
            return None, TARGETS_NONE, None

        rows, head, k = cluster_classes(new_features, pseudo_classes, seed)
        return rows, TARGETS_PSEUDO.format(k=k), head
    predicted = predicted_rows(classifier, new_features)
    if labels is None:
        return predicted, TARGETS_PREDICTED, classifier
    known = new_model.class_index(torch.from_numpy(np.asarray(labels, dtype=np.int64))).numpy()
    if (known >= 0).all():
        return known.astype(np.int64), TARGETS_LABELS, classifier
    return np.where(known >= 0, known, predicted).astype(np.int64), TARGETS_MIXED, classifier


def _no_classifier():
    """The head given to a map's training when there is none (a new model without a classifier,
    pseudo-classes off): the disc term is off then, so it is never called; if it were, it says why."""
    import torch

    class NoClassifier(torch.nn.Module):
        def forward(self, features):
            raise RuntimeError("no classifier: the new model has none and gallery.upgrade.pseudo_classes is 0, so "
                               "the disc term is off")

    return NoClassifier()


@dataclass(frozen=True)
class MapPairs:
    """Old and new features of the same items, with the disc term's targets and the check's truth.

    ``positions``: the gallery items (None for the pipeline's split); ``targets``: classifier
    rows (None: no disc term); ``truth``: what the check's retrieval counts as a match (labels,
    or the targets' classes); ``source``: ``splits`` or ``gallery <store>``, recorded with the
    check; ``head``: the classifier the targets index when it is not the new model's own (fitted
    on pseudo-classes); ``pseudo_disc``: the disc term takes those pseudo-classes."""

    old: np.ndarray
    new: np.ndarray
    targets: np.ndarray | None
    truth: np.ndarray
    source: str
    targets_from: str
    positions: np.ndarray | None = None
    head: object | None = None
    pseudo_disc: bool = False

    def classifier(self, new_model):
        """kappa_new for the disc term and the check: the fitted head, else the new model's own,
        else (no classes at all, the disc term off) a stand-in that is never called."""
        if self.head is not None:
            return self.head
        own = getattr(new_model, "classifier", None)
        return own if own is not None else _no_classifier()

    def __len__(self) -> int:
        return len(self.old)

    @property
    def disc_off(self) -> bool:
        """The disc term is off for these pairs: no classes (a new model without a classifier,
        pseudo-classes off), or pseudo-classes without ``pseudo_disc``."""
        return self.targets is None or (self.head is not None and not self.pseudo_disc)

    @property
    def disc_targets(self) -> str:
        """What the disc term's classes are, as a map's version records them."""
        if self.disc_off and self.targets is not None:
            return f"off (gallery.upgrade.pseudo_disc is false); the check's classes: {self.targets_from}"
        return self.targets_from

    def settings(self, config):
        """A map's settings (an AlignConfig) for these pairs: the disc term off where ``disc_off``."""
        if self.disc_off and config.disc:
            return config.model_copy(update={"disc": False})
        return config

    @property
    def training(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(old, new, rows) as the map's training takes them; rows are 0 where there is no disc term."""
        rows = self.targets if self.targets is not None else np.zeros(len(self.old), dtype=np.int64)
        return self.old, self.new, rows

    @property
    def checking(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(old, new, truth) as the map check takes them."""
        return self.old, self.new, self.truth


def gallery_source(store_uri: str) -> str:
    return f"gallery {store_uri}"


def from_gallery(new_model, positions: np.ndarray, old: np.ndarray, new: np.ndarray, labels: np.ndarray | None,
                 store_uri: str, pseudo_classes: int = 0, seed: int = 0, pseudo_disc: bool = False) -> MapPairs:
    """The pairs of the sampled items: ``labels`` are the gallery's labels of those items, or
    None; ``pseudo_classes``, ``seed`` and ``pseudo_disc``: gallery.upgrade's, for a new model
    without a classifier."""
    targets, targets_from, head = class_targets(new_model, labels, new, pseudo_classes, seed)
    truth = np.asarray(labels, dtype=np.int64) if labels is not None else (
        targets if targets is not None else np.zeros(len(old), dtype=np.int64))
    own = getattr(new_model, "classifier", None)
    return MapPairs(np.asarray(old, np.float32), np.asarray(new, np.float32), targets, truth,
                    gallery_source(store_uri), targets_from, np.asarray(positions, dtype=np.int64),
                    head if head is not own else None, pseudo_disc)


def reverse_classes(pairs: MapPairs, pseudo_classes: int, seed: int) -> tuple[np.ndarray, str]:
    """The classes that online backfilling's metric-compatible reverse transformation contrasts
    on the map's pairs: the check's truth (the gallery's labels, else the disc term's targets)
    when it has two classes or more, else K-means clusters of the new features
    (``pseudo_classes`` of them, 50 when that is 0). Returns (classes, where they come from)."""
    truth = np.asarray(pairs.truth)
    if len(np.unique(truth)) >= 2:
        return truth.astype(np.int64), pairs.targets_from if pairs.targets is not None else TARGETS_LABELS
    k = class_count(pseudo_classes or 50, len(pairs))
    return cluster(pairs.new, k, seed), TARGETS_PSEUDO.format(k=k)


def fit_reverse(pairs: MapPairs, pseudo_classes: int, seed: int, log=print):
    """Online backfilling's metric-compatible reverse transformation (new -> old), fitted on the
    map's pairs and their ``reverse_classes``."""
    classes, source = reverse_classes(pairs, pseudo_classes, seed)
    log(f"online backfilling: fitting the metric-compatible reverse transformation on {len(pairs)} pairs "
        f"({pairs.source}; classes: {source})")
    reverse = fit_metric_compatible(pairs.new, pairs.old, classes, seed=seed)
    log(f"online backfilling: reverse transformation fitted; the new space's distances meet the old space's "
        f"times {reverse.new_scale ** 2:.4g}")
    return reverse
