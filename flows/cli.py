"""The `fastfill` command: every flow and the bring-your-own-features evaluation."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Upgrade an embedding model without re-indexing: FastFill pipeline, backfill and evaluation.")
stage_app = typer.Typer(no_args_is_help=True, help="Run one pipeline stage (what each DVC stage calls).")
app.add_typer(stage_app, name="stage")

ParamsOption = Annotated[Path, typer.Option("--params", "-p", help="the configuration file")]


def _params(path: Path):
    from components.platform.config import ConfigError, load_params

    try:
        return load_params(path)
    except ConfigError as error:
        typer.secho(str(error), fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None


def _call(flow, *args, **kwargs):
    """Run a flow; bad or missing input ends the command with its message, not a traceback."""
    from components.platform.config import ConfigError
    from components.experiment.data import DataError
    from components.gallery.catalog import GalleryError
    from components.gallery.store import StoreError
    from components.gallery.upgrade import UpgradeLocked
    from components.experiment.map_check import MapCheckError
    from components.platform.registry import RegistryError

    try:
        return flow(*args, **kwargs)
    except (DataError, FileNotFoundError, GalleryError, StoreError, RegistryError, UpgradeLocked,
            MapCheckError, ConfigError) as error:
        typer.secho(f"error: {error}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None


def _dvc_commit(params_path: Path, targets: list[str], done: str | None = None) -> None:
    """Record what a command produced in dvc.lock (``targets``: `dvc commit` arguments), so
    `dvc repro` of those stages redoes nothing. Only for the repository's own params.yaml."""
    if params_path.resolve() != Path("params.yaml").resolve() or not Path("dvc.yaml").is_file():
        return
    dvc = shutil.which("dvc") or str(Path(sys.executable).with_name("dvc"))
    result = subprocess.run([dvc, "commit", "--force", "--quiet", *targets], capture_output=True, text=True)
    if result.returncode != 0:
        typer.secho(f"warning: `dvc commit` failed, DVC does not know about this run:\n{result.stderr}",
                    fg=typer.colors.YELLOW, err=True)
    elif done:
        typer.echo(done)


def _print_summary(metrics: dict) -> None:
    typer.echo("\n                      top-1@0  top-1@100  top1_auc  map_auc")
    for name, entry in metrics.items():
        if name == "headroom":
            continue
        label = name + (f" ({entry['order']})" if "order" in entry else "")
        typer.echo(f"  {label:<20}{100 * entry['top1_0']:8.2f}  {100 * entry['top1_100']:9.2f}"
                   f"  {100 * entry['top1_auc']:8.2f}  {100 * entry['map_auc']:7.2f}")
    for key, gap in metrics.get("headroom", {}).items():
        typer.echo(f"  headroom {key}: {100 * gap:.2f} top-1 points")


@app.command()
def run(params: ParamsOption = Path("params.yaml"),
        dvc_commit: Annotated[bool, typer.Option(help="record the outputs in dvc.lock afterwards")] = True) -> None:
    """Run the whole pipeline: data splits, old and new models, alignment maps, evaluation."""
    config = _params(params)
    from flows.pipeline import pipeline_flow

    start = time.perf_counter()
    metrics = _call(pipeline_flow, config)
    _print_summary(metrics)
    typer.echo(f"\npipeline finished in {time.perf_counter() - start:.0f} s; "
               f"reports in {config.paths.reports}/ (metrics.json, backfill.png)")
    if dvc_commit:
        _dvc_commit(params, ["--with-deps", "evaluate"], "dvc.lock updated: `dvc repro evaluate` has nothing to redo")


@app.command()
def seeds(params: ParamsOption = Path("params.yaml"),
          seed: Annotated[list[int] | None, typer.Option("--seed", help="repeat for several; default: experiment.seeds")] = None,
          out: Annotated[Path, typer.Option(help="per-seed outputs go to OUT/seed-<s>/")] = Path("runs")) -> None:
    """Run the pipeline once per seed and write reports/seeds.json (per-seed numbers, mean, std)."""
    config = _params(params)
    from components.evaluation.seed_report import seeds_markdown
    from flows.pipeline import seeds_flow

    chosen = seed or list(config.experiment.seeds)
    start = time.perf_counter()
    summary = _call(seeds_flow, config, chosen, out)
    typer.echo(f"\nseeds {chosen}, {time.perf_counter() - start:.0f} s in all\n")
    typer.echo(seeds_markdown(summary))
    typer.echo(f"written: {config.paths.reports / 'seeds.json'} and seeds.md")


