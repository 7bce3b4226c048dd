"""One look at the state: `fastfill doctor` checks what the product needs (the tracking server,
the registry, the store, the Prefect API, the webhook secret), one line each; `fastfill status`
says where the gallery and its upgrade stand, with the last gate decision and links to the runs."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from fastfill.cli import app, json_output
from fastfill.cli.command_support import (
    SERVICE,
    SERVICE_TIMEOUT,
    ParamsOption,
    StoreOption,
    call,
    check_prefect_api,
    load,
    outcome,
    store_uri,
)
from fastfill.cli.json_output import JsonOption, answer, answers_json
from fastfill.cli.webhook_commands import WEBHOOK_EVENTS, registered_webhooks, webhook_events
from fastfill.components.gallery.layouts.catalog import MANIFEST, check_registry
from fastfill.components.gallery.layouts.opening import gallery_at
from fastfill.components.gallery.store import open_store
from fastfill.components.gallery.triggers.claims import ENDED_UNSTARTED, claimed, unfinished
from fastfill.components.gallery.upgrade.ending import decision
from fastfill.components.gallery.upgrade.outcome import Decision
from fastfill.components.gallery.upgrade.planning import DECISION, load_plan
from fastfill.components.gallery.upgrade.status import GalleryStatus, gallery_status
from fastfill.components.platform import registry
from fastfill.components.platform.registry import CHALLENGER, CHAMPION, ModelRef, alias_version
from fastfill.components.platform.vocabulary import POLL_DEPLOYMENT, UPGRADE_DEPLOYMENT, UPGRADE_FLOW

OK, FAIL, NOT_SET_UP = "ok", "FAIL", "--"  # "--": an optional part that is not set up (not a failure)


def _line(state: str | bool, name: str, text: str) -> None:
    state = OK if state is True else FAIL if state is False else state
    typer.echo(f"{state:<5} {name:<9} {text}")


def _problem(error: Exception) -> str:
    """One line for a failed check: a known failure's own message, else the error's type and text."""
    known = outcome(error)
    return known[1] if known else " ".join(f"{type(error).__name__}: {error}".split())[:400]


def _local_store_missing(uri: str) -> Path | None:
    """The file or folder of a local MLflow store that does not exist (opening it would create
    an empty one), or None."""
    if uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///"):])
        return None if path.is_file() else path
    if uri.startswith("file:") or "://" not in uri:
        path = Path(uri.removeprefix("file://").removeprefix("file:"))
        return None if path.is_dir() else path
    return None


def _demo_host() -> bool:
    """This folder is the product's repository (its pipeline can run here), not a team's host."""
    return Path("dvc.yaml").is_file() and Path("flows").is_dir()


def _make_registry(name: str = "the models") -> str:
    """How to get a registry with models on this host: the demo pipeline in the repository, the
    team's own models anywhere else."""
    if _demo_host():
        return f"run `fastfill run` (it creates the store and registers {name} with champion and challenger)"
    return ("register your models with `fastfill model register --onnx FILE` (or --torchvision NAME --weights FILE, "
            "--mlflow URI) and `--alias champion` / `--alias challenger` (it creates the store)")


def _mlflow_client(config):
    """(client, what was checked): the tracking store's client, after the server answered (an
    http(s) URI) or the local store was found; raises for either problem."""
    from mlflow import MlflowClient

    registry.quiet_store_start()
    uri = registry.tracking_uri(config.mlflow)
    missing = _local_store_missing(uri)
    if missing is not None:
        raise FileNotFoundError(f"no MLflow store at {missing}: point MLFLOW_TRACKING_URI (mlflow.tracking_uri) at "
                                f"your registry, or {_make_registry()}")
    found = registry.check_tracking_server(config.mlflow, timeout=SERVICE_TIMEOUT)
    return MlflowClient(tracking_uri=uri, registry_uri=registry.registry_uri(config.mlflow)), found


