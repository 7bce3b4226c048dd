"""Tasks of the gallery flows: ingest, plan, chunk backfill, measurement, finish."""

from __future__ import annotations

import functools

import numpy as np
from prefect import task

from components.platform import registry
from components.experiment import registered
from components.platform.config import AlignConfig, MlflowConfig, Params
from components.gallery import backfill as bf, catalog, plan as pl, upgrade
from components.gallery.catalog import Gallery, GalleryError
from components.gallery.lifecycle import CHECK_SOURCE_TAG, SPLITS_SOURCE, checked_on, done_prefix
from components.gallery.pairs import TARGETS_LABELS, MapPairs
from components.platform.progress import progress
from components.platform.registry import ModelRef
from components.gallery.store import Store, open_store
from tasks._policy import GPU_TAGS, IO_RETRIES, NO_CACHING, log


@functools.lru_cache(maxsize=16)
def store_at(uri: str) -> Store:
    """One store object per URI and process (Dask workers open their own)."""
    return open_store(uri)


@task(name="load-model", **IO_RETRIES, **NO_CACHING)
def load_model(config: MlflowConfig, ref: ModelRef):
    registry.setup(config)
    model = registered.load_model(ref.uri)
    return model.eval()


@task(name="embed-images", tags=GPU_TAGS, **NO_CACHING)
def embed_images(model, images: np.ndarray, batch_size: int = 512, precision: str = "auto",
                 label: str | None = None) -> np.ndarray:
    """``images`` embedded by ``model``; with ``label``, its progress shown (a bar, or log lines)."""
    from components.experiment.inference import embed

    if label is None:
        return embed(model, images, batch_size=batch_size, precision=precision)
    with progress(label, total=len(images), unit="image", log=log) as bar:
        return embed(model, images, batch_size=batch_size, precision=precision, on_batch=bar.advance)


@task(name="write-gallery", **NO_CACHING)
def write_gallery(store_uri: str, images, features, model: ModelRef, labels, groups, ids, part_size: int,
                  registry_uri: str | None = None) -> dict:
    def on_part(done: int, total: int) -> None:
        log(f"ingest: part {done}/{total} written")

    return catalog.ingest(store_at(store_uri), images, features, model, labels=labels, groups=groups, ids=ids,
                          part_size=part_size, on_part=on_part, registry=registry_uri)


@task(name="embed-split-pairs", tags=GPU_TAGS, **NO_CACHING)
def split_pairs(params: Params, old_model, new_model) -> MapPairs | None:
    """Both models' features of this host's prepared new-train split (``map_pairs: splits``)
    with kappa_new's row of each label, or None when no split is prepared here."""
    import torch

    from components.experiment.data import DataError, load_split
    from components.experiment.inference import embed
    from components.platform.layout import Layout

    try:
        split = load_split(Layout(params.paths).splits, "new_train")
    except (DataError, FileNotFoundError):
        return None
    rows = new_model.class_index(torch.from_numpy(split.labels)).numpy()
    keep = rows >= 0
    images = split.images[keep]
    log(f"map pairs: embedding {len(images)} images of the new-train split with both models")
    with progress("embedding the split's pairs", total=2 * len(images), unit="image", log=log) as bar:
        old, new = embed(old_model, images, on_batch=bar.advance), embed(new_model, images, on_batch=bar.advance)
    return MapPairs(old, new, rows[keep], rows[keep], SPLITS_SOURCE, TARGETS_LABELS)


@task(name="embed-gallery-pairs", tags=GPU_TAGS, **IO_RETRIES, **NO_CACHING)
def gallery_pairs(store_uri: str, positions: np.ndarray, new_model, config, sequential: str | None = None) -> MapPairs:
    """The map sample's pairs (``map_pairs: gallery``): old features from the store (the
    gallery's model's, or for a ``sequential`` upgrade the source parts it starts from), new ones
    by embedding the items' images; unreadable images are left out of the sample."""
    from components.experiment.inference import embed
    from components.gallery.images import readable
    from components.gallery.pairs import from_gallery

    gallery = Gallery(store_at(store_uri))
    images, failures = catalog.fetch_images(gallery, positions, workers=config.read_workers)
    if failures:
        log(f"map sample: {len(failures)} of {len(positions)} images could not be read and are left out "
            f"(first: {failures[0].uri}: {failures[0].reason})")
        keep = readable(len(positions), failures)
        positions, images = positions[keep], images[keep]
    log(f"map pairs: embedding {len(positions)} gallery items with the new model (a seeded sample; their features "
        "are kept as backfilled)")
    with progress("embedding the map sample", total=len(images), unit="image", log=log) as bar:
        new = catalog.check_features(embed(new_model, images, batch_size=config.batch_size, precision=config.precision,
                                           on_batch=bar.advance), None, "new-model features of the map sample")
    labels = gallery.labels()
    old = catalog.rows_at(gallery, positions, (lambda part: pl.source_key(sequential, part)) if sequential else
                          (lambda part: catalog.features_key(gallery.model, part)))
    return from_gallery(new_model, positions, old, new, None if labels is None else labels[positions],
                        gallery.store.uri)


