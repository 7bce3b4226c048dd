"""An evaluation stage's layout written from arrays: what the prepare and train stages would
leave for the evaluation's methods to read (the test split's labels, each model's features, a
map's stored sigma), for tests of the evaluation's tasks on a stage layout."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fastfill.components.platform.config import PathsConfig
from fastfill.components.platform.layout import Layout


def evaluation_layout(root: Path, labels: np.ndarray, old: np.ndarray, new: np.ndarray, *,
                      train: tuple[np.ndarray, np.ndarray] | None = None,
                      log_sigma2: np.ndarray | None = None) -> Layout:
    """A layout under ``root`` with the test split's ``labels`` (its images blank), the old and
    new models' test features, with ``train`` their new_train features (old, new), and with
    ``log_sigma2`` the fastfill map's stored sigma."""
    layout = Layout(PathsConfig(data=root / "data", artifacts=root / "artifacts", reports=root / "r"))
    layout.splits.mkdir(parents=True)
    np.save(layout.splits / "test_images.npy", np.zeros((len(labels), 1, 2, 2), np.uint8))
    np.save(layout.splits / "test_labels.npy", labels)
    for role, test, pairs in (("old", old, None if train is None else train[0]),
                              ("new", new, None if train is None else train[1])):
        layout.features_dir(role).mkdir(parents=True)
        np.save(layout.features(role, "test"), test)
        if pairs is not None:
            np.save(layout.features(role, "new_train"), pairs)
    if log_sigma2 is not None:
        layout.align_dir("fastfill").mkdir(parents=True)
        np.save(layout.align_dir("fastfill") / "log_sigma2.npy", log_sigma2)
    return layout
