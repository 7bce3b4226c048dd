"""Pseudo-classes for the disc term of a new model without a classifier: K-means clusters of the
map sample's new features and a head fitted on them, carried by the map's pairs."""

import numpy as np
import pytest
import torch

from fastfill.components.gallery.upgrade.pairs import TARGETS_NONE, TARGETS_PREDICTED, from_gallery
from fastfill.components.gallery.upgrade.pseudo_classes import class_count, cluster_classes


def _blobs(per_class: int = 80, classes: int = 5, dim: int = 16, seed: int = 0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, dim)) * 6
    labels = np.repeat(np.arange(classes), per_class)
    return (centres[labels] + rng.normal(size=(len(labels), dim))).astype(np.float32), labels


class _Model:
    def __init__(self, classifier=None):
        self.classifier = classifier

    def class_index(self, labels):
        return labels


def test_the_clusters_find_the_classes_and_the_head_predicts_them():
    features, labels = _blobs()
    rows, head, k = cluster_classes(features, 5, seed=3)
    assert k == 5 and rows.shape == labels.shape and set(rows) == set(range(5))
    for label in range(5):  # each class lies in one cluster, and each cluster holds one class
        assert len(set(rows[labels == label])) == 1
    predicted = head(torch.from_numpy(features)).argmax(1).numpy()
    assert (predicted == rows).mean() > 0.98
    assert not any(p.requires_grad for p in head.parameters())


def test_the_same_sample_gives_the_same_classes_and_head():
    features, _ = _blobs(seed=1)
    first, head, _ = cluster_classes(features, 8, seed=0)
    again, head_again, _ = cluster_classes(features, 8, seed=0)
    np.testing.assert_array_equal(first, again)
    assert torch.equal(head.weight, head_again.weight)


@pytest.mark.parametrize(("wanted", "items", "k"), [(50, 5000, 50), (50, 600, 30), (50, 50, 2), (3, 5000, 3)])
def test_a_small_sample_gets_fewer_classes(wanted, items, k):
    assert class_count(wanted, items) == k


def test_pairs_of_a_model_without_a_classifier_take_pseudo_classes():
    features, labels = _blobs()
    old = features[:, :8].copy()
    pairs = from_gallery(_Model(), np.arange(len(features)), old, features, None, "file:///g", pseudo_classes=5)
    assert pairs.targets_from.startswith("pseudo-classes: 5 K-means clusters")
    assert pairs.head is not None and pairs.classifier(_Model()) is pairs.head
    np.testing.assert_array_equal(pairs.truth, pairs.targets)  # no labels: the check counts the clusters
    _, _, rows = pairs.training
    assert len(set(rows)) == 5

    labeled = from_gallery(_Model(), np.arange(len(features)), old, features, labels, "file:///g", pseudo_classes=5)
    np.testing.assert_array_equal(labeled.truth, labels)  # labels stay the check's truth

    off = from_gallery(_Model(), np.arange(len(features)), old, features, None, "file:///g", pseudo_classes=0)
    assert off.targets is None and off.targets_from == TARGETS_NONE and off.head is None


def test_the_disc_term_takes_pseudo_classes_only_when_asked():
    """gallery.upgrade.pseudo_disc: the clusters are the check's classes either way; the map's disc
    term takes them only when it is set. A model's own classifier always gets the term."""
    from fastfill.components.platform.config import AlignConfig

    features, _ = _blobs()
    old = features[:, :8].copy()
    fastfill = AlignConfig(disc=True, uncertainty=True)
    default = from_gallery(_Model(), np.arange(len(features)), old, features, None, "file:///g", pseudo_classes=5)
    assert default.disc_off and not default.settings(fastfill).disc
    assert default.disc_targets.startswith("off (gallery.upgrade.pseudo_disc is false)")
    np.testing.assert_array_equal(default.truth, default.targets)
    asked = from_gallery(_Model(), np.arange(len(features)), old, features, None, "file:///g", pseudo_classes=5,
                         pseudo_disc=True)
    assert asked.settings(fastfill).disc and asked.disc_targets.startswith("pseudo-classes: 5")
    own = from_gallery(_Model(torch.nn.Linear(features.shape[1], 4)), np.arange(len(features)), features, features,
                       None, "file:///g")
    assert own.settings(fastfill).disc and own.disc_targets == TARGETS_PREDICTED


def test_a_model_with_a_classifier_keeps_its_own():
    features, _ = _blobs()
    torch.manual_seed(0)
    classifier = torch.nn.Linear(features.shape[1], 4)
    model = _Model(classifier)
    pairs = from_gallery(model, np.arange(len(features)), features, features, None, "file:///g", pseudo_classes=50)
    assert pairs.targets_from == TARGETS_PREDICTED and pairs.head is None
    assert pairs.classifier(model) is classifier


def test_with_pseudo_classes_off_a_map_trains_without_a_classifier():
    """pseudo_classes: 0 and a model without a classifier: no disc term, and the map's training
    (which never calls a head without it) is given a stand-in that says so if it ever is."""
    from fastfill.components.experiment.map_training import train_alignment
    from fastfill.components.platform.config import AlignConfig

    features, _ = _blobs(per_class=20)
    old = features[:, :8].copy()
    off = from_gallery(_Model(), np.arange(len(features)), old, features, None, "file:///g", pseudo_classes=0)
    head = off.classifier(_Model())
    with pytest.raises(RuntimeError, match="no classifier"):
        head(torch.zeros(1, features.shape[1]))
    config = AlignConfig(hidden=[8], epochs=2, warmup_epochs=1, batch_size=32, min_steps=4, disc=False,
                         validation_fraction=0.0)
    h, _ = train_alignment(config, *off.training, head, device=torch.device("cpu"), log=lambda line: None)
    assert h(torch.from_numpy(old[:3])).shape == (3, features.shape[1])
