"""The one configuration: params.yaml, validated by one pydantic model.

Every stage reads only its own section (``prepare``, ``train.<role>``, ``align.<method>``,
``evaluate``, ``mlflow``), which is also what dvc.yaml lists as that stage's params, so a change
to one section re-runs only the stages that read it. Unknown keys and bad values are errors that
name the key.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fastfill.components.platform.runtime import CPU_KERNELS, DEFAULT_CPU_KERNELS
from fastfill.components.platform.secrets import redact, take_password
from fastfill.components.platform.vocabulary import (
    ADAPTERS,
    COMPATIBLE_ORDERS,
    MAP_ORDERS,
    MERGES,
    RERANK_DEPTH,
    AdapterKind,
    Distance,
    GalleryOrder,
    Merge,
    OnlineReverse,
    Order,
    Precision,
    TrainingPrecision,
)

DEFAULT_PARAMS = Path("params.yaml")
FASHION_MNIST_DEB = "/usr/share/datasets/fashion-mnist"

PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
# lambda of the affine map's lambda-orthogonality penalty when align.<m>.orthogonality is null
ORTHOGONALITY_DEFAULT = 1.0
# What a gallery upgrade's map uses where align.<m>.conditioning / patience are null (a team's models)
UPGRADE_CONDITIONING = "scale"
UPGRADE_PATIENCE = 10
# the paper's joint weighting collapses on team pairs, and psi's gradient through its input costs the map top-1:
# benchmarks/team_map_conditioning.py
UPGRADE_WEIGHTING = "separate"
PositiveFloat = Annotated[float, Field(gt=0)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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




def adapter_method(kind: str) -> str:
    """The method name of a query-side adapter in metrics.json and the comparison."""
    return f"adapter_{kind}"


def dual_method(merge: str) -> str:
    """The method name of the shadow-index playbook with one merge (dual_rrf, dual_score_minmax...)."""
    return f"dual_{merge}"


def online_method(kind: str) -> str:
    """The method name of online backfilling with a reverse transformation of one adapter kind."""
    return f"online_{kind}"


def rerank_method(depth: int, sync: int = 0) -> str:
    """The method name of candidate reranking at one depth and synchronous budget (rerank_k50,
    rerank_k200_sync4)."""
    return f"rerank_k{depth}" + (f"_sync{sync}" if sync else "")


RerankOrder = Literal["random", "sigma", "query"]


class RerankSpec(Section):
    """Candidate reranking at one depth: the old index's top ``depth`` ranked by the new model."""

    depth: PositiveInt = Field(description="candidates the old index returns per query (EmbedFlow's candidate_depth)")
    sync: Annotated[int, Field(ge=0)] = Field(
        default=0, description="candidates without new features embedded on the query path (max_sync_misses)")

    @property
    def method(self) -> str:
        return rerank_method(self.depth, self.sync)


def _default_rerank_orders() -> list[RerankOrder]:
    return ["random", "sigma", "query"]


def _default_compare_rerank() -> list[RerankSpec]:
    return [RerankSpec(depth=d, sync=s) for d in (50, 200) for s in (0, 4)]


# default factories typed with their fields' Literals (a lambda's list would be a list[str])
def _default_orders() -> dict[str, list[Order]]:
    return {"fct": ["random"], "fastfill": ["random", "sigma", "oracle"]}


def _default_headline_order() -> dict[str, Order]:
    return {"fct": "random", "fastfill": "sigma"}


def _default_dual_orders() -> list[Literal["random", "sigma"]]:
    return ["random", "sigma"]


def _default_online() -> list[OnlineReverse]:
    return ["metric_compatible", "residual_mlp"]


