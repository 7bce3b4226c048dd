"""benchmarks/team_upgrade.py's upgrade on one backend: the team's six commands in order, each
described in a line, and what the upgrade's MLflow run and the registry recorded (predicted
against measured, the gate's curve).
"""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks.team_upgrade_commands import (
    FASTFILL,
    error_lines,
    parse_dry_run,
    parse_json_output,
    parse_upgrade,
    run_command,
)

_ADOPTED = re.compile(r"^(\S+): (\d+) items adopted, model (\S+);")


def describe_step(name: str, step: dict) -> str:
    """One cell: what the command said, in a line."""
    if step["timed_out"]:
        return f"TIMED OUT after {step['seconds']:.0f} s: " + " / ".join(error_lines(step["stdout"], step["stderr"], 2))
    parsed = step.get("parsed") or {}
    if step["rc"] not in (0, 3):
        return f"FAILED (exit {step['rc']}): " + " / ".join(error_lines(step["stdout"], step["stderr"], 3))
    if name == "adopt":
        m = next((_ADOPTED.match(line) for line in step["stdout"].splitlines() if _ADOPTED.match(line)), None)
        warn = " (warned: no labels, no judgments configured)" if "has no label column" in step["stderr"] else ""
        return (f"{m[2]} items adopted, model {m[3]}" if m else step["stdout"].strip()[:200]) + warn
    if name == "dry run":
        bits = []
        if "estimated_backfill_seconds" in parsed:
            bits.append(f"estimated backfill {parsed['estimated_backfill_seconds']:.0f} s")
        if parsed.get("truth"):
            bits.append(f"truth: {parsed['truth']}")
        metric = parsed.get("metric", "top1")
        label = "top-1" if metric == "top1" else "agreement with the finished upgrade"
        if parsed.get("recommended"):
            r = parsed["recommended"]
            bits.append(f"recommended stop {100 * r['fraction']:.0f}% ({r['items']} items), predicted {label} "
                        f"{r[metric]:.2f} there" + (f", {r[metric + '_full']:.2f} at 100%" if metric + "_full" in r else ""))
        elif parsed.get("curve"):
            bits.append(f"predicted {label} {parsed['curve'][0][metric]:.2f} at 0%, {parsed['curve'][-1][metric]:.2f} "
                        "at 100%, no recommended stop")
        elif parsed.get("advisor_note"):
            bits.append(f"advisor: {parsed['advisor_note']}")
        return "; ".join(bits) or step["stdout"].strip().splitlines()[0][:200]
    if name == "status":
        status = parsed
        if not status:
            return step["stdout"].strip()[:200]
        upgrade = status.get("upgrade") or {}
        text = f"state {status.get('state')}, model {status.get('model')}"
        if upgrade:
            text += f", items_done {upgrade.get('items_done')} of {status.get('items')}"
            predicted = upgrade.get("predicted") or {}
            rec = predicted.get("recommendation")
            if rec:
                text += f", recommended stop {100 * rec['fraction']:.0f}%" + (
                    f" (by {predicted['metric']})" if isinstance(predicted.get("metric"), str) else "")
        return text
    if parsed.get("state") == "up-to-date":
        return parsed["message"]
    if "state" in parsed:
        text = (f"{parsed['state']}: {parsed['items_done']} of {parsed['items']} items ({parsed['percent']:.1f}%) in "
                f"{parsed['command_seconds']} s")
        if parsed.get("advised"):
            a = parsed["advised"]
            text += (f"; advisor ({'top-1' if a['metric'] == 'top1' else 'agreement'}): stop at "
                     f"{100 * a['fraction']:.0f}%" + (" (stopped there)" if a["stopped_there"] else ""))
        if parsed.get("gate"):
            g = parsed["gate"]
            text += (f"; gate {'PASSED' if g['passed'] else 'REJECTED'}: champion top-1 {g['champion_top1']:.2f}, "
                     f"challenger mean top-1 {g['challenger_top1_auc']:.2f}, NFR@1 {g['nfr1_percent']:.2f}%")
        return text
    return " / ".join(error_lines(step["stdout"], step["stderr"], 2))


