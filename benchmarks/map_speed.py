"""A map in seconds? The upgrade's map training on 1,000 pairs of 1,024 -> 512 dimensions, each part
timed as the upgrade runs it, against a bare torch loop of the same steps.

Pairs: by default a synthetic team pair (latent class structure, as ``wide_features`` of
benchmarks/team_map_conditioning.py: a class centre plus noise in 32 dimensions, old = a random
two-layer projection to 1,024 dimensions, new = another to 512, neither normalized), ``--pairs``
items, all of them the map sample; with ``--features PATH.npz`` (keys old, new, labels) a cached
team pair, of which a map sample of ``--pairs`` items is taken as the upgrade takes it
(``components.gallery.upgrade.pairs.sample_positions``).

Parts, with the product's own functions and settings (params.yaml's align.fastfill as an upgrade
trains it, ``AlignConfig.for_upgrade()``, with the disc term off: a team's new model has no
classifier and gallery.upgrade.pseudo_disc is false):

- ``pseudo-classes``: ``cluster_classes(new, 50, seed)``, K-means of the new features and the head
  fitted on them (the check's classes where the gallery has none, psi's pairs' rows);
- ``FastFill map``: ``train_alignment`` of that configuration (no checkpoint path, as
  tasks/upgrade_map.py trains it);
- ``l2-only reference``: ``train_alignment`` of ``map_check.reference_config`` (no checkpoint path),
  as ``decide_map`` trains it when the map does not carry its own (``map_check.shares_reference``
  false: another weighting, or the disc term on); the report says whether the map's network is the
  trained reference bit for bit, which is what lets an upgrade skip this part;
- ``map check``: ``decide_map`` with the held-out pairs' labels as the check's truth, as an upgrade
  of a gallery with labels runs it: given no registered reference (the map's own network when it
  shares its reference, else one trained there), and handed the trained reference; the fitted
  head included where the map falls back and gets one.

Bare torch loops of the same steps (the optimiser steps and batch size each product run took, the
same network widths, the same loss terms: l2 and psi's term as the configured weighting computes
them, components/experiment/losses.py; no scheduler, validation, checkpoint, clipping or logging), on the same conditioned pairs:

- ``bare, torch Adam``: the product's network (``AlignmentMap``: its linear layers are
  components/experiment/dense.py's) with torch.optim.Adam, in this process (kernels pinned as
  the ``fastfill`` command pins them, compute.cpu_kernels);
- ``bare, ExactAdam``: the same with the product's optimiser (components/experiment/optimizers.py);
- ``bare, plain torch`` (unless ``--no-plain``): nn.Sequential of nn.Linear, BatchNorm1d and ReLU
  with torch.optim.Adam, in a fresh process whose kernels are not pinned (the machine's own).

Inside each product training the layers are timed by wrapping the product's functions for the
run (per-epoch validation, the optimiser's step, gradient clipping, the scheduler, the
finite-weights test, weight snapshots, the log, checkpoint writes; the map's forward and the
backward pass); the rest of the loop is what no wrapper covers. A layer that slows the steps after
it shows in their seconds, not its own: one toggle measures it, ``product, held-out retrieval on
numpy's BLAS threads``, the FastFill map's training with the held-out retrieval of its per-epoch
validation (numpy's matrix product) on numpy's BLAS's own threads instead of the one thread the
product holds it to (threadpoolctl, components/experiment/map_validation.py), nothing else
changed (its weights are compared with the product's, bit for bit). With ``--profile`` one more
run of the FastFill map under cProfile lists the functions that take its time.

Everything runs with ``--threads`` torch threads (2) and flushed denormals (the product's loop
sets them; the bare loops get the same), ``--repeats`` times interleaved (the order alternates
each repeat); medians and minima are reported, and each ratio is product / bare of the same
repeat. The machine's cores may be shared with other work: absolute seconds move with its load
(recorded), and ratios measured side by side are what to compare.

    .venv/bin/python benchmarks/map_speed.py
    .venv/bin/python benchmarks/map_speed.py --features /tmp/ffcond/cache/fashion-4000-2000-2-0-1024.npz \\
        --out reports/map_speed-fashion

Writes ``<out>.md`` and ``<out>.json`` (default ``reports/map_speed``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.map_speed_report import CHECKS, TARGET_RATIO, TARGET_SECONDS, markdown  # noqa: E402

PSEUDO_CLASSES = 50  # gallery.upgrade.pseudo_classes
LOOP = "training loop"  # the product's epoch loop (_train_on_features): the other training layers run inside it
STEP_LAYERS = ("forward (training batches)", "loss terms", "backward", "optimiser step (ExactAdam)")  # a bare step's
TOGGLE = "product, held-out retrieval on numpy's BLAS threads"
CHECK_LAYERS = ("fitted head", "judgment (map vs reference)", "order judgment (fitted head)")  # not nested


# ---------------------------------------------------------------- pairs


def synthetic_pair(items: int, seed: int, classes: int = 20, latent: int = 32) -> dict:
    """A team pair 1,024 -> 512: latent classes (a centre plus noise in ``latent`` dimensions), old =
    a random two-layer ReLU projection to 1,024 dimensions of the latent seen through more noise,
    new = another to 512 dimensions through less; neither normalized."""
    import numpy as np

    rng = np.random.default_rng([seed, 65, 3])
    centres = rng.normal(size=(classes, latent))
    labels = rng.integers(0, classes, size=items)
    z = centres[labels] + 0.9 * rng.normal(size=(items, latent))

    def project(width: int, noise: float) -> np.ndarray:
        first = rng.normal(size=(latent, 4 * latent)) / np.sqrt(latent)
        second = rng.normal(size=(4 * latent, width)) / np.sqrt(4 * latent)
        seen = z + noise * rng.normal(size=z.shape)
        return (np.maximum(seen @ first, 0) @ second).astype(np.float32)

    return {"old": project(1024, 1.2), "new": project(512, 0.3), "labels": labels.astype(np.int64)}


def load_pair(features: Path | None, pairs: int, seed: int) -> dict:
    """The map sample: the synthetic pair, or ``pairs`` items of a cached team pair sampled as an
    upgrade samples its gallery."""
    import numpy as np

    from fastfill.components.gallery.upgrade.pairs import sample_positions

    if features is None:
        return {**synthetic_pair(pairs, seed), "source": "synthetic 1024 -> 512", "gallery_items": pairs}
    data = np.load(features)
    positions = sample_positions(len(data["labels"]), pairs, seed)
    return {"old": np.ascontiguousarray(data["old"][positions], dtype=np.float32),
            "new": np.ascontiguousarray(data["new"][positions], dtype=np.float32),
            "labels": np.asarray(data["labels"][positions], dtype=np.int64), "source": str(features),
            "gallery_items": int(len(data["labels"]))}


# ---------------------------------------------------------------- the bare loop


def bare_loop(old, new, *, hidden: list[int], uncertainty: bool, batch_size: int, lr: float, steps: int, seed: int,
              l2_reduction: str = "sum", lam: float = 1.0, weighting: str = "separate", optimiser: str = "torch",
              layers: str = "product") -> tuple[float, float]:
    """(Wall seconds, CPU seconds of this process) of ``steps`` optimiser steps on (``old``, ``new``) in
    a plain loop: each pass over the pairs in a seeded order, batches of ``batch_size`` (a batch of one
    skipped, as the product does),
    the l2 term per pair and, with ``uncertainty``, psi's term as ``weighting`` adds it (the
    upgrade's separate: mean l2 + mean(0.5 exp(-s) l2.detach() + 0.5 s / lambda), psi on the outputs
    detached; detached: the same with half the l2 mean and psi on the outputs; joint:
    mean(0.5 exp(-s) l2 + 0.5 s / lambda)).
    ``optimiser``: torch (torch.optim.Adam) or exact (ExactAdam); ``layers``: product (the
    product's AlignmentMap) or plain (nn.Linear)."""
    import torch
    from torch import nn

    if weighting not in ("separate", "detached", "joint"):
        raise ValueError(f"the bare loop computes the separate, detached and joint weightings, not {weighting!r}")
    torch.manual_seed(seed)
    old_dim, new_dim = old.shape[1], new.shape[1]
    if layers == "product":
        from fastfill.components.experiment.models import AlignmentMap

        built = AlignmentMap(old_dim, new_dim, hidden, uncertainty)
        net, psi = built.transform, built.uncertainty
    else:
        modules: list[nn.Module] = []
        width = old_dim
        for size in hidden:
            modules += [nn.Linear(width, size), nn.BatchNorm1d(size), nn.ReLU(inplace=True)]
            width = size
        net = nn.Sequential(*modules, nn.Linear(width, new_dim))
        psi = nn.Linear(new_dim, 1) if uncertainty else None
    parameters = list(net.parameters()) + (list(psi.parameters()) if psi is not None else [])
    if optimiser == "exact":
        from fastfill.components.experiment.optimizers import ExactAdam

        adam: torch.optim.Optimizer = ExactAdam(parameters, lr=lr)
    else:
        adam = torch.optim.Adam(parameters, lr=lr)
    x, y = torch.from_numpy(old), torch.from_numpy(new)
    generator = torch.Generator().manual_seed(seed)
    net.train()
    done = 0
    started, cpu = time.perf_counter(), time.process_time()
    while done < steps:
        permutation = torch.randperm(len(x), generator=generator)
        for start in range(0, len(x), batch_size):
            index = permutation[start: start + batch_size]
            if len(index) < 2:
                continue
            out = net(x[index])
            squared = (y[index] - out).pow(2)
            l2 = squared.sum(dim=1) if l2_reduction == "sum" else squared.mean(dim=1)
            if psi is None:
                loss = l2.mean()
            elif weighting == "joint":
                s = psi(out).squeeze(-1)
                loss = (0.5 * torch.exp(-s) * l2 + 0.5 * s / lam).mean()
            else:
                s = psi(out.detach() if weighting == "separate" else out).squeeze(-1)
                head = (0.5 * torch.exp(-s) * l2.detach() + 0.5 * s / lam).mean()
                loss = (l2.mean() if weighting == "separate" else 0.5 * l2.mean()) + head
            adam.zero_grad(set_to_none=True)
            loss.backward()
            adam.step()
            done += 1
            if done == steps:
                break
    return time.perf_counter() - started, time.process_time() - cpu


def plain_worker(spec_path: str) -> None:
    """The ``bare, plain torch`` loops in this fresh, unpinned process: prints their seconds as JSON."""
    import numpy as np
    import torch

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    torch.set_flush_denormal(True)
    data = np.load(spec["data"])
    bare_loop(data["old"][:64], data["new"][:64], **{**spec["loops"][0]["settings"], "steps": 2})  # warm-up
    out = {}
    for loop in spec["loops"]:
        out[loop["name"]] = bare_loop(data["old"], data["new"], **loop["settings"])  # (wall, cpu)
    print(json.dumps({"seconds": out, "kernels": torch.backends.cpu.get_cpu_capability()}))


def run_plain(loops: list[dict], old, new, threads: int) -> dict:
    """``plain_worker`` in a fresh process with the machine's own kernels (the pin's variables
    removed from its environment)."""
    import numpy as np

    from fastfill.components.platform import runtime

    with tempfile.TemporaryDirectory(prefix="map-speed-") as scratch:
        np.savez(Path(scratch) / "pairs.npz", old=old, new=new)
        spec = Path(scratch) / "spec.json"
        spec.write_text(json.dumps({"data": str(Path(scratch) / "pairs.npz"), "threads": threads, "loops": loops}))
        env = {k: v for k, v in os.environ.items() if k not in runtime.kernel_environment("avx2")}
        env.update(FASTFILL_CPU_KERNELS="native", OMP_NUM_THREADS=str(threads))
        done = subprocess.run([sys.executable, __file__, "--plain-worker", str(spec)], env=env, check=True,
                              capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- the product's layers, timed


@contextlib.contextmanager
def timed_layers():
    """Within the block, the product's training and check layers are wrapped with timers; yields
    {layer: [seconds, calls]}."""
    import torch

    from fastfill.components.experiment import map_check, map_training
    from fastfill.components.experiment.models import AlignmentMap
    from fastfill.components.experiment.optimizers import ExactAdam

    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])

    def timer(function, name):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                totals[name][0] += time.perf_counter() - started
                totals[name][1] += 1
        return timed

    class TimedExactAdam(ExactAdam):
        step = timer(ExactAdam.step, "optimiser step (ExactAdam)")

    original_schedule = map_training.warmup_cosine

    def warmup_cosine(*args, **kwargs):
        scheduler = original_schedule(*args, **kwargs)
        scheduler.step = timer(scheduler.step, "scheduler step")
        return scheduler

    patches = [
        (map_training, "_train_on_features", timer(map_training._train_on_features, LOOP)),
        (map_training, "alignment_loss", timer(map_training.alignment_loss, "loss terms")),
        (map_training, "ExactAdam", TimedExactAdam),
        (map_training, "warmup_cosine", warmup_cosine),
        (map_training, "validation_record", timer(map_training.validation_record, "validation (every epoch)")),
        (map_training, "_finite_weights", timer(map_training._finite_weights, "finite-weights test")),
        (map_training, "_snapshot", timer(map_training._snapshot, "weight snapshots")),
        (map_training, "_say_epoch", timer(map_training._say_epoch, "log lines")),
        (map_training, "save_checkpoint", timer(map_training.save_checkpoint, "checkpoint writes")),
        (map_training, "fit_uncertainty_head", timer(map_training.fit_uncertainty_head, "fitted head")),
        (map_check, "check_map", timer(map_check.check_map, "judgment (map vs reference)")),
        (map_check, "judge_order", timer(map_check.judge_order, "order judgment (fitted head)")),
        (torch.nn.utils, "clip_grad_norm_", timer(torch.nn.utils.clip_grad_norm_, "gradient clipping")),
        (AlignmentMap, "normalized", timer(AlignmentMap.normalized, "forward (training batches)")),
        (torch.Tensor, "backward", timer(torch.Tensor.backward, "backward")),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield totals
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


@contextlib.contextmanager
def free_blas_validation():
    """A toggle: within the block, the held-out retrieval of the map's per-epoch validation
    (``map_training.retrieval_at_zero``, numpy's matrix product) runs on numpy's BLAS's own
    threads, as it did before the product held it to one thread (threadpoolctl); the rest of the
    training as it is."""
    from fastfill.components.evaluation import retrieval_metrics
    from fastfill.components.experiment import map_training

    original = map_training.retrieval_at_zero

    def retrieval_at_zero(transformed, new, labels, distance="l2"):
        metrics = retrieval_metrics(new, transformed, labels, distance=distance)
        return {"top1": float(metrics["top1"]), "map": float(metrics["map"])}

    map_training.retrieval_at_zero = retrieval_at_zero
    try:
        yield
    finally:
        map_training.retrieval_at_zero = original


# ---------------------------------------------------------------- one repeat


def quiet(_: str) -> None:
    pass


def product_training(config, pair: dict, rows, head, method: str) -> dict:
    """``train_alignment`` as the upgrade runs it, its layers timed: seconds, epochs, steps."""
    import torch

    from fastfill.components.experiment.map_training import train_alignment

    lines: list[str] = []
    with timed_layers() as timed:
        started, cpu = time.perf_counter(), time.process_time()
        h, history = train_alignment(config, pair["old"], pair["new"], rows, head, device=torch.device("cpu"),
                                     log=lines.append, method=method)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    layers = {k: {"seconds": v[0], "calls": v[1]} for k, v in timed.items() if k != LOOP}
    loop = timed[LOOP][0]
    layers["rest of the loop (psi's forward, batches, zero_grad, sums, records)"] = {
        "seconds": loop - sum(v["seconds"] for v in layers.values()), "calls": None}
    layers["setup (split, scales, network, held-out pairs)"] = {"seconds": seconds - loop, "calls": None}
    kept = [r["epoch"] for r in history if r.get("best")]
    return {"seconds": seconds, "cpu_seconds": cpu, "epochs": len(history), "steps": int(history[-1]["step"]),
            "kept_epoch": kept[0] if kept else None,
            "diverged": next((r["diverged"]["reason"] for r in history if "diverged" in r), None),
            "layers": layers, "in_run_ratio": seconds / sum(layers[k]["seconds"] for k in STEP_LAYERS if k in layers),
            "last_lines": lines[-2:], "map": h}


def product_check(config, pair: dict, rows, head, candidate, reference=None) -> dict:
    """``decide_map`` as the upgrade runs it: ``reference`` is what the registry hands it (None: no
    registered l2-only map for the two versions)."""
    import torch

    from fastfill.components.experiment.map_check import decide_map

    with timed_layers() as layers:
        started, cpu = time.perf_counter(), time.process_time()
        decision = decide_map("fastfill", config, candidate, (pair["old"], pair["new"], rows), lambda: reference,
                              head, checking=(pair["old"], pair["new"], pair["labels"]), order="sigma",
                              device=torch.device("cpu"), log=quiet, check_l2_only=True)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    return {"seconds": seconds, "cpu_seconds": cpu, "use": decision.use, "order": decision.order,
            "message": (decision.record or {}).get("message", decision.skipped),
            "layers": {k: {"seconds": v[0], "calls": v[1]} for k, v in layers.items()}}


def conditioned_training_pairs(config, pair: dict) -> tuple:
    """The training pairs as the product's loop sees them: its split, divided by its scales."""
    import numpy as np

    from fastfill.components.experiment.map_training import feature_scales, split_pairs

    train_index, _ = split_pairs(config, len(pair["old"]), "fastfill")
    old, new = pair["old"][train_index], pair["new"][train_index]
    if config.conditioned:
        input_scale, output_scale = feature_scales(old, new)
        old, new = old / input_scale, new / output_scale
    return np.ascontiguousarray(old, dtype=np.float32), np.ascontiguousarray(new, dtype=np.float32)


def loop_settings(config, steps: int, uncertainty: bool) -> dict:
    return {"hidden": list(config.hidden), "uncertainty": uncertainty, "batch_size": config.batch_size,
            "lr": config.lr, "steps": steps, "seed": config.seed, "l2_reduction": config.l2_reduction,
            "lam": config.uncertainty_lambda, "weighting": config.uncertainty_weighting}


def bare_loops(config, conditioned: tuple, steps: int, uncertainty: bool) -> dict:
    """The bare loops of this process, torch's Adam and the product's ExactAdam: seconds and steps."""
    settings = loop_settings(config, steps, uncertainty)
    out = {}
    for name, optimiser in (("torch Adam", "torch"), ("ExactAdam", "exact")):
        seconds, cpu = bare_loop(*conditioned, **settings, optimiser=optimiser)
        out[f"bare, {name}"] = {"seconds": seconds, "cpu_seconds": cpu, "steps": steps}
    return out


def same_network(h, reference, psi: bool = False) -> bool:
    """Whether the map's network (with ``psi``, its whole state) has the other's weights, bit for bit."""
    import torch

    mine, theirs = (h.state_dict(), reference.state_dict()) if psi else (h.transform.state_dict(),
                                                                         reference.transform.state_dict())
    return mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def plain_loops(configs: dict, steps: dict) -> list[dict]:
    """The ``bare, plain torch`` loops' settings, for ``plain_worker``."""
    return [{"name": part, "settings": {**loop_settings(config, steps[part], part == "FastFill map"),
                                        "optimiser": "torch", "layers": "plain"}} for part, config in configs.items()]


def one_repeat(repeat: int, configs: dict, pair: dict, conditioned: tuple, steps: dict, args) -> dict:
    """Every part once; the order alternates with the repeat: product runs first on even repeats,
    the bare loops (the plain one included) first on odd ones."""
    from fastfill.components.gallery.upgrade.pseudo_classes import cluster_classes

    out: dict = {"repeat": repeat, "load_before": os.getloadavg()[0]}
    started, cpu = time.perf_counter(), time.process_time()
    rows, head, k = cluster_classes(pair["new"], PSEUDO_CLASSES, args.seed)
    out["pseudo-classes"] = {"seconds": time.perf_counter() - started, "cpu_seconds": time.process_time() - cpu, "k": k}
    product_first = repeat % 2 == 0
    plain = None if product_first or args.no_plain else run_plain(plain_loops(configs, steps), *conditioned,
                                                                  args.threads)
    trained = {}
    for part, config in configs.items():
        uncertainty = part == "FastFill map"
        method = "fastfill" if uncertainty else ""
        bare_runs = None if product_first else bare_loops(config, conditioned, steps[part], uncertainty)
        toggled = None
        if uncertainty and not product_first:
            with free_blas_validation():
                toggled = product_training(config, pair, rows, head, method)
        out[part] = product_training(config, pair, rows, head, method)
        trained[part] = out[part].pop("map")
        steps.setdefault(part, out[part]["steps"])  # the first repeat's: the bare loops' steps
        out[part]["bare"] = bare_runs or bare_loops(config, conditioned, steps[part], uncertainty)
        if uncertainty:
            if toggled is None:
                with free_blas_validation():
                    toggled = product_training(config, pair, rows, head, method)
            toggled["same_weights"] = same_network(toggled.pop("map"), trained[part], psi=True)
            out[part]["toggles"] = {TOGGLE: toggled}
    out["map check"] = product_check(configs["FastFill map"], pair, rows, head, trained["FastFill map"])
    out["map check, handed the trained reference"] = product_check(
        configs["FastFill map"], pair, rows, head, trained["FastFill map"], trained["l2-only reference"])
    out["map check"]["reference_is_the_map_network"] = same_network(trained["FastFill map"],
                                                                     trained["l2-only reference"])
    if not args.no_plain:
        plain = plain or run_plain(plain_loops(configs, steps), *conditioned, args.threads)
        for part in configs:
            seconds, cpu = plain["seconds"][part]
            out[part]["bare"]["bare, plain torch"] = {"seconds": seconds, "cpu_seconds": cpu, "steps": steps[part],
                                                      "kernels": plain["kernels"]}
    out["load_after"] = os.getloadavg()[0]
    return out


def warm_up(configs: dict, pair: dict, conditioned: tuple) -> None:
    """One untimed pass of every part on a few pairs and one epoch: the libraries' lazy imports and
    first-call costs stay out of the measured runs."""
    from fastfill.components.gallery.upgrade.pseudo_classes import cluster_classes

    small = {key: pair[key][:200] for key in ("old", "new", "labels")}
    rows, head, _ = cluster_classes(small["new"], PSEUDO_CLASSES, 0)
    trained = {}
    for part, config in configs.items():
        quick = config.model_copy(update={"epochs": 1, "min_steps": 0, "warmup_epochs": 0})
        trained[part] = product_training(quick, small, rows, head, "")["map"]
        for optimiser in ("torch", "exact"):
            bare_loop(conditioned[0][:64], conditioned[1][:64], **loop_settings(config, 2, part == "FastFill map"),
                      optimiser=optimiser)
    quick = configs["FastFill map"].model_copy(update={"epochs": 1, "min_steps": 0, "warmup_epochs": 0})
    product_check(quick, small, rows, head, trained["FastFill map"])
    product_check(quick, small, rows, head, trained["FastFill map"], trained["l2-only reference"])


def profiled(config, pair: dict, top: int) -> list[dict]:
    """One more run of the FastFill map under cProfile: the ``top`` functions by own time."""
    import cProfile
    import pstats

    import torch

    from fastfill.components.experiment.map_training import train_alignment
    from fastfill.components.gallery.upgrade.pseudo_classes import cluster_classes

    rows, head, _ = cluster_classes(pair["new"], PSEUDO_CLASSES, config.seed)
    profile = cProfile.Profile()
    profile.enable()
    train_alignment(config, pair["old"], pair["new"], rows, head, device=torch.device("cpu"), log=quiet,
                    method="fastfill")
    profile.disable()
    stats = pstats.Stats(profile)
    entries = []
    for (filename, line, name), (_, calls, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = filename.replace(str(ROOT) + "/", "").split("site-packages/")[-1]
        entries.append({"function": f"{where}:{line}({name})", "calls": calls, "own_seconds": round(own, 3),
                        "cumulative_seconds": round(cumulative, 3)})
    entries.sort(key=lambda e: e["own_seconds"], reverse=True)
    return entries[:top]


# ---------------------------------------------------------------- summary and report


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def summarize(repeats: list[dict], configs: dict) -> dict:
    """Per part: wall and CPU seconds (median, min), epochs, steps, seconds per step; per bare loop
    the same and the per-repeat ratios product / bare (wall and CPU seconds per step); per layer
    the median seconds over the repeats."""
    parts: dict = {"pseudo-classes": {"seconds": spread([r["pseudo-classes"]["seconds"] for r in repeats]),
                                      "cpu_seconds": spread([r["pseudo-classes"]["cpu_seconds"] for r in repeats]),
                                      "k": repeats[0]["pseudo-classes"]["k"]}}
    for part in configs:
        runs = [r[part] for r in repeats]
        per_step = [run["seconds"] / run["steps"] for run in runs]
        cpu_per_step = [run["cpu_seconds"] / run["steps"] for run in runs]
        bare = {}
        for name in runs[0]["bare"]:
            loop = [run["bare"][name] for run in runs]
            loop_per_step = [b["seconds"] / b["steps"] for b in loop]
            loop_cpu = [b["cpu_seconds"] / b["steps"] for b in loop]
            bare[name] = {"seconds": spread([b["seconds"] for b in loop]),
                          "cpu_seconds": spread([b["cpu_seconds"] for b in loop]), "steps": loop[0]["steps"],
                          "seconds_per_step": spread(loop_per_step),
                          "ratio": spread([p / b for p, b in zip(per_step, loop_per_step, strict=True)]),
                          "cpu_ratio": spread([p / b for p, b in zip(cpu_per_step, loop_cpu, strict=True)])}
            if "kernels" in loop[0]:
                bare[name]["kernels"] = loop[0]["kernels"]
        layers = {}
        for name in {name: None for run in runs for name in run["layers"]}:
            seconds = [run["layers"].get(name, {}).get("seconds", 0.0) for run in runs]
            calls = [run["layers"].get(name, {}).get("calls") for run in runs]
            layers[name] = {"seconds": statistics.median(seconds),
                            "calls": None if None in calls else statistics.median(calls),
                            "share": statistics.median([s / run["seconds"] for s, run in zip(seconds, runs, strict=True)])}
        toggles = {}
        for name in runs[0].get("toggles", {}):
            loop = [run["toggles"][name] for run in runs]
            loop_per_step = [t["seconds"] / t["steps"] for t in loop]
            toggles[name] = {
                "seconds": spread([t["seconds"] for t in loop]), "cpu_seconds": spread([t["cpu_seconds"] for t in loop]),
                "steps": loop[0]["steps"], "seconds_per_step": spread(loop_per_step),
                "same_weights": [t["same_weights"] for t in loop],
                "in_run_ratio": spread([t["in_run_ratio"] for t in loop]),
                "ratio_to_bare": {bare_name: spread([t / (run["bare"][bare_name]["seconds"] / run["bare"][bare_name]["steps"])
                                                     for t, run in zip(loop_per_step, runs, strict=True)])
                                  for bare_name in runs[0]["bare"]},
                "ratio_to_product": spread([t / p for t, p in zip(loop_per_step, per_step, strict=True)])}
        parts[part] = {"seconds": spread([run["seconds"] for run in runs]), "toggles": toggles,
                       "cpu_seconds": spread([run["cpu_seconds"] for run in runs]), "epochs": runs[0]["epochs"],
                       "epochs_each": [run["epochs"] for run in runs], "steps": runs[0]["steps"],
                       "steps_each": [run["steps"] for run in runs], "kept_epoch": runs[0]["kept_epoch"],
                       "diverged": runs[0]["diverged"], "seconds_per_step": spread(per_step), "bare": bare,
                       "layers": layers, "in_run_ratio": spread([run["in_run_ratio"] for run in runs]),
                       "last_lines": runs[0]["last_lines"]}
    for name in CHECKS:
        checks = [r[name] for r in repeats]
        layer_names = [n for n in (*CHECK_LAYERS, "backward") if any(n in c["layers"] for c in checks)]
        layers = {n: {"seconds": statistics.median([c["layers"].get(n, {}).get("seconds", 0.0) for c in checks]),
                      "calls": statistics.median([c["layers"].get(n, {}).get("calls", 0) for c in checks])}
                  for n in layer_names}
        layers["rest of the check"] = {"seconds": statistics.median(
            [c["seconds"] - sum(v["seconds"] for n, v in c["layers"].items() if n in CHECK_LAYERS) for c in checks]),
            "calls": None}
        if "backward" in layers:  # nested in the fitted head's seconds
            layers["backward (inside the fitted head)"] = layers.pop("backward")
        parts[name] = {"seconds": spread([c["seconds"] for c in checks]),
                       "cpu_seconds": spread([c["cpu_seconds"] for c in checks]), "use": checks[0]["use"],
                       "order": checks[0]["order"], "message": checks[0]["message"], "layers": layers}
    parts["map check"]["reference_is_the_map_network"] = [r["map check"]["reference_is_the_map_network"]
                                                          for r in repeats]
    return parts


def product_version() -> dict:
    """The product's commit, and the product files (components/, tasks/) that differ from it."""
    def git(*command: str) -> str:
        try:
            return subprocess.run(["git", *command], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    changed = git("status", "--porcelain", "--", "components", "tasks")
    return {"commit": git("rev-parse", "--short", "HEAD"),
            "changed_files": [line[3:] for line in changed.splitlines() if line.strip()]}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--features", type=Path, default=None, help="a cached team pair (npz: old, new, labels)")
    parser.add_argument("--pairs", type=int, default=1000, help="the map sample")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    parser.add_argument("--max-epochs", type=int, default=None,
                        help="train at most this many epochs (a smoke test); default: the configuration's")
    parser.add_argument("--no-plain", action="store_true", help="skip the plain-torch loop in a fresh process")
    parser.add_argument("--profile", type=int, default=25, help="functions listed from a cProfile run (0: none)")
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "map_speed")
    parser.add_argument("--plain-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    from fastfill.components.platform import runtime

    if args.plain_worker:
        runtime.pin_cpu_kernels("native")
        plain_worker(args.plain_worker)
        return 0
    kernels = runtime.pin_cpu_kernels(runtime.cpu_kernels_of(args.params))  # as the `fastfill` command does
    runtime.apply_defaults()

    import numpy as np
    import torch

    from fastfill.components.experiment.map_check import reference_config
    from fastfill.components.platform.config import load_params

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    wall = time.perf_counter()
    fastfill = load_params(args.params).align["fastfill"].for_upgrade().model_copy(update={"disc": False,
                                                                                          "seed": args.seed})
    if args.max_epochs is not None:
        fastfill = type(fastfill).model_validate({**fastfill.model_dump(), "epochs": args.max_epochs, "min_steps": 0,
                                                  "warmup_epochs": min(fastfill.warmup_epochs, args.max_epochs - 1)})
    configs = {"FastFill map": fastfill, "l2-only reference": reference_config(fastfill)}
    pair = load_pair(args.features, args.pairs, args.seed)
    conditioned = conditioned_training_pairs(fastfill, pair)
    held = len(pair["old"]) - len(conditioned[0])
    print(f"{pair['source']}: {len(pair['old'])} pairs ({len(conditioned[0])} trained on, {held} held out), "
          f"{pair['old'].shape[1]} -> {pair['new'].shape[1]}; kernels {kernels}, {args.threads} threads", flush=True)

    warm_up(configs, pair, conditioned)
    steps: dict[str, int] = {}  # filled by the first repeat, whose product runs go first
    repeats = []
    for repeat in range(args.repeats):
        measured = one_repeat(repeat, configs, pair, conditioned, steps, args)
        repeats.append(measured)
        said = []
        for part in configs:
            run = measured[part]
            ratios = ", ".join(f"{name} {run['seconds'] / run['steps'] / (b['seconds'] / b['steps']):.2f}x"
                               for name, b in run["bare"].items())
            said.append(f"{part} {run['seconds']:.1f} s ({run['epochs']} epochs, {run['steps']} steps; "
                        f"product / {ratios})")
        print(f"repeat {repeat + 1}/{args.repeats}: pseudo-classes {measured['pseudo-classes']['seconds']:.1f} s; "
              + "; ".join(said) + f"; map check {measured['map check']['seconds']:.1f} s "
              f"({measured['map check']['use']}); load {measured['load_before']:.1f}", flush=True)

    parts = summarize(repeats, configs)
    result = {
        "command": " ".join([".venv/bin/python", "benchmarks/map_speed.py", *(argv if argv is not None else sys.argv[1:])]),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "plain_worker"},
        "settings": ", ".join(f"{k} {getattr(fastfill, k)}" for k in (
            "hidden", "batch_size", "lr", "epochs", "min_steps", "patience", "conditioning", "uncertainty_weighting",
            "validation_fraction")),
        "product": product_version(),
        "environment": {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
                        "threads": torch.get_num_threads(), "kernels": kernels,
                        "torch_kernels": torch.backends.cpu.get_cpu_capability(),
                        "kernels_not_in_effect": runtime.kernels_in_effect(kernels),
                        "load_min": min(min(r["load_before"], r["load_after"]) for r in repeats),
                        "load_max": max(max(r["load_before"], r["load_after"]) for r in repeats)},
        "data": {"source": pair["source"], "gallery_items": pair["gallery_items"], "pairs": len(pair["old"]),
                 "training_pairs": len(conditioned[0]), "held_out": held, "old_dim": int(pair["old"].shape[1]),
                 "new_dim": int(pair["new"].shape[1]),
                 "old_squared_norm": float(np.mean(np.square(pair["old"], dtype=np.float64).sum(axis=1))),
                 "new_squared_norm": float(np.mean(np.square(pair["new"], dtype=np.float64).sum(axis=1)))},
        "repeats": args.repeats, "targets": {"seconds": TARGET_SECONDS, "ratio": TARGET_RATIO},
        "parts": parts, "runs": [{k: v for k, v in r.items()} for r in repeats],
    }
    if args.profile:
        started = time.perf_counter()
        result["profile"] = profiled(fastfill, pair, args.profile)
        result["profile_seconds"] = time.perf_counter() - started
    result["wall_seconds"] = time.perf_counter() - wall

    for part in configs:
        p = parts[part]
        print(f"{part}: {p['seconds']['median']:.2f} s median ({p['seconds']['min']:.2f} min), {p['epochs']} epochs, "
              f"{p['steps']} steps, {p['seconds_per_step']['median']:.4f} s/step; "
              + ", ".join(f"/ {name} {b['ratio']['median']:.2f}x" for name, b in p["bare"].items()))
    print(f"pseudo-classes {parts['pseudo-classes']['seconds']['median']:.2f} s; map check "
          f"{parts['map check']['seconds']['median']:.2f} s ({parts['map check']['use']})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(f"wrote {args.out.with_suffix('.md')} and {args.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
