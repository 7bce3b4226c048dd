"""Commands of the upgrades that run themselves: the deployments (`serve`, `deploy`), the registry
watcher (`watch`); MLflow registry webhooks are cli/webhook_commands.py."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

from fastfill.cli import app
from fastfill.cli.command_support import (
    SERVICE,
    USAGE,
    ParamsOption,
    ServiceUnavailable,
    StoreOption,
    call,
    check_prefect_api,
    exit_within,
    fail,
    load,
    params_file,
    stop_on_sigterm,
    store_uri,
)
from fastfill.cli.json_output import JsonOption, answer, answers_json
from fastfill.flows.deployments import deployments, watch_once
from fastfill.services.deployment_runner import serve_until_stopped
from fastfill.services.registry_watcher import RegistryWatcher
from fastfill.services.work_pools import Placement, deploy_to_pools, on_work_pools, worker_folder


@app.command(short_help="Serve the deployments and poll the registry.")
def serve(store: StoreOption = None, params: ParamsOption = Path("params.yaml")) -> None:
    """Serve the deployments (needs a Prefect server, PREFECT_API_URL): the upgrade, the nightly
    check-and-upgrade and, when triggers.comparison_cron is set, the comparison; and poll the registry every
    triggers.poll_seconds (no flow run unless there is an upgrade to start; pausing the
    deployment registry-watcher/poll pauses the polling). Deployments that 'fastfill deploy' put on
    a work pool are left to that pool's workers."""
    config = load(params)
    _need_prefect_server()

    uri = store_uri(config, store)
    found = deployments(config, params_file(params), uri)
    pooled = on_work_pools([f"{d.flow_name}/{d.name}" for d in found])  # `fastfill deploy` put them there
    for name, pool in pooled.items():
        typer.echo(f"not serving {name}: it is on the work pool {pool}, whose workers run it")
    found = [d for d in found if f"{d.flow_name}/{d.name}" not in pooled]
    typer.echo("serving " + (", ".join(f"{d.flow_name}/{d.name}" for d in found)
                             or "nothing: every deployment is on a work pool"))
    interval = config.triggers.poll_seconds
    watcher = RegistryWatcher(config, params_file(params), uri, interval)
    typer.echo(f"watching {config.mlflow.registered_model}@challenger for {uri} every {interval} s")
    watcher.start(delay=min(interval, 5))  # once the deployments it starts are registered
    failed = None
    try:
        failed = serve_until_stopped(found)  # SIGTERM or Ctrl-C ends it
    finally:
        watcher.stop(wait=2)
        if failed:
            typer.echo(f"the Prefect runner stopped by itself ({failed})", err=True)
        typer.echo(_pause_served(found))


def _need_prefect_server() -> None:
    """Deployments and their schedules live on a Prefect server: without PREFECT_API_URL, or with
    one that does not answer, the command ends in one line before anything is served."""
    from prefect.settings import get_current_settings

    if not get_current_settings().api.url:
        fail("fastfill serve needs a Prefect server, where its deployments and schedules live: start one "
             "(`infra/local-stack.sh start prefect`, or `prefect server start`) and set PREFECT_API_URL (e.g. "
             "http://127.0.0.1:4200/api); one upgrade needs no server: `fastfill upgrade`", SERVICE)
    try:
        check_prefect_api(needed=True)
    except ServiceUnavailable as error:
        fail(error, SERVICE)


def _pause_served(found: list, deadline_seconds: float = 8.0) -> str:
    """Pause the schedules of the deployments this process served (nobody runs them now), within
    ``deadline_seconds``: a server that answers with an error (5xx: its database busy while the
    runner stops) is asked again until then; a server that is gone is not waited for. One line
    says how it ended."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError
    from prefect.settings import PREFECT_API_REQUEST_TIMEOUT, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    if not found:
        return "stopped; nothing was served here (every deployment is on a work pool)"
    deadline = time.monotonic() + deadline_seconds
    pending = [f"{deployment.flow_name}/{deployment.name}" for deployment in found]
    unknown = []  # stopped before the runner registered them: no schedule of theirs is due
    while True:
        try:
            with temporary_settings({PREFECT_CLIENT_MAX_RETRIES: 0, PREFECT_API_REQUEST_TIMEOUT: 5.0}), \
                    get_client(sync_client=True) as client:
                while pending:
                    try:
                        client.pause_deployment(client.read_deployment_by_name(pending[0]).id)
                    except ObjectNotFound:
                        unknown.append(pending[0])
                    pending.pop(0)
            never = f" ({', '.join(unknown)}: not registered yet, so never due)" if unknown else ""
            return f"stopped; the served deployments' schedules are paused until `fastfill serve` runs again{never}"
        except Exception as error:  # noqa: BLE001 - stopping must not fail on it
            status = getattr(getattr(error, "response", None), "status_code", None)
            answered = isinstance(error, PrefectHTTPStatusError) and status is not None
            if answered and status is not None and status >= 500 and time.monotonic() + 1.0 < deadline:
                time.sleep(1.0)
                continue
            why = (f"the Prefect server answered {status}" if answered else "the Prefect server did not answer")
            return (f"stopped; the served deployments' schedules could not be paused ({type(error).__name__}: {why}); "
                    "they stay due until `fastfill serve` runs again")


def _job_variables(text: str | None, option: str) -> dict:
    """A --job-variables value: a JSON object, or nothing."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as error:
        fail(f"{option}: not JSON ({error}); give an object, e.g. '{{\"env\": {{\"FASTFILL_DEVICE\": "
             f"\"cuda\"}}}}'", USAGE)
    if not isinstance(value, dict):
        fail(f"{option}: give a JSON object (job variable -> value), not {type(value).__name__}", USAGE)
    return value