def mlflow_numbers(params_file: Path, run_id: str | None) -> dict:
    """The upgrade's MLflow run (every metric's history, its tags) and the registry's aliases."""
    from fastfill.components.platform import registry
    from fastfill.components.platform.config import load_params

    config = load_params(params_file).mlflow
    client, _ = registry.setup(config)
    out: dict = {"aliases": {}}
    for alias in ("champion", "challenger"):
        out["aliases"][alias] = registry.alias_version(client, config.registered_model, alias)
    versions = client.search_model_versions(f"name='{config.registered_model}'")
    out["version_tags"] = {v.version: {k: t for k, t in v.tags.items() if k.startswith(("promotion", "role"))}
                           for v in versions}
    if not run_id:
        return out
    run = client.get_run(run_id)
    out["run"] = {"id": run_id, "name": run.info.run_name, "status": run.info.status,
                  "tags": {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")},
                  "metrics": {}}
    for key in sorted(run.data.metrics):
        history = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
        out["run"]["metrics"][key] = [[m.step, m.value] for m in history]
    return out


def predicted_vs_measured(metrics: dict, items: int | None) -> dict | None:
    """Where the run logged both the prediction (predicted_top1/map) and the measurement
    (top1/map) at the same step (items backfilled): the gaps in points."""
    out = {}
    for metric in sorted(k[len("predicted_"):] for k in metrics if k.startswith("predicted_")):
        predicted = {s: v for s, v in metrics.get(f"predicted_{metric}", [])}
        measured = {s: v for s, v in metrics.get(metric, [])}
        common = sorted(set(predicted) & set(measured))
        if not common:
            continue
        gaps = [abs(predicted[s] - measured[s]) * 100 for s in common]
        out[metric] = {"points": len(common), "largest_gap": round(max(gaps), 2),
                       "mean_gap": round(sum(gaps) / len(gaps), 2),
                       "at": [{"items": s, "fraction": round(s / items, 4) if items else None,
                               "predicted": round(100 * predicted[s], 2), "measured": round(100 * measured[s], 2)}
                              for s in common]}
    return out or None


def annotate(by: dict) -> None:
    """Notes on outcomes that are not what the step asked for, or are the consequence of an
    earlier one: an upgrade asked to stop at the advisor's stop that did not pause, and a finish
    refused because the same version was rejected one step before."""
    dry = by["dry run"].get("parsed") or {}
    stop = by["upgrade to the advised stop"]
    parsed = stop.get("parsed") or {}
    if parsed.get("state") and parsed["state"] != "paused":
        if parsed.get("advised") and parsed["advised"]["fraction"] >= 1:
            stop["note"] = (f"the advisor's stop was 100%, so it ran to the end and the gate decided: "
                            f"{parsed['state']}")
            stop["ok"] = stop["rc"] in (0, 3)
        else:
            why = "the advisor recommended no stop" + (f" (dry run: {dry['advisor_note']})"
                                                        if dry.get("advisor_note") else "")
            stop["note"] = (f"did not pause at the advisor's stop: it went to {parsed['percent']:.0f}% and ended "
                            f"{parsed['state']}; {why}")
            stop["ok"] = False
    finish = by["upgrade to 100% (gate)"]
    if (finish["rc"] == 6 and "was rejected by the promotion gate" in finish["stderr"]
            and parsed.get("state") == "rejected"):
        finish["note"] = ("expected after the previous step: the gate had already rejected this version, and a gallery "
                          "refuses a rejected version again (docs/upgrade.md)")
        finish["ok"] = True


def gate_curve(metrics: dict) -> list[dict] | None:
    """The gate's measured curve (gate.top1, gate.nfr1: one point per step of the curve, 0% to
    100% evenly), in %."""
    top1 = [v for _, v in sorted(metrics.get("gate.top1", []))]
    if not top1:
        return None
    nfr1 = [v for _, v in sorted(metrics.get("gate.nfr1", []))]
    last = max(len(top1) - 1, 1)
    return [{"fraction": round(i / last, 4), "top1": round(100 * v, 2),
             "nfr1": round(100 * nfr1[i], 2) if i < len(nfr1) else None} for i, v in enumerate(top1)]


def run_backend(name: str, folder: Path, params_file: Path, store: str, root: str, manifest: Path, judgments: Path,
                gain: float, env: dict, timeout: float, use_strace: bool) -> dict:
    fastfill = [str(FASTFILL)]
    common = ["--store", store, "--params", str(params_file)]
    steps_argv = [
        ("adopt", ["gallery", "adopt", "--manifest", str(manifest), "--root", root] + common),
        ("dry run", ["upgrade", "--dry-run", "--judgments", str(judgments),
                     "--stop-when-gain-below", f"{gain:g}"] + common),
        ("upgrade to the advised stop", ["upgrade", "--judgments", str(judgments), "--stop-when-gain-below", f"{gain:g}",
                                         "--no-progress"] + common),
        ("status", ["upgrade", "status"] + common),
        ("upgrade to 100% (gate)", ["upgrade", "--judgments", str(judgments), "--no-progress"] + common),
        ("final status", ["upgrade", "status"] + common),
    ]
    traces = folder.parent / "strace"
    traces.mkdir(exist_ok=True)
    steps = []
    for i, (step_name, argv) in enumerate(steps_argv):
        trace = traces / f"{name}-{i}.txt" if use_strace else None
        print(f"[{name}] {step_name}: fastfill {' '.join(argv)}", flush=True)
        step = run_command(fastfill + argv, folder, env, timeout, trace)
        step["name"] = step_name
        kind = "status" if "status" in step_name else "adopt" if step_name == "adopt" else \
            "dry run" if step_name == "dry run" else "upgrade"
        if kind == "dry run":
            step["parsed"] = parse_dry_run(step["stdout"])
        elif kind == "status":
            step["parsed"] = parse_json_output(step["stdout"]) if step["rc"] == 0 else None
        elif kind == "upgrade":
            step["parsed"] = parse_upgrade(step["stdout"])
        step["said"] = describe_step(kind, step)
        step["ok"] = step["rc"] == 0 or (step["rc"] == 3 and step_name.startswith("upgrade to 100%"))
        print(f"[{name}]   {step['seconds']:.1f} s, exit {step['rc']}: {step['said']}", flush=True)
        steps.append(step)
    by = {s["name"]: s for s in steps}
    annotate(by)
    status = by["status"].get("parsed") or {}
    upgrade = status.get("upgrade") or {}
    stop = by["upgrade to the advised stop"].get("parsed") or {}
    finish = by["upgrade to 100% (gate)"].get("parsed") or {}
    run_id = upgrade.get("mlflow_run_id") or stop.get("mlflow_run_id") or finish.get("mlflow_run_id")
    try:
        recorded = mlflow_numbers(params_file, run_id)
    except Exception as error:  # noqa: BLE001 - reported, the other backend goes on
        recorded = {"error": f"{type(error).__name__}: {error}"}
    metrics = (recorded.get("run") or {}).get("metrics", {})
    return {
        "store": store, "images_root": root, "params": str(params_file), "steps": steps,
        "predicted": {"dry_run": by["dry run"].get("parsed"), "status": upgrade.get("predicted"),
                      "advised_stop": stop.get("advised")},
        "stopped_at": {"items_done": upgrade.get("items_done"), "items": status.get("items"),
                       "fraction": upgrade.get("fraction"), "state": status.get("state"),
                       "chunks_done": upgrade.get("chunks_done"), "chunks": upgrade.get("chunks")} if upgrade else None,
        "gate": finish.get("gate"), "finish_state": finish.get("state"),
        "final_status": by["final status"].get("parsed"),
        "mlflow": recorded, "predicted_vs_measured": predicted_vs_measured(metrics, status.get("items")),
        "gate_curve": gate_curve(metrics),
    }
