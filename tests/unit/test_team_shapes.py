"""benchmarks/team_shapes.py: the third team data set of the advisor's calibration."""

import numpy as np

from benchmarks.team_own_models import photo
from benchmarks.team_shapes import KINDS, shapes


def test_shapes_are_drawn_from_the_seed_alone():
    images, labels = shapes(40, seed=3)
    again, same = shapes(40, seed=3)
    other, _ = shapes(40, seed=4)
    assert images.shape == (40, 48, 48, 3) and images.dtype == np.uint8
    assert np.array_equal(images, again) and np.array_equal(labels, same)
    assert not np.array_equal(images, other)
    assert set(labels.tolist()) <= set(range(len(KINDS)))


def test_a_photo_of_an_rgb_image_keeps_its_colours():
    images, _ = shapes(1, seed=0)
    picture = photo(images[0], np.random.default_rng(0))
    assert picture.mode == "RGB" and 28 <= min(picture.size) and max(picture.size) <= 112
