"""A map sample too small for the map's check is refused before anything is embedded, naming
gallery.upgrade.map_sample (the setting the user chose), not the check's own setting."""

import pytest

from fastfill.components.experiment.map_validation import validation_split
from fastfill.components.gallery.layouts.catalog import GalleryError
from fastfill.components.gallery.upgrade.samples import check_map_sample, least_map_sample
from fastfill.components.platform.config import UpgradeConfig


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


def _params(**upgrade):
    from fastfill.components.platform.config import parse_params

    return parse_params({"gallery": {"upgrade": {"map_pairs": "gallery", "order": "sigma", **upgrade}}})


@pytest.mark.parametrize("items, sample, reembed", [(3082, 5000, True), (6000, 5000, True), (6666, 5000, True),
                                                    (6667, 5000, False), (10000, 5000, False),
                                                    (3000, 0.8, True), (400, 0.1, False)])
def test_a_map_sample_of_most_of_the_gallery_makes_the_upgrade_a_re_embed(items, sample, reembed):
    """At least three quarters of the gallery in the map sample: every item is embedded while
    planning, no FastFill map is trained or checked (a short l2-only one, no check), random order."""
    from fastfill.components.gallery.upgrade.samples import SMALL_GALLERY_STEPS, fit_to_gallery

    params = _params(map_sample=sample, map_sample_min=0 if isinstance(sample, float) else 5000)
    fitted, why = fit_to_gallery(params, items)
    if not reembed:
        assert why is None and fitted is params
        return
    upgrade = fitted.gallery.upgrade
    assert (upgrade.method, upgrade.order, upgrade.map_sample) == ("fct", "random", items)
    assert fitted.upgrade_map.validation_fraction == 0 and fitted.upgrade_map.min_steps <= SMALL_GALLERY_STEPS
    assert "re-embeds every item while planning; no fastfill map is trained or checked" in why, why
    assert why.startswith("the map sample would hold"), why


def test_the_splits_pairs_never_re_embed():
    from fastfill.components.gallery.upgrade.samples import fit_to_gallery

    params = _params(map_pairs="splits")
    assert fit_to_gallery(params, 3000) == (params, None)
