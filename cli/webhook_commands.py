"""MLflow registry webhooks: receive them (`webhook serve`, which starts upgrades on the Prefect
server), register, list and delete them (the MLflow server alone)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fastfill.cli import app
from fastfill.cli.command_support import (
    INPUT,
    USAGE,
    ParamsOption,
    StoreOption,
    call,
    fail,
    load,
    params_file,
    stop_on_sigterm,
    store_uri,
)
from fastfill.cli.json_output import JsonOption, answer, answers_json, webhook_fields
from fastfill.components.gallery.triggers.webhook_checks import webhook_secret
from fastfill.components.platform import registry
from fastfill.components.platform.registry import RegistryError

webhook_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                          help="MLflow registry webhooks: receive them; register, list and delete them.")
app.add_typer(webhook_app, name="webhook", short_help="MLflow webhooks: serve, register, list, delete.")


@webhook_app.command("serve", short_help="Receive MLflow registry webhooks.")
def webhook_serve(store: StoreOption = None, params: ParamsOption = Path("params.yaml"),
                  host: Annotated[str | None, typer.Option(envvar="FASTFILL_WEBHOOK_HOST",
                                                           help="default triggers.webhook_host (127.0.0.1)")] = None,
                  port: Annotated[int | None, typer.Option(envvar="FASTFILL_WEBHOOK_PORT",
                                                           help="default triggers.webhook_port")] = None) -> None:
    """Receive MLflow registry webhooks; a signed alias event for 'challenger' starts the upgrade."""
    config = load(params)
    from fastfill.services.webhook_receiver import WebhookReceiver  # Prefect: the deliveries start deployments

    try:
        secret = webhook_secret(config)
    except ValueError as error:
        fail(error, USAGE)
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
    stop_on_sigterm()
    try:
        receiver.serve_forever()  # SIGTERM or Ctrl-C: the deliveries in flight get a few seconds, then it ends
    except KeyboardInterrupt:
        pass
    typer.echo(f"stopped; the receiver no longer listens on http://{receiver.address[0]}:{receiver.address[1]}/",
               err=True)


WEBHOOK_EVENTS = ["model_version_alias.created"]
WebhookName = Annotated[str, typer.Option("--name", help="the webhook's name in MLflow")]


def registered_webhooks(client) -> list:
    """Every webhook on the MLflow server, all pages."""
    hooks, token = [], None
    while True:
        page = client.list_webhooks(max_results=100, page_token=token)
        hooks.extend(page)
        token = page.token
        if not token:
            return hooks


def webhook_events(hook) -> list[str]:
    return sorted(str(getattr(event, "value", event)) for event in hook.events)


def _refused_as_input(write, *args, **kwargs):
    """A webhook write; the MLflow server's refusal of the URL becomes bad input that says what to
    change (MLflow accepts only https URLs, and no private address, unless its server allows them)."""
    from mlflow.exceptions import MlflowException

    try:
        return write(*args, **kwargs)
    except MlflowException as error:
        if getattr(error, "error_code", "") != "INVALID_PARAMETER_VALUE":
            raise
        raise RegistryError(f"the MLflow server refused the webhook: {error.message}. An http:// or private-address "
                            "URL needs MLFLOW_WEBHOOK_ALLOWED_SCHEMES=https,http and MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS=true "
                            "in the MLflow server's environment (infra/local-stack.sh sets both)") from None


@webhook_app.command("register", short_help="Register the receiver with the MLflow server.")
def webhook_register(url: Annotated[str, typer.Option(help="where the receiver listens, e.g. http://127.0.0.1:8787/")],
                     params: ParamsOption = Path("params.yaml"), name: WebhookName = "fastfill-upgrade") -> None:
    """Register the receiver with the MLflow server (SQL backend) for model_version_alias.created.
    Idempotent: a webhook of the same name is updated in place (URL, events, secret), never
    registered twice."""
    config = load(params)

    try:
        secret = webhook_secret(config)
    except ValueError as error:
        fail(error, USAGE)
    client, _ = registry.setup(config.mlflow)
    same = sorted((hook for hook in call(registered_webhooks, client) if hook.name == name),
                  key=lambda hook: (hook.creation_timestamp or 0, hook.webhook_id))  # the first registered stays
    description = "fastfill: a new challenger starts the gallery upgrade"
    if not same:
        hook = call(_refused_as_input, client.create_webhook, name=name, url=url, events=WEBHOOK_EVENTS,
                    secret=secret, description=description)
        typer.echo(f"webhook {hook.webhook_id} ({name}) registered -> {url} ({', '.join(WEBHOOK_EVENTS)})")
        return
    hook, *extra = same
    before = (hook.url, webhook_events(hook))
    # the secret cannot be read back: it is always set again, so a changed secret takes effect
    call(_refused_as_input, client.update_webhook, hook.webhook_id, url=url, events=WEBHOOK_EVENTS, secret=secret,
         description=description, status="ACTIVE")
    changed = "unchanged" if before == (url, sorted(WEBHOOK_EVENTS)) else f"updated from {before[0]}"
    typer.echo(f"webhook {hook.webhook_id} ({name}) already registered -> {url} ({changed}; secret set again)")
    for duplicate in extra:  # left by an older release that registered a webhook on every call
        client.delete_webhook(duplicate.webhook_id)
        typer.echo(f"webhook {duplicate.webhook_id} ({name}) deleted: a duplicate of {hook.webhook_id}")


@webhook_app.command("list", short_help="The webhooks registered with MLflow.")
@answers_json
def webhook_list(params: ParamsOption = Path("params.yaml"), as_json: JsonOption = False) -> None:
    """The webhooks registered with the MLflow server: id, name, status, events and URL."""
    config = load(params)

    client, _ = registry.setup(config.mlflow)
    hooks = call(registered_webhooks, client)
    if as_json:
        return answer("fastfill.webhook.list/1", {"tracking": registry.identity(config.mlflow),
                                                  "webhooks": [webhook_fields(h, webhook_events(h)) for h in hooks]})
    if not hooks:
        typer.echo(f"no webhooks on {registry.identity(config.mlflow)}; `fastfill webhook register --url ...` adds one")
        return
    for hook in hooks:
        status = getattr(hook.status, "value", hook.status)
        typer.echo(f"{hook.webhook_id}  {hook.name}  {status}  {','.join(webhook_events(hook))}  {hook.url}")


@webhook_app.command("delete", short_help="Delete a webhook from the MLflow server.")
def webhook_delete(params: ParamsOption = Path("params.yaml"), name: WebhookName = "fastfill-upgrade",
                   webhook_id: Annotated[str | None, typer.Option("--id", help="delete this id instead of by name")] = None
                   ) -> None:
    """Delete the webhook of that name (or id) from the MLflow server."""
    config = load(params)

    client, _ = registry.setup(config.mlflow)
    hooks = call(registered_webhooks, client)
    doomed = [hook for hook in hooks if (hook.webhook_id == webhook_id if webhook_id else hook.name == name)]
    if not doomed:
        known = ", ".join(f"{hook.name} ({hook.webhook_id})" for hook in hooks) or "none"
        fail(f"no webhook {'with id ' + webhook_id if webhook_id else 'named ' + repr(name)} on "
             f"{registry.identity(config.mlflow)}; registered: {known}", INPUT)
    for hook in doomed:
        client.delete_webhook(hook.webhook_id)
        typer.echo(f"webhook {hook.webhook_id} ({hook.name}) deleted")

