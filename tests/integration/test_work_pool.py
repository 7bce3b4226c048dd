"""Upgrades on a Prefect work pool: `fastfill deploy` puts the deployments on pools of a real
Prefect server (creating the pools), a worker started as on another host (its own working folder
and Prefect home, only PREFECT_API_URL in common) polls the GPU pool, and a challenger registered
in a real MLflow store, found by `fastfill watch`, is upgraded by the worker's flow run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from fastfill.components.gallery.layouts.opening import gallery_at
from fastfill.components.gallery.store import open_store
from testkit.process_state import stop_group
from tests.integration.helpers import assert_none_outlive, descendants, registry_models
from tests.integration.test_service_stop import _Command, _prefect_server

pytestmark = pytest.mark.slow  # a Prefect server, a worker and an upgrade of their own: about a minute on 2 cores

BIN = Path(sys.executable).parent
POOL, GPU_POOL = "fastfill-cpu", "fastfill-gpu"
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def _fastfill(args: list[str], cwd: Path, env: dict) -> str:
    done = subprocess.run([str(BIN / "fastfill"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _api(url: str, path: str) -> dict:
    return httpx.get(f"{url}{path}", timeout=10).json()


def _serve_first(url: str, params, params_path: Path, store: str) -> None:
    """The upgrade deployment as `fastfill serve` registers it (served, with its folder as path),
    so that deploying moves it to the pool."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from fastfill.flows.deployments import deployments

    with temporary_settings({PREFECT_API_URL: url}):
        deployments(params, str(params_path), store)[0].apply()


def _wait_for_run(url: str, run_id: str, worker_log: Path, timeout: float = 150) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = _api(url, f"/flow_runs/{run_id}")
        if run["state_type"] in FINAL:
            return run
        time.sleep(1)
    raise AssertionError(f"flow run {run_id} still {run['state_type']} after {timeout} s; the worker said:\n"
                         f"{worker_log.read_text()[-3000:]}")


def _stop(process: subprocess.Popen) -> None:
    """The worker and everything below it (its flow runs have process groups of their own)."""
    below = descendants(process.pid)
    stop_group(process, timeout=20)
    assert_none_outlive(below, timeout=10)


def test_a_registry_triggered_upgrade_runs_on_a_work_pool_worker(upgrade_env, cli_env, tmp_path):
    from fastfill.flows.ingest import ingest_flow

    params, workdir = upgrade_env
    params_path = workdir / "params.yaml"
    client, _, _, old_version, new_version = registry_models(params)
    name = params.mlflow.registered_model
    client.delete_registered_model_alias(name, "challenger")  # registered again below, as a platform team does
    store = str(workdir / "gallery")
    ingest_flow(store_uri=store, params_path=str(params_path))
    gallery = gallery_at(open_store(store))
    assert gallery.manifest(refresh=True)["model"]["version"] == old_version

    host = tmp_path / "worker-host"  # the worker's host: its own folders and Prefect home
    (host / "runs").mkdir(parents=True)  # a process pool's working directory must exist
    with _prefect_server(cli_env, tmp_path) as (server_env, _):
        url = server_env["PREFECT_API_URL"]
        env = {**server_env, "PREFECT_HOME": str(tmp_path / "cli-home")}
        _serve_first(url, params, params_path, store)

        args = ["deploy", "--pool", POOL, "--gpu-pool", GPU_POOL, "-p", str(params_path), "--store", store]
        first_id = _api(url, "/deployments/name/upgrade-gallery/upgrade")["id"]
        first = _fastfill(args, workdir, env)
        print(first)
        assert f"created work pool {POOL} (type process)" in first and f"created work pool {GPU_POOL}" in first
        assert f"upgrade-gallery/upgrade -> work pool {GPU_POOL} (moved from `fastfill serve`" in first
        assert f"registry-watcher/poll -> work pool {POOL} (created" in first
        upgrade = _api(url, "/deployments/name/upgrade-gallery/upgrade")
        assert upgrade["work_pool_name"] == GPU_POOL and upgrade["path"] is None, upgrade
        assert upgrade["entrypoint"] == "fastfill.flows.deployments.upgrade_entry"
        assert upgrade["job_variables"] == {"working_dir": str(workdir)}  # by default the file's folder
        assert _api(url, "/deployments/name/registry-watcher/poll")["work_pool_name"] == POOL
        pools = {pool["name"]: pool["type"] for pool in httpx.post(f"{url}/work_pools/filter", json={}).json()}
        assert pools.get(POOL) == pools.get(GPU_POOL) == "process", pools

        # again, the runs to start in a folder of the worker's host: the same pools, the deployments updated
        again = _fastfill([*args, "--worker-dir", str(host / "runs")], workdir, env)
        assert f"using work pool {POOL} (type process)" in again and "created" not in again, again
        assert f"upgrade-gallery/upgrade -> work pool {GPU_POOL} (updated" in again
        upgrade = _api(url, "/deployments/name/upgrade-gallery/upgrade")
        assert upgrade["job_variables"] == {"working_dir": str(host / "runs")}, upgrade
        assert upgrade["id"] == first_id

        worker_env = {**server_env, "PREFECT_HOME": str(host / "prefect-home"), "PREFECT_WORKER_QUERY_SECONDS": "1"}
        with open(host / "worker.log", "w") as log:
            worker = subprocess.Popen([str(BIN / "prefect"), "worker", "start", "--pool", GPU_POOL], cwd=host,
                                      env=worker_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            # `fastfill serve` leaves the deployments on pools to their workers (a runner would race them)
            serve = _Command(["serve", "-p", str(params_path), "--store", store], workdir, env, "serve")
            try:
                serve.wait_for("serving nothing: every deployment is on a work pool")
                for deployment, pool in (("upgrade-gallery/upgrade", GPU_POOL), ("registry-watcher/poll", POOL)):
                    assert f"not serving {deployment}: it is on the work pool {pool}," in serve.text()
            finally:
                serve.stop(signal.SIGTERM)
            assert "stopped; nothing was served here" in serve.text(), serve.text()[-2000:]

            client.set_registered_model_alias(name, "challenger", new_version)
            said = _fastfill(["watch", "-p", str(params_path), "--store", store], workdir, env)
            checked = json.loads(said[said.index("{"):])  # after its log line
            assert checked["started"] is True, checked
            run = _wait_for_run(url, checked["flow_run_id"], host / "worker.log")
        finally:
            _stop(worker)
    log = (host / "worker.log").read_text()
    assert run["state_type"] == "COMPLETED", (run["state"], log[-3000:])
    assert run["work_pool_name"] == GPU_POOL and run["name"] == f"upgrade {store} to models:/{name}/{new_version}"
    assert checked["flow_run_id"] in log  # this worker ran it
    assert gallery.manifest(refresh=True)["model"]["version"] == new_version
    assert str(client.get_model_version_by_alias(name, "champion").version) == new_version