class EvaluateConfig(Section):
    distance: Distance = Field(default="l2", description='l2, or cosine on L2-normalised features')
    curve_points: Annotated[int, Field(ge=0)] = Field(
        default=20, description="B: intermediate points; the curve has B + 2 points"
    )
    orders: dict[str, list[Order]] = Field(
        default_factory=_default_orders,
        description="backfill orders evaluated per method (random, sigma, oracle, distance, entropy, ...)")
    headline_order: dict[str, Order] = Field(
        default_factory=_default_headline_order,
        description="the order whose numbers stand for the method in metrics.json",
    )
    seed: int = Field(default=0, description='of the random orders')
    adapters: list[AdapterKind] = Field(
        default_factory=list, description="query-side adapters evaluated as methods adapter_<kind> (random order): "
        "new queries mapped into the old space, the stored gallery untouched (procrustes, low_rank, residual_mlp; "
        "the comparison sets compare.adapters)")
    adapter_rank: Annotated[int, Field(ge=1)] = Field(
        default=32, description="the rank of the low_rank adapter's linear part (and the residual MLP's start)")
    dual: list[Merge] = Field(
        default_factory=list, description="the shadow-index playbook evaluated as methods dual_<merge>: the old "
        "query searches the items not yet re-embedded, the new query those that are, the two lists merged by "
        "rrf, score_minmax or score_zscore (no map, two query embeddings and two searches per query; the "
        "comparison sets compare.dual). All merges are measured in one pass per order: rrf costs about one "
        "map curve, each score merge about as much again")
    dual_orders: list[Literal["random", "sigma"]] = Field(
        default_factory=_default_dual_orders, description="the backfill orders of every dual_<merge> "
        "method, the first its headline; sigma is the order of dual_sigma_from's map")
    dual_sigma_from: str = Field(default="fastfill", description="the map (under align) whose stored sigma "
                                 "gives the dual methods' sigma order (the map orders the backfill, it serves "
                                 "nothing)")
    online: list[OnlineReverse] = Field(
        default_factory=list, description="online backfilling evaluated as methods online_<kind> (Seo et al., WACV "
        "2025): the new model's query searches the re-embedded items, the same query mapped into the old space by "
        "a reverse transformation (metric_compatible: the paper's, trained with its metric-compatible contrastive "
        "term and the pairs' classes; or a query-side adapter <kind>), fitted on the maps' pairs, the others, and the "
        "two lists are merged by raw distance (one query embedding and two searches per query), in "
        "evaluate.dual_orders; the comparison sets compare.online")
    rerank: list[RerankSpec] = Field(
        default_factory=list, description="candidate reranking evaluated as methods rerank_k<depth>[_sync<sync>] "
        "(docs/methods.md): the old query searches the old gallery for depth candidates, the new query ranks those "
        "with new features (plus up to sync embedded on the query path), the rest keep the old order; in "
        "evaluate.rerank_orders. Two query embeddings and one search per query; the comparison sets compare.rerank")
    rerank_orders: list[RerankOrder] = Field(
        default_factory=_default_rerank_orders, description="the backfill orders of every rerank method, the first "
        "its headline: random, sigma (dual_sigma_from's map), query (a query-driven worker's: the test queries in a "
        "random order queue their candidates)")
    rrf_k: PositiveInt = Field(default=60, description="reciprocal rank fusion: an item's score is the sum over "
                               "the lists of 1 / (rrf_k + its rank); a shadow index's two lists never share an "
                               "item, so the merge interleaves them by rank and rrf_k changes no position")

    @property
    def headlines(self) -> dict[str, str]:
        """headline_order, each adapter's only order (random), each dual and online method's first order."""
        return {**self.headline_order, **{adapter_method(kind): "random" for kind in self.adapters},
                **{dual_method(merge): self.dual_orders[0] for merge in self.dual},
                **{online_method(kind): self.dual_orders[0] for kind in self.online},
                **{spec.method: self.rerank_orders[0] for spec in self.rerank}}

    @model_validator(mode="after")
    def _headline_in_orders(self) -> EvaluateConfig:
        for method, order in self.headline_order.items():
            if order not in self.orders.get(method, []):
                raise ValueError(
                    f"headline_order.{method} = {order!r} is not in orders.{method} "
                    f"({self.orders.get(method, [])}); add it there or pick another"
                )
        return self


class MlflowConfig(Section):
    tracking_uri: str = Field(
        default="sqlite:///mlruns.db", description="overridden by MLFLOW_TRACKING_URI when set"
    )

    @field_validator("tracking_uri", "registry_uri", mode="before")
    @classmethod
    def _password_taken(cls, value: object) -> object:
        return _without_password(value)

    registry_uri: str | None = Field(
        default=None, description="the model registry, where it is not the tracking store; null = the tracking URI. "
        "Overridden by MLFLOW_REGISTRY_URI when set")
    artifact_location: str = Field(
        default="mlartifacts", description="a local store's artifact folder (a tracking server keeps its own)")
    experiment: str = Field(default="fastfill", description='the MLflow experiment of every run')
    registered_model: str = Field(
        default="embedder", description='the registered model of the embedding models (aliases champion, challenger)')
    alignment_model: str = Field(
        default="embedder-alignment", description="the registered model of the alignment maps; by default "
        "<registered_model>-alignment (icon-embedder's maps are icon-embedder-alignment)")
    allow_pickled_models: bool = Field(
        default=False, description="load registry versions stored as pickled modules (an older format): "
        "loading a pickle runs its code, so only for a registry whose writers you trust")

    @model_validator(mode="before")
    @classmethod
    def _alignment_model_follows(cls, data):
        """Without alignment_model, the maps are registered beside the embedder: <name>-alignment."""
        if isinstance(data, dict) and "alignment_model" not in data and data.get("registered_model"):
            data = {**data, "alignment_model": f"{data['registered_model']}-alignment"}
        return data