PoolOption = Annotated[str, typer.Option("--pool", help="the work pool of the registry checks, and of every "
                                         "deployment without --gpu-pool; created (type process) if missing")]


@app.command(short_help="Put the deployments on Prefect work pools.")
def deploy(pool: PoolOption,
           gpu_pool: Annotated[str | None, typer.Option("--gpu-pool", help="the work pool of the upgrade and the "
                                                        "comparison (they train models); created (type process) "
                                                        "if missing")] = None,
           store: StoreOption = None, params: ParamsOption = Path("params.yaml"),
           worker_params: Annotated[str | None, typer.Option(help="the configuration file's path on the workers' "
                                                             "hosts; default: this file's absolute path")] = None,
           worker_dir: Annotated[str | None, typer.Option(help="where a process pool's runs start (relative paths "
                                                          "of the file are read from there); default: the "
                                                          "folder of --worker-params")] = None,
           job_variables: Annotated[str | None, typer.Option(help="JSON object: job variables of the runs on "
                                                             "--pool, e.g. an image or env")] = None,
           gpu_job_variables: Annotated[str | None, typer.Option(help="JSON object: job variables of the runs on "
                                                                 "the GPU pool")] = None) -> None:
    """Put the deployments on Prefect work pools (needs PREFECT_API_URL), so that a worker started
    on another host (prefect worker start --pool NAME, where the package is installed) runs them
    instead of 'fastfill serve': the upgrade, the registry checks and the scheduled comparison.
    Pools that are missing are created as process pools. Running it again updates the
    deployments in place. 'fastfill serve' then no longer serves those deployments; it still
    polls the registry, and the upgrades it starts run on the pool."""
    config = load(params)
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        fail("fastfill deploy needs PREFECT_API_URL: the Prefect server that the workers poll (without it the "
             "deployments would go to a temporary server that ends with this command)", USAGE)

    placement = Placement(pool, gpu_pool, _job_variables(job_variables, "--job-variables"),
                          _job_variables(gpu_job_variables, "--gpu-job-variables"))
    call(check_prefect_api, needed=True)
    path = worker_params or params_file(params)
    # keywords: `call` would check the MLflow server too, which deploying does not need
    done = call(deploy_to_pools, params=config, params_path=path, store_uri=store, placement=placement,
                working_dir=worker_dir or worker_folder(path), say=typer.echo)
    for deployed in done:
        extra = f"; job variables {json.dumps(deployed.job_variables)}" if deployed.job_variables else ""
        extra += "; still paused" if deployed.paused else ""
        was = {"created": "created", "updated": "updated", "moved": "moved from `fastfill serve`"}[deployed.action]
        typer.echo(f"{deployed.name} -> work pool {deployed.pool} ({was}{extra})")
    typer.echo(f"the runs read {path} on the worker's host; start a worker there for each pool: "
               + "; ".join(f"prefect worker start --pool {name}" for name in placement.pools())
               + f" (with PREFECT_API_URL={PREFECT_API_URL.value()})")


@app.command(short_help="Check the registry once; start an upgrade if due.")
@answers_json
def watch(store: StoreOption = None, params: ParamsOption = Path("params.yaml"),
          resume: Annotated[bool, typer.Option(help="also resume a paused upgrade")] = False,
          every: Annotated[float | None, typer.Option(help="keep checking, every this many seconds (as 'fastfill "
                                                      "serve' does), until interrupted")] = None,
          as_json: JsonOption = False) -> None:
    """Check the registry once: start the upgrade deployment when 'challenger' is new to the
    gallery. A plain check: no flow run is created when there is nothing to start."""
    config = load(params)

    uri = store_uri(config, store)
    stop_on_sigterm()  # a check blocked on a registry or Prefect server that is gone is interrupted too
    if every is not None:
        if as_json:
            fail("--json answers a single check; --every keeps checking (its lines are not one answer)", USAGE)
        if every <= 0:
            fail(f"--every {every:g}: give a positive number of seconds", USAGE)
        watcher = RegistryWatcher(config, params_file(params), uri, every)
        typer.echo(f"watching {config.mlflow.registered_model}@challenger for {uri} every {every:g} s", err=True)
        # the checks run in a daemon thread: one blocked in a client's retries (a registry that is
        # gone) can neither swallow the interrupt nor keep the process alive after it
        watcher.start()
        try:
            while watcher.alive():
                time.sleep(0.2)
        except KeyboardInterrupt:
            pass
        watcher.stop(wait=2.0)
        typer.echo(f"stopped watching {config.mlflow.registered_model}@challenger for {uri}")
        exit_within(10.0)
        return
    try:
        result = call(watch_once, config, uri, params_file(params), resume)  # a missing deployment: exit 5
    except KeyboardInterrupt:
        typer.echo("stopped; the registry check was interrupted", err=True)
        raise typer.Exit(130) from None
    if as_json:
        return answer("fastfill.watch/1", result)
    typer.echo(json.dumps(result, indent=1))
