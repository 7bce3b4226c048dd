"""What an upgrade would do, before it does it (``fastfill upgrade --dry-run``): items, chunks,
bytes to read, object-store requests, and a duration estimated from reading and embedding a
small random sample of the gallery's own images. Nothing is written.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from typing import NamedTuple

import numpy as np

from fastfill.components.experiment.inference import apply_alignment, embed, pick_device
from fastfill.components.experiment.map_training import train_alignment
from fastfill.components.gallery.advice import advisor
from fastfill.components.gallery.advice.planning_cost import PlanningEstimate, planning_cost
from fastfill.components.gallery.advice.target_advice import ways_to_target
from fastfill.components.gallery.gate.promotion import decide, measure_gate, relative_nfr
from fastfill.components.gallery.inputs.images import ITEM_S3_CODES, read_bytes, readable, resolve
from fastfill.components.gallery.inputs.judgments import load_judgments
from fastfill.components.gallery.layouts.catalog import Gallery, GalleryError, fetch_images, item_column
from fastfill.components.gallery.upgrade import samples
from fastfill.components.gallery.upgrade.decider import UpgradeDecider
from fastfill.components.gallery.upgrade.gallery_view import GalleryView
from fastfill.components.gallery.upgrade.lifecycle import (
    TRUTH_JUDGMENTS,
    TRUTH_NONE,
    needs_check,
    no_truth_refusal,
    registered_map_order,
    truth_of,
)
from fastfill.components.gallery.upgrade.outcome import UpgradeResult
from fastfill.components.gallery.upgrade.pairs import fit_reverse, from_gallery
from fastfill.components.gallery.upgrade.planning import stand_in_ranks, upgrade_id
from fastfill.components.gallery.upgrade.samples import (
    evaluation_positions,
    judged_queries,
    pairs_description,
    pairs_source,
    readable_images,
    registry_map,
)
from fastfill.components.gallery.upgrade.usage import (
    USAGE_ORDERS,
    backfill_order,
    map_order,
    order_after_map,
    usage_weights,
)
from fastfill.components.model_store.registered import load_model
from fastfill.components.platform.registry import CHAMPION, ModelRef, alias_version, asked_version

# The dry run's prediction reads every part through the map up to three times (its order, its
# anchor, the target's); the parts are kept in memory while they fit in this many bytes.
KEEP_TRANSFORMED = 1 << 30


def _mean_encoded_size(gallery: Gallery, positions: np.ndarray) -> float:
    """Mean bytes of an adopted gallery's encoded images (the sample's, read once more)."""

    sizes = []
    for uri in item_column(gallery, positions, "image"):
        try:
            sizes.append(len(read_bytes(resolve(str(uri), gallery.image_root))))
        except OSError:  # a missing or unreadable file is counted by the sample's failures
            continue
        except Exception as error:  # noqa: BLE001 - S3: only an object's own problem is skipped
            response = getattr(error, "response", None)
            if not (isinstance(response, dict) and response.get("Error", {}).get("Code") in ITEM_S3_CODES):
                raise
            continue
    return float(np.mean(sizes)) if sizes else 0.0


@dataclass(frozen=True)
class BytesToRead:
    features: int
    images: int
    finish: int
    total: int


@dataclass(frozen=True)
class BytesToWrite:
    plan: int
    backfill: int
    finish: int


@dataclass(frozen=True)
class Requests:
    """Object-store requests of each step."""

    plan: int
    backfill: int
    finish: int
    total: int


@dataclass(frozen=True)
class SampleTimes:
    """The sample the dry run read and embedded: its size, the items it could not read, the
    seconds per item of each."""

    items: int
    failed: int
    read_seconds_per_item: float
    embed_seconds_per_item: float


@dataclass(frozen=True)
class UpgradeCost:
    """What an upgrade of a gallery would cost (``dry_run``): its size, the bytes and requests of
    each step, the per-item times measured on a sample, and the backfill's estimated duration
    (``asdict``: the dry run's document, each part an object of its fields in this order)."""

    store: str
    items: int
    parts: int
    chunks: int
    chunk_size: int
    images: str  # where the backfill reads images from
    bytes_to_read: BytesToRead
    bytes_to_write: BytesToWrite
    requests: Requests
    sample: SampleTimes
    estimated_backfill_seconds: float
    note: str


@dataclass(frozen=True)
class PredictedGate:
    """The promotion gate's decision as the dry run predicts it on the evaluation sample: passed or
    not, why, and its numbers (``components.gallery.gate.promotion``)."""

    passed: bool
    reasons: list[str]
    queries: int
    champion_top1: float
    top1_auc: float
    top1_auc_gain: float
    nfr1_mean: float
    nfr1_end: float
    fraction_to_gain: float | None  # None: the gain is never reached
    nfr1_relative: float  # NFR@1 against independent errors' flips

    def to_dict(self) -> dict:
        return {"passed": self.passed, "reasons": list(self.reasons), "queries": self.queries,
                "champion_top1": self.champion_top1, "top1_auc": self.top1_auc, "top1_auc_gain": self.top1_auc_gain,
                "nfr1_mean": self.nfr1_mean, "nfr1_end": self.nfr1_end, "fraction_to_gain": self.fraction_to_gain,
                "nfr1_relative": self.nfr1_relative}


@dataclass(frozen=True)
class GatePrediction:
    """The dry run's ``gate``: the decision predicted (``decided``), or a ``note`` saying why it
    is not (ungated, or a judged gate)."""

    decided: PredictedGate | None = None
    note: str | None = None

    def to_dict(self) -> dict:
        return self.decided.to_dict() if self.decided is not None else {"note": self.note}


@dataclass(frozen=True)
class TargetAdvice:
    """Which way reaches a target top-1 with the least backfill (``target_advice.ways_to_target``):
    each way's first fraction reaching it, the best way and a ``line`` saying so, on which truth;
    or a ``note`` saying why the ways are not compared."""

    target_top1: float
    note: str | None = None
    ways: list[dict] | None = None
    best: str | None = None
    line: str | None = None
    truth: str | None = None

    @classmethod
    def from_dict(cls, record: dict) -> TargetAdvice:
        return cls(target_top1=record["target_top1"], note=record.get("note"), ways=record.get("ways"),
                   best=record.get("best"), line=record.get("line"), truth=record.get("truth"))

    def to_dict(self) -> dict:
        if self.line is None:
            return {"target_top1": self.target_top1, "note": self.note}
        return {"target_top1": self.target_top1, "ways": self.ways, "best": self.best, "line": self.line,
                "truth": self.truth}


@dataclass(frozen=True)
class DryRunAdvice:
    """The budget advisor's part of the dry run: the predicted curve with its recommended stop
    (``prediction``, as the advisor makes and advice.json stores it: ``advisor.describe`` reads
    it), or a ``note`` saying when it appears; the gate's decision predicted on the evaluation
    sample; the ways to a target top-1 when asked; the registry's map and the order it predicted
    with. ``resumed``: the stored prediction of the upgrade the dry run would resume (its
    document always has ``target``, and no gate). ``to_dict``: the document's ``advice``."""

    note: str | None = None
    prediction: dict | None = None
    gate: GatePrediction | None = None
    target: TargetAdvice | None = None
    map_version: str | None = None
    order: str | None = None
    resumed: bool = False

    @property
    def top1_curve(self) -> bool:
        """The prediction is a top-1 curve (labels or judged queries; not the label-free agreement)."""
        return self.prediction is not None and "top1" in self.prediction

    def to_dict(self) -> dict:
        if self.prediction is None:
            return {"note": self.note}
        advice = dict(self.prediction)
        if self.resumed or self.target is not None:
            advice["target"] = self.target.to_dict() if self.target is not None else None
        if self.gate is not None:
            advice["gate"] = self.gate.to_dict()
        if self.map_version is not None:
            advice.update(map_version=self.map_version, order=self.order)
        return advice


@dataclass(frozen=True)
class DryRun:
    """What `fastfill upgrade --dry-run` answers: the version the upgrade would go to (``to`` None
    when there is none: ``nothing`` says why), whether it resumes or starts a sequential upgrade,
    its cost, what the gate would measure against, where the map's pairs come from, and the
    budget advisor's prediction (``advice``, with ``note`` when none can be made yet)."""

    source: str  # the gallery's model ("from" in the JSON)
    to: str | None
    in_progress: str | None = None
    resumes: bool = False
    cost: UpgradeCost | None = None
    truth: str | None = None
    map_pairs: str | None = None
    advice: DryRunAdvice | None = None
    small_gallery: str | None = None
    nothing: UpgradeResult | None = None  # no version to upgrade to
    planning: PlanningEstimate | None = None  # what planning embeds and how long it takes (planning_cost)

    def as_dict(self) -> dict:
        """The document's fields (docs/json.md, fastfill.upgrade.dry_run/1)."""
        if self.nothing is not None:
            return {"from": self.source, "to": None, **self.nothing.as_dict()}
        return {"from": self.source, "to": self.to, "in_progress": self.in_progress, "resumes": self.resumes,
                **(asdict(self.cost) if self.cost else {}), "truth": self.truth, "map_pairs": self.map_pairs,
                "advice": self.advice.to_dict() if self.advice is not None else None,
                "small_gallery": self.small_gallery,
                "planning": self.planning.to_dict() if self.planning is not None else None}


def dry_run(gallery: Gallery, config, new_model, *, sample: int = 64, seed: int = 0) -> UpgradeCost:
    """The plan of an upgrade of ``gallery`` to ``new_model`` under ``config``
    (gallery.upgrade), with measured per-item read and embedding times."""

    n, parts = gallery.num_items, gallery.num_parts
    chunks = math.ceil(n / config.chunk_size)
    shape = tuple(gallery.manifest()["image_shape"])
    old_dim, new_dim = gallery.model.dim or 0, new_model.embedding_dim
    positions = np.sort(np.random.default_rng(seed).choice(n, size=min(sample, n), replace=False))
    started = time.perf_counter()
    images, failures = fetch_images(gallery, positions, workers=config.read_workers,
                                    preprocessing=getattr(new_model, "preprocessing", None))
    read_seconds = time.perf_counter() - started
    ok = readable(len(positions), failures)
    # warm-up: first-call costs are not per item
    embed(new_model, images[ok][:2], batch_size=config.batch_size, precision=config.precision)
    started = time.perf_counter()
    embed(new_model, images[ok], batch_size=config.batch_size, precision=config.precision)
    embed_seconds = time.perf_counter() - started
    per_read, per_embed = read_seconds / len(positions), embed_seconds / max(1, int(ok.sum()))

    image_bytes = _mean_encoded_size(gallery, positions) if gallery.adopted else float(np.prod(shape))
    feature_bytes, new_bytes = n * old_dim * 4, n * new_dim * 4
    image_reads = n if gallery.adopted else parts  # packed parts are cached per process
    plan_requests = 3 * parts + 5  # features in, transformed and sigma out; order, eval sample, plan, manifest
    # the images, each part's item URIs once (cached per process), a chunk's features and its marker
    backfill_requests = image_reads + (parts if gallery.adopted else 0) + 2 * chunks
    finish_requests = 2 * chunks + 2 * parts + 2  # markers and chunks in; transformed in, features out
    backfill_seconds = n * (per_read + per_embed) / max(1, config.max_concurrency)
    if config.max_items_per_second:
        backfill_seconds = max(backfill_seconds, n / config.max_items_per_second)
    return UpgradeCost(
        store=gallery.store.uri, items=n, parts=parts, chunks=chunks, chunk_size=config.chunk_size,
        images="read by URI where they are" if gallery.adopted else "packed parts in the store",
        bytes_to_read=BytesToRead(features=feature_bytes, images=int(n * image_bytes), finish=2 * new_bytes,
                                  total=int(feature_bytes + n * image_bytes + 2 * new_bytes)),
        bytes_to_write=BytesToWrite(plan=int(n * (new_dim * 4 + 4 + 8)), backfill=new_bytes, finish=new_bytes),
        requests=Requests(plan=plan_requests, backfill=backfill_requests, finish=finish_requests,
                          total=plan_requests + backfill_requests + finish_requests),
        sample=SampleTimes(items=len(positions), failed=len(failures), read_seconds_per_item=per_read,
                           embed_seconds_per_item=per_embed),
        estimated_backfill_seconds=backfill_seconds,
        note="the backfill's estimate covers reading and embedding at max_concurrency chunks in flight; the "
             "store's latency under load is not in it; planning (its embedding, the map's training and check) is "
             "estimated apart (planning)")


def dry_run_upgrade(params, gallery: Gallery, client, to_uri: str = "", target_top1: float | None = None) -> DryRun:
    """What ``fastfill upgrade`` would do to ``gallery`` (``params``: the configuration;
    ``client``: the registry's), writing nothing: no plan, no lock, no MLflow run. The version
    as the upgrade chooses it (``decider.UpgradeDecider.target``), the cost (``dry_run``), what
    the gate would measure against, where the map's pairs come from, and the budget advisor's
    prediction when it can be made without writing; with ``target_top1`` (a fraction), which way
    (each order of the map, the shadow index, online backfilling, candidate reranking) reaches it
    with the least backfill."""

    params, fitted = samples.fit_to_gallery(params, gallery.num_items)  # as the upgrade will run it
    config, name = params.gallery.upgrade, params.mlflow.registered_model
    view = GalleryView(gallery)
    decider = UpgradeDecider(gallery.store.uri, name, params.promotion.gate, config.judgments,
                             config.stop_when_gain_below)
    new = decider.target(asked_version(client, name, to_uri), view)
    if new is None:
        return DryRun(gallery.model.uri, None, nothing=decider.no_target(view, alias_version(client, name, CHAMPION)))
    truth = truth_of(view.has_labels, config.judgments)
    truth_line = {TRUTH_NONE: "none: the gallery has no labels and no judged queries are configured; "
                  + ("the upgrade would be refused before planning (promotion.gate true)" if params.promotion.gate
                     else "the upgrade runs ungated"),
                  TRUTH_JUDGMENTS: f"the judged queries of {config.judgments}"}.get(truth, "the gallery's labels")
    model = load_model(new.uri).eval()
    cost = dry_run(gallery, config, model, seed=config.seed)
    resumes = view.current == upgrade_id(gallery.model, ModelRef(new.name, new.version, model.embedding_dim))
    advice = _predicted(params, gallery, client, new, model, view.current if resumes else None,
                        sequential=bool(view.current) and not resumes, target_top1=target_top1)
    planning = None if resumes else _planning(params, gallery, client, new, model, cost, fitted)
    return DryRun(gallery.model.uri, new.uri, in_progress=view.current, resumes=resumes, cost=cost, truth=truth_line,
                  map_pairs=pairs_description(config, gallery.num_items), advice=advice, small_gallery=fitted,
                  planning=planning)


def _planning(params, gallery: Gallery, client, new, model, cost: UpgradeCost,
              fitted: str | None) -> PlanningEstimate:
    """What planning would embed and how long it would take (``planning_cost``): the map and
    its check's reference are trained only when the registry has no checked map for the two
    versions; a small gallery is re-embedded whole while planning, with no map to check."""
    config = params.gallery.upgrade
    n = gallery.num_items
    per_item = cost.sample.read_seconds_per_item + cost.sample.embed_seconds_per_item
    eval_positions = evaluation_positions(gallery, config)
    if fitted is not None:
        return planning_cost(config, n, np.arange(n), eval_positions, per_item, None, 0, 0, trains=False,
                             checks=False)
    source = pairs_source(config, gallery.store.uri)
    chosen = registry_map(client, params.mlflow.alignment_model, gallery.model, new, map_order(config.order), source)
    settings = params.upgrade_map
    trains = chosen is None
    checks = settings.check != "off" and settings.validation_fraction > 0 and (
        trains or needs_check(chosen.tags, source, config.recheck))
    map_positions = samples.map_sample(config, n) if config.map_pairs == "gallery" else np.zeros(0, np.int64)
    disc = settings.disc and (getattr(model, "classifier", None) is not None or config.pseudo_disc)
    map_config = settings.for_upgrade().model_copy(update={"disc": disc and settings.disc})
    return planning_cost(config, n, map_positions, eval_positions, per_item, map_config, gallery.model.dim or 0,
                         model.embedding_dim, trains=trains, checks=checks)


def _predicted(params, gallery: Gallery, client, new, model, resumes: str | None, sequential: bool,
               target_top1: float | None = None) -> DryRunAdvice:
    """The budget advisor's prediction without writing anything: the stored one of the upgrade
    this would resume; else, when the registry holds a checked map joining the two versions,
    computed here (the evaluation sample embedded with the new model, the gallery's features
    sent through the map part by part, twice: its order first (sigma's, the usage weights', or
    random), then the search). Otherwise a note saying when the prediction appears."""

    config = params.gallery.upgrade
    if resumes:
        stored = _stored_prediction(gallery, resumes, config.stop_when_gain_below, target_top1)
        if stored is not None:
            return stored
    labels = gallery.labels()
    note = _before_planning(params, gallery, labels, sequential)
    if note is not None:
        return DryRunAdvice(note=note)
    source, pairs = pairs_source(config, gallery.store.uri), pairs_description(config, gallery.num_items)
    chosen = registry_map(client, params.mlflow.alignment_model, gallery.model, new, map_order(config.order), source)
    note = _map_not_ready(params, gallery, new, chosen, source, pairs)
    if note is not None:
        return DryRunAdvice(note=note)
    order_kind = order_after_map(config.order, registered_map_order(chosen.tags, map_order(config.order))[0])
    weights = None
    if order_kind in USAGE_ORDERS:  # before any embedding: the usage orders need the items' weights
        try:
            weights = usage_weights(gallery, config.usage_log).weights
        except GalleryError as error:
            return DryRunAdvice(note=f"no prediction: {error}")
    alignment_map = load_model(f"models:/{params.mlflow.alignment_model}/{chosen.version}").eval()
    sample = _embedded_sample(gallery, config, model)
    transformed = _through_map(gallery, alignment_map)
    sigma = None
    if order_kind != "random":
        sigma = _map_sigma(gallery, transformed)
        if sigma is None and order_kind != "usage":
            return DryRunAdvice(note=f"no prediction: the registry's map (version {chosen.version}) has no "
                                     f"uncertainty head for the {order_kind} order; use --order random"
                                     + (" or usage" if order_kind == "usage_sigma" else ""))
    advice = _map_prediction(params, gallery, model, alignment_map, sample, transformed, order_kind, sigma,
                             weights, labels, target_top1)
    return replace(advice, map_version=str(chosen.version), order=order_kind)


def _stored_prediction(gallery: Gallery, resumes: str, gain_below: float,
                       target_top1: float | None) -> DryRunAdvice | None:
    """The prediction stored by the upgrade under way (None when it stored none)."""
    stored = advisor.stored_advice(gallery.store, resumes)
    if stored is None:
        return None
    target = None if target_top1 is None else TargetAdvice(
        target_top1, note=f"the ways are compared before an upgrade starts; {resumes} is under way in its own order "
        "(its predicted curve is above)")
    return DryRunAdvice(prediction={**stored, "recommendation": advisor.at_stop(stored, gain_below)}, target=target,
                        resumed=True)


def _before_planning(params, gallery: Gallery, labels, sequential: bool) -> str | None:
    """Why nothing can be predicted whatever the registry holds (None: it can be)."""
    config = params.gallery.upgrade
    if truth_of(labels is not None, config.judgments) == TRUTH_NONE and params.promotion.gate:
        return "no prediction: the upgrade would be refused before planning: " + no_truth_refusal(gallery.store.uri)
    if config.eval_queries == 0:
        return "no prediction: gallery.upgrade.eval_queries is 0, so there is no evaluation sample"
    if sequential:
        return "no prediction before a sequential upgrade is planned; `fastfill upgrade status` shows it then"
    return None


def _map_not_ready(params, gallery: Gallery, new, chosen, source: str, pairs: str) -> str | None:
    """Why the registry's map cannot predict yet: there is none, or it has not passed its check
    on the map's pairs (None: it is ready)."""
    if chosen is None:
        return (f"no prediction yet: the registry has no map from {gallery.model.uri} to {new.uri}; the upgrade "
                f"trains one when it plans (on {pairs}), and `fastfill upgrade status` then shows the "
                "predicted curve")
    if params.upgrade_map.check != "off" and needs_check(chosen.tags, source, params.gallery.upgrade.recheck):
        return (f"no prediction yet: the registry's map (version {chosen.version}) has not passed its check on "
                f"{source}; the upgrade checks it first (on {pairs}) and may replace it, and `fastfill upgrade "
                "status` then shows the predicted curve")
    return None


class _Sample(NamedTuple):
    """The evaluation sample as planning embeds it: its positions, their new-model features, the
    judged queries (judgments, new-model and champion features; None without), and what
    planning embeds and backfills first."""

    positions: np.ndarray
    queries: np.ndarray
    judged: tuple | None
    prefilled: np.ndarray


def _embedded_sample(gallery: Gallery, config, model) -> _Sample:
    """The evaluation sample's readable items and the judged queries, embedded with ``model``."""

    def embed_new(images, label=None):
        return embed(model, images, batch_size=config.batch_size, precision=config.precision)

    preprocessing = getattr(model, "preprocessing", None)
    positions, images = readable_images(gallery, evaluation_positions(gallery, config), config.read_workers,
                                        "evaluation sample", lambda line: None, preprocessing)
    queries = embed_new(images)
    judged = None
    if config.judgments:
        champion = load_model(gallery.model.uri).eval()

        def embed_champion(images, label=None):
            return embed(champion, images, batch_size=config.batch_size, precision=config.precision)

        # (judgments, new-model and champion features of the queries)
        judged = judged_queries(gallery, config, load_judgments(config.judgments, gallery.ids()), embed_new,
                                embed_champion, {}, preprocessing=preprocessing,
                                champion_preprocessing=getattr(champion, "preprocessing", None))
    prefilled = positions  # what planning embeds and backfills first: the sample, and the judged query items
    if judged is not None:
        prefilled = np.union1d(positions, judged[0].query_positions[judged[0].query_positions >= 0])
    return _Sample(positions, queries, judged, prefilled)


def _through_map(gallery: Gallery, alignment_map):
    """``transformed(part)``: the part's stored features through the map (transformed, sigma),
    kept in memory while the parts fit in KEEP_TRANSFORMED bytes."""
    kept: dict[int, tuple] = {}

    def transformed(part: int):  # the order, the prediction and the target each read every part
        if part not in kept:
            result = apply_alignment(alignment_map, gallery.features(gallery.model, part))
            if sum(a.nbytes for r in [*kept.values(), result] for a in r if a is not None) > KEEP_TRANSFORMED:
                return result
            kept[part] = result
        return kept[part]

    return transformed


def _map_sigma(gallery: Gallery, transformed) -> np.ndarray | None:
    """The whole gallery's log sigma^2 through the map (None: the map has no uncertainty head)."""
    parts = [transformed(p)[1] for p in range(gallery.num_parts)]
    return None if any(s is None for s in parts) else np.concatenate(parts)


def _map_prediction(params, gallery: Gallery, model, alignment_map, sample: _Sample, transformed, order_kind: str,
                    sigma, weights, labels, target_top1: float | None) -> DryRunAdvice:
    """The advisor's curve in the upgrade's order, the ways to ``target_top1`` when asked, and the
    gate's predicted decision."""
    config = params.gallery.upgrade
    positions, queries, judged = sample.positions, sample.queries, sample.judged
    order = backfill_order(order_kind, gallery.num_items, config.seed, sigma, weights)
    # the evaluation sample is embedded while planning and backfilled first: its stand-in places
    ranks = stand_in_ranks(order, sample.prefilled, positions, config.seed)
    old_side = gallery.features_at(gallery.model, positions)
    sample_transformed = apply_alignment(alignment_map, old_side)[0]

    def transformed_parts():
        return ((gallery.part_bounds(p)[0], transformed(p)[0]) for p in range(gallery.num_parts))

    prediction = advisor.predict_upgrade(
        positions, queries, sample_transformed, ranks, gallery.num_items, transformed_parts, order,
        labels=labels, judged=None if judged is None else judged[:2], distance=params.gallery.distance,
        gain_below=config.stop_when_gain_below)
    target = None
    if target_top1 is not None:
        reverse, other_maps = _later_ways(params, gallery, model, dict(zip(positions.tolist(), queries)), old_side,
                                          positions)
        target = TargetAdvice.from_dict(_ways_to_target(
            target_top1, gallery, config, positions, sample.prefilled, queries, old_side, sample_transformed,
            transformed, transformed_parts, sigma, weights, params.gallery.distance, judged, reverse, other_maps))
    gate = _gate_prediction(params, labels, positions, old_side, queries, sample_transformed, ranks,
                            judged is not None)
    return DryRunAdvice(prediction=prediction, gate=gate, target=target)


def _gate_prediction(params, labels, positions: np.ndarray, champion: np.ndarray, queries: np.ndarray,
                     transformed: np.ndarray, ranks: np.ndarray, judged: bool) -> GatePrediction:
    """The promotion gate's decision as the upgrade will measure it on a labeled gallery: the same
    evaluation sample, its champion features, its new features (embedded while planning, so
    backfilled), the map's transform of its old side and its stand-in places in the order
    (``components.gallery.gate.promotion``). With judged queries the gate measures the whole
    gallery's new features, so it is predicted only by the curve above; ungated, nothing."""
    if not params.promotion.gate:
        return GatePrediction(note="the upgrade is ungated (promotion.gate false or --no-gate)")
    if judged or labels is None:
        return GatePrediction(note="the judged gate measures the whole gallery's new features, so it is decided "
                                   "after the backfill; the predicted curve above is its best guess")
    numbers = measure_gate(champion, queries, queries, transformed, labels[positions],
                           np.argsort(ranks, kind="stable"), distance=params.gallery.distance,
                           curve_points=params.promotion.curve_points)
    passed, reasons = decide(numbers, params.promotion)
    keep = ("queries", "champion_top1", "top1_auc", "top1_auc_gain", "nfr1_mean", "nfr1_end", "fraction_to_gain")
    return GatePrediction(PredictedGate(passed=passed, reasons=list(reasons), **{key: numbers[key] for key in keep},
                                        nfr1_relative=relative_nfr(numbers)))


LATER_MAP = "lambda_orth"  # the later map the ways compare: the affine, lambda-orthogonal one
LATER_MAP_WAY = "lambda-orthogonal map (affine)"


def _later_ways(params, gallery: Gallery, model, embedded: dict, old_side: np.ndarray, positions: np.ndarray):
    """What the ways of the later methods need, fitted here on the map sample's pairs (the items
    the upgrade would train its map on; those of the evaluation sample already embedded are not
    embedded again): online backfilling's metric-compatible reverse transformation, and the
    lambda-orthogonal affine map (align.lambda_orth, else compare.align.lambda_orth; left out
    when neither is configured or the upgrade's own method is it). Returns (reverse, other maps
    as ``ways_to_target`` takes them)."""
    config = params.gallery.upgrade
    wanted = samples.map_sample(config, gallery.num_items)
    missing = np.array([p for p in wanted.tolist() if p not in embedded], dtype=np.int64)
    if len(missing):
        read, images = samples.readable_images(gallery, missing, config.read_workers, "map sample", lambda line: None,
                                               getattr(model, "preprocessing", None), refuse_none=not embedded)
        embedded = {**embedded, **dict(zip(read.tolist(), embed(model, images, batch_size=config.batch_size,
                                                                    precision=config.precision)))}
    kept = np.array([p for p in wanted.tolist() if p in embedded], dtype=np.int64)
    labels = gallery.labels()
    pairs = from_gallery(model, kept, gallery.features_at(gallery.model, kept), np.stack([embedded[p] for p in kept]),
                         None if labels is None else labels[kept], gallery.store.uri, config.pseudo_classes,
                         config.seed, config.pseudo_disc)
    reverse = fit_reverse(pairs, config.pseudo_classes, config.seed, log=lambda line: None)
    if LATER_MAP not in params.map_methods or config.method == LATER_MAP:
        return reverse, {}
    settings = pairs.settings(params.map_methods[LATER_MAP])
    if len(pairs) < samples.least_map_sample(settings.validation_fraction):  # too few to hold some out: the last epoch
        settings = settings.model_copy(update={"validation_fraction": 0.0})
    later = train_alignment(settings, *pairs.training, pairs.classifier(model), device=pick_device(),
                            log=lambda line: None, method=LATER_MAP)[0].eval()

    def later_parts():
        return ((gallery.part_bounds(p)[0], apply_alignment(later, gallery.features(gallery.model, p))[0])
                for p in range(gallery.num_parts))

    return reverse, {LATER_MAP_WAY: (apply_alignment(later, old_side)[0], later_parts)}


def _ways_to_target(target, gallery: Gallery, config, positions, prefilled, queries, old_side, sample_transformed,
                    transformed, transformed_parts, sigma, weights, distance: str, judged, reverse=None,
                    other_maps=None) -> dict:
    """``target_advice.ways_to_target`` with every order this gallery allows: sigma's when the
    map has an uncertainty head, the usage orders' when the items have weights; candidate
    reranking at ``gallery.upgrade.rerank_depth``."""

    if sigma is None:
        sigma = _map_sigma(gallery, transformed)
    if weights is None:
        try:
            weights = usage_weights(gallery, config.usage_log).weights
        except GalleryError:
            weights = None  # no weights: the usage orders are not among the ways
    return ways_to_target(target, gallery, positions=positions, prefilled=prefilled, queries=queries,
                          old_side=old_side, sample_transformed=sample_transformed,
                          transformed_parts=transformed_parts, log_sigma2=sigma, weights=weights, seed=config.seed,
                          distance=distance, judged=judged, reverse=reverse, other_maps=other_maps,
                          rerank_depth=config.rerank_depth)