class UpgradeConfig(Section):
    """`fastfill upgrade`: how a stored gallery is moved to a new model."""

    method: str = Field(default="fastfill", description="the map method that trains a map when the registry has "
                        "none joining the two versions: a key of align, or of compare.align (lambda_orth: the "
                        "affine lambda-orthogonal map, which has no sigma head, so order random or usage)")
    online: bool = Field(
        default=False, description="also fit online backfilling's metric-compatible reverse transformation (new "
        "queries into the old space, distances comparable with the new space's) on the map's pairs while planning, "
        "and keep it in the store: `fastfill search --merge online` then answers with the new model alone, its "
        "query on the re-embedded items and its reverse transform on the rest, merged by distance")
    rerank_depth: PositiveInt = Field(
        default=RERANK_DEPTH, description="candidate reranking's depth K: the old index's candidates per query that the new "
        "model ranks where they are re-embedded; the default of `fastfill search --merge rerank --depth`, and the "
        "depth of the candidate reranking way `upgrade --dry-run --target-top1` compares")
    order: GalleryOrder = Field(
        default="sigma", description="backfill order: sigma = least certain first (FastFill); random; usage = the "
        "items queries hit most first; usage_sigma = usage weight x predicted error (sigma^2) first, the items "
        "never hit after them in sigma order. The usage orders need weights: usage_log, or a weight column")
    chunk_size: PositiveInt = 1000
    max_concurrency: PositiveInt = Field(default=2, description="chunks in flight at once")
    task_runner: Literal["threads", "dask"] = "threads"
    dask_address: str | None = Field(default=None, description="scheduler of an existing Dask cluster, "
                                     "e.g. tcp://10.0.0.5:8786; null with dask = a temporary local cluster")
    budget: Annotated[float, Field(gt=0, le=1)] | Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="stop the backfill after this fraction (0 < f <= 1.0) or count of items")
    eval_queries: Annotated[int, Field(ge=0)] | Literal["all", "auto"] = Field(
        default="auto", description="labeled items measured along the backfill (queries and their gallery): auto = "
        "as many as eval_standard_error needs, whatever the gallery's size (all of them in a smaller gallery); "
        "all; a count; 0 = off")
    eval_standard_error: Annotated[float, Field(gt=0, le=50)] = Field(
        default=1.5, description="with eval_queries auto: the standard error, in top-1 points, of a point of the "
        "measured and predicted curves at worst (a top-1 of 50%): 0.25 * (100 / it)^2 queries (1.5: 1,112; "
        "1.0: 2,500)")
    stop_when_gain_below: PositiveFloat | None = Field(
        default=None, description="stop the backfill at the budget advisor's recommended fraction: where no later "
        "point of the predicted curve gains this many top-1 points per 5% of the gallery (e.g. 0.1); null: go to "
        "100%. Needs the evaluation sample (eval_queries > 0)")
    batch_size: PositiveInt = Field(default=512, description='images embedded per forward pass')
    precision: Precision = Field(
        default="auto", description="embedding on CUDA: auto = bfloat16 autocast (float16 where bfloat16 is not "
        "supported), fp32 = off; the CPU always computes in float32 under auto")
    max_items_per_second: PositiveFloat | None = Field(
        default=None, description="throttle: start chunks no faster than this many items per second (null: no limit)")
    read_workers: PositiveInt = Field(default=16, description="parallel image reads per chunk (adopted galleries)")
    max_failed_images: Annotated[float, Field(ge=0, lt=1)] | Annotated[int, Field(ge=1)] = Field(
        default=0.01, description="images that may fail to read or decode before the upgrade stops: a fraction "
        "of the items (0 <= f < 1) or a count; the failed items keep their transformed features")
    lease_seconds: Annotated[float, Field(ge=3, le=3600)] = Field(
        default=60, description="the upgrade lock is a lease: its holder renews it every third of this; a lock not "
        "renewed for this long (its holder died or lost the store) is taken over by the next upgrade from any host, "
        "and a holder that could not renew it stops before its next write")
    map_pairs: Literal["gallery", "splits"] = Field(
        default="gallery", description="where the pairs that train and check a map come from when the registry's "
        "map for the two versions has not passed its check on that source: gallery = a seeded sample of the "
        "gallery's own items (old features from the store, new ones by embedding their images; they are written "
        "as backfilled, so no embedding is wasted); splits = the pipeline's prepared new-train split on this host")
    map_sample: Annotated[float, Field(gt=0, le=1)] | Annotated[int, Field(ge=2)] = Field(
        default=5000, description="map_pairs gallery: the items sampled, a count (all of a smaller gallery; it does "
        "not grow with the gallery: what the map and its check need, docs/results.md) or a fraction of the gallery "
        "(0 < f <= 1.0, raised to map_sample_min)")
    map_sample_min: Annotated[int, Field(ge=0)] = Field(
        default=5000, description="map_pairs gallery: a fractional map_sample is at least this many items (all "
        "of a smaller gallery)")
    pseudo_classes: Annotated[int, Field(ge=0)] = Field(
        default=50, description="a new model without a classifier: K-means clusters of the map sample's new features "
        "(at most this many, at least 20 items each) with a linear head fitted on them are the classes the check "
        "counts as matches where the gallery has no labels, and, with pseudo_disc, the map's disc term's classes; "
        "0 = none (no disc term for such a model)")
    pseudo_disc: bool = Field(
        default=False, description="the map's disc term on the pseudo-classes (a new model without a classifier): "
        "off by default, since on the team pairs measured it cost the map top-1 at 0% backfill (docs/results.md, "
        "\"The map on a team's features\"); a new model's own classifier always gets the term")
    recheck: bool = Field(
        default=False, description="check the registry's map again on this upgrade's pairs even when it already "
        "passed its check on the same source")
    judgments: str | None = Field(
        default=None, description="judged queries that the promotion gate and the budget advisor take as their "
        "truth before the gallery's labels: a CSV or Parquet file (local path or s3://) with columns `query` "
        "(a gallery id, or an image URI) and `relevant` (a gallery id), one relevant item per row")
    usage_log: str | None = Field(
        default=None, description="query log that gives the usage orders (usage, usage_sigma) their per-item "
        "weights: a CSV or Parquet file (local path or s3://) with columns `query` (a logged query's id) and `hit` "
        "(a gallery id it returned), one row per hit; an item's weight is the number of distinct queries that hit "
        "it. Null: the items table's weight column (set at adopt)")
    seed: int = Field(default=0, description="the random order's, the evaluation sample's and the map sample's")


