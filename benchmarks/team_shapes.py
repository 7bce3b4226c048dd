"""A third team data set and pair for the advisor's calibration (``benchmarks/team_advisor_map``):
``shapes``, synthetic RGB photos of ten kinds of shape, and a pair of models of other families and
widths than the fashion and bars pair's.

- **The images** (``shapes``): 48x48 RGB, one shape per image; the class is the shape (filled
  circle, filled square, triangle, plus, five-pointed star, ring, square frame, crescent, arrow,
  hexagon), drawn upright at a random position near the centre, a random size and a tilt of up
  to 23 degrees, in a random colour whose brightness differs from the background's, on a random
  background (a flat colour, a linear gradient, low-contrast stripes of random angle and period,
  or coloured noise), with a few distractor specks. Colour and background carry no class. Drawn
  with PIL at four times the size and reduced (anti-aliased), deterministically from a seed.
- **The pair** (``embedders``): old, a ShuffleNetV2 x0.5 at 32x32 (stretched), trained on all
  ten classes and exported to ONNX at its penultimate layer (the 1,024 pooled channels that feed
  its classifier; with ``penultimate`` False its 10 class scores); new, an EfficientNet-B0 at
  48x48 (stretched), all ten classes, through the product's ``TorchvisionEmbedder`` (its 1,280-d
  input to the classifier). Both take ImageNet's mean and std, train briefly here
  (``team_own_models.train_model``) and embed through the product's embedders.
"""

from __future__ import annotations

import math

import numpy as np

