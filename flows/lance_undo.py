"""Undoing an upgrade of a Lance table (gallery.layout lance), as Prefect runs it: `fastfill
upgrade abort` (``table_abort_flow``) and `fastfill gallery rollback` (``table_rollback_flow``).
Both take the upgrade lock and claim the version they undo, so the registry watcher and the
webhook do not start it again, as on the parts layout.

Abort: the record ``upgrades/<id>/aborted.json`` first (who, when, how far it got), then the
table's upgrade columns and backfill table go, then the upgrade's MLflow run ends KILLED.

Rollback: the intent first (``rollback.json`` beside the table: the model it rolls
back from), then the table back to its previous serving tag (``LanceGallery.rollback``), then
the registry, as on the parts layout: ``champion`` back on the previous version when it still
names the rolled-back one, and that version tagged ``promotion=rolled-back``; the record marked
done last. A rollback killed at any point is completed by the next one, never done twice.
"""

from __future__ import annotations

from prefect import flow

from components.gallery.upgrade import planning, reversal
from components.gallery.layouts.catalog import GalleryError, now
from components.gallery.triggers.claims import claim
from components.gallery.layouts.lance_table import LanceGallery
from components.gallery.store.lock import acquire_lock
from components.gallery.store import ObjectMissing, open_store
from components.platform import registry
from components.platform.config import Params
from components.platform.registry import ModelRef
from flows.parameters import resolve_params
from flows.undo import mark_run_aborted, take_undo_lock
from tasks._policy import log

ROLLBACK = "upgrades/rollback.json"


@flow(name="gallery-table-rollback", log_prints=True)
def table_rollback_flow(params: Params | None = None, store_uri: str | None = None,
                        params_path: str | None = None) -> dict:
    """Roll the table at ``store_uri`` (default gallery.store) back to its previous serving tag,
    and the registry with it; see the module's docstring."""
    params = resolve_params(params, params_path, None)
    uri = store_uri or params.gallery.store
    table, store = LanceGallery(uri), open_store(uri)
    client, _ = registry.setup(params.mlflow)
    with acquire_lock(store, "rollback", log=log, lease_seconds=params.gallery.upgrade.lease_seconds):
        try:
            record = store.get_json(ROLLBACK)
        except ObjectMissing:
            record = None
        if record is None or record.get("registry_recorded"):
            record = {"from": table.model().to_dict(), "registry_recorded": False}
            store.put_json(ROLLBACK, record)  # the intent, before the table changes
        rolled = ModelRef.from_dict(record["from"])
        claim(store, rolled.name, rolled.version, "rollback")  # the watcher and the webhook leave it alone
        if table.model().same_version(rolled):
            _, previous = table.rollback()
        else:  # a rollback killed after its restore: its tag, if that is what is missing
            table.tag_pending_rollback()
            previous = table.model()
        log(f"{table.uri} serves {previous.uri}'s features again (rolled back from {rolled.uri})")
        moved = False
        tags = {"promotion": "rolled-back", "promotion.rolled_back_to": str(previous.version),
                "promotion.rolled_back_store": table.uri}
        if rolled.name == previous.name:
            moved = registry.record_rollback(client, rolled.name, rolled.version, previous.version, None, tags)
            champion = registry.alias_version(client, rolled.name, registry.CHAMPION)
            log(f"champion moved back to {previous.uri}" if moved else
                f"champion names version {champion}, not {rolled.version}: left as it is")
        else:  # another registered model: only the tags
            registry.record_rollback(client, rolled.name, rolled.version, rolled.version, None, tags)
        store.put_json(ROLLBACK, {**record, "to": previous.to_dict(), "registry_recorded": True})
        return {"state": "rolled back", "model": previous.uri, "from": rolled.uri, "champion_moved": moved}


@flow(name="gallery-table-abort", log_prints=True)
def table_abort_flow(params: Params | None = None, store_uri: str | None = None, params_path: str | None = None) -> dict:
    """Drop the unfinished upgrade of the table at ``store_uri`` (default gallery.store) under
    the upgrade lock (refused while another process holds it); see the module's docstring."""
    params = resolve_params(params, params_path, None)
    uri = store_uri or params.gallery.store
    table, store = LanceGallery(uri), open_store(uri)
    upgrade = table.upgrade()
    if upgrade is None:
        raise GalleryError(f"{table.uri}: no upgrade in progress to abort")
    with take_undo_lock(store, upgrade.id, f"abort upgrade {upgrade.id}", params):
        current = table.upgrade()  # read again under the lock
        if current is None or current.id != upgrade.id:
            raise GalleryError(f"upgrade {upgrade.id} is no longer the one in progress at {table.uri}; nothing was "
                               "changed")
        record = reversal.aborted(store, upgrade.id)
        plan = planning.load_plan(store, upgrade.id)
        if record is None:
            landed = len(table.landed_chunks())
            record = {"upgrade": upgrade.id, "aborted": now(), "by": reversal.who(), "from": table.model().uri,
                      "to": upgrade.new.uri, "chunks_done": landed, "chunks": plan.num_chunks if plan else None,
                      "mlflow_run_id": plan.mlflow_run_id if plan else None}
            store.put_json(planning.upgrade_key(upgrade.id, reversal.ABORTED), record)  # the record first
        table.abort(upgrade.id)
        if claim(store, upgrade.new.name, upgrade.new.version, "abort", upgrade=upgrade.id):
            log(f"{upgrade.new.uri} is claimed for {table.uri}: the registry watcher and the webhook will not start "
                "it again (`fastfill upgrade` still can)")
        mark_run_aborted(params, record, f"{record['chunks_done']} chunks")
        log(f"aborted upgrade {upgrade.id} ({record['chunks_done']} chunks landed); {table.uri} serves "
            f"{table.model().uri}'s features again")
        return {**record, "state": "aborted", "model": table.model().uri}
