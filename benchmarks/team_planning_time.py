"""How long the team's upgrade plans, and how much of it is the images it reads and embeds.

benchmarks/team_own_models.py's team (its two models trained here, the same gallery of RGB
JPEGs and judged queries, the same configuration) on the local backend: ``model register`` twice,
``gallery adopt``, then the upgrade that plans (``fastfill upgrade --judgments ...
--stop-when-gain-below ... --no-progress``). Planning's wall time is split by the timestamps of
the upgrade's own log lines:

- **embedding** (reading and embedding images with the new model): the map sample (from the line
  ``map sample: ...`` to ``embedding the map sample: done ...``) and the judged queries and the
  evaluation sample (the seconds the line ``judged queries and evaluation sample: ... in N s``
  says);
- **overhead**, everything else planning does: opening the upgrade's run, the map's pairs
  (stored old features, pseudo-classes), the map's training and registration, the map check and
  its reference, the gallery's features through the map, the order, writing the plan and its
  prefilled chunks.

Planning runs from the line ``the gate measures against ...`` (the judged queries read, the new
model loaded) to ``planned <upgrade>: ...``. The advisor's prediction and the backfill come after.

    .venv/bin/python benchmarks/team_planning_time.py            # 3000 items, map_sample 1000
    .venv/bin/python benchmarks/team_planning_time.py --models-from /tmp/x   # the models trained before

Writes ``<out>.md`` and ``<out>.json`` (default ``reports/team_planning_time``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.team_own_models import (  # noqa: E402
    register,
    scratch_folder,
    team_arguments,
    team_models,
    write_gallery,
    write_report,
)
from benchmarks.team_upgrade_commands import FASTFILL, ROOT, clean_env, error_lines, run_command  # noqa: E402
from benchmarks.team_upgrade_inputs import backend_params  # noqa: E402

TARGET = 2.0  # the product's target: planning's overhead at most this many times its embedding
_LINE = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) \| \w+\s*\| (?:Flow|Task) run '[^']*' - (.*)$")
_SAMPLES = re.compile(r"^judged queries and evaluation sample: (\d+) more items read and embedded in ([0-9.]+) s")
_MAP_SAMPLE = re.compile(r"^map sample: (\d+) of (\d+) gallery items")


def log_lines(stderr: str) -> list[tuple[float, str]]:
    """(seconds since midnight, message) of each Prefect log line, in order (a day's wrap added)."""
    out: list[tuple[float, str]] = []
    for line in stderr.splitlines():
        m = _LINE.match(line.strip())
        if not m:
            continue
        seconds = int(m[1]) * 3600 + int(m[2]) * 60 + int(m[3]) + int(m[4]) / 1000
        while out and seconds < out[-1][0] - 60:
            seconds += 86400
        out.append((seconds, m[5]))
    return out


def planning_phases(lines: list[tuple[float, str]]) -> dict:
    """Planning's wall time split by the marker lines (see the module's docstring), in seconds."""
    def first(prefix: str, after: float = 0.0, last: bool = False) -> tuple[float, str]:
        found = [(t, text) for t, text in lines if t >= after and text.startswith(prefix)]
        if not found:
            raise ValueError(f"the upgrade logged no line starting {prefix!r}")
        return found[-1] if last else found[0]

    start, _ = first("the gate measures against")
    end, planned = first("planned ", start)
    sample_start, said = first("map sample: ", start)
    sample_end, _ = first("embedding the map sample: done", sample_start)
    train_start, trained = first("training a ", sample_end)
    check_start, _ = first("map check", train_start)
    check_end, _ = first("map check", check_start, last=True)
    said_epochs = ("epoch ", "kept the", "stopped at epoch")
    epochs = [t for t, text in lines if train_start <= t <= check_start and text.startswith(said_epochs)]
    train_end = epochs[-1] if epochs else check_start
    transform_end, _ = first("planning: the gallery's features through the map: done", check_end)
    samples_line, text = first("judged queries and evaluation sample:", transform_end)
    m, n = _SAMPLES.match(text), _MAP_SAMPLE.match(said)
    assert m is not None and n is not None
    samples_seconds = float(m[2])
    samples_start = samples_line - samples_seconds
    parts = {
        "run opened, registry looked up (start to map sample)": sample_start - start,
        "map pairs: stored old features, pseudo-classes": train_start - sample_end,
        "map training": train_end - train_start,
        "map registered (training end to map check)": check_start - train_end,
        "map check and its reference": check_end - check_start,
        "check recorded, gallery's features through the map": transform_end - check_end,
        "order (and the champion loaded)": samples_start - transform_end,
        "plan and prefilled chunks written": end - samples_line,
    }
    embedding = {f"map sample ({n[1]} items)": sample_end - sample_start,
                 f"judged queries and evaluation sample ({m[1]} more items)": samples_seconds}
    overhead, embedded = sum(parts.values()), sum(embedding.values())
    return {"planning_seconds": round(end - start, 2), "embedding": {k: round(v, 2) for k, v in embedding.items()},
            "embedding_seconds": round(embedded, 2), "overhead": {k: round(v, 2) for k, v in parts.items()},
            "overhead_seconds": round(overhead, 2), "ratio": round(overhead / embedded, 2) if embedded else None,
            "map_training_line": trained, "planned_line": planned}


def wait_for_load(limit: float, most_seconds: float) -> list[float]:
    """Waits (up to ``most_seconds``) until the 1-minute load is below ``limit``; the loads after."""
    deadline = time.monotonic() + most_seconds
    while os.getloadavg()[0] >= limit and time.monotonic() < deadline:
        time.sleep(15)
    return [round(x, 2) for x in os.getloadavg()]


def main(argv: list[str] | None = None) -> int:
    parser = team_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--models-from", type=Path, help="a workdir of an earlier run: its two models, not trained again")
    parser.add_argument("--wait-load", type=float, default=0.0,
                        help="before the upgrade, wait (at most 30 min) for a 1-minute load below this (0: no wait)")
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "team_planning_time")
    args = parser.parse_args(argv)
    import yaml

    started = time.perf_counter()
    scratch = scratch_folder(args.workdir, "team-planning-time-")
    if args.models_from:
        models = json.loads((args.models_from / "models.json").read_text())
    else:
        print(f"scratch folder: {scratch}; training the team's two models ...", flush=True)
        models = team_models(scratch, args.train_items, args.epochs, args.seed)
        (scratch / "models.json").write_text(json.dumps(models, indent=2))
    gallery = write_gallery(scratch, args.items, args.judged, args.seed)
    data = yaml.safe_load((ROOT / "params.yaml").read_text())
    data.pop("prepare", None)
    data["gallery"] = {"part_size": 500, "upgrade": {"map_sample": args.map_sample, "map_pairs": "gallery",
                                                     "method": "fastfill", "order": "sigma"}}
    folder = scratch / "local-fastfill-sigma"
    folder.mkdir()
    env = {**clean_env(), "PREFECT_HOME": str(folder / "prefect-home")}
    store = str(folder / "gallery")
    params_file = backend_params(data, folder, store, args.chunk_size)
    steps = register(params_file, folder, models, env)
    common = ["--store", store, "--params", str(params_file)]
    adopt = ["gallery", "adopt", "--manifest", str(scratch / "manifest.csv"), "--root", str(scratch / "images")]
    upgrade = ["upgrade", "--judgments", str(scratch / "judgments.csv"), "--stop-when-gain-below", f"{args.gain:g}",
               "--no-progress"]
    report: dict = {"config": vars(args) | {"workdir": str(scratch), "out": str(args.out)}, "models": models,
                    "gallery": gallery, "machine": f"{os.cpu_count()} CPU cores", "problems": []}
    for name, argv_ in (("adopt", adopt), ("upgrade", upgrade)):
        if name == "upgrade":
            report["load_before"] = (wait_for_load(args.wait_load, 1800) if args.wait_load
                                     else [round(x, 2) for x in os.getloadavg()])
        print(f"[{name}] fastfill {' '.join(argv_ + common)}  (load {os.getloadavg()[0]:.2f})", flush=True)
        step = run_command([str(FASTFILL), *argv_, *common], folder, env, 3600, None)
        step.update(name=name, ok=step["rc"] == 0)
        print(f"  {step['seconds']:.1f} s, exit {step['rc']}", flush=True)
        steps.append(step)
        if not step["ok"]:
            report["problems"].append({"step": name, "rc": step["rc"],
                                       "said": " / ".join(error_lines(step["stdout"], step["stderr"], 3))})
            break
    report["load_after"] = [round(x, 2) for x in os.getloadavg()]
    if steps[-1]["name"] == "upgrade" and steps[-1]["ok"]:
        report["upgrade_command"] = "fastfill " + " ".join(upgrade + common)
        report["upgrade_seconds"] = steps[-1]["seconds"]
        try:
            report["planning"] = planning_phases(log_lines(steps[-1]["stderr"]))
        except (ValueError, AssertionError) as error:
            report["problems"].append({"step": "upgrade", "rc": 0, "said": f"its log could not be split: {error}"})
    for step in steps:
        step["stderr"] = step["stderr"][-300_000:] if step["name"] == "upgrade" else step["stderr"][-2000:]
        step["stdout"] = step["stdout"][-2000:]
    report["steps"] = steps
    report["wall_seconds"] = round(time.perf_counter() - started, 1)
    write_report(args.out, markdown(report, argv), report)
    return 1 if report["problems"] else 0