SIZE = 48
KINDS = ("circle", "square", "triangle", "plus", "star", "ring", "frame", "crescent", "arrow", "hexagon")
IMAGENET = dict(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
OLD = {"architecture": "shufflenet_v2_x0_5", "classes": list(range(10)),
       "preprocessing": dict(channels=3, height=32, width=32, **IMAGENET)}
NEW = {"architecture": "efficientnet_b0", "classes": list(range(10)),
       "preprocessing": dict(channels=3, height=48, width=48, **IMAGENET)}


def _colour(rng: np.random.Generator) -> tuple[int, int, int]:
    return tuple(int(c) for c in rng.integers(0, 256, size=3))


def _distinct(rng: np.random.Generator, other: tuple[int, int, int]) -> tuple[int, int, int]:
    """A colour whose brightness differs from ``other``'s by a fixed margin (the shape shows on
    its background in grey too)."""
    luma = np.array([0.299, 0.587, 0.114])
    while True:
        colour = _colour(rng)
        if abs(float(luma @ np.subtract(colour, other))) > 80:
            return colour


def _background(rng: np.random.Generator, side: int) -> tuple[np.ndarray, tuple[int, int, int]]:
    """A (side, side, 3) background and its mean colour."""
    base, second = np.array(_colour(rng), float), np.array(_colour(rng), float)
    kind = int(rng.integers(0, 4))
    y, x = np.mgrid[0:side, 0:side] / side
    if kind == 0:
        image = np.broadcast_to(base, (side, side, 3)).copy()
    elif kind == 1:
        angle = rng.uniform(0, 2 * np.pi)
        t = (np.cos(angle) * x + np.sin(angle) * y)
        t = (t - t.min()) / max(float(np.ptp(t)), 1e-6)
        image = base * (1 - t[..., None]) + second * t[..., None]
    elif kind == 2:
        angle, period = rng.uniform(0, np.pi), rng.uniform(0.08, 0.3)
        t = (np.sin(2 * np.pi * (np.cos(angle) * x + np.sin(angle) * y) / period) > 0).astype(float)
        second = base + (second - base) * 0.25  # low-contrast stripes: the shape stays the foreground
        image = base * (1 - t[..., None]) + second * t[..., None]
    else:
        image = base + rng.normal(0, 15, size=(side, side, 3))
    image = np.clip(image, 0, 255)
    return image, tuple(int(c) for c in image.reshape(-1, 3).mean(0))


def _polygon(cx: float, cy: float, radius: float, points: list[tuple[float, float]], angle: float):
    """``points`` (unit coordinates) scaled by ``radius``, rotated by ``angle``, moved to (cx, cy)."""
    c, s = math.cos(angle), math.sin(angle)
    return [(cx + radius * (c * px - s * py), cy + radius * (s * px + c * py)) for px, py in points]


def _regular(n: int, inner: float | None = None) -> list[tuple[float, float]]:
    if inner is None:
        return [(math.cos(2 * math.pi * k / n - math.pi / 2), math.sin(2 * math.pi * k / n - math.pi / 2))
                for k in range(n)]
    return [((1 if k % 2 == 0 else inner) * math.cos(math.pi * k / n - math.pi / 2),
             (1 if k % 2 == 0 else inner) * math.sin(math.pi * k / n - math.pi / 2)) for k in range(2 * n)]


_PLUS = [(-0.3, -1), (0.3, -1), (0.3, -0.3), (1, -0.3), (1, 0.3), (0.3, 0.3), (0.3, 1), (-0.3, 1), (-0.3, 0.3),
         (-1, 0.3), (-1, -0.3), (-0.3, -0.3)]
_ARROW = [(-1, -0.25), (0.2, -0.25), (0.2, -0.7), (1, 0), (0.2, 0.7), (0.2, 0.25), (-1, 0.25)]


def shape_image(label: int, rng: np.random.Generator, size: int = SIZE) -> np.ndarray:
    """One (size, size, 3) uint8 image of class ``label`` (its kind: ``KINDS[label]``)."""
    from PIL import Image, ImageDraw

    scale = 4
    side = size * scale
    background, mean = _background(rng, side)
    picture = Image.fromarray(background.astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(picture)
    for _ in range(int(rng.integers(0, 3))):  # specks: small discs of any colour, anywhere
        x, y, r = rng.uniform(0, side), rng.uniform(0, side), rng.uniform(0.5, 1.5) * scale
        draw.ellipse([x - r, y - r, x + r, y + r], fill=_colour(rng))
    fill = _distinct(rng, mean)
    radius = rng.uniform(0.28, 0.42) * side
    cx, cy = (side / 2 + rng.uniform(-0.5, 0.5) * (side / 2 - radius) for _ in range(2))
    angle = rng.uniform(-0.4, 0.4)  # upright, tilted by up to 23 degrees either way
    box = [cx - radius, cy - radius, cx + radius, cy + radius]
    square = [(-0.75, -0.75), (0.75, -0.75), (0.75, 0.75), (-0.75, 0.75)]
    mask = Image.new("L", (side, side), 0)
    shape = ImageDraw.Draw(mask)
    kind = KINDS[label]
    if kind == "circle":
        shape.ellipse(box, fill=255)
    elif kind == "square":
        shape.polygon(_polygon(cx, cy, radius, square, angle), fill=255)
    elif kind == "triangle":
        shape.polygon(_polygon(cx, cy, radius, _regular(3), angle), fill=255)
    elif kind == "plus":
        shape.polygon(_polygon(cx, cy, radius, _PLUS, angle), fill=255)
    elif kind == "star":
        shape.polygon(_polygon(cx, cy, radius, _regular(5, 0.4), angle), fill=255)
    elif kind == "ring":
        shape.ellipse(box, outline=255, width=max(1, int(radius * rng.uniform(0.2, 0.35))))
    elif kind == "frame":
        shape.polygon(_polygon(cx, cy, radius, square, angle), outline=255,
                      width=max(1, int(radius * rng.uniform(0.2, 0.3))))
    elif kind == "crescent":
        shape.ellipse(box, fill=255)
        shift = radius * rng.uniform(0.45, 0.65)
        dx, dy = shift * math.cos(angle), shift * math.sin(angle)
        shape.ellipse([box[0] + dx, box[1] + dy, box[2] + dx, box[3] + dy], fill=0)
    elif kind == "arrow":
        shape.polygon(_polygon(cx, cy, radius, _ARROW, angle), fill=255)
    else:
        shape.polygon(_polygon(cx, cy, radius, _regular(6), angle), fill=255)
    picture = Image.composite(Image.new("RGB", (side, side), fill), picture, mask)
    return np.asarray(picture.resize((size, size), Image.Resampling.LANCZOS))


def shapes(count: int, seed: int, size: int = SIZE) -> tuple[np.ndarray, np.ndarray]:
    """``count`` images (count, size, size, 3) uint8 of random classes and their labels."""
    rng = np.random.default_rng([seed, 65])
    labels = rng.integers(0, len(KINDS), size=count)
    return np.stack([shape_image(int(label), rng, size) for label in labels]), labels.astype(np.int64)


def embedders(train_images, train_labels, epochs: int, seed: int, penultimate: bool = True):
    """The shapes pair as the product loads them: (old ONNX embedder, new torchvision embedder,
    held-out accuracies); the old graph ends at ShuffleNetV2's pooled 1,024 channels, or with
    ``penultimate`` False at its class scores."""
    import torch

    from benchmarks.team_own_models import embedder_pair

    def cut(network) -> None:  # the last convolution's channels, averaged over space: what feeds the classifier
        network.fc = torch.nn.Identity()

    return embedder_pair(OLD, NEW, train_images, train_labels, epochs, seed, cut if penultimate else None)
