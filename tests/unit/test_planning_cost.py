"""The dry run's planning estimate (components/gallery/advice/planning_cost.py): what planning
embeds, each item once, and the seconds of its parts, the map's training measured on this machine."""

import numpy as np

from fastfill.cli.upgrade_commands import describe_planning
from fastfill.components.gallery.advice.planning_cost import TYPICAL_EPOCHS, epoch_seconds, planned_items, planning_cost
from fastfill.components.platform.config import AlignConfig, UpgradeConfig


def test_planning_embeds_each_item_once():
    items = planned_items(np.arange(0, 100), np.arange(50, 250), 1000)
    assert items.to_dict() == {"map_sample": 100, "evaluation_sample": 200, "evaluation_outside_map_sample": 150,
                     "total": 250, "share_of_gallery": 0.25, "evaluation_standard_error": 3.54}


def test_the_map_and_its_reference_are_timed_only_when_trained():
    config = UpgradeConfig()
    settings = AlignConfig(hidden=[16], batch_size=32, validation_fraction=0.2, uncertainty=True, disc=False,
                           epochs=3, warmup_epochs=1, min_steps=0).for_upgrade()
    with_disc = settings.model_copy(update={"disc": True})  # the map's network differs from its reference's
    both = planning_cost(config, 1000, np.arange(120), np.arange(100, 160), 0.01, with_disc, 12, 8, trains=True,
                         checks=True)
    seconds = both.to_dict()["seconds"]
    assert seconds["embedding"] == round(160 * 0.01, 1)
    # both trained maps are timed (on 96 pairs either may round to 0.0 s on a fast machine: the
    # unrounded epoch is measured below)
    assert seconds["map_training"] >= 0 and seconds["reference_training"] >= 0
    assert seconds["total"] == round(seconds["embedding"] + seconds["map_training"] + seconds["reference_training"], 1)
    assert both.seconds_at_most >= seconds["total"] - 0.1 and str(TYPICAL_EPOCHS) in both.note
    assert list(seconds) == ["embedding", "map_training", "reference_training", "total"]
    lines = describe_planning(both)
    assert lines[0].startswith("  planning embeds 160 items (16.0% of the gallery: map sample 120")
    assert "the map's training" in lines[1] and "the check's reference" in lines[1]

    checked = planning_cost(config, 1000, np.arange(120), np.arange(100, 160), 0.01, settings, 12, 8, trains=False,
                            checks=False)
    assert set(checked.to_dict()["seconds"]) == {"embedding", "total"} and "seconds_at_most" not in checked.to_dict()
    assert describe_planning(checked)[1] == "  planning takes about 2 s (embedding 2 s)"


def test_a_map_that_is_its_own_reference_trains_once():
    """separate without a disc term: the check takes the map's network as its reference."""
    settings = AlignConfig(hidden=[16], batch_size=32, validation_fraction=0.2, uncertainty=True, disc=False,
                           epochs=3, warmup_epochs=1, min_steps=0).for_upgrade()
    once = planning_cost(UpgradeConfig(), 1000, np.arange(120), np.arange(100, 160), 0.01, settings, 12, 8,
                         trains=True, checks=True)
    assert once.seconds.map_training is not None and once.seconds.reference_training is None


def test_an_epoch_is_measured_not_assumed():
    settings = AlignConfig(hidden=[16], batch_size=32, validation_fraction=0.2, uncertainty=True, disc=False,
                           epochs=3, warmup_epochs=1, min_steps=0).for_upgrade()
    assert 0 < epoch_seconds(settings, 12, 8, 120) < 60


def test_the_evaluation_sample_is_sized_by_its_standard_error_not_the_gallery():
    """auto: the queries whose top-1 has at most eval_standard_error points of standard error at
    worst; the same count for a gallery of 3,000 items as for one of a million."""
    from fastfill.components.gallery.upgrade.planning import (
        eval_sample,
        eval_size,
        worst_case_queries,
        worst_case_standard_error,
    )

    auto = UpgradeConfig()
    assert auto.eval_queries == "auto" and eval_size(auto) == worst_case_queries(1.5) == 1112
    assert worst_case_standard_error(1112) <= 1.5 < worst_case_standard_error(1111)
    assert eval_size(UpgradeConfig(eval_standard_error=1.0)) == 2500
    assert eval_size(UpgradeConfig(eval_queries="all")) is None and eval_size(UpgradeConfig(eval_queries=40)) == 40
    for items in (3000, 1_000_000):
        assert len(eval_sample(None, eval_size(auto), 0, items)) == 1112
    assert len(eval_sample(np.zeros(500), eval_size(auto), 0)) == 500  # a smaller gallery: all of it
