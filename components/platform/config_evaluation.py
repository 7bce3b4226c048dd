"""The pipeline's evaluation sections of params.yaml: how the stages measure the methods
(``evaluate``: the distance, the backfill curves and their orders, and the methods that are no map
of their own: query-side adapters, the shadow index's merges, online backfilling, candidate
reranking), the seeds of a multi-seed run (``experiment``) and the comparison of every method
(``compare``), with the names these methods take in metrics.json.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from fastfill.components.platform.config_base import PositiveInt, Section
from fastfill.components.platform.config_pipeline import AlignConfig, CompatibleConfig
from fastfill.components.platform.vocabulary import (
    ADAPTERS,
    MERGES,
    AdapterKind,
    Distance,
    Merge,
    OnlineReverse,
    Order,
    TrainingPrecision,
)


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
