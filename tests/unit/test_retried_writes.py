"""The writes of an upgrade, an abort and a rollback are Prefect tasks retried on an I/O failure
(``tasks/_policy.IO_RETRIES``), and each is safe to try again: a try whose write landed but whose
answer was lost leaves its retry finding that write, not refusing it or writing a second one.
The tasks' bodies are called as functions here (``.fn``), with ``retrying`` set: no Prefect run."""

from types import SimpleNamespace

import pytest
from prefect import Task

from fastfill.components.gallery.layouts.catalog import GalleryError
from fastfill.components.gallery.triggers import claims
from fastfill.components.gallery.upgrade import backfill, ending, reversal
from fastfill.components.platform import registry
from fastfill.tasks import _policy, gallery_store, upgrade_tracking
from tests.gallery_cases import NEW, OLD, _gallery, _plan

RETRIED = [
    # abort and rollback: the store's writes, the claims, the registry's records
    gallery_store.abort_upgrade, gallery_store.roll_back, gallery_store.mark_rollback_recorded,
    gallery_store.claim_version, upgrade_tracking.end_aborted_run, upgrade_tracking.record_rollback,
    # the upgrade's MLflow records
    upgrade_tracking.open_upgrade_run, upgrade_tracking.close_upgrade_run, upgrade_tracking.tag_run,
    upgrade_tracking.log_prediction, upgrade_tracking.log_gate, upgrade_tracking.follow_decision,
    # the upgrade's store writes
    gallery_store.complete_abort, gallery_store.start_over, gallery_store.point_manifest, gallery_store.write_plan,
    gallery_store.sync_serving, gallery_store.write_decision, gallery_store.finish_upgrade,
    gallery_store.reject_upgrade, gallery_store.mark_registry_recorded,
]


@pytest.mark.parametrize("write", RETRIED, ids=lambda t: t.name)
def test_every_write_of_abort_rollback_and_the_upgrade_s_records_is_a_retried_task(write):
    assert isinstance(write, Task), f"{write} is not a Prefect task"
    assert write.retries == _policy.IO_RETRIES["retries"] > 0
    assert write.retry_condition_fn is _policy.IO_RETRIES["retry_condition_fn"]


@pytest.fixture
def retry(monkeypatch):
    """Set whether the tasks' bodies run as a retry."""
    def set_to(value: bool) -> None:
        monkeypatch.setattr(gallery_store, "retrying", lambda: value)
        monkeypatch.setattr(upgrade_tracking, "retrying", lambda: value)
    return set_to


def test_an_abort_tried_again_after_its_answer_was_lost_returns_its_record(tmp_path, models, data, retry):
    gallery = _gallery(str(tmp_path / "g"), models, data)
    plan = _plan(gallery, models[2])
    uri = gallery.store.uri
    record = reversal.abort(gallery, plan.id)  # the first try: everything written, the answer lost
    retry(False)
    with pytest.raises(GalleryError, match="nothing to abort"):  # a first try still refuses a finished abort
        gallery_store.abort_upgrade.fn(uri, plan.id)
    retry(True)
    assert gallery_store.abort_upgrade.fn(uri, plan.id) == record
    assert gallery.manifest(refresh=True)["upgrade"] is None and gallery.model == OLD


def test_a_rollback_tried_again_after_its_answer_was_lost_returns_its_record(tmp_path, models, data, retry):
    _, new, h = models
    gallery = _gallery(str(tmp_path / "g"), models, data)
    plan = _plan(gallery, h)
    for chunk in range(plan.num_chunks):
        backfill.backfill_chunk(gallery, plan.id, chunk, new)
    ending.finish(gallery, plan)
    uri = gallery.store.uri
    record = reversal.rollback(gallery)  # the first try: record and manifest written, the answer lost
    history = gallery.manifest(refresh=True)["history"]
    retry(False)
    with pytest.raises(GalleryError, match="already a rollback"):
        gallery_store.roll_back.fn(uri)
    retry(True)
    assert gallery_store.roll_back.fn(uri) == record
    assert gallery.manifest(refresh=True)["history"] == history  # one rollback, not two
    assert gallery_store.mark_rollback_recorded.fn(uri, plan.id)["registry_recorded"]
    assert gallery_store.mark_rollback_recorded.fn(uri, plan.id)["registry_recorded"]  # again: still recorded
    assert reversal.interrupted_rollback(gallery) is None


def test_a_claim_tried_again_finds_its_own_record_and_no_other(tmp_path, models, data, retry):
    gallery = _gallery(str(tmp_path / "g"), models, data)
    uri = gallery.store.uri
    record = claims.claim_record(NEW.name, NEW.version, "abort", upgrade="u")
    retry(False)
    assert gallery_store.claim_version.fn(uri, record)
    assert not gallery_store.claim_version.fn(uri, record)  # a later claim of the version
    retry(True)
    assert gallery_store.claim_version.fn(uri, record)  # its own, written by the try whose answer was lost
    other = {**record, "claimed": "another time"}
    assert not gallery_store.claim_version.fn(uri, other)  # someone else's claim stays someone else's


class _Registry:
    """champion and the tags of a registry, in memory."""

    def __init__(self, champion: str):
        self.champion, self.tags = champion, {}

    def get_model_version_by_alias(self, name, alias):
        return SimpleNamespace(version=self.champion)

    def set_registered_model_alias(self, name, alias, version):
        self.champion = version

    def set_model_version_tag(self, name, version, key, value):
        self.tags[key] = value

    def set_tag(self, run_id, key, value):
        self.tags[key] = value


def test_a_rollback_s_registry_step_tried_again_knows_it_moved_champion(retry):
    client = _Registry(champion="2")
    retry(False)
    assert upgrade_tracking.record_rollback.fn(client, "embedder", "2", "1", None, {"promotion": "rolled-back"})
    assert client.champion == "1"
    assert not upgrade_tracking.record_rollback.fn(client, "embedder", "2", "1", None, {})  # a first try: not moved
    retry(True)
    assert upgrade_tracking.record_rollback.fn(client, "embedder", "2", "1", None, {})  # the lost try's move
    moved_since = _Registry(champion="3")  # champion moved by someone else: left alone, retried or not
    assert not upgrade_tracking.record_rollback.fn(moved_since, "embedder", "2", "1", None, {})
    assert moved_since.champion == "3"


def test_the_gate_s_numbers_sent_again_with_their_timestamp_are_kept_once(tmp_path):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    numbers = {"top1": [0.5, 0.6, 0.7], "nfr1": [0.0, 0.1, 0.1], "champion_top1": 0.5, "top1_auc": 0.6,
               "top1_auc_gain": 0.1, "nfr1_mean": 0.07}
    stamp = registry.metric_time()
    upgrade_tracking.log_gate.fn(client, run_id, numbers, stamp)
    upgrade_tracking.log_gate.fn(client, run_id, numbers, stamp)  # a retry after the first landed
    assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "gate.top1")) == [
        (0, 0.5), (1, 0.6), (2, 0.7)]
    assert [m.value for m in client.get_metric_history(run_id, "gate.nfr1_mean")] == [0.07]