def _registry_line(client, config) -> tuple[bool, str]:
    from mlflow.exceptions import MlflowException

    name = config.mlflow.registered_model
    try:
        model = client.get_registered_model(name)
    except MlflowException as error:
        if getattr(error, "error_code", "") == "RESOURCE_DOES_NOT_EXIST":
            return False, (f"no registered model {name!r}: set mlflow.registered_model to yours, or "
                           f"{_make_registry(name)}")
        raise
    aliases = dict(model.aliases)
    text = f"{name}: " + ", ".join(f"{alias} -> v{aliases[alias]}" if alias in aliases else f"no {alias}"
                                   for alias in (CHAMPION, CHALLENGER))
    if CHAMPION not in aliases:
        return False, (f"{text}; give the version the gallery serves the alias {CHAMPION} "
                       f"(MlflowClient().set_registered_model_alias({name!r}, {CHAMPION!r}, VERSION))")
    if CHALLENGER not in aliases:
        text += " (nothing waits to be upgraded to)"
    else:
        tags = client.get_model_version(name, aliases[CHALLENGER]).tags
        if tags.get("promotion") == "rejected":
            text += (f" (v{aliases[CHALLENGER]} was rejected by the promotion gate: {tags.get('promotion.reason', '')}; "
                     f"register a better version and give it the alias {CHALLENGER})")
        elif tags.get("promotion"):
            text += f" (v{aliases[CHALLENGER]}: promotion={tags['promotion']})"
    return True, text


def _store_line(config, uri: str) -> tuple[str | bool, str]:
    store = open_store(uri)
    store.check()
    if not store.exists(MANIFEST):
        return NOT_SET_UP, (f"{store.uri} is reachable and holds no gallery yet: make one with `fastfill gallery "
                            "ingest` (or `fastfill gallery adopt`), or pass --store")
    gallery = gallery_at(store)  # in the layout its manifest names
    manifest = gallery.manifest(refresh=True)
    check_registry(manifest, store.uri, registry.identity(config.mlflow))
    state = gallery_status(gallery, failures=False)
    text = f"{store.uri}: {state.items:,} items, model {state.model}, {state.state}"
    if state.upgrade is not None:
        text += f" ({state.upgrade.upgrade_id})"
    problem = state.index.problem if state.index is not None else None
    if problem:  # the index readers search cannot serve them
        return False, f"{text}; its serving index: {problem}"
    return True, text


def _webhook_line(config, client) -> tuple[str | bool, str]:
    """Webhooks are optional: none registered and no secret is "not set up"; a registered
    webhook without the secret here is a failure (its deliveries cannot be verified)."""
    variable = config.triggers.webhook_secret_env
    secret = bool(os.environ.get(variable))
    try:
        hooks = [h for h in registered_webhooks(client) if set(webhook_events(h)) & set(WEBHOOK_EVENTS)] if client else None
    except Exception:  # noqa: BLE001 - a store without webhooks (file store, older server)
        hooks = None
    listed = "" if hooks is None else f"{len(hooks)} registered ({', '.join(h.name for h in hooks) or 'none'})"
    if not hooks and not secret:
        return NOT_SET_UP, ("no webhook registered and no secret: upgrades start by the watcher or by hand; to start "
                            f"them on registry events set {variable} and run `fastfill webhook register --url URL`")
    if hooks and not secret:
        return False, (f"{listed}, but {variable} is not set here: the receiver cannot verify their deliveries; set it to "
                       "the secret given to `fastfill webhook register`")
    if not hooks:
        return NOT_SET_UP, (f"{variable} is set, but no webhook is registered with the MLflow server: run `fastfill "
                            "webhook register --url URL`" if hooks is not None else f"{variable} is set (this MLflow store "
                            "lists no webhooks)")
    return True, f"{listed}; {variable} is set"


def _prefect_health_line() -> tuple[str | bool, str]:
    """Prefect is optional: without PREFECT_API_URL flows run on a temporary local server. With
    it, the server must answer, and the deployments `fastfill serve` creates should exist."""
    from prefect.settings import get_current_settings

    if not get_current_settings().api.url:
        return NOT_SET_UP, ("PREFECT_API_URL is not set: flows run on a temporary local server; set it to a Prefect "
                            "server (and run `fastfill serve`) for deployments, schedules and the UI")
    found = check_prefect_api(SERVICE_TIMEOUT)
    from prefect import get_client

    with get_client(sync_client=True) as prefect:
        names = {f"{prefect.read_flow(d.flow_id).name}/{d.name}" for d in prefect.read_deployments()}
    wanted = [UPGRADE_DEPLOYMENT, POLL_DEPLOYMENT]
    missing = [name for name in wanted if name not in names]
    if missing:
        return NOT_SET_UP, f"{found}; no deployment {', '.join(missing)}: run `fastfill serve` to create them"
    return True, f"{found}; deployments: {', '.join(sorted(names))}"


