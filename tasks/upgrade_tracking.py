"""The upgrade's MLflow bookkeeping: its run opened with the plan as params and closed, tags, the
advisor's and the gate's numbers, the decision followed in the registry, an aborted upgrade's run
ended and a rollback recorded, and progress as chunks land (``UpgradeProgress``, also a Prefect
progress artifact). Every write is retried on an I/O failure (``IO_RETRIES``): a Prefect task
each, but the backfill's progress, whose writes are many per run and go through ``io_retried``
(the same policy without a task run each). Each is safe to try again: tags and states are set,
not added; metrics carry a timestamp taken once (``registry.metric_time``), so points sent again
are the same points, which MLflow keeps once; a rollback tried again knows its own champion move.
Each takes the run's one registry client (``registry.setup``, called once by the flow)."""

from __future__ import annotations

from typing import cast
from uuid import UUID

from prefect import task

from fastfill.components.gallery.layouts.catalog import GalleryError
from fastfill.components.gallery.upgrade.measure import BackfillMeasure
from fastfill.components.gallery.upgrade.planning import Plan
from fastfill.components.platform import registry
from fastfill.tasks._policy import IO_RETRIES, NO_CACHING, io_retried, log, retrying


def upgrade_run_id(plan: Plan) -> str:
    """The id of ``plan``'s MLflow run (planning opens it before the plan is written); a plan
    without one cannot have its upgrade recorded, and is refused with what to do."""
    if plan.mlflow_run_id is None:
        raise GalleryError(f"upgrade {plan.upgrade_id}: its plan names no MLflow run (mlflow_run_id), so the upgrade's "
                           "progress and prediction cannot be recorded; abort it (`fastfill upgrade abort`) and "
                           "plan it again")
    return plan.mlflow_run_id


@task(name="open-upgrade-run", **IO_RETRIES, **NO_CACHING)
def open_upgrade_run(client, experiment: str, plan_fields: dict, store_uri: str) -> str:
    """The upgrade's MLflow run, with the plan as params; its id goes into plan.json. Runs of the
    same upgrade left RUNNING by a planning that was killed (no plan was written, and this process
    holds the lock) are marked KILLED first."""
    name = f"upgrade {plan_fields['id']}"
    stale = client.search_runs([experiment], filter_string=f"attributes.run_name = '{name}' and "
                               f"attributes.status = 'RUNNING' and tags.`{registry.STAGE_TAG}` = 'upgrade' and "
                               f"tags.store = '{store_uri}'")
    for run in stale:
        client.set_tag(run.info.run_id, "fastfill.interrupted", "planning was killed before its plan was written")
        client.set_terminated(run.info.run_id, "KILLED")
        log(f"MLflow run {run.info.run_id} of a killed planning of {plan_fields['id']} marked KILLED")
    run = client.create_run(experiment, run_name=name, tags={
        registry.STAGE_TAG: "upgrade", "store": store_uri, "from": plan_fields["old"], "to": plan_fields["new"],
        "git_commit": registry.git_commit()})
    registry.log_params(client, run.info.run_id, plan_fields)
    return run.info.run_id


@task(name="close-upgrade-run", **IO_RETRIES, **NO_CACHING)
def close_upgrade_run(client, run_id: str, status: str, reason: str) -> None:
    """End the upgrade's run (FAILED when planning was refused), with the reason as a tag."""
    client.set_tag(run_id, "fastfill.refused", reason[:5000])
    client.set_terminated(run_id, status)


@task(name="tag-upgrade-run", **IO_RETRIES, **NO_CACHING)
def tag_run(client, run_id: str, tags: dict) -> None:
    for key, value in tags.items():
        client.set_tag(run_id, key, value)


@task(name="log-prediction", **IO_RETRIES, **NO_CACHING)
def log_prediction(client, plan: Plan, advice: dict, timestamp: int) -> None:
    """The budget advisor's curve as series (step: items backfilled): predicted_top1 and
    predicted_map, or predicted_agreement without labels. ``timestamp``: ``registry.metric_time()``."""
    steps = [int(f * plan.num_items) for f in advice["fractions"]]
    series = ({"predicted_agreement": advice["agreement"]} if advice.get("metric") == "agreement" else
              {"predicted_top1": advice["top1"], "predicted_map": advice["map"]})
    registry.log_series(client, upgrade_run_id(plan), series, steps=steps, timestamp=timestamp)