class IndexConfig(Section):
    """The faiss index of `fastfill search`: exact (flat), or inverted lists for large galleries."""

    kind: Literal["flat", "ivf", "ivfpq"] = Field(
        default="flat", description="flat: exact, N x d floats in memory; ivf: inverted lists (faster, same "
        "memory); ivfpq: inverted lists of product-quantised codes (pq_m bytes per item)")
    nlist: PositiveInt = Field(default=1024, description="inverted lists (ivf, ivfpq); at most items / 39")
    nprobe: PositiveInt = Field(default=16, description="lists searched per query (ivf, ivfpq)")
    pq_m: PositiveInt = Field(default=16, description="sub-quantisers of ivfpq (must divide the dimension)")
    train_size: PositiveInt = Field(default=50000, description="items sampled to train the lists")
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="where searches run: auto = on a CUDA GPU when there is one (faiss's GPU "
        "build from the gpu extra; without it, flat indexes are searched exactly by torch), else the CPU")


class S3Config(Section):
    """How the S3 client of an ``s3://`` gallery meets a busy or failing endpoint: throttling (503
    SlowDown), 5xx errors, dropped connections and slow answers are retried with boto3's
    exponential backoff and jitter; a request failing every attempt stops the command."""

    retry_mode: Literal["standard", "adaptive"] = Field(
        default="standard", description="boto3's retry mode: standard = backoff with jitter; adaptive = that, "
        "plus client-side rate limiting once the endpoint throttles")
    max_attempts: Annotated[int, Field(ge=1, le=50)] = Field(
        default=6, description="attempts per request, the first included (with the standard backoff, 6 attempts "
        "wait about 15 s in all on average, 31 s at most, before the request fails)")
    connect_timeout: PositiveFloat = Field(default=5, description="seconds to open a connection")
    read_timeout: PositiveFloat = Field(
        default=60, description="seconds the endpoint may stay silent during an answer before the attempt fails")


class PgvectorConfig(Section):
    """A gallery served from PostgreSQL with pgvector (gallery.layout pgvector; docs/serving.md):
    the server, the team's table and columns, the view the team's service queries, and the ANN
    index each model's column gets."""

    uri: str = Field(default="", description="postgresql://user@host:port/database (a password is never "
                     "stored: PGPASSWORD or ~/.pgpass); empty = the PG* environment variables; FASTFILL_PG_URI "
                     "replaces it at run time")
    table: str | None = Field(default=None, description="the gallery's table: the team's (`gallery adopt --table` "
                              "sets it); null = a new gallery's own, gallery_<10 hex digits of its store's URI>")
    id_column: str = Field(default="id", description="the table's item id column (integers or text)")
    image_column: str = Field(default="image", description="the column of each item's image URI")
    view: str | None = Field(default=None, description="the view the team's service queries: id, embedding, "
                             "model, source; null = <table>_serving")
    prefix: str | None = Field(default=None, description="the start of the name of every object the product makes "
                               "beside the table (each model's vectors table <prefix>_emb_<model>_v<version>, the "
                               "bookkeeping tables <prefix>_fastfill_serving and _chunks); null = the table's name. "
                               "Another name when one of those is taken by an object that is not this gallery's")
    ann: Literal["hnsw", "ivfflat", "none"] = Field(
        default="ivfflat", description="the ANN index built on each model's vectors before readers move to them: "
        "ivfflat (each chunk's rows enter it cheaply: 1.0 s per 10,000 rows against HNSW's 41 s, "
        "docs/serving.md) or hnsw")
    hnsw_m: PositiveInt = Field(default=16, description="HNSW: links per node")
    hnsw_ef_construction: PositiveInt = Field(default=64, description="HNSW: candidate list while building")
    ef_search: PositiveInt = Field(default=100, description="HNSW: candidate list per search (`fastfill search`; "
                                   "a team's service sets hnsw.ef_search itself)")
    ivfflat_lists: PositiveInt | None = Field(default=None, description="IVFFlat: lists; null = sqrt(rows)")
    ivfflat_probes: PositiveInt = Field(default=10, description="IVFFlat: lists searched per query")
    index_memory: Annotated[str, Field(pattern=r"^[1-9][0-9]*\s*(kB|MB|GB)$")] = Field(
        default="1GB", description="maintenance_work_mem while an ANN index is built (IVFFlat on 1,000,000 "
        "256-d rows needs 221 MB, more than PostgreSQL's 64 MB default)")

    @field_validator("uri", mode="before")
    @classmethod
    def _password_taken(cls, value: object) -> object:
        return _without_password(value)


def _without_password(value: object) -> object:
    """A server URI's password taken out (``secrets.take_password``: the connection gets it from
    this process's memory), so the configuration, and every record made of it (Prefect's flow
    parameters, MLflow's params, the gallery's manifest), never holds one. Never fails: what is
    not text is left to the field's own check, which then shows no URI."""
    if isinstance(value, bytes | bytearray):
        try:
            value = bytes(value).decode()
        except UnicodeDecodeError:
            return value
    return take_password(value) if isinstance(value, str) else value


