"""Commands of the gallery's upgrade: the upgrade itself (and its dry run), its status, unlock
and abort."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from fastfill.cli import app, json_output
from fastfill.cli.command_support import (
    REJECTED,
    USAGE,
    ParamsOption,
    StoreOption,
    call,
    fail,
    load,
    need_services,
    store_uri,
)
from fastfill.cli.gallery_commands import run_undo, show_status
from fastfill.cli.json_output import JsonOption, answer, answers_json
from fastfill.cli.upgrade_progress import ProgressBar, progress_mode, progress_wanted
from fastfill.components.gallery.advice.advisor import describe
from fastfill.components.gallery.store.lock import break_lock
from fastfill.components.gallery.upgrade.outcome import UpgradeResult
from fastfill.components.gallery.upgrade.reversal import abortable
from fastfill.components.platform import registry
from fastfill.components.platform.config import ConfigError
from fastfill.components.platform.progress import forced_mode
from fastfill.flows.parameters import apply_overrides

if TYPE_CHECKING:  # the dry run's module loads torch: only its type here
    from fastfill.components.gallery.advice.estimate import DryRun
    from fastfill.components.gallery.advice.planning_cost import PlanningEstimate

upgrade_app = typer.Typer(rich_markup_mode=None, help="Upgrade the stored gallery to a new model (fastfill upgrade --to ...), "
                               "or see its state (fastfill upgrade status).")
app.add_typer(upgrade_app, name="upgrade", short_help="Upgrade the gallery to a new model; status, unlock, abort.")

# The gallery.upgrade keys the upgrade's options set, and the option that sets each; an option's
# parameter is its name in snake case (--chunk-size: chunk_size).
UPGRADE_OPTIONS = {"chunk_size": "--chunk-size", "max_concurrency": "--concurrency", "order": "--order",
                   "task_runner": "--runner", "dask_address": "--dask-address",
                   "max_items_per_second": "--max-items-per-second", "stop_when_gain_below": "--stop-when-gain-below",
                   "map_pairs": "--pairs", "recheck": "--recheck", "judgments": "--judgments",
                   "usage_log": "--usage-log"}
# The options that name a file the flow run reads, and what it holds (for the message when it is missing).
FILE_OPTIONS = {"judgments": "a CSV or Parquet file with columns query and relevant",
                "usage_log": "a CSV or Parquet file with columns query and hit"}


def upgrade_overrides(given: dict) -> dict:
    """The overrides (dotted keys, for flows.parameters.apply_overrides) that the options among
    the command's parameters ``given`` set; a local judgments file or usage log as an absolute path."""
    overrides = {}
    for key, option in UPGRADE_OPTIONS.items():
        value = given[option.removeprefix("--").replace("-", "_")]
        if value is not None:
            overrides[f"gallery.upgrade.{key}"] = _file_path(value, option, FILE_OPTIONS[key]) if key in FILE_OPTIONS \
                else value
    return overrides


def _with_upgrade(config, overrides: dict):
    """params with the command's gallery.upgrade options applied, checked as params.yaml is
    (one line per bad value, naming its key and the option that set it)."""
    try:
        return apply_overrides(config, overrides, "the command's options")
    except ConfigError as error:
        fail("\n".join(_naming_the_option(line, overrides) for line in str(error).splitlines()), USAGE)


def _naming_the_option(line: str, overrides: dict) -> str:
    key = line.strip().split(":", 1)[0]
    if key not in overrides:
        return line
    return f"{line}; set by {UPGRADE_OPTIONS[key.removeprefix('gallery.upgrade.')]}"


def _file_path(text: str | None, option: str, holds: str) -> str | None:
    """A local file as an absolute path (the flow run reads it, wherever it runs from); a
    missing one is refused here, in one line."""
    if text is None or "://" in text:
        return text
    path = Path(text).expanduser()
    if not path.is_file():
        fail(f"{option} {text}: no such file; give {holds}", USAGE)
    return str(path.resolve())


def _parse_budget(text: str | None) -> float | int | None:
    if text is None:
        return None
    try:
        value = float(text.rstrip("%")) / 100 if text.endswith("%") else (float(text) if "." in text else int(text))
    except ValueError:
        fail(f"--budget {text!r}: give a fraction (0.25 or 25%) or a count of items (2500)", USAGE)
    if (isinstance(value, float) and not 0 < value <= 1) or (isinstance(value, int) and value < 1):
        fail(f"--budget {text!r}: a fraction must be in (0, 1], a count at least 1", USAGE)
    return value


