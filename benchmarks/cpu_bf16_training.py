"""Training steps in float32 against bfloat16 autocast on this CPU, side by side in one run;
and two trainings one after the other with every core against two at once, one process each.

The comparison's time is almost all training (docs/results.md, "The comparison of every
method": the MLP maps and the CNN models). A CPU with avx512_bf16 or AMX runs bfloat16
matrix products faster; this measures by how much, for the shapes the comparison trains:
an alignment map (MLP 128 -> 256 -> 256 -> 1024 -> 1024 -> 129, batch 256) and a CNN
embedder step (batch 128, 28 x 28 images). Ratios are float32 time / bfloat16 time.

`fastfill compare` runs its seeds side by side (compare.jobs), each process with cores/jobs
threads. The second part measures why: the same two bfloat16 trainings, first one after the
other in one process with every thread, then at once in two processes of cores/2 threads each.
The ratio is sequential time / side-by-side time (above 1: side by side is faster).

    python benchmarks/cpu_bf16_training.py --repeats 3
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time

import torch
import torch.nn as nn


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1024),
                         nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 129))


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(64 * 49, 128)).to(memory_format=torch.channels_last)


def seconds(model: nn.Module, x: torch.Tensor, steps: int, bf16: bool) -> float:
    optimizer = torch.optim.AdamW(model.parameters(), 1e-3)

    def step() -> None:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        optimizer.step()

    for _ in range(5):  # warm-up: first-call costs are not per step
        step()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    return time.perf_counter() - started


def _one_training(args: tuple[str, int]) -> float:
    """In a fresh process: one bfloat16 training of ``kind`` with ``threads`` threads."""
    kind, threads = args
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    build, x, steps = _cases()[kind]
    return seconds(build(), x, steps, True)


def _cases() -> dict:
    return {"alignment map (MLP), 200 steps": (_mlp, torch.randn(256, 128), 200),
            "CNN embedder, 30 steps": (_cnn, torch.randn(128, 1, 28, 28).to(memory_format=torch.channels_last), 30)}


def side_by_side(kind: str, cores: int) -> tuple[float, float]:
    """Two trainings: one after the other with ``cores`` threads, and at once with cores // 2 each."""
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        pool.map(_one_training, [(kind, cores)])  # the worker started and warm
        started = time.perf_counter()
        pool.map(_one_training, [(kind, cores), (kind, cores)])
        sequential = time.perf_counter() - started
    with context.Pool(2) as pool:
        pool.map(_one_training, [(kind, 1), (kind, 1)])  # both workers started and warm
        started = time.perf_counter()
        pool.map(_one_training, [(kind, max(1, cores // 2))] * 2, chunksize=1)
        together = time.perf_counter() - started
    return sequential, together


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    cases = _cases()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, (build, x, steps) in cases.items():
        times = {False: [], True: []}
        for _ in range(args.repeats):  # interleaved, so a busy moment hits both
            for bf16 in (False, True):
                times[bf16].append(seconds(build(), x, steps, bf16))
        fp32, bf16 = statistics.median(times[False]), statistics.median(times[True])
        print(f"{name}: float32 {fp32:.2f} s, bfloat16 {bf16:.2f} s, ratio {fp32 / bf16:.2f}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cores < 2:
        print("one core: nothing to run side by side")
        return 0
    for name in cases:
        runs = [side_by_side(name, cores) for _ in range(args.repeats)]
        sequential, together = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        print(f"{name}, two bfloat16 trainings: one after the other with {cores} threads {sequential:.2f} s, "
              f"side by side in two processes of {max(1, cores // 2)} {together:.2f} s, ratio {sequential / together:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