class MilvusConfig(Section):
    """A gallery served from Milvus (gallery.layout milvus; docs/serving.md): the server, and the
    alias the team's service searches (one collection per model version behind it)."""

    uri: str = Field(default="milvus.db", description="http://host:19530 (a token in MILVUS_TOKEN), or a local "
                     "Milvus Lite file (.db; one process at a time may open it)")
    alias: str | None = Field(default=None, description="the alias the team's service searches; null = a new "
                              "gallery's own, gallery_<10 hex digits of its store's URI>")
    ann: Literal["hnsw", "flat"] = Field(default="hnsw", description="each collection's index")
    hnsw_m: PositiveInt = Field(default=16, description="HNSW: links per node")
    hnsw_ef_construction: PositiveInt = Field(default=64, description="HNSW: candidate list while building")
    ef_search: PositiveInt = Field(default=100, description="HNSW: candidate list per search (`fastfill search`)")

    @field_validator("uri", mode="before")
    @classmethod
    def _password_taken(cls, value: object) -> object:
        return _without_password(value)


class QdrantConfig(Section):
    """A gallery served from Qdrant (gallery.layout qdrant; docs/serving.md): the server, and the
    alias the team's service searches (one collection per model version behind it)."""

    url: str = Field(default="qdrant", description="http(s)://host:6333 (an API key in QDRANT_API_KEY), or a local "
                     "folder for Qdrant's local mode (one process at a time may open it)")
    alias: str | None = Field(default=None, description="the alias the team's service searches; null = a new "
                              "gallery's own, gallery_<10 hex digits of its store's URI>")
    ann: Literal["hnsw", "flat"] = Field(default="hnsw", description="each collection's index (flat: exact search)")
    hnsw_m: PositiveInt = Field(default=16, description="HNSW: links per node")
    hnsw_ef_construction: PositiveInt = Field(default=64, description="HNSW: candidate list while building")
    ef_search: PositiveInt = Field(default=100, description="HNSW: candidate list per search (`fastfill search`)")

    @field_validator("url", mode="before")
    @classmethod
    def _password_taken(cls, value: object) -> object:
        return _without_password(value)


class LanceConfig(Section):
    """A Lance gallery's serving table (gallery.layout lance; docs/serving.md): <store>/serving.lance,
    the table LanceDB readers search, and its ANN index."""

    ann: Literal["ivf_flat", "ivf_hnsw_sq", "none"] = Field(
        default="ivf_flat", description="the serving table's ANN index (none: every search scans)")
    ann_min_rows: NonNegativeInt = Field(default=10000, description="no ANN index under this many rows: a scan "
                                         "is as fast")
    partitions: PositiveInt | None = Field(default=None, description="IVF partitions; null = about the square "
                                           "root of the rows")
    nprobes: PositiveInt = Field(default=20, description="IVF partitions searched per query (`fastfill search`)")


class GalleryConfig(Section):
    """The stored gallery: `fastfill gallery ...`, `fastfill upgrade`, `fastfill search`."""

    store: str = Field(default="gallery", description="a local folder, or s3://bucket/prefix")
    part_size: PositiveInt = 1000
    distance: Distance = "l2"
    layout: Literal["parts", "lance", "pgvector", "milvus", "qdrant"] = Field(
        default="parts", description="the layout of a gallery that ingest or adopt makes: parts (.npy and "
        "Parquet parts with a manifest), lance (the Lance table <store>/gallery.lance that other tools read; "
        "docs/lance.md), pgvector (a PostgreSQL table the team's service queries, gallery.pgvector), milvus "
        "(collections behind an alias, gallery.milvus) or qdrant (collections behind an alias, gallery.qdrant; all "
        "three docs/serving.md); an existing gallery is read in the "
        "layout its manifest names (`fastfill gallery convert` moves it)")
    lance: LanceConfig = LanceConfig()
    pgvector: PgvectorConfig = PgvectorConfig()
    milvus: MilvusConfig = MilvusConfig()
    qdrant: QdrantConfig = QdrantConfig()
    index: IndexConfig = IndexConfig()
    upgrade: UpgradeConfig = UpgradeConfig()
    s3: S3Config = S3Config()


class PromotionConfig(Section):
    """The gate between a finished backfill and moving `champion`: measured on the upgrade's
    evaluation sample, the challenger (new queries, the gallery along its backfill) against the
    champion (the gallery's model on its own features)."""

    gate: bool = Field(default=True, description="false: a complete upgrade switches the gallery and moves "
                       "champion without checking")
    min_top1_auc_gain: Annotated[float, Field(ge=-1, le=1)] = Field(
        default=0.0, description="challenger's mean top-1 along its backfill minus the champion's top-1, at least")
    max_nfr1: Annotated[float, Field(ge=0, le=1)] = Field(
        default=1.0, description="negative flips at top-1 against the champion, mean along the backfill, at most "
        "(1.0: no absolute bound; a weaker champion's right answers flip more under any better model, "
        "docs/upgrade.md)")
    max_relative_nfr1: Annotated[float, Field(ge=0)] = Field(
        default=0.8, description="negative flips at top-1 (mean along the backfill) as a share of those a challenger "
        "of its mean top-1 would make if its errors ignored the champion's right answers, at most: nfr1_mean / "
        "(1 - top1_auc); about 1 for independent errors, 0.47-0.60 measured on real upgrades (docs/upgrade.md)")
    max_fraction_to_gain: Annotated[float, Field(ge=0, le=1)] = Field(
        default=1.0, description="the challenger's top-1 must exceed the champion's by this backfilled fraction")
    curve_points: Annotated[int, Field(ge=0)] = Field(default=20, description="B: the gate's curve has B + 2 points")


