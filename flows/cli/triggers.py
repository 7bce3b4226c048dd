"""Commands of the upgrades that run themselves: deployments, the watcher, webhooks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from flows.cli.common import ParamsOption, StoreOption, app, call, fail, load, store_uri

webhook_app = typer.Typer(no_args_is_help=True, help="MLflow registry webhooks: receive them, register one.")
app.add_typer(webhook_app, name="webhook")


@app.command()
def serve(params: ParamsOption = Path("params.yaml")) -> None:
    """Serve the deployments (needs a Prefect server, PREFECT_API_URL): the upgrade, the nightly
    check-and-upgrade and the weekly comparison; and poll the registry every
    triggers.poll_seconds (no flow run unless there is an upgrade to start; pausing the
    deployment registry-watcher/poll pauses the polling)."""
    config = load(params)
    from prefect import serve as prefect_serve

    from flows.triggers import RegistryWatcher, deployments, params_file

    found = deployments(config, params_file(params))
    typer.echo("serving " + ", ".join(f"{d.flow_name}/{d.name}" for d in found))
    interval = config.triggers.poll_seconds
    watcher = RegistryWatcher(config, params_file(params), store_uri(config, None), interval)
    typer.echo(f"watching {config.mlflow.registered_model}@challenger for {store_uri(config, None)} every {interval} s")
    watcher.start(delay=min(interval, 5))  # once the deployments it starts are registered
    try:
        prefect_serve(*found)
    finally:
        watcher.stop()


@app.command()
def watch(store: StoreOption = None, params: ParamsOption = Path("params.yaml"),
          resume: Annotated[bool, typer.Option(help="also resume a paused upgrade")] = False,
          every: Annotated[float | None, typer.Option(help="keep checking, every this many seconds (as `fastfill "
                                                      "serve` does), until interrupted")] = None) -> None:
    """Check the registry once: start the upgrade deployment when `challenger` is new to the
    gallery. A plain check: no flow run is created when there is nothing to start."""
    config = load(params)
    from flows.triggers import DeploymentMissing, RegistryWatcher, params_file, watch_once

    uri = store_uri(config, store)
    if every is not None:
        if every <= 0:
            fail(f"--every {every:g}: give a positive number of seconds", 2)
        watcher = RegistryWatcher(config, params_file(params), uri, every)
        try:
            watcher.run()
        except KeyboardInterrupt:
            return
    try:
        result = call(watch_once, config, uri, params_file(params), resume)
    except DeploymentMissing as error:
        fail(error, 1)
    typer.echo(json.dumps(result, indent=1))


@webhook_app.command("serve")
def webhook_serve(store: StoreOption = None, params: ParamsOption = Path("params.yaml"),
                  host: Annotated[str | None, typer.Option(help="default triggers.webhook_host (127.0.0.1)")] = None,
                  port: Annotated[int | None, typer.Option(help="default triggers.webhook_port")] = None) -> None:
    """Receive MLflow registry webhooks; a signed alias event for `challenger` starts the upgrade."""
    config = load(params)
    from flows.triggers import WebhookReceiver, params_file, webhook_secret

    try:
        secret = webhook_secret(config)
    except ValueError as error:
        fail(error, 2)
    receiver = WebhookReceiver(config, params_file(params), store_uri(config, store), secret,
                               host or config.triggers.webhook_host,
                               config.triggers.webhook_port if port is None else port)
    typer.echo(f"listening on http://{receiver.address[0]}:{receiver.address[1]}/", err=True)
    limits = config.triggers
    typer.echo(f"bodies up to {limits.webhook_max_body_bytes} bytes; {limits.webhook_burst} POSTs at once per address, "
               f"then {limits.webhook_rate_per_minute:g} a minute; a repeated delivery id within "
               f"{limits.max_clock_skew_seconds} s is answered as a duplicate", err=True)
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        typer.secho("warning: PREFECT_API_URL is not set, so a delivery would start the upgrade on a temporary "
                    "Prefect server that has no deployments; point it at the server `fastfill serve` uses",
                    fg=typer.colors.YELLOW, err=True)
    try:
        receiver.serve_forever()
    except KeyboardInterrupt:
        receiver.shutdown()


@webhook_app.command("register")
def webhook_register(url: Annotated[str, typer.Option(help="where the receiver listens, e.g. http://127.0.0.1:8787/")],
                     params: ParamsOption = Path("params.yaml"),
                     name: Annotated[str, typer.Option(help="the webhook's name in MLflow")] = "fastfill-upgrade") -> None:
    """Register the receiver with the MLflow server (SQL backend) for model_version_alias.created."""
    config = load(params)
    from components.platform import registry
    from flows.triggers import webhook_secret

    try:
        secret = webhook_secret(config)
    except ValueError as error:
        fail(error, 2)
    client, _ = registry.setup(config.mlflow)
    hook = client.create_webhook(name=name, url=url, events=["model_version_alias.created"], secret=secret,
                                 description="fastfill: a new challenger starts the gallery upgrade")
    typer.echo(f"webhook {hook.webhook_id} -> {url} (model_version_alias.created)")


if __name__ == "__main__":
    app()
