"""The deployments on Prefect work pools (`fastfill deploy`): a worker polling a pool, on any
host that has the package installed, runs them, where `fastfill serve` runs them in its own
process. The same deployments as `fastfill serve`'s (flows/deployments.py, ``deployments()``),
with a work pool each: the registry checks on ``pool``, the upgrade and the comparison (the
training) on ``gpu_pool`` when one is given. The flow is imported by module path
(``flows.deployments.upgrade_entry``), from the package installed on the worker's host, so no
code is copied or pulled; the runs read the configuration file at ``params_path`` on that host.

A deployment is either served by `fastfill serve` or on a work pool, never both (a runner and a
worker would race for the same runs): `fastfill serve` leaves out those the server has on a
pool (``on_work_pools``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastfill.components.platform.config import Params
from fastfill.flows.deployments import UPGRADE_DEPLOYMENT, deployments

# what trains models: on the GPU pool when there is one (a task's `gpu` tag routes nothing)
GPU_DEPLOYMENTS = (UPGRADE_DEPLOYMENT, "comparison/weekly")
CREATED_TYPE = "process"  # a missing pool is created as a process pool; others: `prefect work-pool create`


@dataclass(frozen=True)
class Placement:
    """Where each deployment goes: ``pool`` for the registry checks, ``gpu_pool`` (else ``pool``)
    for the training; the job variables of each pool's runs."""

    pool: str
    gpu_pool: str | None = None
    job_variables: dict = field(default_factory=dict)
    gpu_job_variables: dict = field(default_factory=dict)

    def pool_of(self, full_name: str) -> str:
        return self.gpu_pool if self.gpu_pool and full_name in GPU_DEPLOYMENTS else self.pool

    def variables_of(self, full_name: str) -> dict:
        gpu = self.gpu_pool and full_name in GPU_DEPLOYMENTS
        return dict(self.gpu_job_variables if gpu else self.job_variables)

    def pools(self) -> list[str]:
        return list(dict.fromkeys([self.pool, *([self.gpu_pool] if self.gpu_pool else [])]))


@dataclass
class Deployed:
    """What `fastfill deploy` did to one deployment."""

    name: str
    pool: str
    action: str  # "created", "updated" (on a pool before) or "moved" (served by `fastfill serve` before)
    job_variables: dict
    paused: bool = False  # paused before, and still


def ensure_pool(client, name: str) -> tuple[Any, bool]:
    """The work pool ``name``, created as a process pool (Prefect's default job template) when the
    server has none of that name: (the pool, whether it was created now)."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
    from prefect.workers.process import ProcessWorker

    try:
        return client.read_work_pool(name), False
    except ObjectNotFound:
        pass
    try:
        client.create_work_pool(WorkPoolCreate(name=name, type=CREATED_TYPE,
                                               base_job_template=ProcessWorker.get_default_base_job_template()))
    except ObjectAlreadyExists:  # created meanwhile by someone else: theirs is used
        return client.read_work_pool(name), False
    return client.read_work_pool(name), True


def placer(placement: Placement, kinds: dict[str, str], working_dir: str | None):
    """``deployments()``'s ``place``: each deployment's pool and job variables, and a module-path
    entrypoint; ``kinds``: each pool's type (``working_dir`` goes to process pools only)."""
    from prefect.deployments.runner import EntrypointType

    def place(full_name: str) -> dict:
        variables = placement.variables_of(full_name)
        pool = placement.pool_of(full_name)
        if kinds[pool] == "process" and working_dir and "working_dir" not in variables:
            variables["working_dir"] = working_dir
        return {"work_pool_name": pool, "job_variables": variables, "entrypoint_type": EntrypointType.MODULE_PATH}

    return place


def deploy_to_pools(params: Params, params_path: str, store_uri: str | None, placement: Placement,
                    working_dir: str | None, say=print) -> list[Deployed]:
    """Create the pools that are missing (process pools) and put every deployment on its pool, by
    module-path entrypoint; ``working_dir``: the folder a process pool's runs start in (relative
    paths in the configuration file are read from there), given to process pools only (Docker
    and Kubernetes runs start in the image's working directory). Idempotent: a deployment that
    exists is updated in place, its id, runs and pause kept."""
    from prefect import get_client
    from prefect.client.schemas.actions import DeploymentUpdate
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        kinds = {}
        for name in placement.pools():
            pool, created = ensure_pool(client, name)
            kinds[name] = pool.type
            say(f"{'created' if created else 'using'} work pool {name} (type {pool.type})")

        done = []
        for deployment in deployments(params, params_path, store_uri, placer(placement, kinds, working_dir)):
            full_name = f"{deployment.flow_name}/{deployment.name}"
            try:
                before = client.read_deployment_by_name(full_name)
            except ObjectNotFound:
                before = None
            deployment_id = deployment.apply()  # unpauses it, as serving does
            if before is not None and before.path:
                # served before: a worker would copy that folder into its runs' working directory
                client.update_deployment(deployment_id, DeploymentUpdate(path=None))
            paused = before is not None and before.paused
            if paused:  # paused in the UI (the watcher's pause switch): it stays paused
                client.pause_deployment(deployment_id)
            action = "created" if before is None else ("updated" if before.work_pool_name else "moved")
            done.append(Deployed(full_name, deployment.work_pool_name, action, deployment.job_variables, paused))
    return done


def on_work_pools(names: list[str]) -> dict[str, str]:
    """Which of the deployments ``names`` the Prefect server has on a work pool: {name: pool}.
    Asked once, without retries and within seconds; a server that does not answer yields {}
    (the runner then reports it in its own way)."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_REQUEST_TIMEOUT, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    pooled: dict[str, str] = {}
    try:
        with temporary_settings({PREFECT_CLIENT_MAX_RETRIES: 0, PREFECT_API_REQUEST_TIMEOUT: 5.0}), \
                get_client(sync_client=True) as client:
            for name in names:
                try:
                    found = client.read_deployment_by_name(name)
                except ObjectNotFound:
                    continue
                if found.work_pool_name:
                    pooled[name] = found.work_pool_name
    except Exception:  # noqa: BLE001 - serving goes on as before; the runner says what is wrong
        return pooled
    return pooled


def worker_folder(params_path: str) -> str | None:
    """The default working directory of a process pool's runs: the folder of the configuration
    file on the worker's host, when its path there is absolute (else Prefect's own default, a
    temporary folder, or the image's working directory)."""
    path = Path(params_path)
    return str(path.parent) if path.is_absolute() else None