class TriggerConfig(Section):
    """What starts upgrades by itself (`fastfill serve`, `fastfill webhook`): a registry watcher
    polling for a new challenger, MLflow registry webhooks, and schedules."""

    poll_seconds: PositiveInt = Field(default=60, description="the registry watcher's interval")
    webhook_host: str = Field(default="127.0.0.1", description="the webhook receiver listens here only")
    webhook_port: Annotated[int, Field(ge=0, le=65535)] = Field(
        default=8787, description="the webhook receiver's port")
    webhook_secret_env: str = Field(default="FASTFILL_WEBHOOK_SECRET",
                                    description="environment variable holding the webhook's HMAC secret")
    max_clock_skew_seconds: PositiveInt = Field(default=300, description="older signed deliveries are refused")
    webhook_max_body_bytes: PositiveInt = Field(
        default=1 << 20, description="a larger declared body is refused with 413 before any of it is read")
    webhook_rate_per_minute: PositiveFloat = Field(
        default=60, description="POSTs per minute per client address after the burst; more get 429 + Retry-After")
    webhook_burst: PositiveInt = Field(default=10, description="POSTs a client address may send at once")
    webhook_read_timeout_seconds: PositiveFloat = Field(
        default=10, description="a request whose next bytes take longer is dropped (408 while reading the body)")
    nightly_cron: str | None = Field(default="0 2 * * *", description="check-and-upgrade; null = none")
    comparison_cron: str | None = Field(default=None, description="re-run the comparison of every method (hours of "
                                       "training on the gallery's host), e.g. '0 3 * * 0'; null (default): none")
    timezone: str = Field(default="UTC", description="of the cron schedules: an IANA name such as Europe/Paris "
                          "(daylight saving followed)")

    @model_validator(mode="after")
    def _known_timezone(self) -> TriggerConfig:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"timezone: {self.timezone!r} is not an IANA time zone; use a name such as UTC, "
                             "Europe/Paris or America/New_York") from None
        return self


class ExperimentConfig(Section):
    """Used only by `fastfill seeds`: the seeds a multi-seed run covers."""

    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2])


class CompareConfig(Section):
    """`fastfill compare` and the compare stages: every method over several seeds. The rows are
    the maps under align plus compare.align, and the compatible new models of compare.compatible;
    compare.orders lists each one's backfill orders, the first being its headline."""

    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1,
                             description="each method is trained and evaluated once per seed")
    out: Path = Field(default=Path("runs/compare"), description="per-seed outputs go to <out>/seed-<s>/")
    registered_model: str = Field(
        default="embedder-comparison", description="the registered model of the comparison's embedding models "
        "(never mlflow.registered_model: the comparison's models are not candidates for production)")
    alignment_model: str = Field(
        default="embedder-comparison-alignment", description="the registered model of the comparison's maps")
    align: dict[str, AlignConfig] = Field(default_factory=dict)
    compatible: dict[str, CompatibleConfig] = Field(default_factory=dict)
    orders: dict[str, list[Order]] = Field(default_factory=dict)
    adapters: list[AdapterKind] = Field(
        default_factory=lambda: list(ADAPTERS),
        description="the query-side adapters among the rows (evaluate.adapters of each seed): the zero-write "
        "alternative, fitted on the maps' pairs")
    dual: list[Merge] = Field(
        default_factory=lambda: list(MERGES),
        description="the shadow-index playbook's merges among the rows (evaluate.dual of each seed), each in "
        "evaluate.dual_orders")
    online: list[OnlineReverse] = Field(
        default_factory=_default_online,
        description="online backfilling's reverse transformations among the rows (evaluate.online of each seed), "
        "each in evaluate.dual_orders; its metrics say whether the curve is monotone")
    rerank: list[RerankSpec] = Field(
        default_factory=_default_compare_rerank,
        description="candidate reranking's depths and synchronous budgets among the rows (evaluate.rerank of each "
        "seed), each in evaluate.rerank_orders")
    precision: TrainingPrecision | None = Field(
        default="auto", description="the precision of every training of the comparison (the models, the maps, "
        "the compatible models), the same for every method; null = each configuration's own")
    jobs: PositiveInt = Field(
        default=1, description="seeds trained at once, each in its own process with cores/jobs threads: on a "
        "CPU, two or three small trainings side by side use the cores better than one (`fastfill compare --jobs`)")


def _check_orders(where: str, orders: Mapping[str, Sequence[str]], align: dict[str, AlignConfig],
                  compatible: dict[str, CompatibleConfig]) -> None:
    """Each method named exists, and each of its orders can be computed for it."""
    for method, names in orders.items():
        if not names:
            raise ValueError(f"{where}.{method} lists no order; give at least one (e.g. [random])")
        if method in align:
            config, allowed = align[method], MAP_ORDERS
            kind = "an alignment map"
        elif method in compatible:
            config, allowed = None, COMPATIBLE_ORDERS
            kind = "a compatible new model"
        else:
            raise ValueError(f"{where} names method {method!r}, which is not defined "
                             f"(known: {sorted([*align, *compatible])})")
        for name in names:
            if name not in allowed:
                raise ValueError(f"{where}.{method}: order {name!r} does not apply to {kind}; "
                                 f"use one of {list(allowed)}")
            if config is None:  # a compatible model's orders: none of the map's below
                continue
            if name == "sigma" and not config.uncertainty:
                raise ValueError(f"{where}.{method} asks for the sigma order, but that map is trained with "
                                 "uncertainty: false, so it has no uncertainty head")
            if name in ("oracle", "distance") and config.architecture == "unified":
                raise ValueError(f"{where}.{method}: the {name} order needs a map into the new model's space; "
                                 "a unified map has random only")