@app.command(short_help="Check the services, registry and store; say what to fix.")
@answers_json
def doctor(store: StoreOption = None, as_json: JsonOption = False, params: ParamsOption = Path("params.yaml")) -> None:
    """Check the tracking server, the registry (the model, its champion and challenger aliases,
    the challenger's promotion state), the store (reachable; its gallery), the Prefect server
    and its deployments, and the registry webhooks with their secret: one line each, with the
    command that fixes a problem. Optional parts that are not set up (no gallery yet, no
    Prefect server, no webhooks) are marked -- and are not failures. Exit 0 unless a check
    FAILs, else 5."""
    config = load(params)
    results: list[bool] = []
    checks: list[tuple[str, str, str]] = []  # (name, ok / fail / not_set_up, text): the --json document

    def report(state: str | bool, name: str, text: str) -> None:
        checks.append((name, "ok" if state is True else "fail" if state is False else "not_set_up", text))
        if not as_json:
            _line(state, name, text)

    def check(name: str, run) -> object:
        try:
            ok, text, value = run()
        except Exception as error:  # noqa: BLE001 - every problem is one line of the report
            ok, text, value = False, _problem(error), None
        report(ok, name, text)
        results.append(ok is not False)
        return value

    def tracking():
        client, found = _mlflow_client(config)
        return True, found, client

    client = check("tracking", tracking)
    if client is None:
        report(False, "registry", "not checked: the tracking store is not available")
        results.append(False)
    else:
        check("registry", lambda: (*_registry_line(client, config), None))
    check("store", lambda: (*_store_line(config, store_uri(config, store)), None))
    check("prefect", lambda: (*_prefect_health_line(), None))
    check("webhook", lambda: (*_webhook_line(config, client), None))
    if as_json:
        answer(*json_output.doctor_document(checks))
    if not all(results):
        raise typer.Exit(SERVICE)


# ---- status


def _last_decision(store) -> Decision | None:
    """The newest promotion decision recorded in the gallery (``upgrades/<id>/decision.json``)."""
    upgrades = sorted({key.split("/")[1] for key in store.list("upgrades/") if key.endswith("/" + DECISION)})
    decisions = [d for d in (decision(store, u) for u in upgrades) if d is not None]
    return max(decisions, key=lambda d: d.decided or "", default=None)


def _same_store(uri: str, store) -> bool:
    if uri.startswith("s3://"):
        return uri.rstrip("/") == store.uri
    return str(Path(uri.removeprefix("file://")).resolve()) == store.identity


def _challenger_line(client, config, store, state: GalleryStatus) -> str | None:
    """Whether the registry's challenger waits for this gallery, and what became of its claim
    (components/gallery/triggers/claims.py): none yet, a start never recorded, a flow run (with its
    state where PREFECT_API_URL names a server: no temporary server is started for a status), or
    a version aborted or rolled back here. None when there is no challenger, or the gallery is on
    it or upgrading to it."""
    name = config.mlflow.registered_model
    version = alias_version(client, name, CHALLENGER)
    uri = f"models:/{name}/{version}"
    if version is None or uri in (state.model, state.upgrade.to if state.upgrade else None):
        return None
    record = claimed(store, name, version)
    if record is None:
        return (f"{name} v{version} (challenger) waits: no upgrade of this gallery was started for it (`fastfill "
                f"upgrade`, or the registry watcher of `fastfill serve` / `fastfill watch`, starts it)")
    since = f"claimed by {record.get('source')} on {record.get('claimed')}"
    if record.get("source") in ("abort", "rollback"):
        undone = "aborted" if record["source"] == "abort" else "rolled back"
        return (f"{name} v{version} (challenger) was {undone} on this gallery on {record.get('claimed')}: the watcher "
                f"and the webhook do not start it again; `fastfill upgrade --to {uri}` does")
    if unfinished(record):
        return (f"{name} v{version} (challenger) {since}, but its start was never recorded (the process stopped "
                "first): the next registry check starts it")
    run = record.get("flow_run_id")
    ended = _flow_run_state(run)
    if ended in ENDED_UNSTARTED:
        return (f"{name} v{version} (challenger) {since}: its flow run {run} ended {ended.lower()} before the gallery "
                "started upgrading; the next registry check starts it again")
    return (f"{name} v{version} (challenger) {since}: flow run {run}"
            + (f" ({ended.lower()})" if ended else " (its state is on the Prefect server that ran it)")
            + ", not started on the gallery yet")


def _flow_run_state(flow_run_id: str | None) -> str | None:
    """A flow run's state type where PREFECT_API_URL names a server, else None (a status never
    starts a temporary server); None too when that server does not answer or know the run."""
    if not flow_run_id or _named_prefect_settings() is None:
        return None
    from fastfill.flows.deployments import flow_run_state

    try:
        return flow_run_state(flow_run_id)
    except Exception:  # noqa: BLE001 - the prefect line reports the server's problems
        return None


