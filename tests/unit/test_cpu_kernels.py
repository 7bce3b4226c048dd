"""compute.cpu_kernels: every library's CPU kernels held to one instruction set, so that every
x86-64 machine computes the same bytes (benchmarks/cpu_kernels.py checks it under emulated CPUs)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastfill.components.platform import runtime
from fastfill.components.platform.config import ConfigError, parse_params

ROOT = Path(__file__).resolve().parents[2]
PINNED = runtime.kernel_environment("avx2")
HAS_AVX512 = "avx512f" in Path("/proc/cpuinfo").read_text()
HAS_AVX2 = " avx2 " in Path("/proc/cpuinfo").read_text().replace("\n", " ")

# The probe's digests under the avx2 level (benchmarks/cpu_kernels.py --probe --steps 5), trained
# with the product's optimiser (components/experiment/optimizers.ExactAdam, whose square root is
# correctly rounded) and linear layers (components/experiment/dense.Dense, on oneDNN): a real AMD
# EPYC with AVX-512 and emulated Intel Haswell and AMD EPYC Rome CPUs compute these same bytes
# (reports/cpu_kernels.md), and a fresh clone's pipeline reproduces the committed outputs from them.
# A machine whose pinned bytes differ fails here, naming the part.
PINNED_DIGESTS = {
    "train cnn_small": "727f17bb123487b3", "embed cnn_small": "fc307b5d67561bf4",
    "train cnn": "52649949bb4c1b02", "embed cnn": "d9e7d439e3d70405", "train map": "ace5835dfa2cc9a7",
    "numpy matmul": "11401b298ac1c993", "numpy argsort": "5345ec897ad36ad2",
    "numpy exp/log/tanh": "ab45b3a7c85e7e55", "faiss search": "101ae423c87bea6e",
}


def _clean_environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in PINNED and k != "FASTFILL_CPU_KERNELS"}
    env.update(extra)
    return env


def _child(code: str, env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


REPORT = """
import json, os, sys
{before}
import numpy, torch, faiss
from numpy._core._multiarray_umath import __cpu_features__
from fastfill.components.platform import runtime
level = os.environ.get("FASTFILL_CPU_KERNELS", "avx2")
print(json.dumps({{"torch": torch.backends.cpu.get_cpu_capability(), "faiss": faiss.SIMDConfig.get_level_name(),
                  "numpy_avx512": bool(__cpu_features__.get("X86_V4")),
                  "env": {{k: os.environ.get(k) for k in runtime.kernel_environment("avx2")}},
                  "level": os.environ.get("FASTFILL_CPU_KERNELS"),
                  "problems": runtime.kernels_in_effect(level)}}))
"""


@pytest.mark.skipif(not HAS_AVX2, reason="this CPU has no AVX2: the avx2 level is above what it has")
def test_a_pinned_process_runs_every_library_at_avx2():
    """The CLI pins before anything heavy loads: torch, faiss and numpy run AVX2 code even on an
    AVX-512 machine, and nothing is reported out of place."""
    report = _child(REPORT.format(before="from fastfill.components.platform.runtime import pin_cpu_kernels\n"
                                         "pin_cpu_kernels('avx2')"), _clean_environment())
    assert report["torch"] == "AVX2"
    assert report["faiss"] == "AVX2"
    assert not report["numpy_avx512"]
    assert report["env"] == PINNED
    assert report["level"] == "avx2"
    assert report["problems"] == []


@pytest.mark.skipif(not HAS_AVX512, reason="only an AVX-512 machine shows kernels loaded before the pin")
def test_libraries_loaded_before_the_pin_are_reported():
    """torch picks its kernels at its first operation, faiss and numpy when they load: after
    those, the pin comes too late, and the stage's check says so."""
    report = _child(REPORT.format(before="import torch, faiss\ntorch.ones(8).sum()\n"
                                         "from fastfill.components.platform.runtime import pin_cpu_kernels\n"
                                         "pin_cpu_kernels('avx2')"), _clean_environment())
    assert report["torch"] == "AVX512"
    assert report["numpy_avx512"]  # numpy read NPY_DISABLE_CPU_FEATURES when it loaded, before the pin
    assert any("torch runs its AVX512 kernels" in p for p in report["problems"])
    assert any("faiss runs its" in p for p in report["problems"])