def markdown(report: dict, argv: list[str] | None) -> str:
    """The short report: the command, the load, the sizes, each part's seconds, the ratio."""
    gallery, config = report["gallery"], report["config"]
    command = " ".join(["benchmarks/team_planning_time.py", *(sys.argv[1:] if argv is None else argv)])
    lines = ["# The team's upgrade: planning's overhead against its embedding", "",
             f"`.venv/bin/python {command}` ({report['machine']}, {report['wall_seconds']:.0f} s in all). "
             f"1-minute / 5-minute / 15-minute load before the upgrade {report.get('load_before')}, after it "
             f"{report.get('load_after')}.", "",
             f"Gallery: {gallery['items']} items ({gallery['images']}), {gallery['judged_queries']} judged queries; "
             f"gallery.upgrade.map_sample {config['map_sample']}; old model ONNX MobileNetV3-Small (1,024-d), new "
             "torchvision ResNet-18 (512-d), both trained here"
             + (f" (by an earlier run, {config['models_from']})" if config.get("models_from") else "")
             + "; local store.", ""]
    planning = report.get("planning")
    if planning:
        lines += [f"The upgrade: `{report['upgrade_command']}`, {report['upgrade_seconds']:.1f} s in all (Prefect's "
                  f"start, planning, the advisor, the backfill to the advised stop); planning "
                  f"{planning['planning_seconds']:.1f} s of it.", "",
                  "| part of planning | seconds |", "|---|---|"]
        lines += [f"| embedding: {k} | {v:.1f} |" for k, v in planning["embedding"].items()]
        lines += [f"| **embedding, in all** | **{planning['embedding_seconds']:.1f}** |"]
        lines += [f"| overhead: {k} | {v:.1f} |" for k, v in planning["overhead"].items()]
        lines += [f"| **overhead, in all** | **{planning['overhead_seconds']:.1f}** |", ""]
        ratio = planning["ratio"]
        verdict = "within" if ratio is not None and ratio <= TARGET else "over"
        lines += [f"Overhead / embedding: **{ratio}** ({verdict} the target of at most {TARGET:g}).", "",
                  f"The map: {planning['map_training_line']}", ""]
    if report["problems"]:
        lines += ["## Problems", ""] + [f"- {p['step']} (exit {p['rc']}): {p['said']}" for p in report["problems"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
