"""Tasks that read and write a gallery's store (I/O, so retried): ingest, the upgrade's planning
writes, a chunk's backfill, the gate's measurement, the end's switch, abort and rollback, and the
claims that keep a version from starting again. A write that is not idempotent by itself looks,
on a retry, for what its last try wrote (``retrying``)."""

from __future__ import annotations

import functools

from prefect import task

from fastfill.components.gallery.advice import advisor
from fastfill.components.gallery.gate.upgrade_gate import measure_upgrade_gate
from fastfill.components.gallery.inputs import judgments
from fastfill.components.gallery.layouts import catalog
from fastfill.components.gallery.layouts.catalog import Gallery
from fastfill.components.gallery.layouts.opening import gallery_at, layout_of
from fastfill.components.gallery.store import Store, configure_s3, open_store
from fastfill.components.gallery.triggers import claims
from fastfill.components.gallery.upgrade import backfill, ending, planning, reversal
from fastfill.components.gallery.upgrade.outcome import Decision
from fastfill.components.gallery.upgrade.planning import Plan
from fastfill.components.model_store import registered
from fastfill.components.platform.registry import ModelRef
from fastfill.tasks._policy import IO_RETRIES, NO_CACHING, log, retrying


@functools.lru_cache(maxsize=16)
def store_at(uri: str) -> Store:
    """One store object per URI and process (Dask workers open their own)."""
    return open_store(uri)


def open_gallery(store_uri: str, s3=None, registry_identity: str | None = None) -> Gallery:
    """The gallery at ``store_uri``, its store checked and its manifest read (every entry point
    opens a gallery this way). ``s3`` (gallery.s3): the retries and timeouts of this process's S3
    clients; with ``registry_identity``, refused when the gallery was built against another
    registry."""
    if s3 is not None:
        configure_s3(s3)
    store = store_at(store_uri)
    store.check()
    gallery = gallery_at(store)  # its manifest says its layout
    manifest = gallery.manifest()
    if registry_identity is not None:
        catalog.check_registry(manifest, store.uri, registry_identity)
    return gallery


@task(name="write-gallery", **NO_CACHING)
def write_gallery(store_uri: str, images, features, model: ModelRef, labels, groups, ids, part_size: int,
                  registry_uri: str | None = None, layout: str = catalog.PARTS, gallery_config=None) -> dict:
    """A new gallery in the layout ``layout`` (gallery.layout; ``gallery_config``, the gallery
    section, names the pgvector layout's server and table)."""
    def on_part(done: int, total: int) -> None:
        log(f"ingest: part {done}/{total} written")

    return catalog.ingest(store_at(store_uri), images, features, model, labels=labels, groups=groups, ids=ids,
                          part_size=part_size, on_part=on_part, registry=registry_uri,
                          layout=layout_of(layout, gallery_config))


@task(name="write-sources", **IO_RETRIES, **NO_CACHING)
def write_sources(store_uri: str, upgrade_id: str, base: Plan) -> int:
    return backfill.write_sources(gallery_at(store_at(store_uri)), upgrade_id, base)


@task(name="discard-unplanned", **IO_RETRIES, **NO_CACHING)
def discard_unplanned(store_uri: str, upgrade_id: str) -> int:
    """What a refused or killed planning of ``upgrade_id`` wrote, deleted (never once its plan exists)."""
    return planning.discard_unplanned(gallery_at(store_at(store_uri)), upgrade_id)


@task(name="write-reverse", **IO_RETRIES, **NO_CACHING)
def write_reverse(store_uri: str, upgrade_id: str, reverse) -> None:
    planning.write_reverse(store_at(store_uri), upgrade_id, reverse)


@task(name="commit-plan", **IO_RETRIES, **NO_CACHING)
def commit_plan(store_uri: str, plan: Plan, order, embedded: dict, judged, positions, queries, ranks) -> int:
    """Planning's last writes, each one idempotent: the chunks of the items embedded while planning
    (written as done), the judged queries' features, then the order, the evaluation sample and
    plan.json, and the gallery pointed at the upgrade. Returns the prefilled chunks written."""
    gallery = gallery_at(store_at(store_uri))
    chunks = backfill.write_prefilled(gallery.store, plan, order, embedded) if plan.prefilled else 0
    if judged is not None:
        judgments.store_judged(gallery.store, plan.upgrade_id, *judged)
    planning.commit_plan(gallery, plan, order, positions, queries, ranks)
    return chunks


@task(name="transform-part", **IO_RETRIES, **NO_CACHING)
def transform_part(store_uri: str, upgrade_id: str, alignment_map, part: int, sequential: bool = False) -> int:
    return planning.transform_part(gallery_at(store_at(store_uri)), upgrade_id, alignment_map, part, sequential=sequential)


@task(name="backfill-chunk", **IO_RETRIES, **NO_CACHING)
def backfill_chunk(store_uri: str, upgrade_id: str, chunk: int, model, batch_size: int, read_workers: int = 16,
                   precision: str = "auto") -> dict:
    """Read the chunk's images, embed them with the new model, write features, then the marker."""
    return backfill.backfill_chunk(gallery_at(store_at(store_uri)), upgrade_id, chunk, model, batch_size=batch_size,
                                   read_workers=read_workers, precision=precision)


@task(name="evaluate-gate", **NO_CACHING)
def evaluate_gate(store_uri: str, plan: Plan, curve_points: int) -> dict:
    """The promotion gate's numbers (components.gallery.gate.upgrade_gate)."""
    return measure_upgrade_gate(gallery_at(store_at(store_uri)), plan, curve_points)