def test_the_environment_wins_over_the_configuration():
    report = _child(REPORT.format(before="from fastfill.components.platform.runtime import pin_cpu_kernels\n"
                                         "pin_cpu_kernels('avx2')"),
                    _clean_environment(FASTFILL_CPU_KERNELS="native", ONEDNN_MAX_CPU_ISA="AVX2"))
    assert report["level"] == "native"
    assert report["env"]["ONEDNN_MAX_CPU_ISA"] == "AVX2"  # set by hand: kept
    assert report["env"]["MKL_CBWR"] is None  # native sets nothing
    assert report["problems"] == []
    hand = _child(REPORT.format(before="from fastfill.components.platform.runtime import pin_cpu_kernels\n"
                                       "pin_cpu_kernels('avx2')"),
                  _clean_environment(MKL_CBWR="AVX2"))
    assert hand["env"]["MKL_CBWR"] == "AVX2"
    assert any("MKL_CBWR='AVX2'" in p for p in hand["problems"])


def test_one_function_gives_the_level_in_force(monkeypatch):
    from fastfill.components.platform.runtime import cpu_kernels_level

    monkeypatch.delenv("FASTFILL_CPU_KERNELS", raising=False)
    assert cpu_kernels_level("native") == "native"
    monkeypatch.setenv("FASTFILL_CPU_KERNELS", "avx2")
    assert cpu_kernels_level("native") == "avx2"


@pytest.mark.skipif(not HAS_AVX2, reason="this CPU has no AVX2: the avx2 level is above what it has")
def test_the_pinned_probe_gives_the_committed_bytes():
    """Training steps of both CNNs and the map, an embedding, numpy's and faiss's kernels under the
    avx2 level: the committed bytes, which a rerun on another machine must give."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_kernels.py"), "--probe", "--steps", "5"],
                          env=_clean_environment(**PINNED, FASTFILL_CPU_KERNELS="avx2"), cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    digests = json.loads(done.stdout.strip().splitlines()[-1])["digests"]
    differing = {part: value for part, value in digests.items() if PINNED_DIGESTS.get(part) != value}
    assert not differing, f"these parts give other bytes than every AVX2 machine: {differing}"


def test_the_level_is_validated_and_read_before_the_libraries(tmp_path):
    with pytest.raises(ConfigError, match="compute.cpu_kernels"):
        parse_params({"compute": {"cpu_kernels": "avx512"}})
    assert parse_params({}).compute.cpu_kernels == "avx2"
    path = tmp_path / "params.yaml"
    path.write_text("compute:\n  cpu_kernels: native\n")
    assert runtime.cpu_kernels_of(path) == "native"
    path.write_text("compute: [broken\n")
    assert runtime.cpu_kernels_of(path) == "avx2"  # the validation that follows names the problem
    assert runtime.cpu_kernels_of(tmp_path / "missing.yaml") == "avx2"
    path.write_bytes("compute:\n  cpu_kernels: native  # caf\u00e9\n".encode("latin-1"))
    assert runtime.cpu_kernels_of(path) == "avx2"  # not UTF-8: the default, and the validation says so
    with pytest.raises(ValueError, match="cpu_kernels must be one of avx2, native"):
        runtime.kernel_environment("sse")


def test_bfloat16_is_not_chosen_under_the_pin(monkeypatch):
    """auto precision trains in float32 when oneDNN is held below the bfloat16 instructions: the
    same bytes on a CPU with avx512_bf16 as on one without."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert runtime.onednn_below_bf16()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert not runtime.onednn_below_bf16()
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert not runtime.onednn_below_bf16()
