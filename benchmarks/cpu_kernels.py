"""Same bytes on every x86-64 CPU: what compute.cpu_kernels pins, checked and timed.

    .venv/bin/python benchmarks/cpu_kernels.py [--repeat 3] [--qemu] [--out reports/cpu_kernels.md]

A probe computes what the pipeline's stages compute, at small size, and prints one SHA-256 per
part: a few training steps of the old and new CNNs (convolutions, batch norm, Adam), of the
alignment map with its uncertainty head, an embedding pass, numpy's normalisation, matrix
product, argsort and transcendental functions, and faiss's exact search. The script runs the probe
in fresh processes:

- on this machine, unpinned (``native``: every library takes the machine's best kernels) and
  pinned (``avx2``, the default);
- with ``--qemu`` (Debian's qemu-user), under emulated CPUs that have AVX2 but no AVX-512: an
  Intel Haswell and an AMD EPYC Rome, each unpinned and pinned. There every library really detects
  an AVX2 machine, so a pinned run here that matches them is the same bytes another CPU gives.

Then it times the probe's training part, pinned against native, alternating, medians of
``--repeat`` runs: the cost of the pin; and the default alignment map's training (the pipeline's
heaviest CPU work) with the machine's own kernels (torch's nn.Linear on MKL, unpinned) against the
pinned product (its linear layers on oneDNN, components/experiment/dense.py). Everything is printed
and written to ``--out``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EMULATED = {"Intel Haswell (AVX2)": "Haswell", "AMD EPYC Rome (AVX2)": "EPYC-Rome"}


def _digest(array) -> str:
    import numpy as np

    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:16]


def probe(steps: int, torch_adam: bool = False) -> dict:
    """The parts' digests and the seconds the training part took (this process's kernels)."""
    import faiss
    import numpy as np
    import torch

    sys.path.insert(0, str(ROOT))
    from fastfill.components.experiment.models import AlignmentMap, Embedder
    from fastfill.components.experiment.optimizers import ExactAdam
    from fastfill.components.platform.config import TrainConfig

    # the product's optimiser (a correctly rounded square root), or torch's, whose square root
    # follows the CPU maker (--torch-adam: what the product trained with before)
    adam = torch.optim.Adam if torch_adam else ExactAdam
    torch.set_num_threads(2)
    torch.manual_seed(0)
    generator = np.random.default_rng(0)
    images = torch.from_numpy(generator.random((128, 1, 28, 28), dtype=np.float32))
    labels = torch.from_numpy(generator.integers(0, 5, 128))
    out: dict[str, str] = {}
    start = time.perf_counter()
    for backbone, width in (("cnn_small", 16), ("cnn", 32)):
        model = Embedder(TrainConfig(backbone=backbone, width=width, embedding_dim=128), 1, list(range(5)))
        optimiser = adam(model.parameters(), lr=1e-3)
        for _ in range(steps):
            optimiser.zero_grad()
            loss = torch.nn.functional.cross_entropy(model.classify(model(images)), labels)
            loss.backward()
            optimiser.step()
        out[f"train {backbone}"] = _digest(torch.cat([p.detach().flatten() for p in model.parameters()]).numpy())
        model.eval()
        with torch.no_grad():
            out[f"embed {backbone}"] = _digest(model(images).numpy())
    old = torch.from_numpy(generator.standard_normal((512, 128), dtype=np.float32))
    new = torch.from_numpy(generator.standard_normal((512, 128), dtype=np.float32))
    mapping = AlignmentMap(128, 128, [256, 256], uncertainty=True)
    optimiser = adam(mapping.parameters(), lr=1e-3)
    for _ in range(steps):
        optimiser.zero_grad()
        mapped = mapping(old)
        log_var = mapping.log_sigma2(mapped)
        loss = (((mapped - new) ** 2).sum(1) * torch.exp(-log_var) + log_var).mean()
        loss.backward()
        optimiser.step()
    out["train map"] = _digest(torch.cat([p.detach().flatten() for p in mapping.parameters()]).numpy())
    seconds = time.perf_counter() - start
    gallery = generator.standard_normal((5000, 128)).astype(np.float32)
    queries = generator.standard_normal((1000, 128)).astype(np.float32)
    gallery /= np.linalg.norm(gallery, axis=1, keepdims=True)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    scores = queries @ gallery.T
    out["numpy matmul"] = _digest(scores)
    out["numpy argsort"] = _digest(np.argsort(-scores[:50], axis=1, kind="stable"))
    out["numpy exp/log/tanh"] = _digest(np.stack([np.exp(scores[:100]), np.log1p(np.abs(scores[:100])),
                                                  np.tanh(scores[:100])]))
    index = faiss.IndexFlatIP(128)
    index.add(gallery)
    distances, neighbours = index.search(queries, 10)
    out["faiss search"] = _digest(np.concatenate([distances.view(np.int32), neighbours.astype(np.int32)], axis=1))
    return {"digests": out, "train_seconds": seconds,
            "kernels": {"torch": torch.backends.cpu.get_cpu_capability(), "faiss": faiss.SIMDConfig.get_level_name()}}


def map_seconds(steps: int, mkl: bool) -> float:
    """Seconds for ``steps`` training steps of the default alignment map's shape (128 -> 256, 256,
    1024, 1024 -> 128 with its uncertainty head, 256 pairs a step, the product's optimiser), its
    linear layers through oneDNN (the product's ``Dense``) or, with ``mkl``, through torch's own
    ``nn.Linear`` (MKL's sgemm)."""
    import numpy as np
    import torch

    sys.path.insert(0, str(ROOT))
    from fastfill.components.experiment.dense import Dense
    from fastfill.components.experiment.models import AlignmentMap
    from fastfill.components.experiment.optimizers import ExactAdam

    if mkl:
        Dense.forward = torch.nn.Linear.forward
    torch.set_num_threads(2)
    torch.manual_seed(0)
    generator = np.random.default_rng(0)
    old = torch.from_numpy(generator.standard_normal((4096, 128), dtype=np.float32))
    new = torch.from_numpy(generator.standard_normal((4096, 128), dtype=np.float32))
    mapping = AlignmentMap(128, 128, [256, 256, 1024, 1024], uncertainty=True)
    optimiser = ExactAdam(mapping.parameters(), lr=1e-3)
    start = time.perf_counter()
    for step in range(steps):
        rows = slice((step * 256) % 4096, (step * 256) % 4096 + 256)
        optimiser.zero_grad()
        mapped = mapping(old[rows])
        log_var = mapping.log_sigma2(mapped)
        loss = (((mapped - new[rows]) ** 2).sum(1) * torch.exp(-log_var) + log_var).mean()
        loss.backward()
        optimiser.step()
    return time.perf_counter() - start


def run_map_timing(level: str, steps: int, mkl: bool) -> float:
    """``map_seconds`` in a fresh process whose kernels are held to ``level``."""
    from fastfill.components.platform.runtime import kernel_environment

    env = {key: value for key, value in os.environ.items()
           if key not in kernel_environment("avx2") and key != "FASTFILL_CPU_KERNELS"}
    env.update(kernel_environment(level))
    command = [sys.executable, __file__, "--map-probe", "--timing-steps", str(steps), *(["--mkl"] if mkl else [])]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the map timing failed ({' '.join(command)}):\n{done.stderr[-2000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def run_probe(level: str, steps: int, cpu: str | None = None, torch_adam: bool = False,
              unset: tuple[str, ...] = ()) -> dict:
    """The probe in a fresh process whose kernels are held to ``level`` (under qemu's ``cpu``),
    less the variables named in ``unset``."""
    sys.path.insert(0, str(ROOT))
    from fastfill.components.platform.runtime import kernel_environment

    env = {key: value for key, value in os.environ.items()
           if key not in kernel_environment("avx2") and key != "FASTFILL_CPU_KERNELS"}
    env.update({key: value for key, value in kernel_environment(level).items() if key not in unset})
    command = [sys.executable, __file__, "--probe", "--steps", str(steps), *(["--torch-adam"] if torch_adam else [])]
    if cpu is not None:
        command = ["qemu-x86_64", "-cpu", cpu, *command]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the probe failed ({' '.join(command)}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--map-probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mkl", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--map-steps", type=int, default=60, help="training steps of the timed alignment map")
    parser.add_argument("--steps", type=int, default=5, help="training steps of each part")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs of each level (medians)")
    parser.add_argument("--timing-steps", type=int, default=40, help="training steps of the timed runs")
    parser.add_argument("--qemu", action="store_true", help="also run under emulated AVX2-only CPUs")
    parser.add_argument("--torch-adam", action="store_true",
                        help="train with torch.optim.Adam (its square root follows the CPU maker) instead of "
                             "the product's ExactAdam")
    parser.add_argument("--attribute", action="store_true",
                        help="also time the pin less one variable at a time: what each costs")
    parser.add_argument("--no-timing", action="store_true", help="only the bytes, no timed runs")
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "cpu_kernels.md")
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe(args.steps, args.torch_adam)))
        return
    if args.map_probe:
        print(map_seconds(args.timing_steps, args.mkl))
        return
    rows: dict[str, dict] = {}
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "this CPU")
    has512 = "avx512f" in Path("/proc/cpuinfo").read_text()
    here = f"{cpu}{' (AVX-512)' if has512 else ''}"
    for level in ("native", "avx2"):
        rows[f"{here}, {level}"] = run_probe(level, args.steps, torch_adam=args.torch_adam)
    if args.qemu:
        if shutil.which("qemu-x86_64") is None:
            raise SystemExit("--qemu needs qemu-user: apt-get install qemu-user")
        for name, model in EMULATED.items():
            for level in ("native", "avx2"):
                rows[f"{name} under qemu, {level}"] = run_probe(level, args.steps, model, args.torch_adam)
    parts = list(next(iter(rows.values()))["digests"])
    reference = rows[f"{here}, avx2"]["digests"]
    lines = [f"CPU kernels and bytes (`.venv/bin/python benchmarks/cpu_kernels.py {' '.join(sys.argv[1:])}`): "
             f"the probe's parts ({args.steps} training steps each"
             f"{', torch.optim.Adam' if args.torch_adam else ', the product optimiser ExactAdam'}), SHA-256 prefixes; "
             f"= marks a part equal to this machine's pinned (avx2) run.", "",
             "| run | kernels (torch, faiss) | " + " | ".join(parts) + " |",
             "|---|---|" + "---|" * len(parts)]
    for name, row in rows.items():
        cells = [("= " if row["digests"][p] == reference[p] else "") + row["digests"][p] for p in parts]
        lines.append(f"| {name} | {row['kernels']['torch']}, {row['kernels']['faiss']} | " + " | ".join(cells) + " |")
    if args.no_timing:
        text = "\n".join(lines) + "\n"
        print(text)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        return
    from fastfill.components.platform.runtime import kernel_environment

    variants = {"native": ("native", ()), "avx2": ("avx2", ())}
    if args.attribute:  # the pin less one variable: how much of the cost that variable is
        variants.update({f"avx2 less {key}": ("avx2", (key,)) for key in kernel_environment("avx2")})
    timings: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeat):
        for name, (level, unset) in variants.items():
            timings[name].append(run_probe(level, args.timing_steps, unset=unset)["train_seconds"])
    medians = {name: statistics.median(values) for name, values in timings.items()}
    native, pinned = medians["native"], medians["avx2"]
    lines += ["", f"Training part ({args.timing_steps} steps of each CNN and the map, 2 threads), medians of "
              f"{args.repeat} alternating runs on {here}: native {native:.2f} s, avx2 {pinned:.2f} s, "
              f"avx2 / native = {pinned / native:.2f}x."]
    # the alignment map's linear layers, the pipeline's heaviest CPU work: the machine's own kernels
    # (torch's nn.Linear on MKL, unpinned) against the pinned product (oneDNN) and against what the
    # pin cost before (nn.Linear on MKL's COMPATIBLE branch)
    map_variants = {"native, nn.Linear (MKL)": ("native", True), "avx2, Dense (oneDNN)": ("avx2", False),
                    "avx2, nn.Linear (MKL COMPATIBLE)": ("avx2", True), "native, Dense (oneDNN)": ("native", False)}
    map_timings: dict[str, list[float]] = {name: [] for name in map_variants}
    for _ in range(args.repeat):
        for name, (level, mkl) in map_variants.items():
            map_timings[name].append(run_map_timing(level, args.map_steps, mkl))
    map_medians = {name: statistics.median(values) for name, values in map_timings.items()}
    own = map_medians["native, nn.Linear (MKL)"]
    lines += ["", f"The default alignment map ({args.map_steps} steps of 256 pairs, 2 threads), medians of "
              f"{args.repeat} alternating runs on {here}; the product trains with Dense under the avx2 pin:",
              "", "| kernels, linear layers | seconds | / the machine's own kernels |", "|---|---|---|"]
    lines += [f"| {name} | {seconds:.2f} | {seconds / own:.2f}x |" for name, seconds in map_medians.items()]
    if args.attribute:
        lines += ["", "| kernels | seconds | / native |", "|---|---|---|"]
        lines += [f"| {name} | {seconds:.2f} | {seconds / native:.2f}x |" for name, seconds in medians.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
