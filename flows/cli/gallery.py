"""Commands of the stored gallery: ingest, info, gc, the upgrade and its status, search."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from flows.cli.common import (
    REJECTED, USAGE, ParamsOption, StoreOption, app, call, fail, load, need_services, require_services, store_uri,
)


gallery_app = typer.Typer(no_args_is_help=True, help="The gallery in object storage: ingest, info, garbage collection.")
app.add_typer(gallery_app, name="gallery")
upgrade_app = typer.Typer(help="Upgrade the stored gallery to a new model (`fastfill upgrade --to ...`), "
                               "or see its state (`fastfill upgrade status`).")
app.add_typer(upgrade_app, name="upgrade")


def _gallery(uri: str):
    from components.gallery.catalog import Gallery
    from components.gallery.store import open_store

    store = open_store(uri)
    store.check()
    return Gallery(store)


# the upgrade's options and the gallery.upgrade keys they set
_UPGRADE_OPTIONS = {"chunk_size": "--chunk-size", "max_concurrency": "--concurrency", "order": "--order",
                    "task_runner": "--runner", "dask_address": "--dask-address",
                    "max_items_per_second": "--max-items-per-second", "stop_when_gain_below": "--stop-when-gain-below",
                    "map_pairs": "--pairs", "recheck": "--recheck", "judgments": "--judgments"}


def _with_upgrade(config, **changes):
    """params with the command's gallery.upgrade options applied, checked as params.yaml is
    (one line per bad value, naming its key and the option that set it)."""
    from components.platform.config import ConfigError, parse_params

    given = {k: v for k, v in changes.items() if v is not None}
    data = config.model_dump()
    data["gallery"]["upgrade"].update(given)
    try:
        return parse_params(data, Path("the command's options"))
    except ConfigError as error:
        lines = str(error).splitlines()
        for i, line in enumerate(lines):
            key = line.strip().split(":", 1)[0].removeprefix("gallery.upgrade.")
            if key in given and key in _UPGRADE_OPTIONS:
                lines[i] = f"{line}; set by {_UPGRADE_OPTIONS[key]}"
        fail("\n".join(lines), USAGE)


def _judgments_path(text: str | None) -> str | None:
    """A local judgments file as an absolute path (the flow run reads it, wherever it runs from);
    a missing one is refused here, in one line."""
    if text is None or "://" in text:
        return text
    path = Path(text).expanduser()
    if not path.is_file():
        fail(f"--judgments {text}: no such file; give a CSV or Parquet file with columns query and relevant", USAGE)
    return str(path.resolve())


def _parse_budget(text: str | None) -> float | int | None:
    if text is None:
        return None
    try:
        value = float(text.rstrip("%")) / 100 if text.endswith("%") else (float(text) if "." in text else int(text))
    except ValueError:
        fail(f"--budget {text!r}: give a fraction (0.25 or 25%) or a count of items (2500)", 2)
    if (isinstance(value, float) and not 0 < value <= 1) or (isinstance(value, int) and value < 1):
        fail(f"--budget {text!r}: a fraction must be in (0, 1], a count at least 1", 2)
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
    config = load(params)
    from flows.gallery import ingest_flow

    uri = store_uri(config, store)
    need_services(config)
    # the flow run reads params.yaml itself: its Prefect parameters are these few values
    manifest = call(ingest_flow, store_uri=uri, model_uri=model, images=images, labels=labels, groups=groups, ids=ids,
                    features=features, params_path=str(params.resolve()))
    typer.echo(f"{uri}: {manifest['num_items']} items, model {manifest['model']['uri']}")


def _parse_shape(text: str | None) -> tuple[int, int, int] | None:
    if text is None:
        return None
    try:
        shape = tuple(int(x) for x in text.replace("x", ",").split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        fail(f"--image-shape {text!r}: give channels,height,width, e.g. 1,28,28 or 3,224,224", 2)
    return shape


@gallery_app.command("adopt")
def gallery_adopt(manifest: Annotated[Path, typer.Option(help="CSV or Parquet: id, uri (s3://bucket/key, a path, "
                                                         "or a path under --root), optional label and group")],
                  store: StoreOption = None,
                  root: Annotated[str | None, typer.Option(help="where relative URIs live: a folder or "
                                                           "s3://bucket/prefix")] = None,
                  features: Annotated[list[Path] | None, typer.Option(
                      help="the current features in the manifest's row order: .npy shards (repeat the option, in "
                           "order) or one Parquet file; omitted: the model embeds the images")] = None,
                  features_column: Annotated[str, typer.Option(help="the Parquet column of the features")] = "features",
                  model: Annotated[str, typer.Option(help="the model the features come from; default: "
                                                     "models:/<registered_model>@champion")] = "",
                  image_shape: Annotated[str | None, typer.Option(help="C,H,W the model takes; default: from its "
                                                                  "registered signature")] = None,
                  params: ParamsOption = Path("params.yaml")) -> None:
    """Adopt a gallery where it is: the images are not copied, a backfill reads them by URI."""
    config = load(params)
    from flows.gallery import adopt_flow

    uri = store_uri(config, store)
    result = call(adopt_flow, config, uri, manifest, model, root, features or None, features_column,
                  _parse_shape(image_shape))
    typer.echo(f"{uri}: {result['num_items']} items adopted, model {result['model']['uri']}; images read by URI")
    if not result.get("has_labels") and not config.gallery.upgrade.judgments:
        typer.echo(f"warning: {manifest} has no label column and gallery.upgrade.judgments is not set: the promotion "
                   "gate of an upgrade of this gallery needs judged queries (`fastfill upgrade --judgments FILE`), or "
                   "the upgrade runs with --no-gate", err=True)


@gallery_app.command("info")
def gallery_info(store: StoreOption = None, params: ParamsOption = Path("params.yaml")) -> None:
    """The gallery's manifest and upgrade state, as JSON."""
    upgrade_status(store, params)


