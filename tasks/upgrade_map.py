"""Tasks of the gallery upgrade's alignment map: train one and register it, and check it
(components.experiment.map_check.decide_map) on the upgrade's pairs, recording the outcome in the
registry and on the upgrade's run. Training and the check are not tried again (a failed check is
a verdict); their writes to the registry and the run are, under the I/O policy (``io_retried``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from prefect import task
from torch import nn

from fastfill.components.experiment.inference import pick_device
from fastfill.components.experiment.map_check import check_metrics, check_tags, decide_map, shares_reference
from fastfill.components.experiment.map_training import train_alignment
from fastfill.components.gallery.layouts.catalog import GalleryError
from fastfill.components.gallery.upgrade import samples, usage
from fastfill.components.gallery.upgrade.lifecycle import (
    CHECK_SOURCE_TAG,
    SPLITS_SOURCE,
    checked_on,
    needs_check,
    registered_map_order,
)
from fastfill.components.gallery.upgrade.pairs import MapPairs, fit_reverse
from fastfill.components.model_store import registered
from fastfill.components.platform import registry
from fastfill.components.platform.config import AlignConfig
from fastfill.components.platform.layout import Layout
from fastfill.components.platform.registry import ModelRef
from fastfill.tasks._policy import GPU_TAGS, NO_CACHING, io_retried, log
from fastfill.tasks.upgrade_tracking import tag_run


@dataclass(frozen=True)
class MapSettings:
    """What the upgrade's map tasks need of the configuration: the registered alignment model's
    name, the map's method and its settings (align.<method>), the gallery's distance."""

    alignment_model: str
    method: str
    config: AlignConfig
    distance: str

    def for_pairs(self, pairs: MapPairs | None) -> AlignConfig:
        """The method's settings for ``pairs``, as an upgrade trains its maps (``AlignConfig.for_upgrade``:
        conditioned features and early stopping unless align.<method> sets them): without classes
        for the disc term (a new model without a classifier, and pseudo-classes off) the term is off."""
        config = self.config.for_upgrade()
        return config if pairs is None else pairs.settings(config)


def pair_tags(pairs: MapPairs) -> dict:
    """What a map's registered version says of the pairs it trained on."""
    return {"pairs": pairs.source, "pairs.count": str(len(pairs)), "disc_targets": pairs.disc_targets}


def register_map(client, alignment_model: str, alignment_map, method: str, old: ModelRef, new: ModelRef,
                 run_id: str, extra: dict | None = None) -> str:
    """Register ``alignment_map`` as a version of the alignment model joining ``old`` and ``new``,
    tagged with its method, the upgrade's run and ``extra``; returns its models:/ URI. Retried on an
    I/O failure: a retry first looks for the version its last try registered (``landed_map``)."""
    tags = {key: str(value) for key, value in {
        "method": method, "run_id": run_id, "from_version": old.version, "to_version": new.version,
        "registered_model": old.name, **(extra or {})}.items()}
    example = np.zeros((2, alignment_map.old_dim), dtype=np.float32)

    def write() -> str:
        version = registered.register_alignment(client, run_id, alignment_map, example, alignment_model, tags)
        return f"models:/{alignment_model}/{version}"

    return io_retried(write, f"registering a version of {alignment_model}",
                      landed=lambda: landed_map(client, alignment_model, run_id, tags))


def landed_map(client, alignment_model: str, run_id: str, tags: dict[str, str]) -> str | None:
    """The models:/ URI of the version of ``alignment_model`` that ``run_id`` registered with
    exactly ``tags`` (a version is created with its tags), or None: what a registration whose
    answer was lost wrote."""
    versions = client.search_model_versions(f"name = '{alignment_model}' and run_id = '{run_id}'")
    own = [int(v.version) for v in versions if dict(v.tags) == tags]
    return f"models:/{alignment_model}/{max(own)}" if own else None


@task(name="train-upgrade-map", tags=GPU_TAGS, **NO_CACHING)
def train_upgrade_map(client, settings: MapSettings, pairs: MapPairs, new_model, old: ModelRef, new: ModelRef,
                      run_id: str) -> tuple:
    """No registered map joins the two versions: train one on ``pairs`` and register it."""

    method, config = settings.method, settings.for_pairs(pairs)
    log(f"training a {method} map {old.key} -> {new.key} on {len(pairs)} pairs ({pairs.source}); disc term "
        f"targets: {pairs.disc_targets}")
    alignment_map, history = train_alignment(config, *pairs.training, pairs.classifier(new_model),
                                             device=pick_device(), log=log, method=method)
    return alignment_map.eval(), register_map(client, settings.alignment_model, alignment_map, method, old, new,
                                              run_id, pair_tags(pairs))