def _method_config(params: Params, pairs: MapPairs) -> tuple[str, AlignConfig]:
    """The upgrade's map method and its configuration: without classes for the disc term (a new
    model without a classifier) the term is off."""
    method = params.gallery.upgrade.method
    config: AlignConfig = params.align[method]
    if pairs is not None and pairs.targets is None and config.disc:
        config = config.model_copy(update={"disc": False})
    return method, config


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
    method, config = _method_config(params, pairs)
    log(f"training a {method} map {old.key} -> {new.key} on {len(pairs)} pairs ({pairs.source}); disc term "
        f"targets: {pairs.targets_from}")
    h, history = train_alignment(config, *pairs.training, new_model.classifier, device=pick_device(), log=log,
                                 method=method)
    return h.eval(), _register_map(params, h, method, old, new, run_id, pair_tags(pairs))


def pair_tags(pairs: MapPairs) -> dict:
    """What a map's registered version says of the pairs it trained on."""
    return {"pairs": pairs.source, "pairs.count": str(len(pairs)), "disc_targets": pairs.targets_from}


def _register_map(params: Params, h, method: str, old: ModelRef, new: ModelRef, run_id: str,
                  extra: dict | None = None) -> str:
    client, _ = registry.setup(params.mlflow)
    tags = {"method": method, "run_id": run_id, "from_version": old.version, "to_version": new.version,
            "registered_model": old.name, **(extra or {})}
    version = registered.register_alignment(client, run_id, h, np.zeros((2, h.old_dim), dtype=np.float32),
                                          params.mlflow.alignment_model, tags)
    return f"models:/{params.mlflow.alignment_model}/{version}"


@task(name="check-upgrade-map", tags=GPU_TAGS, **NO_CACHING)
def check_upgrade_map(params: Params, alignment_map, map_uri: str, pairs: MapPairs | None, new_model, old: ModelRef,
                      new: ModelRef, run_id: str, order: str, why_unchecked: str | None = None) -> tuple:
    """The map check (components.experiment.map_check) on the held-out part of ``pairs`` (the
    same source the map trains on: the gallery's sample, or the split): the l2-only reference
    is the registry's FCT map for the same two versions when it passed on this source, or one
    trained here. Returns the map to use, its URI and the backfill order (``order``, or random
    for a fallback map whose fitted sigma head is not shown to help); the outcome and its source
    are tagged on the map's version and the upgrade's run. Raises MapCheckError under ``check: fail``."""
    from components.experiment.map_check import check_map, check_metrics, check_tags, fallback_map, held_out, reference_config
    from components.experiment.inference import pick_device
    from components.experiment.map_training import train_alignment

    method, config = _method_config(params, pairs)
    client, _ = registry.setup(params.mlflow)
    version = map_uri.rsplit("/", 1)[1]
    held = None if pairs is None or config.check == "off" else held_out(config, *pairs.checking, method)
    if held is None:
        why = why_unchecked or ("no prepared training split here" if pairs is None else f"align.{method}.check is off"
                                if config.check == "off" else f"align.{method}.validation_fraction is 0")
        log(f"map check skipped: {why}")
        client.set_model_version_tag(params.mlflow.alignment_model, version, "check", f"skipped ({why})")
        client.set_tag(run_id, "check", f"skipped ({why})")
        return alignment_map, map_uri, order
    found = [v for v in registry.find_alignment(client, params.mlflow.alignment_model, old.version, new.version)
             if v.tags.get("method") == "fct" and v.version != version and checked_on(v.tags, pairs.source)]
    if found:
        reference_uri = f"models:/{params.mlflow.alignment_model}/{found[0].version}"
        reference = registered.load_model(reference_uri).eval()
        log(f"map check: the l2-only reference is {reference_uri}")
    else:
        log(f"map check: training the l2-only reference on the same {len(pairs)} pairs ({pairs.source})")
        reference, _ = train_alignment(reference_config(config), *pairs.training, new_model.classifier,
                                       device=pick_device(), log=log)
        reference_uri = None
    result = check_map(method, config, alignment_map, reference, held, distance=params.gallery.distance).to_dict()
    log(f"map check ({config.check}) on {pairs.source}: {result['message']}")
    used = alignment_map
    if result["action"] == "fallback" and order == "sigma":
        used, _, decision = fallback_map(method, config, reference, pairs.training, held, new_model.classifier,
                                         distance=params.gallery.distance, device=pick_device())
        if decision is not None:
            log(f"map check fallback: {decision['message']}")
            result["fallback_order"] = decision
            order = decision["order"]
    elif result["action"] == "fallback":
        used = reference
    tags = {**check_tags(result), CHECK_SOURCE_TAG: pairs.source}
    for key, value in tags.items():
        client.set_model_version_tag(params.mlflow.alignment_model, version, key, value)
    registry.log_metrics(client, run_id, check_metrics(result))
    for key, value in tags.items():
        client.set_tag(run_id, key, value)
    if used is alignment_map:
        return alignment_map, map_uri, order
    fallback_tags = {"check": "fallback map", "replaces": map_uri, CHECK_SOURCE_TAG: pairs.source, "fallback_order": order,
                     **pair_tags(pairs)}
    if used is not reference:  # the reference with a fitted head: a map of the method
        return used.eval(), _register_map(params, used, method, old, new, run_id, fallback_tags), order
    if reference_uri is None:
        reference_uri = _register_map(params, reference, "fct", old, new, run_id, fallback_tags)
    return reference, reference_uri, order