@gallery_app.command("gc")
def gallery_gc(store: StoreOption = None, params: ParamsOption = Path("params.yaml")) -> None:
    """Delete features of models the gallery no longer uses, and finished upgrades' working data."""
    config = load(params)
    from components.gallery.upgrade import collect_garbage

    uri = store_uri(config, store)
    deleted = call(lambda: collect_garbage(_gallery(uri)))
    typer.echo(f"{uri}: deleted {deleted['features']} feature objects and {deleted['upgrade_objects']} "
               "objects of finished upgrades")


def progress_wanted(progress: bool | None, stream=None) -> bool:
    """``--progress`` / ``--no-progress``; neither: FASTFILL_PROGRESS when it says ``bar`` (on),
    ``log`` or ``off`` (off), else on when stderr (``stream``) is a terminal."""
    from components.platform.progress import resolve_mode

    stream = sys.stderr if stream is None else stream
    return resolve_mode(None, stream) == "bar" if progress is None else progress


def progress_mode(progress: bool | None) -> str | None:
    """What ``--progress`` / ``--no-progress`` make of FASTFILL_PROGRESS for the steps the
    command runs in this process (components.platform.progress): ``bar``, or ``log`` (lines
    through the flow's logger, no bar); neither: None, the environment decides."""
    return None if progress is None else ("bar" if progress else "log")