@app.command()
def sweep(params: ParamsOption = Path("params.yaml"),
          size: Annotated[list[str] | None, typer.Option("--size", help="prepare.train_per_class, or all; repeat for "
                                                         "several (default: 100, 300, 1000, all)")] = None,
          seed: Annotated[list[int] | None, typer.Option("--seed", help="repeat for several; default: experiment.seeds")] = None,
          out: Annotated[Path, typer.Option(help="per-size, per-seed outputs go to OUT/n-<size>/seed-<s>/")] = Path("runs/sweep"),
          resume: Annotated[bool, typer.Option(help="reuse the runs that already have a metrics.json")] = False,
          report_only: Annotated[bool, typer.Option(help="run nothing: report the runs that exist")] = False) -> None:
    """FastFill against FCT by data size: the pipeline at each train_per_class and seed, then
    reports/sweep.{md,json,png}."""
    config = _params(params)
    from flows.sweep import sweep_flow, sweep_outputs

    sizes = []
    for text in size or ["100", "300", "1000", "all"]:
        if text != "all" and not (text.isdigit() and int(text) > 0):
            typer.secho(f"error: --size {text!r} must be a positive number of images per class, or all",
                        fg=typer.colors.RED, err=True)
            raise typer.Exit(2)
        sizes.append(None if text == "all" else int(text))
    chosen = seed or list(config.experiment.seeds)
    start = time.perf_counter()
    summary = _call(sweep_flow, config, sizes, chosen, out, resume, report_only)
    outputs = sweep_outputs(config)
    typer.echo(f"\nsweep of sizes {[s or 'all' for s in sizes]} x seeds {chosen}: {time.perf_counter() - start:.0f} s\n")
    typer.echo(outputs["markdown"].read_text())
    typer.echo(f"written: {outputs['markdown']}, {outputs['json'].name}, {outputs['plot'].name}")
    if not summary["holds_everywhere"]:
        raise typer.Exit(4)


@app.command()
def compare(params: ParamsOption = Path("params.yaml"),
            seed: Annotated[list[int] | None, typer.Option("--seed", help="repeat for several; default: compare.seeds")] = None,
            dvc_commit: Annotated[bool, typer.Option(help="record the outputs in dvc.lock afterwards")] = True) -> None:
    """Train and evaluate every method (FCT, FastFill and its ablations, RBT, unified, BCT, RACT)
    over seeds; write reports/comparison.{md,json,png} and log them to MLflow."""
    config = _params(params)
    from components.evaluation.comparison import ranking
    from flows.compare import compare_flow, comparison_outputs

    chosen = seed or list(config.compare.seeds)
    start = time.perf_counter()
    summary = _call(compare_flow, config, chosen)
    typer.echo(f"\ncomparison of seeds {chosen} finished in {time.perf_counter() - start:.0f} s")
    for metric in ("top1_auc", "map_auc"):
        typer.echo(f"  {metric}: " + " > ".join(f"{label} {100 * v:.2f}" for label, v in ranking(summary, metric)))
    outputs = comparison_outputs(config)
    typer.echo(f"written: {outputs['markdown']}, {outputs['json'].name}, {outputs['plot'].name}")
    if dvc_commit and sorted(chosen) == sorted(config.compare.seeds):
        _dvc_commit(params, ["prepare", *(f"compare@{s}" for s in chosen), "comparison"])


class Role(str, Enum):
    old = "old"
    new = "new"


@stage_app.command("prepare")
def stage_prepare(params: ParamsOption = Path("params.yaml")) -> None:
    """Write the deterministic splits (old-train, new-train, test)."""
    config = _params(params)
    from flows.prepare import prepare_flow

    _call(prepare_flow, config)


@stage_app.command("train")
def stage_train(role: Annotated[Role, typer.Option(help="which model")],
                params: ParamsOption = Path("params.yaml")) -> None:
    """Train one embedding model, store its features of the splits, register it."""
    config = _params(params)
    from flows.train import train_flow

    _call(train_flow, config, role.value)