@task(name="fit-reverse-transformation", tags=GPU_TAGS, **NO_CACHING)
def fit_reverse_transformation(pairs: MapPairs, pseudo_classes: int, seed: int):
    """gallery.upgrade.online: online backfilling's metric-compatible reverse transformation on
    the map's pairs (``pairs.fit_reverse``)."""
    return fit_reverse(pairs, pseudo_classes, seed, log=log)


def trained_on(tags: dict) -> tuple[str, str | None]:
    """The pairs a registered map trained on: (source, count); the pipeline's own maps carry no
    tag and trained on its splits."""
    return tags.get("pairs", SPLITS_SOURCE), tags.get("pairs.count")


def _registered_reference(client, alignment_model: str, old: ModelRef, new: ModelRef, version: str, source: str,
                          found: dict):
    """A callable giving the registry's FCT map for the two versions (other than the checked
    ``version``), loaded, or None; its URI goes into ``found``. The reference is the l2-only map
    trained on the same pairs as the checked map (the pipeline's FCT beside its FastFill map:
    both measured on this upgrade's held-out pairs, nothing trained here), else one that passed
    its own check on ``source``."""
    def reference():
        same = trained_on(client.get_model_version(alignment_model, version).tags)
        fct = [v for v in registry.find_alignment(client, alignment_model, old.version, new.version)
               if v.tags.get("method") == "fct" and v.version != version]
        paired = [v for v in fct if trained_on(v.tags) == same]
        matches = paired or [v for v in fct if checked_on(v.tags, source)]
        if not matches:
            return None
        found["uri"] = f"models:/{alignment_model}/{matches[0].version}"
        loaded = registered.load_model(found["uri"]).eval()
        log(f"map check: the l2-only reference is {found['uri']}"
            + (f" (trained on the same pairs, {same[0]})" if paired else ""))
        return loaded

    return reference


@task(name="check-upgrade-map", tags=GPU_TAGS, **NO_CACHING)
def check_upgrade_map(client, settings: MapSettings, alignment_map, map_uri: str, pairs: MapPairs | None, new_model,
                      old: ModelRef, new: ModelRef, run_id: str, order: str, why_unchecked: str | None = None) -> tuple:
    """The map check (components.experiment.map_check.decide_map) on the held-out part of
    ``pairs`` (the same source the map trains on: the gallery's sample, or the split): the
    l2-only reference is the registry's FCT map for the same two versions when it passed on this
    source, or one trained here. Returns the map to use, its URI and the backfill order
    (``order``, or random for a fallback map whose fitted sigma head is not shown to help); the
    outcome and its source are tagged on the map's version and the upgrade's run. Raises
    MapCheckError under ``check: fail``."""

    method, config, model_name = settings.method, settings.for_pairs(pairs), settings.alignment_model
    version = map_uri.rsplit("/", 1)[1]
    decision = None
    found: dict[str, str] = {}  # "uri": the registry's reference, when the check used one
    if pairs is not None:
        decision = decide_map(method, config, alignment_map, pairs.training,
                              _registered_reference(client, model_name, old, new, version, pairs.source, found),
                              pairs.classifier(new_model), checking=pairs.checking, order=order,
                              distance=settings.distance, device=pick_device(), log=log,
                              pairs_from=pairs.source, check_l2_only=True)
    if pairs is None or decision is None or decision.skipped:
        why = why_unchecked or (decision.skipped if decision else "no prepared training split here")
        log(f"map check skipped: {why}")
        _record_check(client, model_name, version, run_id, {"check": f"skipped ({why})"})
        return alignment_map, map_uri, order
    record = decision.record
    if record is None:  # decide_map leaves the record out only of a skipped check
        raise GalleryError(f"the map check of {map_uri} decided {decision.use!r} without its record")
    tags = {**check_tags(record), CHECK_SOURCE_TAG: pairs.source,
            "check.reference": found.get("uri") or ("the map's own network (trained on the l2 term alone)"
                                                    if shares_reference(config) else f"trained on {pairs.source}")}
    _record_check(client, model_name, version, run_id, tags, check_metrics(record))
    if decision.use == "candidate":
        return alignment_map, map_uri, decision.order
    fallback_tags = {"check": "fallback map", "replaces": map_uri, CHECK_SOURCE_TAG: pairs.source,
                     "fallback_order": decision.order, **pair_tags(pairs)}
    if decision.use == "fitted":  # the reference with a fitted head: a map of the method
        fitted = decision.map
        if not isinstance(fitted, nn.Module):
            raise GalleryError(f"the map check's fitted map for {map_uri} is a {type(fitted).__name__}, not a "
                               "network")
        return (fitted.eval(), register_map(client, model_name, fitted, method, old, new, run_id, fallback_tags),
                decision.order)
    reference_uri = found.get("uri")
    if reference_uri is None:
        reference_uri = register_map(client, model_name, decision.map, "fct", old, new, run_id, fallback_tags)
    return decision.map, reference_uri, decision.order