def _mlflow_lines(config, run_id: str | None, decided: Decision | None, store=None,
                  state: GalleryStatus | None = None) -> list[tuple[str, str]]:
    """The challenger's state for this gallery, the run's link and the decision's record in the
    registry; raises when the tracking store cannot be used."""
    from mlflow.exceptions import MlflowException

    client, _ = _mlflow_client(config)
    lines = []
    if store is not None and state is not None:
        waiting = _challenger_line(client, config, store, state)
        if waiting is not None:
            lines.append(("trigger", waiting))
    if decided is not None and decided.new is not None:
        new = decided.new
        try:
            tags = client.get_model_version(new.name, str(new.version)).tags
            tag = tags.get("promotion")
            lines.append(("registry", f"{new.name} v{new.version}: promotion={tag}" if tag else
                          f"{new.name} v{new.version} has no promotion tag yet; run the same `fastfill upgrade` "
                          "again to record the decision"))
        except MlflowException as error:
            if getattr(error, "error_code", "") != "RESOURCE_DOES_NOT_EXIST":
                raise
            lines.append(("registry", f"{new.name} v{new.version} no longer exists"))
    if run_id:
        shown = registry.identity(config.mlflow)
        experiment = client.get_run(run_id).info.experiment_id
        if shown.startswith(("http://", "https://")):
            where = f"{shown.rstrip('/')}/#/experiments/{experiment}/runs/{run_id}"
        else:
            where = (f"experiment {experiment}, run {run_id} in {shown} (`mlflow ui --backend-store-uri {shown}`, then "
                     f"/#/experiments/{experiment}/runs/{run_id})")
        lines.append(("mlflow", where))
    return lines


def _prefect_may_be_named() -> bool:
    """Whether a Prefect server may be named, known without importing Prefect (a second of CPU a
    status does not need): PREFECT_API_URL in the environment, or a Prefect profiles file that
    mentions it (then Prefect's own settings decide)."""
    if os.environ.get("PREFECT_API_URL"):
        return True
    home = Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser()
    profiles = Path(os.environ.get("PREFECT_PROFILES_PATH") or home / "profiles.toml").expanduser()
    try:
        return "PREFECT_API_URL" in profiles.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


def _named_prefect_settings():
    """Prefect's settings where they name a server (PREFECT_API_URL), else None; Prefect is not
    imported where nothing can name one (``_prefect_may_be_named``), and no temporary server is
    ever started for a status."""
    if not _prefect_may_be_named():
        return None
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    return settings if settings.api.url else None


def _prefect_line(gallery_store) -> str | None:
    """The newest upgrade flow run of this gallery on the Prefect server, with its state, as a
    link to the UI; None without PREFECT_API_URL. Raises when the server does not answer."""
    settings = _named_prefect_settings()
    if settings is None:
        return None
    check_prefect_api(SERVICE_TIMEOUT)
    from prefect import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    ui = (settings.ui_url or settings.api.url.rstrip("/").removesuffix("/api")).rstrip("/")
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[UPGRADE_FLOW])),
                                     sort=FlowRunSort.START_TIME_DESC, limit=50)
    for run in runs:
        uri = run.parameters.get("store_uri")
        if isinstance(uri, str) and _same_store(uri, gallery_store):
            state = run.state.name if run.state else "unknown"
            return f"{ui}/runs/flow-run/{run.id} ({run.name}, {state})"
    return f"{ui}/runs (no {UPGRADE_FLOW} flow run of this gallery on {settings.api.url})"


def _show(name: str, text: str) -> None:
    typer.echo(f"{name:<8} {text}")