@task(name="write-sources", **IO_RETRIES, **NO_CACHING)
def write_sources(store_uri: str, upgrade_id: str, base: pl.Plan) -> int:
    return bf.write_sources(Gallery(store_at(store_uri)), upgrade_id, base)


@task(name="transform-part", **IO_RETRIES, **NO_CACHING)
def transform_part(store_uri: str, upgrade_id: str, alignment_map, part: int, sequential: bool = False) -> int:
    return pl.transform_part(Gallery(store_at(store_uri)), upgrade_id, alignment_map, part, sequential=sequential)


@task(name="backfill-chunk", **IO_RETRIES, **NO_CACHING)
def backfill_chunk(store_uri: str, upgrade_id: str, chunk: int, model, batch_size: int, read_workers: int = 16,
                   precision: str = "auto") -> dict:
    """Read the chunk's images, embed them with the new model, write features, then the marker."""
    return bf.backfill_chunk(store_at(store_uri), upgrade_id, chunk, model, batch_size=batch_size,
                             read_workers=read_workers, precision=precision)


@task(name="finish-upgrade", **IO_RETRIES, **NO_CACHING)
def finish_upgrade(store_uri: str, plan: pl.Plan) -> dict:
    return upgrade.finish(Gallery(store_at(store_uri)), plan)


@task(name="evaluate-gate", **NO_CACHING)
def evaluate_gate(store_uri: str, plan: pl.Plan, config) -> dict:
    """The promotion gate's numbers on the upgrade's evaluation sample (components.gallery.promotion)."""
    from components.gallery.judgments import measure_judged_gate, stored_judged
    from components.gallery.promotion import measure_gate

    gallery = Gallery(store_at(store_uri))
    store = gallery.store
    judged = stored_judged(store, plan.id)
    if judged is not None:  # judged queries come first: the whole gallery along the backfill's own order
        judgments, new_queries, champion_queries = judged
        final, _ = bf.mixed_features(gallery, plan)
        return measure_judged_gate(champion_queries, gallery.all_features(gallery.model), new_queries, final,
                                   pl.transformed_all(gallery, plan.id), judgments, pl.order_of(store, plan.id),
                                   distance=plan.distance, curve_points=config.curve_points)
    positions, queries = pl.stored_eval_sample(store, plan.id)
    transformed = bf.transformed_rows(gallery, plan.id, positions)
    new = bf.mixed_rows(gallery, plan, positions)
    champion = catalog.rows_at(gallery, positions, lambda part: catalog.features_key(gallery.model, part))
    order = np.argsort(pl.eval_ranks(store, plan, positions), kind="stable")  # the sample's places in the backfill
    return measure_gate(champion, queries, new, transformed, gallery.labels()[positions], order,
                        distance=plan.distance, curve_points=config.curve_points)