class _ProgressBar:
    """The backfill's bar on the terminal, fed by polling the store's chunk markers, so it moves
    the same whatever runs the chunks (threads here, or Dask workers elsewhere). ``finish`` with
    the flow's result draws the final count, also when the backfill was over before the first
    poll saw it (a small gallery)."""

    def __init__(self, uri: str, enabled: bool, stream=None, interval: float = 0.5):
        import threading

        self.uri, self.enabled, self.interval = uri, enabled, interval
        self.stream = sys.stderr if stream is None else stream
        self.bar = None  # a components.platform.progress.Progress, from the first poll that sees chunks
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fastfill-progress", daemon=True)

    def __enter__(self):
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._halt()
        with self._lock:
            if self.bar is not None:
                self.bar.close()

    def _halt(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _show(self, label: str, total: int, done: int) -> None:
        from components.platform.progress import progress

        with self._lock:
            if self.bar is None:
                # counted from what was done when it was first seen: a resumed backfill's rate is this run's
                self.bar = progress(label, total=total, unit="item", mode="bar", stream=self.stream, initial=done)
            self.bar.update_to(done)

    def finish(self, result: dict) -> None:
        """The flow's result: the bar ends at its count of backfilled items (no bar for an
        upgrade with nothing to do)."""
        self._halt()
        if not self.enabled or result.get("state") == "up-to-date" or not {"items", "items_done"} <= result.keys():
            return
        label = f"backfill {result.get('upgrade') or ''}".rstrip()
        if self.bar is None:
            self._show(label, result["items"], 0)
        self._show(label, result["items"], result["items_done"])

    def _run(self) -> None:
        from components.gallery.upgrade import status

        try:
            gallery = _gallery(self.uri)
            while not self._stop.wait(self.interval):
                state = status(gallery, failures=False)
                info = state.get("upgrade")
                if info and info.get("chunks") and not self._stop.is_set():
                    self._show(f"backfill {info['id']}", state["items"], info["items_done"])
        except Exception:  # noqa: BLE001 - the bar is a convenience; the flow reports the store's errors
            return


def _size(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if count < 1000 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return ""


def _describe_dry_run(plan: dict) -> str:
    if plan.get("to") is None:  # no challenger and no upgrade in progress
        return f"dry run: nothing written. {plan['message']}"
    sample = plan["sample"]
    seconds = plan["estimated_backfill_seconds"]
    lines = [
        f"dry run: nothing written. {plan['from']} -> {plan['to']} on {plan['store']}"
        + (f" (resumes the upgrade in progress, {plan['in_progress']})" if plan["resumes"] else
           f" (the gallery is in the middle of {plan['in_progress']}: a sequential upgrade)" if plan["in_progress"]
           else ""),
        f"  items {plan['items']:,} in {plan['parts']:,} parts; {plan['chunks']:,} chunks of {plan['chunk_size']:,}; "
        f"images {plan['images']}",
        f"  to read: {_size(plan['bytes_to_read']['total'])} (features {_size(plan['bytes_to_read']['features'])}, "
        f"images {_size(plan['bytes_to_read']['images'])}, finish {_size(plan['bytes_to_read']['finish'])})",
        f"  object-store requests: {plan['requests']['total']:,} (plan {plan['requests']['plan']:,}, backfill "
        f"{plan['requests']['backfill']:,}, finish {plan['requests']['finish']:,})",
        f"  measured on {sample['items']} items ({sample['failed']} unreadable): read {1000 * sample['read_seconds_per_item']:.2f} "
        f"ms/item, embed {1000 * sample['embed_seconds_per_item']:.2f} ms/item",
        f"  estimated backfill: {seconds / 3600:.1f} h" if seconds >= 3600 else f"  estimated backfill: {seconds:.0f} s",
        f"  ({plan['note']})",
        f"  truth of the gate and the advisor: {plan['truth']}",
        f"  map pairs (when the registry's map must be trained or checked): {plan['map_pairs']}",
    ]
    advice = plan.get("advice") or {}
    if "top1" in advice:
        from components.gallery.advisor import describe

        lines += ["  " + line for line in describe(advice)]
    elif advice.get("note"):
        lines.append(f"  budget advisor: {advice['note']}")
    return "\n".join(lines)


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
            max_items_per_second: Annotated[float | None, typer.Option(
                help="throttle: start chunks no faster than this many items per second")] = None,
            stop_when_gain_below: Annotated[float | None, typer.Option(
                help="stop at the budget advisor's recommended fraction: where the predicted curve gains less than "
                     "this many top-1 points per 5% of the gallery (e.g. 0.1)")] = None,
            pairs: Annotated[str | None, typer.Option(
                "--pairs", help="where a map's training and check pairs come from: gallery (a sample of its items) "
                                "or splits (this host's prepared split)")] = None,
            recheck: Annotated[bool | None, typer.Option(
                "--recheck", help="check the registry's map again even if it passed on the same pairs' source")] = None,
            judgments: Annotated[str | None, typer.Option(
                help="judged queries for the gate and the advisor: CSV/Parquet with columns query (gallery id or "
                     "image URI) and relevant (gallery id)")] = None,
            dry_run: Annotated[bool, typer.Option(help="print the plan (items, chunks, bytes, requests, an estimated "
                                                  "duration from a measured sample, the predicted backfill curve) "
                                                  "and write nothing")] = False,
            params: ParamsOption = Path("params.yaml")) -> None:
    """Upgrade the stored gallery to a new model: plan, then backfill in chunks in sigma order;
    queries use the new model from the start. The same command resumes a stopped upgrade."""
    if ctx.invoked_subcommand is not None:
        return
    options = {"chunk_size": chunk_size, "max_concurrency": concurrency, "order": order, "task_runner": runner,
               "dask_address": dask_address, "max_items_per_second": max_items_per_second,
               "stop_when_gain_below": stop_when_gain_below, "map_pairs": pairs, "recheck": recheck,
               "judgments": _judgments_path(judgments)}
    config = _with_upgrade(load(params), **options)
    from components.platform.progress import forced_mode
    from flows.upgrade import dry_run_upgrade, run_upgrade_file

    uri = store_uri(config, store)
    need_services(config)  # MLflow and Prefect answer, or one line and exit 5 before any flow
    if dry_run:
        with forced_mode(progress_mode(progress)):
            typer.echo(_describe_dry_run(call(dry_run_upgrade, config, uri, to)))
        return
    start = time.perf_counter()
    # the flow run reads params.yaml itself, with the options as overrides: small, readable parameters
    overrides = {f"gallery.upgrade.{key}": value for key, value in options.items() if value is not None}
    with forced_mode(progress_mode(progress)), _ProgressBar(uri, progress_wanted(progress)) as bar:
        result = call(run_upgrade_file, config, str(params.resolve()), uri, to, _parse_budget(budget), break_lock,
                      gate, overrides)
        bar.finish(result)
    if result["state"] == "up-to-date":
        typer.echo(f"up-to-date: {result['message']}" if result.get("message") else
                   f"up-to-date: the gallery is already built with {result['model']}; nothing to upgrade")
        return
    typer.echo(f"{result['state']}: {result['items_done']} of {result['items']} "
               f"items backfilled ({100 * result['fraction']:.1f}%) in {time.perf_counter() - start:.0f} s; "
               f"MLflow run {result['mlflow_run_id']}")
    advised = (result.get("advice") or {}).get("recommendation")
    if advised:
        metric = "top-1" if advised.get("metric", "top1") == "top1" else "agreement"
        value = advised["top1" if metric == "top-1" else "agreement"]
        full = advised["top1_full" if metric == "top-1" else "agreement_full"]
        typer.echo(f"budget advisor: recommended stop for a gain below {advised['gain_below']:g} {metric} points per 5% is "
                   f"{100 * advised['fraction']:.0f}% (predicted {metric} {100 * value:.2f}, {100 * full:.2f} at 100%)"
                   + ("; stopped there: the same command stays there, a --budget goes on"
                      if result.get("stopped") == "recommended" else ""))
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
        raise typer.Exit(REJECTED)


@upgrade_app.command("status")
def upgrade_status(store: StoreOption = None, params: ParamsOption = Path("params.yaml")) -> None:
    """The gallery's model and the running or paused upgrade, with how much is done (JSON)."""
    config = load(params)
    from components.gallery.upgrade import status

    uri = store_uri(config, store)
    typer.echo(json.dumps(call(lambda: status(_gallery(uri))), indent=2))


@upgrade_app.command("unlock")
def upgrade_unlock(store: StoreOption = None, params: ParamsOption = Path("params.yaml")) -> None:
    """Break a stale upgrade lock (its process is gone); the next `fastfill upgrade` resumes."""
    config = load(params)
    from components.gallery.lock import break_lock

    uri = store_uri(config, store)
    held = call(lambda: break_lock(_gallery(uri).store))
    typer.echo(f"{uri}: " + (f"removed the lock of upgrade {held.get('upgrade')} (pid {held.get('pid')} on "
                             f"{held.get('host')})" if held else "no lock was held"))


def _undo(flow, store: str | None, params: Path) -> tuple[str, dict]:
    """Run an undoing flow (abort, rollback) on the gallery, the services checked first: (its
    store's URI, the flow's result). The flow reads the configuration file itself."""
    config = load(params)
    uri = store_uri(config, store)
    need_services(config)
    return uri, call(flow, store_uri=uri, params_path=str(params.resolve()))


@upgrade_app.command("abort")
def upgrade_abort(store: StoreOption = None, params: ParamsOption = Path("params.yaml")) -> None:
    """Drop the unfinished upgrade; the gallery serves the champion's features again (see docs/upgrade.md)."""
    # Planned or part of the way through its backfill; refused while another process holds the
    # lock, and for an upgrade that finished or was rejected. gc collects its working data; a
    # later `fastfill upgrade` to the same version plans it again from scratch.
    from flows.undo import abort_flow

    uri, record = _undo(abort_flow, store, params)
    typer.echo(f"{uri}: aborted upgrade {record['upgrade']} to {record['to']} ({record['stage']}: "
               f"{record['chunks_done']} of {record['chunks']} chunks, {record['items_done']} of {record['items']} "
               f"items); the gallery serves {record['model']}'s features again. `fastfill gallery gc` deletes its "
               f"working data; `fastfill upgrade --to {record['to']}` plans it again from scratch")


@gallery_app.command("rollback")
def gallery_rollback(store: StoreOption = None, params: ParamsOption = Path("params.yaml")) -> None:
    """Undo the last finished upgrade while the old features exist (before gc): champion moves back."""
    # The gallery serves the previous model's features again, champion moves back to that
    # version (when it still names the rolled-back one), and the rolled-back version is tagged
    # promotion=rolled-back. Refused during an upgrade and once gc collected the old features.
    from flows.undo import rollback_flow

    uri, result = _undo(rollback_flow, store, params)
    typer.echo(f"{uri}: rolled back from {result['from']} to {result['model']}; "
               + ("champion moved back" if result["champion_moved"] else "champion left as it was (it no longer "
                                                                       f"named {result['from']})"))


@app.command()
def search(store: StoreOption = None,
           features: Annotated[Path | None, typer.Option(help=".npy of query features (the query model's)")] = None,
           images: Annotated[Path | None, typer.Option(help=".npy of uint8 query images, embedded with the query model")] = None,
           k: Annotated[int, typer.Option("--k", "-k", help="results per query")] = 10,
           params: ParamsOption = Path("params.yaml")) -> None:
    """Top-k item ids of each query against the gallery as it is now (mid-upgrade: the new model's
    features where backfilled, transformed old features elsewhere), and for each hit where its
    features come from (``sources``). JSON to stdout."""
    config = load(params)
    if (features is None) == (images is None):
        fail("give exactly one of --features or --images", 2)
    from components.gallery.search import GallerySearch
    from flows.gallery import _load_array

    uri = store_uri(config, store)

    def run_search():
        searcher = GallerySearch(_gallery(uri), config.gallery.distance, config.gallery.index)
        if features is not None:
            return searcher, searcher.search(_load_array(features, "--features"), k)
        from components.platform import registry
        from components.experiment import registered

        require_services(config)  # the model comes from the registry
        registry.setup(config.mlflow)
        model = registered.load_model(searcher.query_model.uri)
        return searcher, searcher.search_images(_load_array(images, "--images"), model, k)

    searcher, (ids, distances) = call(run_search)
    typer.echo(json.dumps({"query_model": searcher.query_model.uri, "backfilled": searcher.backfilled,
                           "items": searcher.gallery.num_items, "ids": ids.tolist(), "sources": searcher.sources(ids),
                           "distances": [[round(float(d), 6) for d in row] for row in distances]}))