@task(name="log-gate", **IO_RETRIES, **NO_CACHING)
def log_gate(client, run_id: str, numbers: dict, timestamp: int) -> None:
    """The promotion gate's curve and numbers on the upgrade's run. ``timestamp``:
    ``registry.metric_time()``."""
    series = {"gate.top1": numbers["top1"], "gate.nfr1": numbers["nfr1"]}
    if "map" in numbers:  # judged queries: mAP along the backfill too
        series["gate.map"] = numbers["map"]
    registry.log_series(client, run_id, series, timestamp=timestamp)
    registry.log_metrics(client, run_id, {f"gate.{k}": numbers[k] for k in
                                          ("champion_top1", "top1_auc", "top1_auc_gain", "nfr1_mean")},
                         timestamp=timestamp)


@task(name="follow-decision-in-registry", **IO_RETRIES, **NO_CACHING)
def follow_decision(client, plan: Plan, tags: dict, promote: bool) -> None:
    """The end's registry step: the decision's tags on the version and the upgrade's run, and
    champion moved when it passed."""
    registry.record_promotion(client, plan.new.name, plan.new.version, plan.mlflow_run_id, tags, promote)


@task(name="end-aborted-run", **IO_RETRIES, **NO_CACHING)
def end_aborted_run(client, run_id: str, aborted: str) -> None:
    """An aborted upgrade's run ends KILLED, tagged ``fastfill.aborted`` with ``aborted`` (who
    aborted it, when, how far it had got)."""
    client.set_tag(run_id, "fastfill.aborted", aborted)
    client.set_terminated(run_id, "KILLED")


@task(name="record-rollback-in-registry", **IO_RETRIES, **NO_CACHING)
def record_rollback(client, name: str, version: str, previous: str, run_id: str | None, tags: dict) -> bool:
    """A rollback's registry step (``registry.record_rollback``): ``tags`` on the rolled-back version
    and its upgrade's run, ``champion`` back on ``previous`` when it still names ``version``.
    Returns whether champion moved (on a retry: also when the last try moved it)."""
    return registry.record_rollback(client, name, version, previous, run_id, tags, retried=retrying())


class UpgradeProgress:
    """Progress to MLflow (fraction, items, and retrieval when the done chunks form a longer
    prefix of the order: ``measure``'s points) and to a Prefect progress artifact."""

    def __init__(self, client, store_uri: str, plan: Plan, measure: BackfillMeasure, artifact_key: str):
        from prefect.artifacts import create_progress_artifact

        self.client, self.plan, self.measuring = client, plan, measure
        self.run_id = upgrade_run_id(plan)
        io_retried(lambda: self.client.update_run(self.run_id, status="RUNNING"), f"reopening MLflow run {self.run_id}")
        history = self.client.get_metric_history(self.run_id, "top1")
        self.measured = {int(m.step) for m in history}
        # called in a sync context: the id itself, not a coroutine
        self.artifact = cast(UUID, create_progress_artifact(0.0, key=artifact_key,
                                                            description=f"backfill of {plan.upgrade_id} in {store_uri}"))

    def chunk_done(self, done: set[int], items_done: int) -> None:
        from prefect.artifacts import update_progress_artifact

        fraction = items_done / self.plan.num_items
        update_progress_artifact(self.artifact, 100.0 * fraction)
        self._log({"backfill_fraction": fraction, "items_backfilled": items_done}, len(done))
        self.measure(done)

    def measure(self, done: set[int]) -> None:
        for items, metrics in self.measuring.points(done, self.measured):
            self._log(metrics, items)
            self.measured.add(items)
            log(f"at {items}/{self.plan.num_items} backfilled: top-1 {100 * metrics['top1']:.2f}%, "
                f"mAP {100 * metrics['map']:.2f}%")

    def _log(self, metrics: dict[str, float], step: int) -> None:
        """``metrics`` at ``step``, retried: stamped once, so a try whose points landed and whose
        answer was lost leaves its retry sending the same points, kept once."""
        stamp = registry.metric_time()
        io_retried(lambda: registry.log_metrics(self.client, self.run_id, metrics, step=step, timestamp=stamp),
                   f"logging the backfill's progress to MLflow run {self.run_id}")

    def close(self, ok: bool) -> None:
        status = "FINISHED" if ok else "FAILED"
        io_retried(lambda: self.client.set_terminated(self.run_id, status), f"ending MLflow run {self.run_id}")
