"""benchmarks/team_upgrade.py's report: the tables of ``<out>.md``."""

from __future__ import annotations


def markdown(report: dict) -> str:
    c = report["config"]
    lines = [f"# A retrieval team's upgrade, through the CLI ({report['mode']})", "",
             f"- models: {c['source']} (old v{c['old_version']} -> new v{c['new_version']}), copied into each "
             "backend's own registry as v1 @champion and v2 @challenger",
             f"- gallery: {report['setup']['images']['items']} PNGs, {report['setup']['images']['source']}; manifest "
             "id, uri (no label column)",
             f"- golden set: {report['setup']['judgments']['queries']} queries, "
             f"{report['setup']['judgments']['rows']} judged pairs ({report['setup']['judgments']['relevance']})",
             f"- stop when the predicted gain is below {c['gain']:g} points per 5% (top-1; agreement for a label-free "
             "prediction)",
             *(["- the tiny models on their own pipeline's test split (%): " + "; ".join(
                 f"{row} " + ", ".join(f"{k} {v:.1f}" for k, v in values.items())
                 for row, values in report["setup"]["train_tiny_models"]["pipeline_reference_percent"].items())]
               if report["setup"].get("train_tiny_models", {}).get("pipeline_reference_percent") else []),
             f"- wall time of the whole script: {report['wall_seconds']:.0f} s; {report['machine']}",
             f"- strace: {report['strace_note']}", ""]
    for name, backend in report["backends"].items():
        lines += [f"## {name}: {backend['store']}", "", "| step | seconds | exit | what it said |", "|---|---:|---:|---|"]
        for step in backend["steps"]:
            said = step["said"] + (f" (**{step['note']}**)" if step.get("note") else "")
            said = said.replace("|", "\\|")
            outside = step.get("outside_reads")
            if outside:
                said += " **read outside the scratch folder: " + ", ".join(f"{k} {v}" for k, v in outside.items()) + "**"
            lines.append(f"| {step['name']} | {step['seconds']:.1f} | {step['rc']} | {said} |")
        lines.append("")
        stopped = backend.get("stopped_at")
        if not stopped:
            final = backend["steps"][3].get("parsed") or {}
            lines.append(f"- stopped at: nowhere; after the stop step `upgrade status` found state {final.get('state')} "
                         "and no upgrade in progress")
        else:
            lines.append(f"- stopped at: items_done {stopped['items_done']} of {stopped['items']} "
                         f"({100 * stopped['fraction']:.1f}%), chunks {stopped['chunks_done']} of {stopped['chunks']}, "
                         f"state {stopped['state']}")
        pvm = backend.get("predicted_vs_measured")
        if pvm:
            for metric, gap in pvm.items():
                lines.append(f"- predicted vs measured {metric} (MLflow run, {gap['points']} points): largest gap "
                             f"{gap['largest_gap']:.2f}, mean {gap['mean_gap']:.2f} points")
        elif "error" in backend["mlflow"]:
            lines.append(f"- MLflow: {backend['mlflow']['error']}")
        else:
            keys = sorted((backend["mlflow"].get("run") or {}).get("metrics", {}))
            lines.append("- predicted vs measured: nothing to compare, the upgrade's MLflow run has no "
                         "predicted_<m> with a measured <m>; its metrics: "
                         + (", ".join(keys) if keys else "none (no run found)"))
        metrics = (backend["mlflow"].get("run") or {}).get("metrics", {})
        for key in sorted(k for k in metrics if k.startswith("predicted_")):
            points = sorted(metrics[key])
            items = (backend.get("stopped_at") or {}).get("items") or max((s for s, _ in points), default=0) or 1
            picks = [points[0], points[len(points) // 2], points[-1]] if len(points) > 2 else points
            lines.append(f"- predicted at planning (MLflow {key}, step = items backfilled): " + ", ".join(
                f"{100 * v:.2f} at {100 * step / items:.0f}%" for step, v in picks))
        curve = backend.get("gate_curve")
        if curve:
            picks = [curve[0], curve[len(curve) // 2], curve[-1]]
            lines.append("- measured by the gate (MLflow gate.top1, gate.nfr1): top-1 " + ", ".join(
                f"{p['top1']:.2f} at {100 * p['fraction']:.0f}%" for p in picks)
                + (f"; NFR@1 {curve[0]['nfr1']:.2f}% at 0%" if curve[0]["nfr1"] is not None else ""))
        gate = backend.get("gate")
        if gate:
            lines.append(f"- gate: {'passed' if gate['passed'] else 'REJECTED'}; " + "; ".join(gate["reasons"]))
        aliases = backend["mlflow"].get("aliases")
        if aliases:
            lines.append(f"- registry afterwards: champion v{aliases.get('champion')}, challenger "
                         f"v{aliases.get('challenger')}")
        lines.append("")
    if report["problems"]:
        lines += ["## Steps that failed", ""]
        lines += [f"- {p['backend']}: {p['step']} (exit {p['rc']}): `{' / '.join(p['said'])}`" for p in report["problems"]]
        lines.append("")
    return "\n".join(lines)
