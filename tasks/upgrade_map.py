"""Tasks of the gallery upgrade's alignment map: train one and register it, and check it
(components.experiment.map_check.decide_map) on the upgrade's pairs, recording the outcome in the
registry and on the upgrade's run."""

from __future__ import annotations

import numpy as np
from prefect import task

from components.platform import registry
from components.experiment import registered
from components.platform.config import AlignConfig, Params
from components.gallery.catalog import GalleryError
from components.gallery.lifecycle import CHECK_SOURCE_TAG, checked_on
from components.gallery.pairs import MapPairs
from components.platform.registry import ModelRef
from tasks._policy import GPU_TAGS, NO_CACHING, log


def method_config(params: Params, pairs: MapPairs | None) -> tuple[str, AlignConfig]:
    """The upgrade's map method and its configuration: without classes for the disc term (a new
    model without a classifier) the term is off."""
    method = params.gallery.upgrade.method
    config: AlignConfig = params.align[method]
    if pairs is not None and pairs.targets is None and config.disc:
        config = config.model_copy(update={"disc": False})
    return method, config


def pair_tags(pairs: MapPairs) -> dict:
    """What a map's registered version says of the pairs it trained on."""
    return {"pairs": pairs.source, "pairs.count": str(len(pairs)), "disc_targets": pairs.targets_from}


def register_map(params: Params, h, method: str, old: ModelRef, new: ModelRef, run_id: str,
                 extra: dict | None = None, client=None) -> str:
    """Register ``h`` as a version of the alignment model joining ``old`` and ``new``, tagged
    with its method, the upgrade's run and ``extra``; returns its models:/ URI."""
    if client is None:
        client, _ = registry.setup(params.mlflow)
    tags = {"method": method, "run_id": run_id, "from_version": old.version, "to_version": new.version,
            "registered_model": old.name, **(extra or {})}
    version = registered.register_alignment(client, run_id, h, np.zeros((2, h.old_dim), dtype=np.float32),
                                            params.mlflow.alignment_model, tags)
    return f"models:/{params.mlflow.alignment_model}/{version}"


@task(name="train-upgrade-map", tags=GPU_TAGS, **NO_CACHING)
def train_upgrade_map(params: Params, pairs: MapPairs | None, new_model, old: ModelRef, new: ModelRef,
                      run_id: str) -> tuple:
    """No registered map joins the two versions: train one on ``pairs`` and register it."""
    from components.platform.layout import Layout
    from components.experiment.inference import pick_device
    from components.experiment.map_training import train_alignment

    if pairs is None:
        raise GalleryError(
            f"no alignment map in the registry joins {old.uri} and {new.uri}, and there is no training split at "
            f"{Layout(params.paths).splits} to train one (gallery.upgrade.map_pairs: splits); use map_pairs: gallery "
            f"(--pairs gallery), run `fastfill stage prepare`, or register a map tagged from_version={old.version}, "
            f"to_version={new.version}")
    method, config = method_config(params, pairs)
    log(f"training a {method} map {old.key} -> {new.key} on {len(pairs)} pairs ({pairs.source}); disc term "
        f"targets: {pairs.targets_from}")
    h, history = train_alignment(config, *pairs.training, new_model.classifier, device=pick_device(), log=log,
                                 method=method)
    return h.eval(), register_map(params, h, method, old, new, run_id, pair_tags(pairs))


def _registered_reference(params: Params, client, old: ModelRef, new: ModelRef, version: str, source: str,
                          found: dict):
    """A callable giving the registry's FCT map for the two versions that passed its check on
    ``source`` (other than the checked ``version``), loaded, or None; its URI goes into ``found``."""
    def reference():
        matches = [v for v in registry.find_alignment(client, params.mlflow.alignment_model, old.version, new.version)
                   if v.tags.get("method") == "fct" and v.version != version and checked_on(v.tags, source)]
        if not matches:
            return None
        found["uri"] = f"models:/{params.mlflow.alignment_model}/{matches[0].version}"
        loaded = registered.load_model(found["uri"]).eval()
        log(f"map check: the l2-only reference is {found['uri']}")
        return loaded

    return reference


@task(name="check-upgrade-map", tags=GPU_TAGS, **NO_CACHING)
def check_upgrade_map(params: Params, alignment_map, map_uri: str, pairs: MapPairs | None, new_model, old: ModelRef,
                      new: ModelRef, run_id: str, order: str, why_unchecked: str | None = None) -> tuple:
    """The map check (components.experiment.map_check.decide_map) on the held-out part of
    ``pairs`` (the same source the map trains on: the gallery's sample, or the split): the
    l2-only reference is the registry's FCT map for the same two versions when it passed on this
    source, or one trained here. Returns the map to use, its URI and the backfill order
    (``order``, or random for a fallback map whose fitted sigma head is not shown to help); the
    outcome and its source are tagged on the map's version and the upgrade's run. Raises
    MapCheckError under ``check: fail``."""
    from components.experiment.map_check import check_metrics, check_tags, decide_map
    from components.experiment.inference import pick_device

    method, config = method_config(params, pairs)
    client, _ = registry.setup(params.mlflow)
    version = map_uri.rsplit("/", 1)[1]
    decision, found = None, {}
    if pairs is not None:
        decision = decide_map(method, config, alignment_map, pairs.training,
                              _registered_reference(params, client, old, new, version, pairs.source, found),
                              new_model.classifier, checking=pairs.checking, order=order,
                              distance=params.gallery.distance, device=pick_device(), log=log,
                              pairs_from=pairs.source, check_l2_only=True)
    if decision is None or decision.skipped:
        why = why_unchecked or (decision.skipped if decision else "no prepared training split here")
        log(f"map check skipped: {why}")
        client.set_model_version_tag(params.mlflow.alignment_model, version, "check", f"skipped ({why})")
        client.set_tag(run_id, "check", f"skipped ({why})")
        return alignment_map, map_uri, order
    tags = {**check_tags(decision.record), CHECK_SOURCE_TAG: pairs.source}
    for key, value in tags.items():
        client.set_model_version_tag(params.mlflow.alignment_model, version, key, value)
    registry.log_metrics(client, run_id, check_metrics(decision.record))
    for key, value in tags.items():
        client.set_tag(run_id, key, value)
    if decision.use == "candidate":
        return alignment_map, map_uri, decision.order
    fallback_tags = {"check": "fallback map", "replaces": map_uri, CHECK_SOURCE_TAG: pairs.source,
                     "fallback_order": decision.order, **pair_tags(pairs)}
    if decision.use == "fitted":  # the reference with a fitted head: a map of the method
        return (decision.map.eval(), register_map(params, decision.map, method, old, new, run_id, fallback_tags, client),
                decision.order)
    reference_uri = found.get("uri")
    if reference_uri is None:
        reference_uri = register_map(params, decision.map, "fct", old, new, run_id, fallback_tags, client)
    return decision.map, reference_uri, decision.order