@task(name="record-decision", **IO_RETRIES, **NO_CACHING)
def record_decision(config: MlflowConfig, plan: pl.Plan, tags: dict, promote: bool) -> None:
    client, _ = registry.setup(config)
    registry.record_decision(client, plan.new.name, plan.new.version, plan.mlflow_run_id, tags, promote)


@task(name="reject-upgrade", **IO_RETRIES, **NO_CACHING)
def reject_upgrade(store_uri: str, plan: pl.Plan, decision: dict) -> dict:
    return upgrade.reject(Gallery(store_at(store_uri)), plan, decision)


@task(name="open-upgrade-run", **IO_RETRIES, **NO_CACHING)
def open_upgrade_run(params: Params, plan_fields: dict, store_uri: str) -> str:
    """The upgrade's MLflow run, with the plan as params; its id goes into plan.json. Runs of the
    same upgrade left RUNNING by a planning that was killed (no plan was written, and this process
    holds the lock) are marked KILLED first."""
    client, experiment = registry.setup(params.mlflow)
    name = f"upgrade {plan_fields['id']}"
    stale = client.search_runs([experiment], filter_string=f"attributes.run_name = '{name}' and "
                               f"attributes.status = 'RUNNING' and tags.`{registry.STAGE_TAG}` = 'upgrade' and "
                               f"tags.store = '{store_uri}'")
    for run in stale:
        client.set_tag(run.info.run_id, "fastfill.interrupted", "planning was killed before its plan was written")
        client.set_terminated(run.info.run_id, "KILLED")
        log(f"MLflow run {run.info.run_id} of a killed planning of {plan_fields['id']} marked KILLED")
    run = client.create_run(experiment, run_name=f"upgrade {plan_fields['id']}", tags={
        registry.STAGE_TAG: "upgrade", "store": store_uri, "from": plan_fields["old"], "to": plan_fields["new"],
        "git_commit": registry.git_commit()})
    registry.log_params(client, run.info.run_id, plan_fields)
    return run.info.run_id


def close_upgrade_run(params: Params, run_id: str, status: str, reason: str) -> None:
    """End the upgrade's run (FAILED when planning was refused), with the reason as a tag."""
    client, _ = registry.setup(params.mlflow)
    client.set_tag(run_id, "fastfill.refused", reason[:5000])
    client.set_terminated(run_id, status)


class UpgradeProgress:
    """Progress to MLflow (fraction, items, and retrieval when the done chunks form a longer
    prefix of the order) and to a Prefect progress artifact."""

    def __init__(self, params: Params, store_uri: str, plan: pl.Plan, meter, artifact_key: str):
        from prefect.artifacts import create_progress_artifact

        self.client, _ = registry.setup(params.mlflow)
        self.plan, self.meter = plan, meter
        self.run_id = plan.mlflow_run_id
        self.client.update_run(self.run_id, status="RUNNING")
        history = self.client.get_metric_history(self.run_id, "top1")
        self.measured = {int(m.step) for m in history}
        self.artifact = create_progress_artifact(0.0, key=artifact_key,
                                                 description=f"backfill of {plan.id} in {store_uri}")

    def chunk_done(self, done: set[int], items_done: int) -> None:
        from prefect.artifacts import update_progress_artifact

        fraction = items_done / self.plan.num_items
        update_progress_artifact(self.artifact, 100.0 * fraction)
        registry.log_metrics(self.client, self.run_id, {"backfill_fraction": fraction, "items_backfilled": items_done},
                             step=len(done))
        self.measure(done)

    def measure(self, done: set[int]) -> None:
        if self.meter is None:
            return
        prefix = done_prefix(done, self.plan.num_chunks)
        items = self.plan.chunk_bounds(prefix - 1)[1] if prefix else 0
        if items and 0 not in self.measured:  # the curve starts at 0%, also when items were embedded while planning
            self._measure_at(0)
        self._measure_at(items)

    def _measure_at(self, items: int) -> None:
        if items in self.measured:
            return
        metrics = self.meter.measure(items)
        registry.log_metrics(self.client, self.run_id, metrics, step=items)
        self.measured.add(items)
        log(f"at {items}/{self.plan.num_items} backfilled: top-1 {metrics['top1']:.4f}, mAP {metrics['map']:.4f}")

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")
