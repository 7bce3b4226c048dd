"""The one configuration: params.yaml, validated by one pydantic model.

Every stage reads only its own section (``prepare``, ``train.<role>``, ``align.<method>``,
``evaluate``, ``mlflow``), which is also what dvc.yaml lists as that stage's params, so a change
to one section re-runs only the stages that read it. Unknown keys and bad values are errors that
name the key.

This module holds the whole (``Params``, the checks that span its sections, reading params.yaml);
the sections are defined by part, each importing only ``config_base``'s ``Section`` and helpers:
the pipeline's in ``config_pipeline`` (data, training, methods) and ``config_evaluation`` (the
evaluation, the comparison), the gallery's and the upgrade's in ``config_gallery``, the services'
in ``config_services``. Every section is importable from here as well.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from fastfill.components.platform.config_base import NonNegativeInt, PositiveFloat, PositiveInt, Section
from fastfill.components.platform.config_evaluation import (
    CompareConfig,
    EvaluateConfig,
    ExperimentConfig,
    RerankOrder,
    RerankSpec,
    adapter_method,
    dual_method,
    online_method,
    rerank_method,
)
from fastfill.components.platform.config_gallery import (
    GalleryConfig,
    IndexConfig,
    LanceConfig,
    MilvusConfig,
    PgvectorConfig,
    PromotionConfig,
    QdrantConfig,
    S3Config,
    UpgradeConfig,
)
from fastfill.components.platform.config_pipeline import (
    BT2_DEFAULTS,
    FASHION_MNIST_DEB,
    ORTHOGONALITY_DEFAULT,
    UPGRADE_CONDITIONING,
    UPGRADE_PATIENCE,
    UPGRADE_WEIGHTING,
    AlignConfig,
    CompatibleConfig,
    ComputeConfig,
    PathsConfig,
    PrepareConfig,
    TrainConfig,
    TrainSection,
)
from fastfill.components.platform.config_services import MlflowConfig, TriggerConfig
from fastfill.components.platform.secrets import redact
from fastfill.components.platform.vocabulary import COMPATIBLE_ORDERS, MAP_ORDERS

__all__ = [
    # the whole, and reading it
    "DEFAULT_PARAMS", "HOST_MAPS", "ConfigError", "Params", "load_params", "needs_train", "parse_params",
    # config_base
    "NonNegativeInt", "PositiveFloat", "PositiveInt", "Section",
    # config_pipeline
    "BT2_DEFAULTS", "FASHION_MNIST_DEB", "ORTHOGONALITY_DEFAULT", "UPGRADE_CONDITIONING", "UPGRADE_PATIENCE",
    "UPGRADE_WEIGHTING", "AlignConfig", "CompatibleConfig", "ComputeConfig", "PathsConfig", "PrepareConfig",
    "TrainConfig", "TrainSection",
    # config_evaluation
    "CompareConfig", "EvaluateConfig", "ExperimentConfig", "RerankOrder", "RerankSpec", "adapter_method",
    "dual_method", "online_method", "rerank_method",
    # config_gallery
    "GalleryConfig", "IndexConfig", "LanceConfig", "MilvusConfig", "PgvectorConfig", "PromotionConfig",
    "QdrantConfig", "S3Config", "UpgradeConfig",
    # config_services
    "MlflowConfig", "TriggerConfig",
]

DEFAULT_PARAMS = Path("params.yaml")


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
