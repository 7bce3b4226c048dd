"""The pipeline's sections of params.yaml, data to methods: where the stages write (``paths``),
how they use the CPU (``compute``), the data (``prepare``), the two models (``train.<role>``), the
alignment maps (``align.<method>``) and the compatible new models (``compatible.<method>``); what
`fastfill run` and `dvc repro` read. The evaluation's and the comparison's sections, which name
these methods, are config_evaluation's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from fastfill.components.platform.config_base import PositiveFloat, PositiveInt, Section
from fastfill.components.platform.runtime import CPU_KERNELS, DEFAULT_CPU_KERNELS
from fastfill.components.platform.vocabulary import Distance, TrainingPrecision

FASHION_MNIST_DEB = "/usr/share/datasets/fashion-mnist"
# lambda of the affine map's lambda-orthogonality penalty when align.<m>.orthogonality is null
ORTHOGONALITY_DEFAULT = 1.0
# What a gallery upgrade's map uses where align.<m>.conditioning / patience are null (a team's models)
UPGRADE_CONDITIONING = "scale"
UPGRADE_PATIENCE = 10
# the paper's joint weighting collapses on team pairs, and psi's gradient through its input costs the map top-1:
# benchmarks/team_map_conditioning.py
UPGRADE_WEIGHTING = "separate"


class PathsConfig(Section):
    """Where stage outputs go, relative to the working directory."""

    data: Path = Field(default=Path("data"), description="prepared splits (prepare's output)")
    artifacts: Path = Field(default=Path("artifacts"), description='models, features and maps of the stages')
    reports: Path = Field(default=Path("reports"), description='metrics.json, curves.json, plots')


class ComputeConfig(Section):
    """How the computing steps use the CPU: a fixed thread count and a fixed instruction-set level
    for the kernels, so a rerun on another x86-64 machine, whatever its cores and instruction
    set, gives the same bytes (docs/pipeline.md, "Reproducible")."""

    threads: PositiveInt | None = Field(
        default=2, description="torch's intra-op threads of the pipeline's stages (training, maps, evaluation); "
        "null = torch's default (the machine's cores). OMP_NUM_THREADS, when set in the environment, wins")
    # runtime.py's names are a tuple, which Python accepts in a Literal and mypy does not
    cpu_kernels: Literal[CPU_KERNELS] = Field(  # type: ignore[valid-type]
        default=DEFAULT_CPU_KERNELS, description="the instruction set every library's CPU kernels are held to (oneDNN, "
        "MKL, OpenBLAS, ATen, faiss, numpy): avx2 = the same bytes on every x86-64 CPU with AVX2 (Intel since 2013, "
        "AMD since 2017), whatever more it has; native = each library takes the machine's best (faster where the CPU "
        "has AVX-512, other bytes there). FASTFILL_CPU_KERNELS, when set, wins. reports/cpu_kernels.md measures it")


class PrepareConfig(Section):
    dataset: Literal["fashion-mnist", "imagefolder"] = "fashion-mnist"
    # Fashion-MNIST: the folder holding the IDX .gz files of the Debian package.
    # imagefolder: a folder with one sub-folder per class, or with train/ and test/ inside.
    source: Path = Field(
        default=Path(FASHION_MNIST_DEB), description="fashion-mnist: the folder of the Debian package's IDX .gz "
        "files; imagefolder: a folder of class sub-folders, or with train/ and test/ inside")
    old_classes: list[int] | None = Field(
        default=None, description="classes the old model trains on; null = the first half"
    )
    train_per_class: PositiveInt | None = None
    test_per_class: PositiveInt | None = None
    unseen_classes: list[int] | None = Field(
        default=None, description="open-class evaluation: no model or map trains on these classes and the test "
        "split holds only them; null = every class is seen")
    image_size: PositiveInt = Field(default=28, description='images are resized to this many pixels square')
    channels: Literal[1, 3] = Field(default=1, description='1 = grey, 3 = RGB')
    test_fraction: Annotated[float, Field(gt=0, lt=1)] = Field(
        default=0.2, description='imagefolder without train/ and test/: the share of each class held out for test')
    seed: int = Field(default=0, description="the split's and the per-class samples' seed")


    @model_validator(mode="after")
    def _class_lists(self) -> PrepareConfig:
        if self.unseen_classes is not None:
            if not self.unseen_classes:
                raise ValueError("prepare.unseen_classes is empty; list the held-out classes, or null for none")
            if len(set(self.unseen_classes)) != len(self.unseen_classes):
                raise ValueError(f"prepare.unseen_classes {self.unseen_classes} lists a class twice")
            overlap = sorted(set(self.unseen_classes) & set(self.old_classes or []))
            if overlap:
                raise ValueError(f"prepare.unseen_classes and prepare.old_classes overlap in {overlap}: the old "
                                 "model must not see the held-out classes; remove them from one list")
        if self.old_classes is not None and not self.old_classes:
            raise ValueError("prepare.old_classes is empty; list the old model's classes, or null for the first half")
        return self


def _precision_field():
    """The precision of a training (train.<role>, align.<method>): one description for both."""
    return Field(
        default="fp32", description="of the training's forward passes: fp32; bf16 = bfloat16 autocast (weights, "
        "optimiser and losses stay float32); auto = bf16 where the hardware runs it fast (a CUDA device that "
        "supports it, a CPU with avx512_bf16/AMX), else fp32. About 2x faster there: benchmarks/cpu_bf16_training.py")


class TrainConfig(Section):
    backbone: Literal["cnn", "cnn_small", "resnet18"] = Field(
        default="cnn", description="cnn_small: 2 conv layers; cnn: 5 conv layers; resnet18: torchvision's, for small images")
    width: PositiveInt = Field(default=32, description='channels of the first conv layer (doubling deeper)')
    embedding_dim: PositiveInt = Field(default=128, description='feature dimension d')
    epochs: PositiveInt = Field(default=4, description='passes over the training split')
    batch_size: PositiveInt = Field(default=128, description='images per optimiser step')
    optimizer: Literal["adam", "sgd"] = Field(default="adam", description='adam, or sgd with momentum 0.9')
    lr: PositiveFloat = Field(default=2e-3, description='peak learning rate (warm-up, then cosine decay)')
    weight_decay: Annotated[float, Field(ge=0)] = Field(default=5e-4, description='L2 weight decay')
    label_smoothing: Annotated[float, Field(ge=0, lt=1)] = Field(
        default=0.1, description='of the classification cross-entropy')
    augment: bool = Field(default=True, description='random horizontal flips and small shifts')
    max_steps: PositiveInt | None = Field(
        default=None, description="stop after this many optimiser steps (tiny test runs)"
    )
    seed: int = Field(default=0, description='weights, order and augmentation')
    precision: TrainingPrecision = _precision_field()


class TrainSection(Section):
    old: TrainConfig
    new: TrainConfig


class AlignConfig(Section):
    """One alignment method: which loss terms train the map, and how."""

    l2: bool = Field(default=True, description='the point-to-point term ||phi_new - h(phi_old)||^2')
    disc: bool = Field(
        default=False, description="the point-to-cluster term: the new model's frozen classifier on h(phi_old) (FastFill)")
    uncertainty: bool = Field(
        default=False, description="the uncertainty head psi (log sigma^2 per item): FastFill's loss and sigma order")
    l2_reduction: Literal["sum", "mean"] = Field(
        default="sum", description="sum over dimensions (the paper's) or mean (the reference code's)")
    uncertainty_lambda: PositiveFloat = Field(
        default=1.0, description='lambda of the uncertainty loss (L / sigma^2 + log sigma^2 / lambda)')
    disc_label_smoothing: Annotated[float, Field(ge=0, lt=1)] = Field(
        default=0.1, description="of the disc term's cross-entropy")
    hidden: list[PositiveInt] = Field(default_factory=lambda: [256, 256, 2048, 2048],
                                      description="widths of the mlp map's hidden layers (each Linear + BatchNorm + ReLU)")
    architecture: Literal["mlp", "rbt", "unified", "affine"] = Field(
        default="mlp", description="rbt: the RBT baseline's map; unified: two RBT maps into a shared space; "
        "affine: h(x) = W x + b with the lambda-orthogonality penalty (see orthogonality)")
    rbt_blocks: PositiveInt = Field(default=2, description="RBT blocks of the rbt map, or of each unified map")
    orthogonality: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description="affine only: lambda of the lambda-orthogonality penalty lambda ||W^T W - I||_F^2 "
        "added to the batch loss (Ricci et al., 2025), a soft orthogonality that keeps the old space's geometry; "
        f"null = {ORTHOGONALITY_DEFAULT:g} for an affine map; 0 = a free affine map, larger = closer to a rotation")

    @property
    def orthogonality_weight(self) -> float:
        """The affine map's lambda: ``orthogonality``, or its default; 0 for the other architectures."""
        if self.architecture != "affine":
            return 0.0
        return ORTHOGONALITY_DEFAULT if self.orthogonality is None else self.orthogonality
    uncertainty_weighting: Literal["joint", "normalized", "detached", "separate"] = Field(
        default="joint", description="how psi's weight reaches the map's gradient: joint = the paper's loss "
        "as written (the map's gradient is divided by ~lambda L); normalized = per-sample weights exp(-s) "
        "rescaled to mean 1 and held constant for the map; detached = the map sees the unweighted loss. psi "
        "always learns log sigma^2 from the (detached) loss in normalized, detached and separate, and its gradient "
        "reaches the map through psi's input, except in separate: psi reads the map's outputs detached, so the map "
        "trains on its loss terms alone and psi beside it")
    uncertainty_warmup: Annotated[float, Field(ge=0, lt=1)] = Field(
        default=0.0, description="fraction of the steps during which the map trains on the unweighted loss")
    epochs: PositiveInt = Field(default=14, description='passes over the training pairs (raised to reach min_steps)')
    min_steps: Annotated[int, Field(ge=0)] = Field(
        default=2000, description="at least this many optimiser steps: small data gets more epochs")
    warmup_epochs: Annotated[int, Field(ge=0)] = Field(
        default=4, description='linear learning-rate warm-up, then cosine decay')
    batch_size: PositiveInt = Field(default=256, description='pairs per step')
    lr: PositiveFloat = Field(default=5e-4, description='peak learning rate (Adam)')
    weight_decay: Annotated[float, Field(ge=0)] = Field(default=0.0, description='L2 weight decay')
    validation_fraction: Annotated[float, Field(ge=0, lt=1)] = Field(
        default=0.1, description="feature pairs held out (seeded) for per-epoch validation, the best checkpoint "
        "and the map check; 0 = none (then no check and the last epoch is kept)")
    validation_items: Annotated[int, Field(ge=2)] = Field(
        default=2000, description="at most this many held-out pairs measured per validation")
    check: Literal["fail", "fallback", "warn", "off"] = Field(
        default="fallback", description="when the map retrieves worse on the validation pairs than the l2-only "
        "map trained on the same pairs: fail = stop with both numbers, fallback = use the l2 map and record why, "
        "warn = keep the map and record the warning; off = no check (the comparison's setting: each of its rows "
        "is its method's own map, measured against FCT's on the test split)")
    check_tolerance: Annotated[float, Field(ge=0, le=1)] = Field(
        default=0.0, description="the map may trail the l2-only map by this much (fraction, e.g. 0.005) in "
        "top1_auc and map_auc on the validation curve")
    check_confidence: Annotated[float, Field(ge=0, lt=1)] = Field(
        default=0.9, description="the map is kept only when, in this share of paired bootstrap resamples of the "
        "held-out queries, it is at least as good as the l2-only map (minus the tolerance) in both top1_auc and "
        "map_auc: few held-out pairs are weak evidence, and then the baseline is used")
    divergence_factor: Annotated[float, Field(gt=1)] | None = Field(
        default=10.0, description="training stops when an epoch's loss is not finite, or exceeds the lowest epoch "
        "loss so far by more than this factor times the larger of that loss's and the first epoch's magnitude; the "
        "best weights (by validation, else by loss) are restored and the log says so. null = only a non-finite loss "
        "stops it. A map whose outputs on the held-out pairs are still not finite is never "
        "used: under check fallback or warn the l2-only map replaces it (tag, metric and log line say why), under "
        "fail the run stops with that reason, under off (the comparison) its row is reported as diverged")
    conditioning: Literal["off", "scale"] | None = Field(
        default=None, description="scale = the map trains on features divided by scalars measured on its training "
        "pairs (the RMS norms of the old and of the new features), its output scaled back into the new model's space "
        "(the scales are stored with its weights), with the uncertainty term warmed in over the first warmup_epochs "
        "epochs and the gradient norm bounded: FastFill's loss then behaves the same whatever the two models' feature "
        f"scales; off = the features as they are; null = {UPGRADE_CONDITIONING} for a gallery upgrade's map (and, "
        f"where uncertainty_weighting is joint, the {UPGRADE_WEIGHTING} weighting: joint lets the head explain a "
        "team pair's error away), off for the pipeline's maps")
    patience: PositiveInt | None = Field(
        default=None, description="with held-out pairs: training stops once the held-out score (top-1 and mAP at 0% "
        "backfill) has not improved for this many epochs, measured every epoch, the best epoch kept; the "
        f"learning-rate warm-up is then warmup_epochs real epochs; null = {UPGRADE_PATIENCE} for a gallery "
        "upgrade's map, the whole schedule (epochs, min_steps) for the pipeline's maps")
    seed: int = Field(default=0, description='weights and batches')
    precision: TrainingPrecision = _precision_field()

    def for_upgrade(self) -> AlignConfig:
        """These settings for a gallery upgrade's map: conditioning and patience filled in where
        null; with conditioning null, the joint weighting becomes the separate one (the map trains on
        its terms alone, psi beside it on the map's outputs detached): on team pairs the joint one let
        the head explain the error away (top-1 at 0% 15.2 against the l2-only map's 81.6 on the wide
        pair), and psi's gradient through its input still cost the map top-1 (docs/results.md, "The
        map on a team's features"). Conditioning set: taken as it is."""
        weighting = UPGRADE_WEIGHTING if self.conditioning is None and self.uncertainty_weighting == "joint" \
            else self.uncertainty_weighting
        return self.model_copy(update={
            "conditioning": UPGRADE_CONDITIONING if self.conditioning is None else self.conditioning,
            "patience": UPGRADE_PATIENCE if self.patience is None else self.patience,
            "uncertainty_weighting": weighting})

    @property
    def conditioned(self) -> bool:
        """The map trains on scaled features (conditioning: scale)."""
        return self.conditioning == "scale"

    def stored(self) -> dict[str, Any]:
        """The settings as a stored map records them: conditioning and patience only when set, so a
        map trained without them is stored as before they existed."""
        return self.model_dump(mode="json", exclude={name for name in ("conditioning", "patience")
                                                     if getattr(self, name) is None})

    @model_validator(mode="after")
    def _some_loss(self) -> AlignConfig:
        if not (self.l2 or self.disc):
            raise ValueError("an alignment method needs at least one of l2 or disc set to true")
        if self.architecture == "unified" and (self.uncertainty or self.disc or not self.l2):
            raise ValueError("architecture: unified trains its own fixed loss (similarity + dual classification + "
                             "KL); leave l2: true, disc: false, uncertainty: false")
        if self.orthogonality is not None and self.architecture != "affine":
            raise ValueError(f"orthogonality is the affine map's penalty; architecture {self.architecture!r} has "
                             "no W to keep orthogonal: set architecture: affine, or remove orthogonality")
        if self.warmup_epochs >= self.epochs and self.warmup_epochs > 0:
            raise ValueError(
                f"warmup_epochs ({self.warmup_epochs}) must be smaller than epochs ({self.epochs})"
            )
        return self


