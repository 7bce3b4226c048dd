"""A model's preprocessing, recorded with the model: what an image becomes before it is embedded.

Two halves, applied in two places so that the pixels that travel (read, stored, cached) stay
uint8:

- the geometry and colour (``decode`` of encoded bytes, ``adapt`` of stored uint8 arrays): the
  colour mode (grey for one channel, RGB for three), then either a plain resize to (height, width)
  (``stretch``) or the shorter side resized to ``resize_to`` and the centre cropped to
  (height, width) (``shorter_then_crop``, torchvision's ``Resize(256)`` + ``CenterCrop(224)``);
- the scaling: uint8 / 255, then (x - mean) / std per channel, inside the model's forward pass
  (``normalise``), so a batch of uint8 images is all a model needs.

Images are opened as Pillow's default loader does (no EXIF rotation; RGBA and palette images
converted to RGB by dropping alpha, as ``Image.convert`` does), since that is what a model
trained through torchvision's ``ImageFolder`` saw. 16-bit and 32-bit greys are scaled to 8 bits.
"""

from __future__ import annotations

import io
import math
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

RESIZE_RULES = ("stretch", "shorter_then_crop")
# torchvision's ImageNet recipe crops 224 of 256: the default resize_to keeps that ratio
CROP_RATIO = 0.875


