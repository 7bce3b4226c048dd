"""Each method's training runs a few epochs on tiny data and lowers its loss: BCT and RACT
(new models trained for compatibility), the RBT map and the unified space."""

import pytest
import torch

from fastfill.components.experiment.compatibility import BCTInfluence, RACTCompatibility, old_class_means
from fastfill.components.experiment.data import Split
from fastfill.components.experiment.inference import embed
from fastfill.components.experiment.map_training import train_alignment, train_unified
from fastfill.components.experiment.training import TrainingRun, train_embedder
from fastfill.components.platform.config import AlignConfig, TrainConfig
from tests.synthetic import SQUARE_CLASSES, square_images

CLASSES = SQUARE_CLASSES


def _quiet(_message: str) -> None:
    pass


@pytest.fixture(scope="module")
def setting():
    split = square_images()
    old_part = Split(split.images[split.labels < 2], split.labels[split.labels < 2])
    old_config = TrainConfig(backbone="cnn_small", width=4, embedding_dim=8, epochs=2, batch_size=16, augment=False)
    old, _ = train_embedder(old_config, old_part, [0, 1], (0.2, 0.3),
                            run=TrainingRun(torch.device("cpu"), log=_quiet))
    new_config = TrainConfig(backbone="cnn", width=4, embedding_dim=12, epochs=5, batch_size=16, augment=False,
                             lr=3e-3)
    return split, old, new_config


def _lowered(history: list[dict], key: str) -> bool:
    return history[-1][key] < history[0][key]


@pytest.mark.parametrize("method", ["bct", "ract", "ract_vanilla"])
def test_compatible_training_lowers_both_terms(setting, method):
    split, old, config = setting
    if method == "bct":
        term = BCTInfluence(old, old_class_means(old, split.images, split.labels))
        assert term.weight.shape == (CLASSES, 8)  # 2 old rows + 2 synthesised
    else:
        term = RACTCompatibility(old, new_to_new=method == "ract")
    frozen = {k: v.clone() for k, v in old.state_dict().items()}
    _, history = train_embedder(config, split, list(range(CLASSES)), (0.2, 0.3),
                                run=TrainingRun(torch.device("cpu"), log=_quiet), compatibility=term)
    assert _lowered(history, "loss") and _lowered(history, "compatibility"), history
    assert all(torch.equal(frozen[k], v) for k, v in old.state_dict().items())  # the old model stays as it was


def test_rbt_map_and_unified_space_lower_their_losses(setting):
    split, old, config = setting
    new, _ = train_embedder(config, split, list(range(CLASSES)), (0.2, 0.3),
                            run=TrainingRun(torch.device("cpu"), log=_quiet))
    old_features, new_features = embed(old, split.images), embed(new, split.images)
    rbt = AlignConfig(architecture="rbt", rbt_blocks=2, hidden=[], epochs=6, warmup_epochs=1, batch_size=16, lr=3e-3, min_steps=0,
                      validation_fraction=0)
    h, history = train_alignment(rbt, old_features, new_features, split.labels, new.classifier,
                                 device=torch.device("cpu"), log=_quiet)
    assert _lowered(history, "l2"), history
    assert h(torch.from_numpy(old_features)).shape == (len(split), 12)

    unified = AlignConfig(rbt_blocks=1, hidden=[], epochs=6, warmup_epochs=1, batch_size=16, lr=3e-3, min_steps=0,
                          validation_fraction=0)
    maps, history = train_unified(unified, old_features, new_features, split.labels, CLASSES,
                                  device=torch.device("cpu"), log=_quiet)
    assert _lowered(history, "loss") and _lowered(history, "similarity"), history
    assert maps.embed_new(torch.from_numpy(new_features)).shape == maps(torch.from_numpy(old_features)).shape