# BT^2's options when left null: the authors' CIFAR-100 configuration (docs/methods.md, "BT^2")
BT2_DEFAULTS = {"extra_dims": 32, "match_old": 5.0, "match_new": 1.0}


class CompatibleConfig(Section):
    """A new model trained to be compatible with the old one (BCT, RACT, stationary
    representations, BT^2): train.new's model and schedule plus a compatibility term; it registers
    its own embedder version."""

    loss: Literal["bct", "ract", "stationary", "bt2"] = Field(
        description="bct: BCT's influence loss; ract: RACT's contrastive term; stationary: a fixed d-Simplex "
        "classifier plus the HOC contrastive term (the row trains its own old model, with train.old's settings and "
        "the same fixed classifier); bt2: BT^2, extra dimensions through an orthogonal basis transformation")
    lam: PositiveFloat = Field(
        default=1.0, description="weight of the compatibility term (bt2: of BCT's influence loss on the compatible "
        "part); stationary: the convex weight lambda of the cross-entropy in lambda CE + (1 - lambda) HOC, at most 1")
    tau: PositiveFloat = Field(
        default=0.05, description="RACT: temperature of the contrastive term; stationary: 1 / mu, mu the HOC "
        "term's similarity scale")
    new_to_new: bool = Field(default=True, description="RACT: false = the vanilla compatible loss (ablation)")
    label_smoothing: Annotated[float, Field(ge=0, lt=1)] = Field(
        default=0.0, description="BCT and bt2: label smoothing of the influence loss")
    extra_dims: PositiveInt | None = Field(
        default=None, description=f"bt2: dimensions added to train.new's embedding_dim (the feature's first d_old "
        f"are the compatible part, the rest free); null = {BT2_DEFAULTS['extra_dims']}")
    match_old: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description=f"bt2: weight of 1 - cos(compatible part, phi_old); null = "
        f"{BT2_DEFAULTS['match_old']:g}")
    match_new: Annotated[float, Field(ge=0)] | None = Field(
        default=None, description=f"bt2: weight of 1 - cos(f, phi'_new), f the new representation before the basis "
        f"transformation and phi'_new the independently trained new model (train.new's); null = "
        f"{BT2_DEFAULTS['match_new']:g}")
    distance: Distance | None = Field(
        default=None, description="the distance its rows are searched and measured with, when its loss prescribes "
        "one (stationary's HOC and BT^2's matching are angular: cosine); null = evaluate.distance")

    @property
    def bt2(self) -> dict[str, float]:
        """BT^2's options with their defaults filled in."""
        return {key: default if getattr(self, key) is None else getattr(self, key)
                for key, default in BT2_DEFAULTS.items()}

    @property
    def trains_own_old_model(self) -> bool:
        """Stationary representations need an old model trained with the same fixed classifier."""
        return self.loss == "stationary"

    @model_validator(mode="after")
    def _options_of_loss(self) -> CompatibleConfig:
        if self.loss != "ract" and not self.new_to_new:
            raise ValueError("new_to_new applies to loss: ract only")
        if self.loss != "bt2":
            set_here = [key for key in BT2_DEFAULTS if getattr(self, key) is not None]
            if set_here:
                raise ValueError(f"{', '.join(set_here)} apply to loss: bt2 only")
        if self.loss == "stationary" and self.lam > 1:
            raise ValueError(f"loss stationary: lam is the convex weight of the cross-entropy, at most 1 (0.1 in the "
                             f"authors' configuration); got {self.lam}")
        return self
