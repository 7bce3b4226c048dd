"""The report of benchmarks/map_speed.py: its result (``map_speed.main``'s dict) as Markdown."""

from __future__ import annotations

TARGET_SECONDS = 20.0  # issue 65: the map's training on 1,000 pairs, and the check's reference, on 2 cores
TARGET_RATIO = 1.2  # the product's loop against a bare loop of the same steps
CHECKS = ("map check", "map check, handed the trained reference")

def fmt(value: float, digits: int = 2) -> str:
    return f"{value:.{digits}f}"


def markdown(result: dict) -> str:
    parts, data, env = result["parts"], result["data"], result["environment"]
    lines = [
        "# A map in seconds: the upgrade's map training, part by part, against a bare torch loop",
        "",
        f"`{result['command']}`",
        "",
        f"Pairs: {data['source']}: a map sample of {data['pairs']} pairs ({data['training_pairs']} trained on, "
        f"{data['held_out']} held out), {data['old_dim']} -> {data['new_dim']} dimensions, mean squared norms "
        f"{fmt(data['old_squared_norm'], 1)} (old) and {fmt(data['new_squared_norm'], 1)} (new). "
        f"Settings: params.yaml's align.fastfill for an upgrade (`AlignConfig.for_upgrade()`, disc term off): "
        f"{result['settings']}.",
        "",
        f"Product: commit {result['product']['commit']}"
        + (f", with uncommitted changes to {', '.join(result['product']['changed_files'])}"
           if result["product"]["changed_files"] else "") + ".",
        "",
        f"Machine: {env['cpu']}, {env['cores']} cores, torch {env['torch']} with {env['threads']} threads, kernels "
        f"{env['kernels']} (torch's {env['torch_kernels']}), denormals flushed. Load average (1 min) "
        f"{fmt(env['load_min'])} to {fmt(env['load_max'])} during the runs: the cores are shared with other work, "
        "so the seconds move with the load; the ratios, measured side by side in each repeat, are what to compare.",
        f"{result['repeats']} repeats, interleaved (product first on even repeats, bare loops first on odd ones); "
        "median (min) over the repeats; each ratio is product / bare of the same repeat, per optimiser step. CPU "
        "seconds are the process's (both threads), the work done whatever the waiting for a core.",
        "",
        "## Parts",
        "",
        "| part | seconds, median (min) | CPU seconds, median | epochs | optimiser steps | s / step, median (min) "
        "| within 20 s (median) |",
        "|---|---|---|---|---|---|---|",
        f"| pseudo-classes (K = {parts['pseudo-classes']['k']}) | {fmt(parts['pseudo-classes']['seconds']['median'])} "
        f"({fmt(parts['pseudo-classes']['seconds']['min'])}) | {fmt(parts['pseudo-classes']['cpu_seconds']['median'])} "
        "| | | | |",
    ]
    for part in ("FastFill map", "l2-only reference"):
        p = parts[part]
        lines.append(f"| {part} | {fmt(p['seconds']['median'])} ({fmt(p['seconds']['min'])}) | "
                     f"{fmt(p['cpu_seconds']['median'])} | {p['epochs']} (kept {p['kept_epoch']}) | {p['steps']} | "
                     f"{fmt(p['seconds_per_step']['median'], 4)} ({fmt(p['seconds_per_step']['min'], 4)}) | "
                     f"{'yes' if p['seconds']['median'] <= TARGET_SECONDS else 'no'} |")
    for name in CHECKS:
        check = parts[name]
        lines.append(f"| {name} (uses: {check['use']}, order {check['order']}) | {fmt(check['seconds']['median'])} "
                     f"({fmt(check['seconds']['min'])}) | {fmt(check['cpu_seconds']['median'])} | | | | |")
    same = parts["map check"]["reference_is_the_map_network"]
    lines += ["", f"The check: {parts['map check']['message']}", "",
              f"The trained l2-only reference is the map's network bit for bit: {', '.join(map(str, same))} (each "
              "repeat)" + (" — where it is, the upgrade's check takes the map's own network "
                           "(`map_check.shares_reference`) and this part is not run in an upgrade." if all(same) else
                           "."), "",
              "## Against a bare torch loop of the same steps", "",
              "| part | loop | seconds, median (min) | s / step, median | product / bare, median (min, max) | "
              f"within {TARGET_RATIO:g}x (median) | product / bare in CPU seconds, median (min, max) |",
              "|---|---|---|---|---|---|---|"]
    for part in ("FastFill map", "l2-only reference"):
        p = parts[part]
        lines.append(f"| {part} | product (`train_alignment`) | {fmt(p['seconds']['median'])} "
                     f"({fmt(p['seconds']['min'])}) | {fmt(p['seconds_per_step']['median'], 4)} | 1.00 | | 1.00 |")
        for name, t in p.get("toggles", {}).items():
            lines.append(f"| {part} | {name} | {fmt(t['seconds']['median'])} ({fmt(t['seconds']['min'])}) | "
                         f"{fmt(t['seconds_per_step']['median'], 4)} | {fmt(t['ratio_to_product']['median'])} | | |")
        for name, b in p["bare"].items():
            lines.append(f"| {part} | {name} | {fmt(b['seconds']['median'])} ({fmt(b['seconds']['min'])}) | "
                         f"{fmt(b['seconds_per_step']['median'], 4)} | **{fmt(b['ratio']['median'])}** "
                         f"({fmt(b['ratio']['min'])}, {fmt(b['ratio']['max'])}) | "
                         f"{'yes' if b['ratio']['median'] <= TARGET_RATIO else 'no'} | {fmt(b['cpu_ratio']['median'])} "
                         f"({fmt(b['cpu_ratio']['min'])}, {fmt(b['cpu_ratio']['max'])}) |")
    lines += ["", "Bare loops: `bare, torch Adam` and `bare, ExactAdam` run the product's network (its linear layers "
              "on oneDNN, components/experiment/dense.py) in this process under the pinned kernels; `bare, plain torch` "
              "runs nn.Linear with torch.optim.Adam in a fresh process with the machine's own kernels. None has a "
              "scheduler, validation, clipping, checkpoint or log.", ""]
    for part in ("FastFill map", "l2-only reference"):
        for name, t in parts[part].get("toggles", {}).items():
            lines += [f"Toggle, {part}: `{name}` is the product's training with the held-out retrieval of its "
                      "per-epoch validation (`map_training.retrieval_at_zero`: numpy's matrix product) run on numpy's "
                      "BLAS's own threads, not the one thread the product holds it to (threadpoolctl), nothing else "
                      "changed; its row's ratio is to the product as it is. Against the bare loops, median (min, max): "
                      + "; ".join(f"{bare_name} **{fmt(r['median'])}** ({fmt(r['min'])}, {fmt(r['max'])})"
                                  for bare_name, r in t["ratio_to_bare"].items())
                      + f". Its weights are the product's bit for bit: {', '.join(map(str, t['same_weights']))} "
                      f"(each repeat); within the run, seconds / its steps' seconds: {fmt(t['in_run_ratio']['median'])}.",
                      ""]
    lines += [
              "Within each product run, from its layers' timers (the same load for all of them): the part's seconds / "
              "the seconds of its steps' forward, loss terms, backward and optimiser step (what a bare loop with "
              "ExactAdam does), median (min, max): "
              + "; ".join(f"{part} **{fmt(parts[part]['in_run_ratio']['median'])}** "
                          f"({fmt(parts[part]['in_run_ratio']['min'])}, {fmt(parts[part]['in_run_ratio']['max'])})"
                          for part in ("FastFill map", "l2-only reference")) + ".", ""]
    for part in ("FastFill map", "l2-only reference"):
        p = parts[part]
        lines += [f"## Where the {part}'s time goes", "",
                  "Each layer's own seconds; a layer that slows the steps after it (see the toggle above) shows in "
                  "their forward and backward.", "",
                  "| layer | seconds (median) | calls | share of the part |", "|---|---|---|---|"]
        for name, layer in sorted(p["layers"].items(), key=lambda item: -item[1]["seconds"]):
            calls = "" if layer["calls"] is None else f"{layer['calls']:g}"
            lines.append(f"| {name} | {fmt(layer['seconds'], 3)} | {calls} | {100 * layer['share']:.1f}% |")
        lines.append("")
    lines += ["## The check's layers", "", "| check | layer | seconds (median) | calls |", "|---|---|---|---|"]
    for check_name in CHECKS:
        for name, layer in parts[check_name]["layers"].items():
            calls = "" if layer["calls"] is None else f"{layer['calls']:g}"
            lines.append(f"| {check_name} | {name} | {fmt(layer['seconds'], 3)} | {calls} |")
    if result.get("profile"):
        lines += ["", f"## One more FastFill map run under cProfile ({fmt(result['profile_seconds'])} s with the "
                  "profiler), functions by own time", "",
                  "| function | calls | own s | cumulative s |", "|---|---|---|---|"]
        for entry in result["profile"]:
            lines.append(f"| `{entry['function']}` | {entry['calls']} | {fmt(entry['own_seconds'], 3)} | "
                         f"{fmt(entry['cumulative_seconds'], 3)} |")
    lines += ["", f"Total wall time of the benchmark: {fmt(result['wall_seconds'], 0)} s.", ""]
    return "\n".join(lines)