def _parse_target(text: str | None) -> float | None:
    """--target-top1: 85% or 85 (percent), or 0.85 (a fraction)."""
    if text is None:
        return None
    try:
        value = float(text.rstrip("%"))
    except ValueError:
        fail(f"--target-top1 {text!r}: give the top-1 to reach, in percent (85 or 85%) or as a fraction (0.85)", USAGE)
    value = value / 100 if text.endswith("%") or value > 1 else value
    if not 0 < value <= 1:
        fail(f"--target-top1 {text!r}: top-1 must be above 0 and at most 100%", USAGE)
    return value


def _size(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if count < 1000 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return ""


def describe_planning(planning: PlanningEstimate) -> list[str]:
    """The dry run's lines for ``planning``."""
    items, seconds = planning.embeds, planning.seconds
    labels = {"map_training": "the map's training", "reference_training": "the check's reference"}
    parts = [f"embedding {seconds.embedding:.0f} s"]
    parts += [f"{labels[key]} {value:.0f} s" for key, value in seconds.trainings()]
    lines = [f"  planning embeds {items.total:,} items ({100 * items.share_of_gallery:.1f}% of the gallery: "
             f"map sample {items.map_sample:,}, evaluation sample {items.evaluation_sample:,} of which "
             f"{items.evaluation_outside_map_sample:,} outside it)"
             + (f"; the evaluation sample measures top-1 within ± {items.evaluation_standard_error:.1f} points "
                "(one standard error, at worst)" if items.evaluation_standard_error is not None else ""),
             f"  planning takes about {_duration(seconds.total)} ({', '.join(parts)})"
             + (f", at most {_duration(planning.seconds_at_most)}" if planning.seconds_at_most is not None else "")]
    return lines


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 120:
        return f"{math.ceil(seconds / 60)} min"
    return f"{seconds:.0f} s"


def _describe_dry_run(dry: DryRun) -> str:
    if dry.nothing is not None or dry.cost is None:  # no challenger and no upgrade in progress
        return f"dry run: nothing written. {dry.nothing.message if dry.nothing else ''}"
    cost = dry.cost
    sample, seconds = cost.sample, cost.estimated_backfill_seconds
    lines = [
        f"dry run: nothing written. {dry.source} -> {dry.to} on {cost.store}"
        + (f" (resumes the upgrade in progress, {dry.in_progress})" if dry.resumes else
           f" (the gallery is in the middle of {dry.in_progress}: a sequential upgrade)" if dry.in_progress
           else ""),
        *([f"  re-embed: {dry.small_gallery}"] if dry.small_gallery else []),
        f"  items {cost.items:,} in {cost.parts:,} parts; {cost.chunks:,} chunks of {cost.chunk_size:,}; "
        f"images {cost.images}",
        f"  to read: {_size(cost.bytes_to_read.total)} (features {_size(cost.bytes_to_read.features)}, "
        f"images {_size(cost.bytes_to_read.images)}, finish {_size(cost.bytes_to_read.finish)})",
        f"  object-store requests: {cost.requests.total:,} (plan {cost.requests.plan:,}, backfill "
        f"{cost.requests.backfill:,}, finish {cost.requests.finish:,})",
        f"  measured on {sample.items} items ({sample.failed} unreadable): read "
        f"{1000 * sample.read_seconds_per_item:.2f} "
        f"ms/item, embed {1000 * sample.embed_seconds_per_item:.2f} ms/item",
        f"  estimated backfill: {seconds / 3600:.1f} h" if seconds >= 3600 else f"  estimated backfill: {seconds:.0f} s",
        f"  ({cost.note})",
        *(describe_planning(dry.planning) if dry.planning else []),
        f"  truth of the gate and the advisor: {dry.truth}",
        f"  map pairs (when the registry's map must be trained or checked): {dry.map_pairs}",
    ]
    advice = dry.advice
    gate_note = advice.gate.note if advice is not None and advice.gate is not None else None
    gate = advice.gate.decided if advice is not None and advice.gate is not None else None
    if advice is not None and advice.prediction is not None and advice.top1_curve:
        lines += ["  " + line for line in describe(advice.prediction)]
    elif advice is not None and advice.note:
        lines.append(f"  budget advisor: {advice.note}")
    if gate is not None:
        reached = gate.fraction_to_gain
        lines.append(
            f"  promotion gate, predicted on the {gate.queries:,} items of the evaluation sample as it will measure "
            f"them: {'PASS' if gate.passed else 'REJECT'} (top-1 {100 * gate.champion_top1:.2f}% -> mean "
            f"{100 * gate.top1_auc:.2f}% along the backfill, NFR@1 {100 * gate.nfr1_mean:.2f}% mean along the "
            f"backfill ({gate.nfr1_relative:.2f} of independent errors' flips), "
            f"{100 * gate.nfr1_end:.2f}% at the end, gain reached at "
            f"{'never' if reached is None else f'{100 * reached:.0f}%'})"
            + ("" if gate.passed else f": {'; '.join(gate.reasons)}"))
    elif gate_note:
        lines.append(f"  promotion gate: {gate_note}")
    target = advice.target if advice is not None else None
    if target is not None:
        lines.append(f"  target top-1 {100 * target.target_top1:.2f}%: {target.line or target.note}")
    return "\n".join(lines)


@upgrade_app.callback(invoke_without_command=True)
@answers_json
def upgrade(ctx: typer.Context,
            store: StoreOption = None,
            to: Annotated[str, typer.Option("--to", help="the new model; default models:/<registered_model>@challenger")] = "",
            budget: Annotated[str | None, typer.Option(help="stop after a fraction (0.25, 25%) or a count of items")] = None,
            chunk_size: Annotated[int | None, typer.Option(help="items per backfill chunk (a new upgrade only)")] = None,
            concurrency: Annotated[int | None, typer.Option(help="chunks in flight at once")] = None,
            order: Annotated[str | None, typer.Option(
                help="sigma, random, usage or usage_sigma (a new upgrade only)")] = None,
            runner: Annotated[str | None, typer.Option(help="threads, or dask")] = None,
            dask_address: Annotated[str | None, typer.Option(help="scheduler of an existing Dask cluster")] = None,
            break_lock: Annotated[bool, typer.Option(help="take over a lock held by another upgrade")] = False,
            gate: Annotated[bool | None, typer.Option(
                help="check the promotion gates before switching; default: promotion.gate")] = None,
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
            usage_log: Annotated[str | None, typer.Option(
                help="query log that weights the usage orders: CSV/Parquet with columns query (a logged query's "
                     "id) and hit (a gallery id it returned)")] = None,
            target_top1: Annotated[str | None, typer.Option(
                help="with --dry-run: which way reaches this top-1 (85%, or 0.85) with the least backfill: the map "
                     "in each order, the shadow index, online backfilling or candidate reranking (gallery.upgrade."
                     "rerank_depth)")] = None,
            dry_run: Annotated[bool, typer.Option(help="print the plan (items, chunks, bytes, requests, an estimated "
                                                  "duration from a measured sample, the predicted backfill curve) "
                                                  "and write nothing")] = False,
            as_json: JsonOption = False,
            params: ParamsOption = Path("params.yaml")) -> None:
    """Upgrade the stored gallery to a new model: plan, then backfill in chunks in sigma order;
    queries use the new model from the start. The same command resumes a stopped upgrade."""
    if ctx.invoked_subcommand is not None:
        return
    # the flow run reads params.yaml itself, with the options as overrides: small, readable parameters
    overrides = upgrade_overrides(ctx.params)
    config = _with_upgrade(load(params), overrides)
    target = _parse_target(target_top1)
    if target is not None and not dry_run:
        fail("--target-top1 goes with --dry-run: it compares the ways to a target before anything is written", USAGE)
    uri = store_uri(config, store)
    need_services(config)  # MLflow and Prefect answer, or one line and exit 5 before any flow (and before torch loads)
    from fastfill.flows.upgrade import run_upgrade_file

    if dry_run:
        with forced_mode(progress_mode(progress)):
            dry = call(estimate_upgrade, config, uri, to, target)
        if as_json:
            answer(*json_output.dry_run_document(dry))
        else:
            typer.echo(_describe_dry_run(dry))
        return
    start = time.perf_counter()
    with forced_mode(progress_mode(progress)), ProgressBar(uri, progress_wanted(progress)) as bar:
        result = call(run_upgrade_file, config, str(params.resolve()), uri, to, _parse_budget(budget), break_lock,
                      gate, overrides)
        bar.finish(result)
    if as_json:  # the same outcome and exit code, as one document
        answer(*json_output.upgrade_document(uri, result, time.perf_counter() - start))
    else:
        typer.echo(_describe_result(result, time.perf_counter() - start))
    if result.state == "rejected":
        raise typer.Exit(REJECTED)


def _describe_result(result: UpgradeResult, seconds: float) -> str:
    """The run's outcome in lines: the state and counts, the advisor's stop, the gate's decision."""
    if result.state == "up-to-date":
        return (f"up-to-date: {result.message}" if result.message else
                f"up-to-date: the gallery is already built with {result.model}; nothing to upgrade")
    lines = [f"{result.state}: {result.items_done} of {result.items} items backfilled "
             f"({100 * result.fraction:.1f}%) in {seconds:.0f} s; MLflow run {result.mlflow_run_id}"]
    advised = result.advice.recommendation if result.advice else None
    if advised:
        metric = "top-1" if advised.metric == "top1" else "agreement"
        lines.append(f"budget advisor: recommended stop for a gain below {advised.gain_below:g} {metric} points per "
                     f"5% is {100 * advised.fraction:.0f}% (predicted {metric} {100 * advised.at_stop:.2f}%, "
                     f"{100 * advised.full:.2f}% at 100%)"
                     + ("; stopped there: the same command stays there, a --budget goes on"
                        if result.stopped == "recommended" else ""))
    numbers = result.promotion.gate_numbers() if result.promotion is not None else None
    if result.promotion is not None and numbers is not None:
        decision, reached = result.promotion, numbers.fraction_to_gain
        lines.append(f"promotion gate: {'passed, champion moved' if decision.passed else 'REJECTED'}: champion top-1 "
                     f"{100 * numbers.champion_top1:.2f}%, challenger mean top-1 along the backfill "
                     f"{100 * numbers.top1_auc:.2f}%, NFR@1 {100 * numbers.nfr1_mean:.2f}%, gain reached at "
                     f"{'never' if reached is None else f'{100 * reached:.0f}%'}")
        lines += [f"  - {reason}" for reason in decision.reasons]
    return "\n".join(lines)


@upgrade_app.command("status", short_help="The upgrade's state and progress (JSON).")
@answers_json
def upgrade_status(store: StoreOption = None, as_json: JsonOption = False,
                   params: ParamsOption = Path("params.yaml")) -> None:
    """The gallery's model and the running or paused upgrade, with how much is done (JSON)."""
    show_status(store, params, "upgrade.status" if as_json else None)


@upgrade_app.command("unlock", short_help="Break a stale upgrade lock.")
@answers_json
def upgrade_unlock(store: StoreOption = None, as_json: JsonOption = False,
                   params: ParamsOption = Path("params.yaml")) -> None:
    """Break a stale upgrade lock (its process is gone); the next 'fastfill upgrade' resumes."""
    config = load(params)
    from fastfill.tasks.gallery_store import open_gallery

    uri = store_uri(config, store)
    held = call(lambda: break_lock(open_gallery(uri).store))
    if as_json:
        return answer(*json_output.unlock_document(uri, held))
    typer.echo(f"{uri}: " + (f"removed the lock of upgrade {held.upgrade_id} (pid {held.pid} on {held.host})"
                             if held is not None else "no lock was held"))


@upgrade_app.command("abort", short_help="Drop the unfinished upgrade.")
@answers_json
def upgrade_abort(store: StoreOption = None, as_json: JsonOption = False,
                  params: ParamsOption = Path("params.yaml")) -> None:
    """Drop the unfinished upgrade; the gallery serves the champion's features again (see docs/upgrade.md)."""
    # Planned or part of the way through its backfill; refused while another process holds the
    # lock, and for an upgrade that finished or was rejected. gc collects its working data; a
    # later `fastfill upgrade` to the same version plans it again from scratch.
    uri, done = run_undo("abort_flow", store, params, abortable)
    if as_json:
        return answer(*json_output.undo_document("upgrade.abort", uri, done.to_dict()))
    record = done.record
    typer.echo(f"{uri}: aborted upgrade {record.upgrade_id} to {record.to} ({record.stage}: "
               f"{record.chunks_done} of {record.chunks} chunks, {record.items_done} of {record.items} "
               f"items); the gallery serves {done.model}'s features again. `fastfill gallery gc` deletes its "
               f"working data; `fastfill upgrade --to {record.to}` plans it again from scratch")


def estimate_upgrade(params, store_uri: str, to_uri: str = "", target_top1: float | None = None) -> DryRun:
    """What ``fastfill upgrade --dry-run`` reports (``components.gallery.advice.estimate.dry_run_upgrade``),
    writing nothing."""
    from fastfill.components.gallery.advice.estimate import dry_run_upgrade
    from fastfill.tasks.gallery_store import open_gallery

    gallery = open_gallery(store_uri, params.gallery.s3)
    return dry_run_upgrade(params, gallery, registry.setup(params.mlflow)[0], to_uri, target_top1)