@stage_app.command("align")
def stage_align(method: Annotated[str, typer.Option(help="a method under align: in params.yaml")],
                params: ParamsOption = Path("params.yaml")) -> None:
    """Train one alignment method's map on the stored features and transform the gallery."""
    config = _params(params)
    if method not in config.align:
        typer.secho(f"unknown method {method!r}; params.yaml defines {sorted(config.align)}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    from flows.align import align_flow

    _call(align_flow, config, method)


@stage_app.command("evaluate")
def stage_evaluate(params: ParamsOption = Path("params.yaml")) -> None:
    """Backfill curves of every method and order; reports/metrics.json, plot data, PNG."""
    config = _params(params)
    from flows.evaluate import evaluate_flow

    _print_summary(_call(evaluate_flow, config))


@stage_app.command("compare")
def stage_compare(seed: Annotated[int, typer.Option(help="one of compare.seeds")],
                  params: ParamsOption = Path("params.yaml")) -> None:
    """Every method of the comparison for one seed, under compare.out/seed-<s>/."""
    config = _params(params)
    from flows.compare import compare_seed_flow

    _print_summary(_call(compare_seed_flow, config, seed))


@stage_app.command("comparison")
def stage_comparison(params: ParamsOption = Path("params.yaml")) -> None:
    """reports/comparison.{md,json,png} from the seeds' results."""
    config = _params(params)
    from flows.compare import comparison_report_flow

    _call(comparison_report_flow, config)
    typer.echo((config.paths.reports / "comparison.md").read_text())


class Distance(str, Enum):
    l2 = "l2"
    cosine = "cosine"


@app.command()
def evaluate(features: Annotated[Path, typer.Option(help="folder with query.npy, gallery_new.npy, gallery_old.npy, labels.npy [, order.npy]")],
             distance: Annotated[Distance, typer.Option(help="l2, or cosine on L2-normalised vectors")] = Distance.l2,
             out: Annotated[Path | None, typer.Option(help="JSON file to write; default: print it")] = None,
             points: Annotated[int, typer.Option(help="intermediate curve points B (the curve has B+2)")] = 20) -> None:
    """Evaluate your own features: the backfill curve and its summaries, as JSON."""
    from components.evaluation.byof import EvaluationInputError, evaluate_feature_folder

    try:
        result = evaluate_feature_folder(features, distance=distance.value, num_intermediate=points)
    except EvaluationInputError as error:
        typer.secho(f"error: {error}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    text = json.dumps(result, indent=2)
    if out is None:
        typer.echo(text)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
        typer.echo(f"top1_auc {result['top1_auc']:.4f}, map_auc {result['map_auc']:.4f}; written to {out}")


# ------------------------------------------------------------------------------------------------
# The stored gallery: ingest, upgrade, search

gallery_app = typer.Typer(no_args_is_help=True, help="The gallery in object storage: ingest, info, garbage collection.")
app.add_typer(gallery_app, name="gallery")
upgrade_app = typer.Typer(help="Upgrade the stored gallery to a new model (`fastfill upgrade --to ...`), "
                               "or see its state (`fastfill upgrade status`).")
app.add_typer(upgrade_app, name="upgrade")

StoreOption = Annotated[str | None, typer.Option("--store", help="a local folder or s3://bucket/prefix; "
                                                 "default: gallery.store in params.yaml")]


def _store(config, store: str | None) -> str:
    return store or config.gallery.store


def _fail(error: Exception, code: int = 1):
    typer.secho(f"error: {error}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code) from None


def _gallery(uri: str):
    from components.gallery.catalog import Gallery
    from components.gallery.store import open_store

    store = open_store(uri)
    store.check()
    return Gallery(store)


def _with_upgrade(config, **changes):
    from components.platform.config import Params

    data = config.model_dump()
    data["gallery"]["upgrade"].update({k: v for k, v in changes.items() if v is not None})
    try:
        return Params.model_validate(data)
    except ValueError as error:
        _fail(error, 2)


def _parse_budget(text: str | None) -> float | int | None:
    if text is None:
        return None
    try:
        value = float(text.rstrip("%")) / 100 if text.endswith("%") else (float(text) if "." in text else int(text))
    except ValueError:
        _fail(f"--budget {text!r}: give a fraction (0.25 or 25%) or a count of items (2500)", 2)
    if (isinstance(value, float) and not 0 < value <= 1) or (isinstance(value, int) and value < 1):
        _fail(f"--budget {text!r}: a fraction must be in (0, 1], a count at least 1", 2)
    return value


@gallery_app.command("ingest")
def gallery_ingest(store: StoreOption = None,
                   model: Annotated[str, typer.Option(help="whose features the gallery stores; default: "
                                                     "models:/<registered_model>@champion")] = "",
                   images: Annotated[Path | None, typer.Option(help="uint8 .npy, (N, C, H, W) or (N, H, W); default: "
                                                            "the prepared test split")] = None,
                   labels: Annotated[Path | None, typer.Option(help=".npy of N integer labels")] = None,
                   groups: Annotated[Path | None, typer.Option(help=".npy of N group names or numbers")] = None,
                   ids: Annotated[Path | None, typer.Option(help=".npy of N unique integer item ids; default 0..N-1")] = None,
                   features: Annotated[Path | None, typer.Option(help=".npy of precomputed features of the model")] = None,
                   params: ParamsOption = Path("params.yaml")) -> None:
    """Put images (and labels, groups) into the store with the champion model's features."""
    config = _params(params)
    from flows.gallery import ingest_flow

    uri = _store(config, store)
    manifest = _call(ingest_flow, config, uri, model, images, labels, groups, ids, features)
    typer.echo(f"{uri}: {manifest['num_items']} items, model {manifest['model']['uri']}")


@gallery_app.command("info")
def gallery_info(store: StoreOption = None, params: ParamsOption = Path("params.yaml")) -> None:
    """The gallery's manifest and upgrade state, as JSON."""
    upgrade_status(store, params)


@gallery_app.command("gc")
def gallery_gc(store: StoreOption = None, params: ParamsOption = Path("params.yaml")) -> None:
    """Delete features of models the gallery no longer uses, and finished upgrades' working data."""
    config = _params(params)
    from components.gallery.upgrade import collect_garbage

    uri = _store(config, store)
    deleted = _call(lambda: collect_garbage(_gallery(uri)))
    typer.echo(f"{uri}: deleted {deleted['features']} feature objects and {deleted['upgrade_objects']} "
               "objects of finished upgrades")


class _ProgressBar:
    """A progress bar on the terminal fed by polling the store's chunk markers, so it moves the
    same whatever runs the chunks (threads here, or Dask workers elsewhere)."""

    def __init__(self, uri: str, enabled: bool):
        import threading

        self.uri, self.enabled = uri, enabled
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self.enabled:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        from tqdm import tqdm

        from components.gallery.upgrade import status

        bar = None
        try:
            gallery = _gallery(self.uri)
            while not self._stop.wait(0.5):
                state = status(gallery)
                info = state.get("upgrade")
                if not info or not info.get("chunks"):
                    continue
                if bar is None:
                    bar = tqdm(total=state["items"], unit="item", desc=f"backfill {info['id']}", file=sys.stderr)
                bar.n = info["items_done"]
                bar.refresh()
            if bar is not None:
                final = status(gallery)
                bar.n = final["upgrade"]["items_done"] if final.get("upgrade") else final["items"]
                bar.close()
        except Exception:  # noqa: BLE001 - the bar is a convenience; the flow reports errors
            if bar is not None:
                bar.close()


@upgrade_app.callback(invoke_without_command=True)
def upgrade(ctx: typer.Context,
            store: StoreOption = None,
            to: Annotated[str, typer.Option("--to", help="the new model; default models:/<registered_model>@challenger")] = "",
            budget: Annotated[str | None, typer.Option(help="stop after a fraction (0.25, 25%) or a count of items")] = None,
            chunk_size: Annotated[int | None, typer.Option(help="items per backfill chunk (a new upgrade only)")] = None,
            concurrency: Annotated[int | None, typer.Option(help="chunks in flight at once")] = None,
            order: Annotated[str | None, typer.Option(help="sigma or random (a new upgrade only)")] = None,
            runner: Annotated[str | None, typer.Option(help="threads, or dask")] = None,
            dask_address: Annotated[str | None, typer.Option(help="scheduler of an existing Dask cluster")] = None,
            break_lock: Annotated[bool, typer.Option(help="take over a lock held by another upgrade")] = False,
            gate: Annotated[bool | None, typer.Option(help="check the promotion gates before switching; default: promotion.gate")] = None,
            progress: Annotated[bool | None, typer.Option(help="show a progress bar; default: on a terminal")] = None,
            params: ParamsOption = Path("params.yaml")) -> None:
    """Upgrade the stored gallery to a new model: plan, then backfill in chunks in sigma order;
    queries use the new model from the start. The same command resumes a stopped upgrade."""
    if ctx.invoked_subcommand is not None:
        return
    config = _with_upgrade(_params(params), chunk_size=chunk_size, max_concurrency=concurrency, order=order,
                           task_runner=runner, dask_address=dask_address)
    from flows.gallery import upgrade_flow

    settings = config.gallery.upgrade
    flow = upgrade_flow
    if settings.task_runner == "dask":
        from prefect_dask import DaskTaskRunner

        runner_obj = DaskTaskRunner(address=settings.dask_address) if settings.dask_address else \
            DaskTaskRunner(cluster_kwargs={"n_workers": settings.max_concurrency, "threads_per_worker": 1})
    else:
        from prefect.task_runners import ThreadPoolTaskRunner

        runner_obj = ThreadPoolTaskRunner(max_workers=settings.max_concurrency + 1)
    flow = upgrade_flow.with_options(task_runner=runner_obj)
    uri = _store(config, store)
    start = time.perf_counter()
    with _ProgressBar(uri, sys.stderr.isatty() if progress is None else progress):
        result = _call(flow, config, uri, to, _parse_budget(budget), break_lock, gate)
    typer.echo(f"{result['state']}: {result['items_done']} of {result['items']} "
               f"items backfilled ({100 * result['fraction']:.1f}%) in {time.perf_counter() - start:.0f} s; "
               f"MLflow run {result['mlflow_run_id']}")
    if "promotion" in result:
        numbers, decision = result["promotion"]["numbers"], result["promotion"]
        reached = numbers["fraction_to_gain"]
        typer.echo(f"promotion gate: {'passed, champion moved' if decision['passed'] else 'REJECTED'}: champion top-1 "
                   f"{100 * numbers['champion_top1']:.2f}, challenger mean top-1 along the backfill "
                   f"{100 * numbers['top1_auc']:.2f}, NFR@1 {100 * numbers['nfr1_mean']:.2f}%, gain reached at "
                   f"{'never' if reached is None else f'{100 * reached:.0f}%'}")
        for reason in decision["reasons"]:
            typer.echo(f"  - {reason}")
    if result["state"] == "rejected":
        raise typer.Exit(3)


@upgrade_app.command("status")
def upgrade_status(store: StoreOption = None, params: ParamsOption = Path("params.yaml")) -> None:
    """The gallery's model and the running or paused upgrade, with how much is done (JSON)."""
    config = _params(params)
    from components.gallery.upgrade import status

    uri = _store(config, store)
    typer.echo(json.dumps(_call(lambda: status(_gallery(uri))), indent=2))


@upgrade_app.command("unlock")
def upgrade_unlock(store: StoreOption = None, params: ParamsOption = Path("params.yaml")) -> None:
    """Break a stale upgrade lock (its process is gone); the next `fastfill upgrade` resumes."""
    config = _params(params)
    from components.gallery.upgrade import break_lock

    uri = _store(config, store)
    held = _call(lambda: break_lock(_gallery(uri).store))
    typer.echo(f"{uri}: " + (f"removed the lock of upgrade {held.get('upgrade')} (pid {held.get('pid')} on "
                             f"{held.get('host')})" if held else "no lock was held"))


@app.command()
def search(store: StoreOption = None,
           features: Annotated[Path | None, typer.Option(help=".npy of query features (the query model's)")] = None,
           images: Annotated[Path | None, typer.Option(help=".npy of uint8 query images, embedded with the query model")] = None,
           k: Annotated[int, typer.Option("--k", "-k", help="results per query")] = 10,
           params: ParamsOption = Path("params.yaml")) -> None:
    """Top-k item ids of each query against the gallery as it is now (mid-upgrade: the new model's
    features where backfilled, transformed old features elsewhere). JSON to stdout."""
    config = _params(params)
    if (features is None) == (images is None):
        _fail("give exactly one of --features or --images", 2)
    from components.gallery.search import GallerySearch
    from flows.gallery import _load_array

    uri = _store(config, store)

    def run_search():
        searcher = GallerySearch(_gallery(uri), config.gallery.distance)
        if features is not None:
            return searcher, searcher.search(_load_array(features, "--features"), k)
        from components.platform import registry

        registry.setup(config.mlflow)
        model = registry.load_model(searcher.query_model.uri)
        return searcher, searcher.search_images(_load_array(images, "--images"), model, k)

    searcher, (ids, distances) = _call(run_search)
    typer.echo(json.dumps({"query_model": searcher.query_model.uri, "backfilled": searcher.backfilled,
                           "items": searcher.gallery.num_items, "ids": ids.tolist(),
                           "distances": [[round(float(d), 6) for d in row] for row in distances]}))


webhook_app = typer.Typer(no_args_is_help=True, help="MLflow registry webhooks: receive them, register one.")
app.add_typer(webhook_app, name="webhook")


@app.command()
def serve(params: ParamsOption = Path("params.yaml")) -> None:
    """Serve the deployments (needs a Prefect server, PREFECT_API_URL): the upgrade, the registry
    watcher on its interval, the nightly check-and-upgrade and the weekly comparison."""
    config = _params(params)
    from prefect import serve as prefect_serve

    from flows.triggers import deployments, params_file

    found = deployments(config, params_file(params))
    typer.echo("serving " + ", ".join(f"{d.flow_name}/{d.name}" for d in found))
    prefect_serve(*found)


@app.command()
def watch(store: StoreOption = None, params: ParamsOption = Path("params.yaml"),
          resume: Annotated[bool, typer.Option(help="also resume a paused upgrade")] = False) -> None:
    """Check the registry once: start the upgrade deployment when `challenger` is new to the gallery."""
    config = _params(params)
    from flows.triggers import params_file, watch_flow

    typer.echo(json.dumps(_call(watch_flow, params_file(params), _store(config, store), resume), indent=1))


@webhook_app.command("serve")
def webhook_serve(store: StoreOption = None, params: ParamsOption = Path("params.yaml"),
                  host: Annotated[str | None, typer.Option(help="default triggers.webhook_host (127.0.0.1)")] = None,
                  port: Annotated[int | None, typer.Option(help="default triggers.webhook_port")] = None) -> None:
    """Receive MLflow registry webhooks; a signed alias event for `challenger` starts the upgrade."""
    config = _params(params)
    from flows.triggers import WebhookReceiver, params_file, webhook_secret

    try:
        secret = webhook_secret(config)
    except ValueError as error:
        _fail(error, 2)
    receiver = WebhookReceiver(config, params_file(params), _store(config, store), secret,
                               host or config.triggers.webhook_host,
                               config.triggers.webhook_port if port is None else port)
    typer.echo(f"listening on http://{receiver.address[0]}:{receiver.address[1]}/", err=True)
    try:
        receiver.serve_forever()
    except KeyboardInterrupt:
        receiver.shutdown()


@webhook_app.command("register")
def webhook_register(url: Annotated[str, typer.Option(help="where the receiver listens, e.g. http://127.0.0.1:8787/")],
                     params: ParamsOption = Path("params.yaml"),
                     name: Annotated[str, typer.Option(help="the webhook's name in MLflow")] = "fastfill-upgrade") -> None:
    """Register the receiver with the MLflow server (SQL backend) for model_version_alias.created."""
    config = _params(params)
    from components.platform import registry
    from flows.triggers import webhook_secret

    try:
        secret = webhook_secret(config)
    except ValueError as error:
        _fail(error, 2)
    client, _ = registry.setup(config.mlflow)
    hook = client.create_webhook(name=name, url=url, events=["model_version_alias.created"], secret=secret,
                                 description="fastfill: a new challenger starts the gallery upgrade")
    typer.echo(f"webhook {hook.webhook_id} -> {url} (model_version_alias.created)")


if __name__ == "__main__":
    app()
