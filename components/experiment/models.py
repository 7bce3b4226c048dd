"""Networks: embedding models (backbone + embedding layer + classifier head) and alignment maps."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, TypeAdapter
from torch import nn

from fastfill.components.experiment import vision
from fastfill.components.experiment.dense import Dense
from fastfill.components.platform.config import AlignConfig, TrainConfig
from fastfill.components.platform.layout import save_torch

if TYPE_CHECKING:  # a type only: the pipeline's stages that build models list what they import (dvc.yaml)
    from fastfill.components.experiment.basis_transformation import BasisTransformedEmbedding


def _conv_block(c_in: int, c_out: int) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]


def small_cnn(channels: int, width: int) -> tuple[nn.Module, int]:
    """Two conv layers: the weak old model of the default architecture-change scenario."""
    layers = [
        *_conv_block(channels, width), nn.MaxPool2d(2),
        *_conv_block(width, 2 * width), nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
    ]
    return nn.Sequential(*layers), 2 * width


def cnn(channels: int, width: int) -> tuple[nn.Module, int]:
    """Five conv layers: the quick CPU backbone."""
    layers = [
        *_conv_block(channels, width), *_conv_block(width, width), nn.MaxPool2d(2),
        *_conv_block(width, 2 * width), *_conv_block(2 * width, 2 * width), nn.MaxPool2d(2),
        *_conv_block(2 * width, 4 * width),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
    ]
    return nn.Sequential(*layers), 4 * width


def resnet18_small(channels: int, width: int) -> tuple[nn.Module, int]:
    """torchvision's ResNet-18 adapted to small images: 3x3 stem, stride 1, no max-pool."""

    net = vision.torchvision.models.resnet18(weights=None)
    net.conv1 = nn.Conv2d(channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    net.maxpool = nn.Identity()
    feature_dim = net.fc.in_features
    net.fc = nn.Identity()
    return net, feature_dim


BACKBONES = {"cnn_small": small_cnn, "cnn": cnn, "resnet18": resnet18_small}


class Embedder(nn.Module):
    """phi (backbone + linear embedding) and kappa (linear classifier over ``classes``).

    Input: images as float in [0, 1], (N, C, H, W); the model normalises them itself so a
    registered version needs nothing else. ``forward`` returns the embedding; ``classify``
    the logits over the model's own classes (global class ids in ``classes``).
    """

    # buffers (register_buffer), declared for the type checker
    classes: torch.Tensor
    pixel_mean: torch.Tensor
    pixel_std: torch.Tensor

    def __init__(self, config: TrainConfig, channels: int, classes: list[int],
                 pixel_mean: float = 0.5, pixel_std: float = 0.25):
        super().__init__()
        self.in_channels = channels
        self.architecture: dict[str, Any] = {"backbone": config.backbone, "width": config.width,
                                             "embedding_dim": config.embedding_dim}
        self.backbone, feature_dim = BACKBONES[config.backbone](channels, config.width)
        # Dense, or BT^2's basis transformation around it (compatibility.BT2Compatibility.prepare)
        self.embedding: Dense | BasisTransformedEmbedding = Dense(feature_dim, config.embedding_dim)
        self.classifier = Dense(config.embedding_dim, len(classes), bias=False)
        self.register_buffer("classes", torch.tensor(classes, dtype=torch.long))
        self.register_buffer("pixel_mean", torch.tensor(pixel_mean))
        self.register_buffer("pixel_std", torch.tensor(pixel_std))

    @property
    def embedding_dim(self) -> int:
        return self.embedding.out_features

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = (images - self.pixel_mean) / self.pixel_std
        return self.embedding(self.backbone(x))

    def classify(self, features: torch.Tensor) -> torch.Tensor:
        return self.classifier(features)

    def class_index(self, labels: torch.Tensor) -> torch.Tensor:
        """Row of the classifier for each global label; -1 for a class the model doesn't know."""
        lookup = torch.full((int(self.classes.max()) + 1,), -1, dtype=torch.long, device=labels.device)
        lookup[self.classes] = torch.arange(len(self.classes), device=labels.device)
        inside = labels <= self.classes.max()
        return torch.where(inside, lookup[labels.clamp(max=int(self.classes.max()))], -1)


class RBTBlock(nn.Module):
    """Residual bottleneck transformation: x + concat of 4 paths, each
    Linear(d -> d/4) + BN + ReLU + Linear(d/4 -> d/4) + BN (split-transform-merge)."""

    def __init__(self, dim: int, paths: int = 4):
        super().__init__()
        if dim % paths:
            raise ValueError(f"an RBT block needs a dimension divisible by {paths}, got {dim}")
        width = dim // paths
        self.paths = nn.ModuleList(
            nn.Sequential(Dense(dim, width), nn.BatchNorm1d(width), nn.ReLU(inplace=True),
                          Dense(width, width), nn.BatchNorm1d(width))
            for _ in range(paths))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.cat([path(x) for path in self.paths], dim=1)


def rbt_stack(in_dim: int, out_dim: int, blocks: int) -> nn.Sequential:
    """RBT blocks on ``in_dim``, then a linear projection when ``out_dim`` differs."""
    layers: list[nn.Module] = [RBTBlock(in_dim) for _ in range(blocks)]
    if out_dim != in_dim:
        layers.append(Dense(in_dim, out_dim))
    return nn.Sequential(*layers)


class AlignmentMap(nn.Module):
    """h: old features -> new feature space, with an optional uncertainty head psi.

    ``architecture="mlp"``: the reference MLP ``old_dim -> hidden... -> new_dim``, each hidden
    layer Linear + BatchNorm + ReLU, the last layer plain. ``"rbt"``: ``rbt_blocks`` RBT blocks
    then a projection (the RBT baseline). ``"affine"``: one Linear layer, ``W x + b`` (torch's
    default initialisation); its training adds the lambda-orthogonality penalty on ``W``
    (``affine_weight``). psi is one linear layer on the transformed feature that predicts
    s = log sigma^2.
    """

    # buffers of a scaled map only (set_scale), declared for the type checker
    input_scale: torch.Tensor
    output_scale: torch.Tensor

    def __init__(self, old_dim: int, new_dim: int, hidden: list[int], uncertainty: bool,
                 architecture: str = "mlp", rbt_blocks: int = 2):
        super().__init__()
        self.transform: nn.Module
        if architecture == "rbt":
            self.transform = rbt_stack(old_dim, new_dim, rbt_blocks)
        elif architecture == "affine":
            self.transform = Dense(old_dim, new_dim)
        elif architecture == "mlp":
            layers: list[nn.Module] = []
            width = old_dim
            for size in hidden:
                layers += [Dense(width, size), nn.BatchNorm1d(size), nn.ReLU(inplace=True)]
                width = size
            layers.append(Dense(width, new_dim))
            self.transform = nn.Sequential(*layers)
        else:
            raise ValueError(f"unknown alignment architecture {architecture!r}; use mlp, rbt or affine")
        self.uncertainty = Dense(new_dim, 1) if uncertainty else None
        self.old_dim, self.new_dim = old_dim, new_dim
        self.architecture: dict[str, Any] = {"hidden": list(hidden), "uncertainty": uncertainty,
                                             "architecture": architecture, "rbt_blocks": rbt_blocks}

    @classmethod
    def from_config(cls, config: AlignConfig, old_dim: int, new_dim: int) -> AlignmentMap:
        return cls(old_dim, new_dim, list(config.hidden), config.uncertainty, config.architecture, config.rbt_blocks)

    @property
    def scaled(self) -> bool:
        """The map works on features divided by scalars measured on its training pairs
        (``set_scale``): its weights carry them as the buffers ``input_scale`` and ``output_scale``."""
        return "input_scale" in self._buffers

    def set_scale(self, input_scale: float, output_scale: float) -> None:
        """h(x) = output_scale * transform(x / input_scale): the network sees old features of a
        fixed size and predicts new features of a fixed size, whatever the two models' own scales.
        The scales are buffers, so they travel with the weights (state_dict, the registry)."""
        for name, value in (("input_scale", input_scale), ("output_scale", output_scale)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"a map's {name} must be a positive number, got {value}")
            current = self._buffers.get(name)
            device = current.device if current is not None else None
            self.register_buffer(name, torch.tensor(float(value), dtype=torch.float32, device=device))

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As nn.Module's; weights that carry scales (a map trained with align.<m>.conditioning)
        give this map those scales, and weights without them (every map before) load as they did."""
        if "input_scale" in state_dict and "output_scale" in state_dict and not self.scaled:
            self.set_scale(1.0, 1.0)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def normalized(self, old_features: torch.Tensor) -> torch.Tensor:
        """The network's own output: h(x) / output_scale (h(x) for a map without scales)."""
        if not self.scaled:
            return self.transform(old_features)
        return self.transform(old_features / self.input_scale)

    def forward(self, old_features: torch.Tensor) -> torch.Tensor:
        if not self.scaled:
            return self.transform(old_features)
        return self.transform(old_features / self.input_scale) * self.output_scale

    @property
    def affine_weight(self) -> torch.Tensor:
        """W of an affine map, ``(new_dim, old_dim)``: what the lambda-orthogonality penalty acts on."""
        if not isinstance(self.transform, nn.Linear):
            raise ValueError("only an affine map (architecture: affine) has one weight matrix W")
        return self.transform.weight

    def log_sigma2(self, transformed: torch.Tensor) -> torch.Tensor:
        """psi on h's output ``transformed`` (in the new model's space; a scaled map's psi sees it
        divided by ``output_scale``)."""
        if self.uncertainty is None:
            raise ValueError("this alignment map has no uncertainty head (train it with uncertainty: true)")
        if self.scaled:
            transformed = transformed / self.output_scale
        return self.uncertainty(transformed).squeeze(-1)


class UnifiedMaps(nn.Module):
    """The unified space: T_q on new features and T_g on old features (RBT blocks each, T_g
    first projected to the new dimension), and one classifier K shared by both sides.
    Queries use T_q(phi_new); the gallery T_g(phi_old) until backfilled, T_q(phi_new) after."""

    def __init__(self, old_dim: int, new_dim: int, num_classes: int, blocks: int = 4):
        super().__init__()
        self.query = rbt_stack(new_dim, new_dim, blocks)
        self.gallery = nn.Sequential(Dense(old_dim, new_dim), *rbt_stack(new_dim, new_dim, blocks))
        self.classifier = Dense(new_dim, num_classes, bias=False)
        self.old_dim, self.new_dim = old_dim, new_dim
        self.blocks = blocks

    def forward(self, old_features: torch.Tensor) -> torch.Tensor:
        """The gallery side, so the map transforms stored old features like any alignment map."""
        return self.gallery(old_features)

    def embed_new(self, new_features: torch.Tensor) -> torch.Tensor:
        return self.query(new_features)


def save_embedder(model: Embedder, config: TrainConfig, path) -> None:
    """A self-describing checkpoint: later stages rebuild the model without reading params."""
    state = {
        "config": config.model_dump(mode="json"),
        "channels": model.in_channels,
        "classes": model.classes.tolist(),
        "state_dict": {k: v.cpu() for k, v in model.state_dict().items()},
    }
    save_torch(Path(path), state)


def load_embedder(path) -> Embedder:
    state = torch.load(path, map_location="cpu", weights_only=True)
    model = Embedder(TrainConfig(**state["config"]), state["channels"], state["classes"])
    model.load_state_dict(state["state_dict"])
    return model.eval()


def save_alignment(h: AlignmentMap | UnifiedMaps, config: AlignConfig, path) -> None:
    state = {"config": config.stored(), "old_dim": h.old_dim, "new_dim": h.new_dim,
             "state_dict": {k: v.cpu() for k, v in h.state_dict().items()}}
    if isinstance(h, UnifiedMaps):
        state["num_classes"] = h.classifier.out_features
    save_torch(Path(path), state)


def load_alignment(path) -> AlignmentMap | UnifiedMaps:
    state = torch.load(path, map_location="cpu", weights_only=True)
    config = AlignConfig(**state["config"])
    h: AlignmentMap | UnifiedMaps
    if config.architecture == "unified":
        h = UnifiedMaps(state["old_dim"], state["new_dim"], state["num_classes"], config.rbt_blocks)
    else:
        h = AlignmentMap.from_config(config, state["old_dim"], state["new_dim"])
    h.load_state_dict(state["state_dict"])
    return h.eval()


# ---- a module as data: a typed description of its architecture plus its weights

class EmbedderSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["embedder"] = "embedder"
    backbone: Literal["cnn", "cnn_small", "resnet18"]
    width: PositiveInt
    embedding_dim: PositiveInt
    channels: PositiveInt
    classes: list[int]


class AlignmentSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["alignment"] = "alignment"
    old_dim: PositiveInt
    new_dim: PositiveInt
    hidden: list[PositiveInt]
    uncertainty: bool
    architecture: Literal["mlp", "rbt", "affine"]
    rbt_blocks: PositiveInt


class UnifiedSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["unified"] = "unified"
    old_dim: PositiveInt
    new_dim: PositiveInt
    num_classes: PositiveInt
    blocks: PositiveInt


ModelSpec = Annotated[EmbedderSpec | AlignmentSpec | UnifiedSpec, Field(discriminator="kind")]
SPEC = TypeAdapter(ModelSpec)


def describe(module: nn.Module) -> dict:
    """The typed description that ``build`` turns back into an untrained ``module``."""
    spec: BaseModel
    if isinstance(module, Embedder):
        spec = EmbedderSpec(**module.architecture, channels=module.in_channels, classes=module.classes.tolist())
    elif isinstance(module, AlignmentMap):
        spec = AlignmentSpec(old_dim=module.old_dim, new_dim=module.new_dim, **module.architecture)
    elif isinstance(module, UnifiedMaps):
        spec = UnifiedSpec(old_dim=module.old_dim, new_dim=module.new_dim,
                           num_classes=module.classifier.out_features, blocks=module.blocks)
    else:
        raise TypeError(f"no description for {type(module).__name__}: only Embedder, AlignmentMap and UnifiedMaps")
    return spec.model_dump(mode="json")


def build(description: dict) -> nn.Module:
    """An untrained module of the described architecture (validated: a ValidationError names a
    field that is missing or wrong)."""
    spec = SPEC.validate_python(description)
    if isinstance(spec, EmbedderSpec):
        config = TrainConfig(backbone=spec.backbone, width=spec.width, embedding_dim=spec.embedding_dim)
        return Embedder(config, spec.channels, spec.classes)
    if isinstance(spec, AlignmentSpec):
        return AlignmentMap(spec.old_dim, spec.new_dim, spec.hidden, spec.uncertainty, spec.architecture,
                            spec.rbt_blocks)
    return UnifiedMaps(spec.old_dim, spec.new_dim, spec.num_classes, spec.blocks)