# The align section of a configuration that has none (a host that only upgrades a gallery): the
# pipeline's two maps of params.yaml, FCT and FastFill (the upgrade trains fastfill where the
# registry has no map; evaluate's default orders name both).
HOST_MAPS: dict[str, dict[str, Any]] = {"fct": {"hidden": [256, 256, 1024, 1024]},
             "fastfill": {"disc": True, "uncertainty": True, "l2_reduction": "sum", "uncertainty_weighting": "joint",
                          "hidden": [256, 256, 1024, 1024], "check": "fallback"}}


class Params(Section):
    paths: PathsConfig = PathsConfig()
    compute: ComputeConfig = ComputeConfig()
    prepare: PrepareConfig = PrepareConfig()
    train: TrainSection | None = Field(
        default=None, description="the pipeline's two models (train.old, train.new); a host that only upgrades a "
        "gallery with registered models leaves it out")
    align: dict[str, AlignConfig] = Field(
        default_factory=lambda: {name: AlignConfig(**fields) for name, fields in HOST_MAPS.items()},
        description="the alignment methods; left out, params.yaml's fct and fastfill (the map the upgrade trains)")
    compatible: dict[str, CompatibleConfig] = Field(
        default_factory=dict, description="compatible new models the pipeline trains (the comparison adds its own)")
    evaluate: EvaluateConfig = EvaluateConfig()
    mlflow: MlflowConfig = MlflowConfig()
    experiment: ExperimentConfig = ExperimentConfig()
    gallery: GalleryConfig = GalleryConfig()
    compare: CompareConfig = CompareConfig()
    promotion: PromotionConfig = PromotionConfig()
    triggers: TriggerConfig = TriggerConfig()

    @model_validator(mode="after")
    def _methods_known(self) -> Params:
        clash = set(self.align) & set(self.compatible)
        if clash:
            raise ValueError(f"{sorted(clash)} is both under align and under compatible; rename one")
        _check_orders("evaluate.orders", self.evaluate.orders, self.align, self.compatible)
        sigma_from = self.evaluate.dual_sigma_from
        wants_sigma = ((self.evaluate.dual or self.evaluate.online) and "sigma" in self.evaluate.dual_orders) or (
            self.evaluate.rerank and "sigma" in self.evaluate.rerank_orders)
        if wants_sigma and (sigma_from not in self.align or not self.align[sigma_from].uncertainty):
            raise ValueError(f"evaluate.dual_sigma_from: {sigma_from!r} is not a map under align with "
                             "uncertainty: true, so the dual and rerank methods have no sigma order; name one, or "
                             "drop sigma from evaluate.dual_orders and evaluate.rerank_orders")
        upgrade = self.gallery.upgrade.method
        maps = self.map_methods
        if upgrade not in maps:
            raise ValueError(
                f"gallery.upgrade.method names {upgrade!r}, which is not under align or compare.align "
                f"(known: {sorted(maps)})"
            )
        if maps[upgrade].architecture == "unified":
            raise ValueError(f"gallery.upgrade.method: {upgrade!r} is a unified map, whose queries live in a "
                             "shared space; a stored gallery upgrade needs a map into the new model's space")
        align = {**self.align, **self.compare.align}
        compatible = {**self.compatible, **self.compare.compatible}
        for section, extra in (("compare.align", self.compare.align), ("compare.compatible", self.compare.compatible)):
            for name in extra:
                if name in self.align or name in self.compatible or (
                        section == "compare.align" and name in self.compare.compatible):
                    raise ValueError(f"{section}.{name} is defined twice; every method needs its own name")
        _check_orders("compare.orders", self.compare.orders, align, compatible)
        missing = sorted((set(align) | set(compatible)) - set(self.compare.orders))
        if self.compare.orders and missing:
            raise ValueError(f"compare.orders has no entry for {missing}; list at least [random] for each method")
        return self

    def registry_name_problems(self) -> list[str]:
        """A loaded configuration's comparison names against production's (checked by
        parse_params, not by the model: a comparison seed's own copy registers under them)."""
        problems = []
        production = {self.mlflow.registered_model, self.mlflow.alignment_model}
        for key in ("registered_model", "alignment_model"):
            name = getattr(self.compare, key)
            if name in production:
                problems.append(f"compare.{key}: {name!r} is a registered model of production (mlflow.*); "
                                "the comparison's models need names of their own")
        if self.compare.registered_model == self.compare.alignment_model:
            problems.append("compare.alignment_model: the same name as compare.registered_model; give each its own")
        return problems

    @property
    def map_methods(self) -> dict[str, AlignConfig]:
        """Every map an upgrade may train, by name: align's entries, and compare.align's (the
        comparison's maps, lambda_orth among them) where align has none of that name."""
        return {**self.compare.align, **self.align}

    @property
    def upgrade_map(self) -> AlignConfig:
        """The settings of the map an upgrade trains (gallery.upgrade.method), from map_methods."""
        return self.map_methods[self.gallery.upgrade.method]

    def for_comparison(self, seed: int) -> Params:
        """The configuration of one seed of the comparison: every method (align + compare.align,
        compatible + compare.compatible), evaluated with compare.orders (the first order of each
        is its headline), reseeded, with outputs under compare.out/seed-<seed>/, registering its
        models and maps as compare.registered_model / compare.alignment_model."""
        data = self.model_dump(mode="json")
        compare = data["compare"]
        data["align"] = {**data["align"], **compare["align"]}
        data["compatible"] = {**data["compatible"], **compare["compatible"]}
        compare["align"], compare["compatible"] = {}, {}  # now part of the seed's own methods
        orders = compare["orders"] or {m: ["random"] for m in [*data["align"], *data["compatible"]]}
        data["evaluate"]["orders"] = orders
        data["evaluate"]["headline_order"] = {m: names[0] for m, names in orders.items()}
        data["evaluate"]["adapters"] = compare["adapters"]
        data["evaluate"]["dual"] = compare["dual"]
        data["evaluate"]["online"] = compare["online"]
        data["evaluate"]["rerank"] = compare["rerank"]
        # each row is its method's own map: the map check's fallback would put FCT's map in its place
        for method in data["align"].values():
            method["check"] = "off"
        if compare["precision"] is not None:
            trained = (data["train"]["old"], data["train"]["new"]) if data["train"] is not None else ()
            for section in (*trained, *data["align"].values()):
                section["precision"] = compare["precision"]
        root = Path(compare["out"]) / f"seed-{seed}"
        seeded = Params.model_validate(data).with_seed(seed).with_outputs_under(root)
        # its models and maps are registered under compare's names, never as production versions
        names = {"registered_model": self.compare.registered_model, "alignment_model": self.compare.alignment_model}
        return seeded.model_copy(update={"mlflow": seeded.mlflow.model_copy(update=names)})

    def with_seed(self, seed: int) -> Params:
        """A copy where every stage's seed is ``seed`` (the data split keeps its own)."""
        data = self.model_dump()
        for role in ("old", "new") if data["train"] is not None else ():
            data["train"][role]["seed"] = seed
        for method in data["align"]:
            data["align"][method]["seed"] = seed
        data["evaluate"]["seed"] = seed
        return Params.model_validate(data)

    def comparison_at_size(self, size: int) -> Params:
        """The comparison at ``size`` training images per class (prepare.train_per_class): its data
        splits and seeds under compare.out/n-<size>/, its report reports/comparison-<size>.*."""
        data = self.model_dump(mode="json")
        root = Path(data["compare"]["out"]) / f"n-{size}"
        data["prepare"]["train_per_class"] = size
        data["paths"]["data"] = str(root / "data")
        data["compare"]["out"] = str(root)
        return Params.model_validate(data)

    def with_outputs_under(self, root: Path) -> Params:
        """A copy whose artifacts and reports live under ``root`` (the data splits are shared)."""
        paths = self.paths.model_copy(update={"artifacts": root / "artifacts", "reports": root / "reports"})
        return self.model_copy(update={"paths": paths})