@app.command("status", short_help="Where the gallery and its upgrade stand.")
@answers_json
def gallery_state(store: StoreOption = None, as_json: JsonOption = False,
                  params: ParamsOption = Path("params.yaml")) -> None:
    """Where the gallery stands: its model, the upgrade in progress and how far it is, the last
    promotion decision, and links to the upgrade's MLflow run and (with PREFECT_API_URL) its
    Prefect flow run; with no gallery yet, the registry and how to make one. Exit 5 when a
    service could not be reached (what it could read is shown)."""
    config = load(params)

    uri = store_uri(config, store)
    lines: dict[str, str] = {}  # what each line says, for --json

    def show(name: str, text: str) -> None:
        lines[name] = text
        if not as_json:
            _show(name, text)

    def answered(healthy: bool, state: GalleryStatus | None = None, decided: Decision | None = None,
                 run_id: str | None = None) -> None:
        if as_json:
            answer("fastfill.status/1", {"ok": healthy, "store": where.uri,
                                         "gallery": state.to_dict() if state else None,
                                         "decision": json_output.decision_fields(decided), "mlflow_run_id": run_id,
                                         "lines": lines})

    where, state, decided = call(_read_gallery, uri)
    if state is None:  # no gallery yet: what the registry holds, and how to make one
        healthy = _show_no_gallery(config, where, show)
        answered(healthy)
        if not healthy:
            raise typer.Exit(SERVICE) from None
        return
    _show_gallery(state, decided, show)
    run_id = state.upgrade.mlflow_run_id if state.upgrade else None
    if run_id is None and decided is not None:
        plan = load_plan(where, decided.upgrade_id)
        run_id = plan.mlflow_run_id if plan else None
    healthy = _show_services(config, run_id, decided, where, state, show)
    answered(healthy, state, decided, run_id)
    if not healthy:
        raise typer.Exit(SERVICE)


def _read_gallery(uri: str):
    """(the store, the gallery's status or None without a gallery, its last promotion decision)."""
    opened = open_store(uri)
    opened.check()
    if not opened.exists(MANIFEST):
        return opened, None, None
    gallery = gallery_at(opened)  # in the layout its manifest names
    return opened, gallery_status(gallery, failures=False), _last_decision(opened)


def _show_no_gallery(config, where, show) -> bool:
    """The lines of a store with no gallery yet: how to make one, and what the registry holds;
    False when the registry could not be read."""
    show("gallery", f"no gallery at {where.uri} yet: make one with `fastfill gallery ingest` (images into "
                    "the store with the champion's features) or `fastfill gallery adopt` (a gallery where it is)")
    try:
        client, _ = _mlflow_client(config)
        ok, text = _registry_line(client, config)
    except Exception as error:  # noqa: BLE001 - reported as one line
        show("registry", f"unavailable: {_problem(error)}")
        return False
    show("registry", text)
    return True


def _show_gallery(state: GalleryStatus, decided: Decision | None, show) -> None:
    """The gallery's own lines: its model, the upgrade and its lock, what comes next, the gate."""
    show("gallery", f"{state.store}: {state.items:,} items, model {state.model}")
    if state.index is not None and state.index.problem:  # the index readers search cannot serve them
        show("index", state.index.problem)
    info = state.upgrade
    if info and info.chunks and info.registry_recorded is not False:
        show("upgrade", f"{state.state}: {info.upgrade_id} ({info.source} -> {info.to}, {info.order} order), "
                        f"{info.chunks_done}/{info.chunks} chunks, {info.items_done or 0:,}/{state.items:,} "
                        f"items ({100 * (info.fraction or 0):.1f}%)")
    elif info:
        show("upgrade", f"{state.state}: {info.upgrade_id} to {info.to}")
    else:
        show("upgrade", "none in progress")
    lock = state.lock
    if lock is not None:
        show("lock", f"held by upgrade {lock.upgrade_id}, process {lock.pid} on {lock.host}"
                     + (" (its lease has expired)" if lock.expired else ""))
    if state.next:
        show("next", state.next)
    if decided is None:
        show("gate", "no promotion decision recorded in this gallery")
    else:
        verdict = decided.verdict if decided.gated else "ungated (promoted without the gate)"
        reasons = "; ".join(decided.reasons)
        show("gate", f"{verdict} on {decided.decided}: {decided.upgrade_id}, {_uri(decided.new)} against "
                     f"champion {_uri(decided.champion)}" + (f": {reasons}" if reasons else ""))


def _show_services(config, run_id: str | None, decided: Decision | None, where, state: GalleryStatus, show) -> bool:
    """The registry's and the run trackers' lines (MLflow, Prefect); False when one could not be
    reached (its line says why)."""
    healthy = True
    try:
        for name, text in _mlflow_lines(config, run_id, decided, where, state):
            show(name, text)
    except Exception as error:  # noqa: BLE001 - reported as one line
        healthy = False
        show("mlflow", f"unavailable: {_problem(error)}")
    try:
        link = _prefect_line(where)
        if link is not None:
            show("prefect", link)
    except Exception as error:  # noqa: BLE001 - reported as one line
        healthy = False
        show("prefect", f"unavailable: {_problem(error)}")
    return healthy


def _uri(model: ModelRef | None) -> str | None:
    return model.uri if model is not None else None