def _record_check(client, model_name: str, version: str, run_id: str, tags: dict[str, str],
                  metrics: dict[str, float] | None = None) -> None:
    """The check's outcome: ``tags`` on the map's version, ``metrics`` then ``tags`` on the upgrade's
    run, retried (tags are set, not added; the metrics are stamped once, so points sent again are
    kept once)."""
    stamp = registry.metric_time()

    def write() -> None:
        for key, value in tags.items():
            client.set_model_version_tag(model_name, version, key, value)
        if metrics:
            registry.log_metrics(client, run_id, metrics, timestamp=stamp)
        for key, value in tags.items():
            client.set_tag(run_id, key, value)

    io_retried(write, f"recording the map check of {model_name} version {version}")


def choose_upgrade_map(params, client, store_uri: str, old: ModelRef, new: ModelRef, new_model, run_id: str,
                       make_pairs) -> tuple:
    """(map, its URI, the backfill order, the pairs embedded for it or None), for either layout:
    the registry's map for this pair of versions, checked first on this upgrade's pairs
    (``make_pairs()``, embedded only when needed; None: no split to take them from) unless it
    already passed on the same source (``recheck`` forces it); or a map trained now on those
    pairs and checked. The usage orders choose and check the map for sigma, and go by usage
    alone when its sigma order was not shown to help."""

    config = params.gallery.upgrade
    settings = MapSettings(params.mlflow.alignment_model, config.method, params.upgrade_map,
                           params.gallery.distance)
    source = samples.pairs_source(config, store_uri)
    wanted = usage.map_order(config.order)  # the usage orders want a map with an uncertainty head, as sigma does
    chosen = samples.registry_map(client, params.mlflow.alignment_model, old, new, wanted, source)
    policy = params.upgrade_map.check
    if chosen is not None:
        map_uri = f"models:/{params.mlflow.alignment_model}/{chosen.version}"
        decided, why = registered_map_order(chosen.tags, wanted)
        order = usage.order_after_map(config.order, decided)
        log(f"alignment map from the registry: {map_uri} ({chosen.tags.get('method')})" + (f"; it is {why}" if why else ""))
        alignment_map = registered.load_model(map_uri).eval()
        if policy == "off" or not needs_check(chosen.tags, source, config.recheck):
            said = (f"align.{config.method}.check is off" if policy == "off" else
                    "an l2-only map needs no check" if chosen.tags.get("method") == "fct" else
                    f"it passed its check on {source} (check: {chosen.tags.get('check')}); --recheck checks it again")
            log(f"{map_uri} is used as it is: {said}")
            tag_run(client, run_id, {"check": f"not repeated ({said})", "map_version": str(chosen.version)})
            return alignment_map, map_uri, order, None
        pairs = make_pairs()
    else:
        pairs = make_pairs()
        if pairs is None:
            raise GalleryError(
                f"no alignment map in the registry joins {old.uri} and {new.uri}, and there is no training split at "
                f"{Layout(params.paths).splits} to train one (gallery.upgrade.map_pairs: splits); use map_pairs: "
                f"gallery (--pairs gallery), run `fastfill stage prepare`, or register a map tagged "
                f"from_version={old.version}, to_version={new.version}")
        alignment_map, map_uri = train_upgrade_map(client, settings, pairs, new_model, old, new, run_id)
        order = config.order
    alignment_map, map_uri, decided = check_upgrade_map(client, settings, alignment_map, map_uri, pairs, new_model, old,
                                                        new, run_id, usage.map_order(order))
    order = usage.order_after_map(config.order, decided)
    if order != config.order and config.order in usage.USAGE_ORDERS:
        log(f"the backfill goes in usage order, not {config.order}: the map's sigma order was not shown to help")
    tag_run(client, run_id, {"map_version": map_uri.rsplit("/", 1)[1]})
    return alignment_map, map_uri, order, pairs
