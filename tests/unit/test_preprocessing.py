"""A model's preprocessing: every image Pillow reads becomes exactly what the model takes, the
same as torchvision's transforms give (Resize + CenterCrop + ToTensor + Normalize)."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from fastfill.components.gallery.inputs.images import decode, read_image
from fastfill.components.model_store.catalogue import preprocessing_from_options
from fastfill.components.model_store.preprocessing import Preprocessing

IMAGENET = Preprocessing(channels=3, height=24, width=24, resize="shorter_then_crop", resize_to=28,
                         mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))


def _encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def _photo(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


@pytest.mark.parametrize("size", [(40, 31), (31, 40), (28, 28), (101, 57)])
def test_shorter_side_then_centre_crop_equals_torchvision(size):
    from fastfill.components.experiment.vision import torchvision

    T = torchvision.transforms
    picture = _photo(*size)
    reference = T.Compose([T.Resize(28), T.CenterCrop(24), T.ToTensor(),
                           T.Normalize(IMAGENET.mean, IMAGENET.std)])(picture)
    ours = IMAGENET.normalise(torch.from_numpy(IMAGENET.decode(_encoded(picture, "PNG")))[None].float() / 255)[0]
    assert ours.shape == reference.shape == (3, 24, 24)
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)


def test_stretch_equals_torchvision_resize_to_both_sides():
    from fastfill.components.experiment.vision import torchvision

    T = torchvision.transforms
    picture = _photo(50, 20)
    prep = Preprocessing(channels=3, height=16, width=12)
    reference = (T.PILToTensor()(T.Resize((16, 12))(picture))).numpy()
    np.testing.assert_array_equal(prep.decode(_encoded(picture, "PNG")), reference)


def _sixteen_bit_grey() -> Image.Image:
    values = (np.arange(20 * 30, dtype=np.uint32).reshape(20, 30) * 109).astype(np.uint16)
    return Image.fromarray(values)  # Pillow opens uint16 as I;16


@pytest.mark.parametrize("make, fmt", [
    (lambda: _photo(33, 21), "JPEG"),
    (lambda: _photo(33, 21), "WEBP"),
    (lambda: _photo(33, 21).convert("RGBA"), "PNG"),
    (lambda: _photo(33, 21).convert("L"), "PNG"),
    (lambda: _photo(33, 21).convert("P"), "PNG"),
    (_sixteen_bit_grey, "PNG"),
    (lambda: _photo(900, 700), "JPEG"),
])
def test_any_image_pillow_reads_becomes_the_model_s_input(make, fmt):
    data = _encoded(make(), fmt)
    for prep in (IMAGENET, Preprocessing(channels=1, height=16, width=16)):
        pixels = prep.decode(data)
        assert pixels.dtype == np.uint8 and pixels.shape == prep.shape


def test_sixteen_bit_greys_are_scaled_not_clipped():
    pixels = Preprocessing(channels=1, height=20, width=30).decode(_encoded(_sixteen_bit_grey(), "PNG"))
    source = np.asarray(_sixteen_bit_grey()).astype(np.float64)
    np.testing.assert_allclose(pixels[0], np.rint(source * 255 / 65535), atol=1)
    assert pixels.max() > 200  # clipping at 255 would make nearly every pixel white, scaling keeps the range


def test_stored_pixels_of_another_shape_go_through_the_same_rule():
    picture = _photo(40, 31)
    stored = np.asarray(picture).transpose(2, 0, 1)[None]
    np.testing.assert_array_equal(IMAGENET.adapt(stored)[0], IMAGENET.decode(_encoded(picture, "PNG")))
    same = np.zeros((2, 3, 24, 24), np.uint8)
    assert IMAGENET.adapt(same) is same  # already the model's shape: untouched


def test_a_bare_shape_keeps_the_plain_stretch_of_earlier_releases():
    picture = _photo(20, 10).convert("L")
    plain = np.asarray(picture.resize((16, 16), Image.Resampling.BILINEAR))[None]
    np.testing.assert_array_equal(decode(_encoded(picture, "PNG"), (1, 16, 16)), plain)


def test_an_unreadable_image_stays_a_named_failure(tmp_path):
    path = tmp_path / "broken.jpg"
    path.write_bytes(b"not an image at all")
    image, why = read_image(str(path), IMAGENET)
    assert image is None and why.startswith("undecodable")
    truncated = tmp_path / "cut.jpg"
    truncated.write_bytes(_encoded(_photo(64, 64), "JPEG")[:200])
    image, why = read_image(str(truncated), IMAGENET)
    assert image is None and why.startswith("undecodable")


@pytest.mark.parametrize("changes, says", [
    (dict(mean=(0.5, 0.5)), "mean needs 1 or 3 values"),
    (dict(std=(0.0,)), "std must be positive"),
    (dict(resize_to=10), "smaller than the 24x24 crop"),
    (dict(resize="stretch", resize_to=30), "resize_to is for resize shorter_then_crop"),
])
def test_an_inconsistent_preprocessing_is_refused_naming_the_field(changes, says):
    with pytest.raises(ValueError, match=says):
        Preprocessing(**{**IMAGENET.model_dump(), **changes})


def test_the_command_s_options_make_the_preprocessing():
    imagenet = preprocessing_from_options("imagenet", None, None, None, None, None, None, None)
    assert imagenet.shape == (3, 224, 224) and imagenet.shorter_side == 256
    assert preprocessing_from_options("imagenet", None, "96", None, None, None, None, None).shorter_side == 110
    grey = preprocessing_from_options(None, 1, "28,20", "stretch", None, "0.5", "0.25", None)
    assert grey.shape == (1, 28, 20) and grey.mean == (0.5,)
    with pytest.raises(ValueError, match="give --size and --channels"):
        preprocessing_from_options(None, None, None, None, None, None, None, None)
    with pytest.raises(ValueError, match="--size"):
        preprocessing_from_options(None, 3, "big", None, None, None, None, None)
