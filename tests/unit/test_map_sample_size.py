"""A map sample too small for the map's check is refused before anything is embedded, naming
gallery.upgrade.map_sample (the setting the user chose), not the check's own setting."""

import pytest

from components.experiment.map_validation import validation_split
from components.gallery.layouts.catalog import GalleryError
from components.gallery.upgrade.samples import check_map_sample, least_map_sample
from components.platform.config import UpgradeConfig


@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5, 0.05])
def test_the_least_sample_is_exactly_where_the_check_can_split_it(fraction):
    least = least_map_sample(fraction)
    validation_split(least, fraction, 0)  # works at the least size
    with pytest.raises(Exception, match="validation needs at least|feature pairs to train"):
        validation_split(least - 1, fraction, 0)


def test_a_too_small_sample_is_refused_naming_map_sample():
    config = UpgradeConfig(map_sample=100)
    with pytest.raises(GalleryError, match=r"gallery.upgrade.map_sample gives 100 items.*at least 195.*Raise "
                                           r"gallery.upgrade.map_sample to 195"):
        check_map_sample(config, 0.1, 600)
    check_map_sample(UpgradeConfig(map_sample=200), 0.1, 600)  # enough: no refusal
    with pytest.raises(GalleryError, match=r"gives 150 items \(the whole gallery\)"):
        check_map_sample(UpgradeConfig(), 0.1, 150)