def needs_train(params: Params, what: str) -> TrainSection:
    """params.train, or a ConfigError saying that ``what`` needs it."""
    if params.train is None:
        raise ConfigError(f"{what} needs the train section (train.old and train.new), which this configuration "
                          "leaves out; add it (params.yaml in the repository has the pipeline's)")
    return params.train


class ConfigError(ValueError):
    """params.yaml is missing, unreadable or invalid; the message names the key."""


def _format_errors(error: ValidationError, source: Path) -> str:
    """One line per problem. A problem of a whole section has the section as its input, URIs
    included: every line goes through ``redact``."""
    lines = [f"{source}: invalid configuration"]
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"]) or "(top level)"
        if item["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key; remove it or check its spelling")
        else:
            lines.append(f"  {key}: {item['msg']} (got {item.get('input')!r})")
    return redact("\n".join(lines))


def parse_params(data: object, source: Path = DEFAULT_PARAMS) -> Params:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of sections at the top level")
    try:
        params = Params.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_format_errors(error, source)) from None
    problems = params.registry_name_problems()
    if problems:
        raise ConfigError("\n".join([f"{source}: invalid configuration", *(f"  {p}" for p in problems)]))
    return params


def load_params(path: Path | str = DEFAULT_PARAMS) -> Params:
    """The configuration in ``path``, validated. Without a file at the default path (a team's
    upgrade host holds none of the pipeline's files) every setting takes its default; an empty
    file is the defaults too. A file named explicitly must exist."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path}: is a folder, not a params file; pass the file in it "
                          f"(--params {path / DEFAULT_PARAMS.name})")
    if not path.is_file():
        # the default file of this folder (a command hands its flows the resolved path)
        if path == DEFAULT_PARAMS or path == DEFAULT_PARAMS.resolve():
            return parse_params({}, path)
        raise ConfigError(f"{path}: no such file; pass an existing params file with --params, or leave "
                          f"--params out to use the defaults")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not UTF-8 text (byte {error.object[error.start]:#04x} at offset {error.start}); "
                          "save it as UTF-8") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    return parse_params({} if data is None else data, path)
