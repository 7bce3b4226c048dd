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
    record = reversal.abort(gallery, plan.upgrade_id)  # the first try: everything written, the answer lost
    retry(False)
    with pytest.raises(GalleryError, match="nothing to abort"):  # a first try still refuses a finished abort
        gallery_store.abort_upgrade.fn(uri, plan.upgrade_id)
    retry(True)
    assert gallery_store.abort_upgrade.fn(uri, plan.upgrade_id) == record
    assert gallery.manifest(refresh=True)["upgrade"] is None and gallery.model == OLD


def test_a_rollback_tried_again_after_its_answer_was_lost_returns_its_record(tmp_path, models, data, retry):
    _, new, h = models
    gallery = _gallery(str(tmp_path / "g"), models, data)
    plan = _plan(gallery, h)
    for chunk in range(plan.num_chunks):
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, new)
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
    assert gallery_store.mark_rollback_recorded.fn(uri, plan.upgrade_id)["registry_recorded"]
    assert gallery_store.mark_rollback_recorded.fn(uri, plan.upgrade_id)["registry_recorded"]  # again: still recorded
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


# ---- writes retried without a task run each (``_policy.io_retried``): the backfill's progress, the map's


class _AnswerLost:
    """An MLflow client whose first ``failing`` call writes and then fails, as if its answer were lost
    (``lands=False``: fails before writing), any number of times (``times``)."""

    def __init__(self, client, failing: str, times: int = 1, lands: bool = True):
        self.client, self.failing, self.left, self.lands, self.calls = client, failing, times, lands, 0

    def __getattr__(self, name):
        method = getattr(self.client, name)
        if name != self.failing:
            return method

        def call(*args, **kwargs):
            self.calls += 1
            result = method(*args, **kwargs) if self.lands else None
            if self.left:
                self.left -= 1
                raise ConnectionError("the connection was reset")
            return method(*args, **kwargs) if not self.lands else result
        return call


@pytest.fixture
def pauses(monkeypatch):
    """The delays io_retried waits between tries (not waited here)."""
    waited: list[float] = []
    monkeypatch.setattr(_policy, "_pause", waited.append)
    return waited


@pytest.fixture
def mlflow_run(tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)  # not the process's registry, whatever set it
    return client, client.create_run(client.create_experiment("e")).info.run_id


def _progress(client, run_id: str, points=()) -> upgrade_tracking.UpgradeProgress:
    """An UpgradeProgress of a 20-item plan on ``run_id`` without its Prefect artifact;
    ``points``: what its measure reports."""
    progress = object.__new__(upgrade_tracking.UpgradeProgress)
    progress.client, progress.run_id, progress.artifact, progress.measured = client, run_id, None, set()
    progress.plan = SimpleNamespace(num_items=20, upgrade_id="u")
    progress.measuring = SimpleNamespace(points=lambda done, measured: [p for p in points if p[0] not in measured])
    return progress


def test_a_chunk_s_progress_whose_answer_was_lost_is_sent_again_and_kept_once(mlflow_run, pauses, monkeypatch):
    import prefect.artifacts

    monkeypatch.setattr(prefect.artifacts, "update_progress_artifact", lambda *args: None)
    real, run_id = mlflow_run
    client = _AnswerLost(real, "log_batch")
    _progress(client, run_id, points=[(10, {"top1": 0.5, "map": 0.4})]).chunk_done({0, 1}, 10)
    assert client.calls == 3 and pauses == [_policy.IO_RETRIES["retry_delay_seconds"][0]]  # progress twice, top1 once
    assert [(m.step, m.value) for m in real.get_metric_history(run_id, "backfill_fraction")] == [(2, 0.5)]
    assert [(m.step, m.value) for m in real.get_metric_history(run_id, "items_backfilled")] == [(2, 10)]
    assert [(m.step, m.value) for m in real.get_metric_history(run_id, "top1")] == [(10, 0.5)]


def test_a_progress_write_failing_for_good_is_tried_as_a_retried_task_is_and_then_fails(mlflow_run, pauses):
    real, run_id = mlflow_run
    client = _AnswerLost(real, "set_terminated", times=99, lands=False)
    with pytest.raises(ConnectionError):
        _progress(client, run_id).close(ok=True)
    assert client.calls == _policy.IO_RETRIES["retries"] + 1
    assert pauses == _policy.IO_RETRIES["retry_delay_seconds"]
    assert real.get_run(run_id).info.status == "RUNNING"


def test_io_retried_does_not_try_again_what_a_retried_task_would_not(pauses):
    tries = []

    def refused():
        tries.append(1)
        raise GalleryError("upgrade u: nothing to abort")

    with pytest.raises(GalleryError):
        _policy.io_retried(refused, "a refused write")
    assert tries == [1] and pauses == []
    flaky = iter([ConnectionError("reset"), "written"])

    def write():
        outcome = next(flaky)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert _policy.io_retried(write, "a write") == "written" and len(pauses) == 1


def test_a_map_registered_whose_answer_was_lost_is_found_not_registered_twice(tmp_path, models, pauses,
                                                                             monkeypatch):
    from fastfill.components.model_store import registered
    from fastfill.components.platform.config import MlflowConfig
    from fastfill.components.platform.registry import ModelRef
    from fastfill.tasks import upgrade_map

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    client, experiment = registry.setup(MlflowConfig(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                                                     artifact_location=str(tmp_path / "artifacts")))
    run_id = client.create_run(experiment).info.run_id
    register, tries = registered.register_alignment, []

    def answer_lost(*args, **kwargs):
        tries.append(register(*args, **kwargs))
        if len(tries) == 1:
            raise ConnectionError("the connection was reset")
        return tries[-1]

    monkeypatch.setattr(registered, "register_alignment", answer_lost)
    old, new = ModelRef("embedder", "1"), ModelRef("embedder", "2")
    uri = upgrade_map.register_map(client, "maps", models[2], "fastfill", old, new, run_id, {"pairs": "gallery"})
    assert uri == "models:/maps/1" and tries == ["1"] and len(pauses) == 1  # found by the retry, not registered again
    assert [str(v.version) for v in client.search_model_versions("name = 'maps'")] == ["1"]
    # another map of the same run (the check's fallback: other tags) is a version of its own
    fallback = upgrade_map.register_map(client, "maps", models[2], "fct", old, new, run_id,
                                        {"pairs": "gallery", "check": "fallback map", "replaces": uri})
    assert fallback == "models:/maps/2" and tries == ["1", "2"]


def test_the_map_check_s_record_whose_answer_was_lost_is_written_again_and_kept_once(mlflow_run, pauses):
    from fastfill.tasks import upgrade_map

    real, run_id = mlflow_run
    real.create_registered_model("maps")
    real.create_model_version("maps", "nowhere", run_id=run_id)
    client = _AnswerLost(real, "set_tag")
    upgrade_map._record_check(client, "maps", "1", run_id, {"check": "passed"}, {"check.map.top1_0": 0.5})
    assert client.calls == 2 and len(pauses) == 1
    assert real.get_run(run_id).data.tags["check"] == real.get_model_version("maps", "1").tags["check"] == "passed"
    assert [m.value for m in real.get_metric_history(run_id, "check.map.top1_0")] == [0.5]