def _abort(store_uri: str, upgrade_id: str) -> reversal.Aborted:
    """``reversal.abort``; on a retry, an abort that the last try completed (its answer lost) is done."""
    gallery = gallery_at(store_at(store_uri))
    done = reversal.completed_abort(gallery, upgrade_id) if retrying() else None
    return done if done is not None else reversal.abort(gallery, upgrade_id)


@task(name="abort-upgrade", **IO_RETRIES, **NO_CACHING)
def abort_upgrade(store_uri: str, upgrade_id: str) -> reversal.Aborted:
    """The unfinished upgrade dropped (``reversal.abort``, under the caller's lock): its record
    ``aborted.json``, then the gallery back on its own model's features. Returns the record."""
    return _abort(store_uri, upgrade_id)


@task(name="complete-abort", **IO_RETRIES, **NO_CACHING)
def complete_abort(store_uri: str, upgrade_id: str) -> None:
    _abort(store_uri, upgrade_id)


@task(name="roll-back", **IO_RETRIES, **NO_CACHING)
def roll_back(store_uri: str) -> dict:
    """The gallery back on the model it had before its last, finished upgrade (``reversal.rollback``,
    under the caller's lock): the record ``rolled-back.json``, then the manifest. Returns the record.
    A retry after a try that switched the manifest (its answer lost) finds that rollback, its
    registry step still to do, and returns its record."""
    gallery = gallery_at(store_at(store_uri))
    done = reversal.interrupted_rollback(gallery) if retrying() else None
    return done if done is not None else reversal.rollback(gallery)


@task(name="mark-rollback-recorded", **IO_RETRIES, **NO_CACHING)
def mark_rollback_recorded(store_uri: str, upgrade_id: str) -> dict:
    """The rollback's record says its registry step is done (written whole: a retry writes it again)."""
    return reversal.mark_rollback_recorded(store_at(store_uri), upgrade_id)


@task(name="claim-version", **IO_RETRIES, **NO_CACHING)
def claim_version(store_uri: str, record: dict) -> bool:
    """The claim ``record`` (``claims.claim_record``) written for the gallery, so the watcher and the
    webhook do not start its version; True for the version's first claim. A retry that finds the
    very record its last try wrote (the answer lost) is that first claim."""
    return claims.put_claim(store_at(store_uri), record, retried=retrying())


@task(name="start-over", **IO_RETRIES, **NO_CACHING)
def start_over(store_uri: str, upgrade_id: str) -> None:
    reversal.start_over(gallery_at(store_at(store_uri)), upgrade_id)


@task(name="point-manifest", **IO_RETRIES, **NO_CACHING)
def point_manifest(store_uri: str, upgrade_id: str) -> None:
    """The manifest names ``upgrade_id`` as the upgrade in progress (a crash came between its plan
    and that switch)."""
    gallery = gallery_at(store_at(store_uri))
    gallery.write_manifest({**gallery.manifest(refresh=True), "upgrade": upgrade_id})


@task(name="write-plan", **IO_RETRIES, **NO_CACHING)
def write_plan(store_uri: str, plan: Plan) -> None:
    planning.write_plan(store_at(store_uri), plan)


@task(name="sync-serving", **IO_RETRIES, **NO_CACHING)
def sync_serving(store_uri: str) -> str:
    """The serving index brought to the upgrade's mixed gallery (a killed switch completed)."""
    gallery = gallery_at(store_at(store_uri))
    serving = gallery.sync_serving()
    index = gallery.index  # called only where the layout serves queries
    return f"{index.where}: the view {index.view} serves {serving.model if serving is not None else None}"


@task(name="advise-upgrade", **IO_RETRIES, **NO_CACHING)
def advise_upgrade(store_uri: str, plan: Plan, gain_below: float | None) -> dict | None:
    """The budget advisor's prediction of the planned upgrade, stored beside its plan."""
    return advisor.advise_upgrade(gallery_at(store_at(store_uri)), plan, gain_below)


@task(name="write-decision", **IO_RETRIES, **NO_CACHING)
def write_decision(store_uri: str, decided: Decision) -> Decision:
    return ending.write_decision(store_at(store_uri), decided)


@task(name="mark-registry-recorded", **IO_RETRIES, **NO_CACHING)
def mark_registry_recorded(store_uri: str, upgrade_id: str) -> None:
    ending.mark_registry_recorded(store_at(store_uri), upgrade_id)


@task(name="finish-upgrade", **IO_RETRIES, **NO_CACHING)
def finish_upgrade(store_uri: str, plan: Plan) -> dict:
    gallery = gallery_at(store_at(store_uri))
    # an adopted gallery's images are decoded for the model it serves: its input shape moves with it
    shape = registered.input_shape(plan.new.uri) if gallery.adopted else None
    record = ending.finish(gallery, plan, shape)
    unserved = record.get("unserved_rows")
    if unserved:
        log(f"{unserved['count']} rows were added to {unserved['table']} since the gallery was made (first ids: "
            f"{', '.join(map(str, unserved['first']))}); the view does not serve them: they have no vector of "
            f"{plan.new.uri}. Take them in with `fastfill gallery release` and `fastfill gallery adopt --table` once "
            "their column holds that model's vectors (docs/serving.md, \"What the product touches in your database\")")
    return record


@task(name="reject-upgrade", **IO_RETRIES, **NO_CACHING)
def reject_upgrade(store_uri: str, plan: Plan, decision: Decision) -> dict:
    return ending.reject(gallery_at(store_at(store_uri)), plan, decision)
