"""The deployments and the flows they run: the upgrade, the registry check, the comparison.

Every path that starts an upgrade by itself ends in the same Prefect deployment,
``upgrade-gallery/upgrade``:

- the registry watcher (services/registry_watcher.py, a thread of `fastfill serve` polling every
  ``triggers.poll_seconds``; any MLflow backend) starts it when `challenger` names a version the
  gallery is not on or moving to. Each check (``watch_once``) is a plain alias read and manifest
  read: no flow run unless there is an upgrade to start. Pausing the deployment
  ``registry-watcher/poll`` (which has no schedule) pauses it;
- ``registry-watcher/nightly`` (cron) does the same check and also resumes a paused upgrade;
- the webhook receiver (services/webhook_receiver.py, `fastfill webhook serve`) starts it on a
  signed ``model_version_alias.created`` delivery for `challenger` from an MLflow server;
- ``comparison/weekly`` (cron, only when ``triggers.comparison_cron`` is set: off by default) re-runs
  the comparison of methods.

A version is claimed in the gallery's store (create-only) before its upgrade starts, and the
flow run carries an idempotency key, so no version starts two upgrades. A claim whose flow run
ended cancelled or crashed before the gallery started upgrading is started again by the next
trigger (a new attempt, a new key).

`fastfill serve` serves these deployments on its own host; `fastfill deploy` puts them on Prefect
work pools instead (services/work_pools.py), whose workers run them wherever they are started.
"""

from __future__ import annotations

from collections.abc import Callable

from prefect import flow
from prefect.schedules import Cron

from fastfill.components.gallery.layouts.opening import gallery_at
from fastfill.components.gallery.triggers.claims import (
    ENDED_UNSTARTED,
    attempt,
    claim,
    claimed,
    record_start,
    release,
    unfinished,
    wants_upgrade,
)
from fastfill.components.gallery.upgrade.planning import load_plan
from fastfill.components.gallery.upgrade.status import UpgradeInProgress, gallery_status
from fastfill.components.platform import registry
from fastfill.components.platform.config import Params, load_params
from fastfill.components.platform.vocabulary import POLL_DEPLOYMENT, UPGRADE_DEPLOYMENT
from fastfill.flows.parameters import run_parameters, store_of
from fastfill.tasks._policy import log
from fastfill.tasks.gallery_store import store_at


class DeploymentMissing(RuntimeError):
    """The Prefect server has no upgrade deployment to start; the message says how to create it."""