class Preprocessing(BaseModel):
    """What a model takes: ``channels`` x ``height`` x ``width`` uint8 pixels, made by ``resize``,
    and the per-channel ``mean`` and ``std`` its forward pass applies to pixels / 255."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    channels: Literal[1, 3]
    height: PositiveInt
    width: PositiveInt
    resize: Literal["stretch", "shorter_then_crop"] = "stretch"
    resize_to: PositiveInt | None = Field(
        default=None, description="shorter_then_crop: the shorter side's size before the crop "
                                  "(default: the crop's larger side / 0.875, 256 for 224)")
    interpolation: Literal["bilinear", "bicubic", "nearest"] = "bilinear"
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)

    @model_validator(mode="after")
    def _consistent(self) -> Preprocessing:
        for name in ("mean", "std"):
            values = getattr(self, name)
            if len(values) not in (1, self.channels):
                raise ValueError(f"{name} needs 1 or {self.channels} values for {self.channels} channel(s), "
                                 f"got {len(values)}")
            if not all(math.isfinite(v) for v in values):
                raise ValueError(f"{name} must be finite numbers, got {list(values)}")
        if any(v <= 0 for v in self.std):
            raise ValueError(f"std must be positive, got {list(self.std)}")
        if self.resize == "stretch" and self.resize_to is not None:
            raise ValueError("resize_to is for resize shorter_then_crop; a stretch resizes to height x width")
        if self.resize == "shorter_then_crop" and self.resize_to is not None and \
                self.resize_to < max(self.height, self.width):
            raise ValueError(f"resize_to {self.resize_to} is smaller than the {self.height}x{self.width} crop")
        return self

    @classmethod
    def plain(cls, shape) -> Preprocessing:
        """A stretch to (C, H, W) with no scaling of its own: the images of a model whose forward
        normalises by itself (this project's own models) or of a gallery's stored pixels."""
        channels, height, width = (int(x) for x in shape)
        return cls.model_validate({"channels": channels, "height": height, "width": width})

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.channels, self.height, self.width

    @property
    def colour_mode(self) -> str:
        return "L" if self.channels == 1 else "RGB"

    @property
    def shorter_side(self) -> int:
        return self.resize_to or round(max(self.height, self.width) / CROP_RATIO)

    def describe(self) -> str:
        """One line for a person: ``3x224x224 RGB, shorter side 256 then centre crop, mean ..., std ...``."""
        rule = "stretched" if self.resize == "stretch" else f"shorter side {self.shorter_side} then centre crop"
        return (f"{self.channels}x{self.height}x{self.width} {self.colour_mode}, {rule} ({self.interpolation}), "
                f"mean {list(self.mean)}, std {list(self.std)}")

    # ---- geometry and colour: encoded bytes or stored pixels -> uint8 (C, H, W)

    def decode(self, data: bytes) -> np.ndarray:
        """Encoded image bytes (anything Pillow reads) -> uint8 (C, H, W). Raises what Pillow
        raises for bytes that are not an image (OSError, ValueError, ...)."""
        from PIL import Image

        with Image.open(io.BytesIO(data)) as image:
            image.load()
            return self._shape(_eight_bit(image))

    def adapt(self, images: np.ndarray) -> np.ndarray:
        """Stored uint8 pixels (N, C', H', W') -> this model's (N, C, H, W): unchanged when they
        already have its shape, else each image through the same colour and resize rule."""
        images = np.asarray(images)
        if images.ndim != 4:
            raise ValueError(f"images must be (N, C, H, W), got shape {images.shape}")
        if images.shape[1:] == self.shape:
            return images
        from PIL import Image

        out = np.empty((len(images), *self.shape), dtype=np.uint8)
        for row, image in enumerate(images):
            picture = Image.fromarray(image[0] if image.shape[0] == 1 else image.transpose(1, 2, 0))
            out[row] = self._shape(picture)
        return out

    def _shape(self, image) -> np.ndarray:
        from PIL import Image

        resample = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC,
                    "nearest": Image.Resampling.NEAREST}[self.interpolation]
        image = image.convert(self.colour_mode)
        if self.resize == "stretch":
            if image.size != (self.width, self.height):
                image = image.resize((self.width, self.height), resample)
        else:
            image = _centre_crop(_shorter_side(image, self.shorter_side, resample), self.height, self.width)
        array = np.asarray(image, dtype=np.uint8)
        return array[None].copy() if self.channels == 1 else array.transpose(2, 0, 1).copy()

    # ---- scaling: inside the model's forward pass

    def normalise(self, batch):
        """A float batch of pixels / 255 (N, C, H, W) -> (x - mean) / std per channel (torch)."""
        import torch

        scale = 1.0 / torch.tensor(self.std, dtype=torch.float64)
        shift = -torch.tensor(self.mean, dtype=torch.float64) * scale
        # one pass over the batch: shift + x * scale
        return torch.addcmul(shift.to(batch.device, batch.dtype).view(1, -1, 1, 1), batch,
                             scale.to(batch.device, batch.dtype).view(1, -1, 1, 1))


def _eight_bit(image):
    """16- and 32-bit greys (``I;16*``, ``I``) and float images (``F``) scaled to 8-bit grey;
    other modes as they are (``convert`` handles them)."""
    from PIL import Image

    if image.mode.startswith("I;16") or image.mode == "I":
        array = np.asarray(image).astype(np.float64)
        top = 65535.0 if image.mode.startswith("I;16") or array.max(initial=0) > 255 else 255.0
        return Image.fromarray(np.clip(np.rint(array * (255.0 / top)), 0, 255).astype(np.uint8), "L")
    if image.mode == "F":
        array = np.asarray(image, dtype=np.float64)
        scale = 255.0 if array.max(initial=0) <= 1.0 else 1.0
        return Image.fromarray(np.clip(np.rint(array * scale), 0, 255).astype(np.uint8), "L")
    return image


def _shorter_side(image, size: int, resample):
    """torchvision's ``Resize(size)`` on a PIL image: the shorter side to ``size``, the longer
    one scaled and truncated as torchvision does."""
    width, height = image.size
    short, long = (width, height) if width <= height else (height, width)
    if short == size:
        return image
    new_short, new_long = size, int(size * long / short)
    target = (new_short, new_long) if width <= height else (new_long, new_short)
    return image.resize(target, resample)


def _centre_crop(image, height: int, width: int):
    """torchvision's ``CenterCrop``: the offsets rounded as it rounds them."""
    image_width, image_height = image.size
    top = int(round((image_height - height) / 2.0))
    left = int(round((image_width - width) / 2.0))
    return image.crop((left, top, left + width, top + height))