def missing_deployment_message() -> str:
    """What to do when the Prefect server this process talks to has no upgrade deployment."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if url:
        return (f"the deployment {UPGRADE_DEPLOYMENT} does not exist on the Prefect server at {url}; create it by "
                f"running `fastfill serve` with PREFECT_API_URL={url} (it serves every deployment; keep it running), or "
                f"put it on a work pool with `fastfill deploy --pool NAME` and start a worker there")
    return (f"the deployment {UPGRADE_DEPLOYMENT} does not exist on the temporary Prefect server this process "
            "started for itself, because PREFECT_API_URL is not set; set PREFECT_API_URL to the Prefect server "
            "where `fastfill serve` runs (it serves every deployment) and restart this process")


def run_upgrade_deployment(parameters: dict, idempotency_key: str | None = None):
    """Start ``upgrade-gallery/upgrade`` without waiting, its run named after what it does
    (``upgrade <store> to <model>``); DeploymentMissing when the Prefect server does not have it
    (Prefect's own error for that says only "None")."""
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    name = f"upgrade {parameters.get('store') or 'gallery.store'} to {parameters.get('to') or 'challenger'}"
    try:
        return run_deployment(UPGRADE_DEPLOYMENT, timeout=0, idempotency_key=idempotency_key, parameters=parameters,
                              flow_run_name=name)
    except ObjectNotFound as error:
        request = getattr(getattr(error, "http_exc", None), "request", None)
        if request is not None and "/deployments/name/" not in str(request.url):
            raise
        raise DeploymentMissing(missing_deployment_message()) from None


def _entry_run_name() -> str:
    parameters = run_parameters()
    return f"upgrade {store_of(parameters)} to {parameters.get('to') or 'challenger'}"


@flow(name="upgrade-gallery", flow_run_name=_entry_run_name, log_prints=True, persist_result=True)  # as upgrade_flow
def upgrade_entry(params_path: str = "params.yaml", store: str | None = None, to: str = "",
                  gate: bool | None = None, budget: float | None = None):
    """What the upgrade deployment runs: the gallery upgrade with params.yaml's settings, as a
    run of flows/upgrade.py (either layout) on the task runner they name, with the same small
    parameters. Its own run ends as the upgrade's did: Completed, or "Paused" or "Rejected"."""
    from fastfill.flows.upgrade import named_state, run_upgrade_file

    params = load_params(params_path)
    result = run_upgrade_file(params, params_path, store or params.gallery.store, to, budget=budget, gate=gate)
    # the run's result crosses a process (the worker's result storage): the JSON dict of --json
    return named_state(result, to or f"models:/{params.mlflow.registered_model}@challenger", data=result.as_dict())


@flow(name="comparison", log_prints=True)
def comparison_entry(params_path: str = "params.yaml") -> dict:
    """What the scheduled comparison runs: every method over compare.seeds."""
    from fastfill.flows.compare import compare_flow

    summary = compare_flow(load_params(params_path))
    return {"seeds": summary["seeds"], "expectations": summary["expectations"]}


def start_upgrade(params: Params, store_uri: str, version: str, source: str, params_path: str) -> dict:
    """Claim ``version`` for this gallery and start the upgrade deployment (without waiting).
    A version claimed before is not started again."""
    name = params.mlflow.registered_model
    store = store_at(store_uri)
    tries = 1
    if not claim(store, name, version, source, starting=True):
        record = claimed(store, name, version)
        never_started = unfinished(record)
        ended = None if never_started else ended_unstarted(record)
        if record is None or (not never_started and ended is None):  # None: neither unfinished nor ended
            log(f"{name} version {version} was already claimed for {store.uri}; not starting it again")
            return {"started": False, "reason": f"version {version} was already claimed for this gallery"}
        tries = max(1, attempt(record) + (ended is not None))  # a start never recorded: the same attempt
        log(f"{name} version {version} was claimed for {store.uri} by a process that stopped before its start was "
            "recorded; starting it now (the same flow run if that process did start one)" if ended is None else
            f"{name} version {version}: its upgrade's flow run {record['flow_run_id']} ended {ended.lower()} before "
            f"the gallery started upgrading; starting it again (attempt {tries})")
    key = f"upgrade:{store.uri}:{name}:{version}" + (f":{tries}" if tries > 1 else "")
    try:
        run = run_upgrade_deployment({"params_path": params_path, "store": store_uri, "to": f"models:/{name}/{version}"},
                                     idempotency_key=key)
    except BaseException:
        if tries == 1:
            release(store, name, version)  # let a later trigger try again
        raise
    record_start(store, name, version, source, str(run.id), tries)
    log(f"{source}: started {UPGRADE_DEPLOYMENT} for {name} version {version} on {store.uri}: flow run {run.id}")
    return {"started": True, "flow_run_id": str(run.id), "version": version}


def flow_run_state(flow_run_id: str) -> str | None:
    """The state type of a flow run on the Prefect server (``COMPLETED``, ``CANCELLED``, ...), or
    None when the server does not know it (a temporary server's runs are gone with it)."""
    from uuid import UUID

    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    try:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(UUID(flow_run_id))
    except (ObjectNotFound, ValueError):
        return None
    return run.state.type.value if run.state else None


def ended_unstarted(record: dict | None) -> str | None:
    """The state (CANCELLED or CRASHED) of a claim's flow run that ended before its upgrade did
    anything, or None (see ``claims.ENDED_UNSTARTED``)."""
    if not record or not record.get("flow_run_id"):
        return None
    state = flow_run_state(record["flow_run_id"])
    return state if state in ENDED_UNSTARTED else None


def registry_candidate(params: Params, store_uri: str) -> tuple[str | None, str | None]:
    """The registry's candidate for the gallery: (the challenger's version, why it should not
    start an upgrade or None)."""
    client, _ = registry.setup(params.mlflow)
    candidate = registry.alias_version(client, params.mlflow.registered_model, registry.CHALLENGER)
    model, upgrading_to = gallery_course(params, store_uri)
    return candidate, wants_upgrade(model, upgrading_to, candidate)


def gallery_course(params: Params, store_uri: str) -> tuple:
    """(the gallery's model, the model its upgrade in progress goes to or None), for either
    layout: what each registry check reads, from the manifest and the plan alone."""
    gallery = gallery_at(store_at(store_uri))
    manifest = gallery.manifest(refresh=True)
    planned = load_plan(gallery.store, manifest["upgrade"]) if manifest.get("upgrade") else None
    return gallery.model, planned.new if planned else None


def paused_upgrade(params: Params, store_uri: str) -> UpgradeInProgress | None:
    """The gallery's paused upgrade (its ``id`` and ``to``), which a run may resume, or None, on
    any layout."""
    state = gallery_status(gallery_at(store_at(store_uri)), probe=False)
    return state.upgrade if state.state == "paused" else None


def watch_once(params: Params, store_uri: str, params_path: str, resume: bool = False,
               say=log) -> dict:
    """One check of the registry and the gallery, with plain MLflow and store reads: the upgrade
    deployment is started (its one flow run) only when `challenger` is new to the gallery, or,
    with ``resume``, when an upgrade is paused. Nothing changed: no flow run, nothing written."""
    candidate, why_not = registry_candidate(params, store_uri)
    if candidate is not None and why_not is None:  # no candidate always has its reason
        return start_upgrade(params, store_uri, candidate, "registry-watcher", params_path)
    if resume:
        paused = paused_upgrade(params, store_uri)
        if paused is not None:
            run = run_upgrade_deployment({"params_path": params_path, "store": store_uri, "to": paused.to})
            say(f"resuming the paused upgrade {paused.upgrade_id}: flow run {run.id}")
            return {"started": False, "resumed": True, "flow_run_id": str(run.id), "reason": why_not}
    return {"started": False, "reason": why_not}


def _watch_run_name() -> str:
    return f"registry check for {store_of(run_parameters())}"


@flow(name="registry-watcher", flow_run_name=_watch_run_name, log_prints=True)
def watch_flow(params_path: str = "params.yaml", store: str | None = None, resume: bool = False) -> dict:
    """One registry check as a flow run (``registry-watcher/nightly`` on its cron, with ``resume``;
    ``registry-watcher/poll`` when run by hand): ``watch_once``. The polling itself is the
    registry watcher's (services/registry_watcher.py), which starts no run when nothing changed."""
    params = load_params(params_path)
    result = watch_once(params, store or params.gallery.store, params_path, resume)
    if not result.get("started") and not result.get("resumed"):
        log(f"registry watcher: nothing to start ({result['reason']})")
    return result


def deployments(params: Params, params_path: str = "params.yaml", store_uri: str | None = None,
                place: Callable[[str], dict] | None = None) -> list:
    """Every deployment, defined in this one place; `fastfill serve` serves them (and polls the
    registry with the registry watcher). ``registry-watcher/poll`` has no schedule: a schedule would
    make a flow run a minute; the watcher polls instead, and this deployment is its pause switch
    and a check on demand. ``store_uri``: the gallery the upgrade and the checks work on, when it
    is not gallery.store (`fastfill serve --store`). ``place``: for `fastfill deploy`, a function
    of a deployment's full name that gives its work pool (to_deployment's ``work_pool_name``,
    ``job_variables``, ``entrypoint_type``; services/work_pools.py); without it they are served."""
    parameters = {"params_path": params_path, **({"store": store_uri} if store_uri else {})}
    triggers = params.triggers
    where: Callable[[str], dict] = place or (lambda full_name: {})
    found = [
        upgrade_entry.to_deployment(name="upgrade", parameters=parameters, concurrency_limit=1,
                                    description="Upgrade the stored gallery (started by the watcher or a webhook)",
                                    **where(UPGRADE_DEPLOYMENT)),
        watch_flow.to_deployment(name="poll", parameters=parameters,
                                 description=f"One registry check now. `fastfill serve` checks every "
                                             f"{triggers.poll_seconds} s without a flow run and starts the upgrade "
                                             "when a new version has the alias challenger; pause this deployment "
                                             "to pause those checks",
                                 **where(POLL_DEPLOYMENT)),
    ]
    if triggers.nightly_cron:
        found.append(watch_flow.to_deployment(
            name="nightly", parameters={**parameters, "resume": True},
            schedule=Cron(triggers.nightly_cron, timezone=triggers.timezone),
            description="Check the registry and resume a paused upgrade",
            **where("registry-watcher/nightly")))
    if triggers.comparison_cron:
        found.append(comparison_entry.to_deployment(name="weekly", parameters={"params_path": params_path},
                                                    schedule=Cron(triggers.comparison_cron,
                                                                  timezone=triggers.timezone),
                                                    description="Re-run the comparison of every method",
                                                    **where("comparison/weekly")))
    return found
