"""Process-wide settings made before the heavy libraries load: Prefect's defaults, the thread
count, and the CPU kernels' instruction set (no Prefect, numpy or torch import at module level)."""

import os

_PREFECT_DEFAULTS = {
    # Otherwise the server tries to reach the internet and can hit `database is locked`.
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    # A fresh ephemeral server can take ~15 s to start on 2 cores.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_LOGGING_LEVEL": "INFO",
}


def apply_defaults() -> None:
    """Prefect's and MLflow's defaults, and the default CPU kernels unless a command already
    pinned them from its configuration (``pin_cpu_kernels``)."""
    if "FASTFILL_CPU_KERNELS" not in os.environ:
        pin_cpu_kernels(DEFAULT_CPU_KERNELS)
    for key, value in _PREFECT_DEFAULTS.items():
        os.environ.setdefault(key, value)
    # MLflow's model logging would otherwise time out fetching nothing from the network.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


def use_threads(threads: int | None) -> int:
    """torch's intra-op thread count for a pipeline stage: ``threads`` (compute.threads) unless
    OMP_NUM_THREADS is set, which wins (the comparison sets it per seed process). The stages'
    float sums depend on how work splits across threads, so a fixed count is what makes a rerun
    on another machine of the same kind give the same bytes. Returns the count in use."""
    import torch

    if threads is not None and not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(threads)
    return torch.get_num_threads()


# compute.cpu_kernels: the instruction-set level every library's CPU kernels are held to. Float
# results follow the kernels (oneDNN's convolutions, MKL's and OpenBLAS's matrix products,
# ATen's vectorised loops, faiss's distances and numpy's ufuncs each pick AVX-512 code where the
# CPU has it), so two machines give the same bytes only when their kernels are the same: "avx2"
# holds every library to AVX2 (x86-64-v3: Intel since Haswell, 2013; AMD since Zen, 2017), and
# MKL to its one vendor-neutral branch;
# "native" lets each take the machine's best. Each library reads its variable once, when it loads
# (numpy, faiss) or at its first kernel (torch, oneDNN, MKL): they are set before any of them.
CPU_KERNELS = ("avx2", "native")  # a tuple: Literal[CPU_KERNELS] in the configuration
DEFAULT_CPU_KERNELS = "avx2"
_KERNEL_ENVIRONMENT = {
    "avx2": {
        "ONEDNN_MAX_CPU_ISA": "AVX2",                 # torch's convolutions (oneDNN)
        "ATEN_CPU_CAPABILITY": "avx2",                # torch's own vectorised loops
        # torch's matrix products and vector maths (MKL). Only COMPATIBLE gives the same bytes on
        # Intel and AMD: under AVX2 (strict or not) an Intel CPU runs other small-matrix and exp
        # kernels than an AMD one, and on AMD MKL ignores every branch but COMPATIBLE
        # (reports/cpu_kernels.md). The models' and maps' linear layers, where MKL's time went,
        # run on oneDNN instead (components/experiment/dense.py), held by the line above
        "MKL_CBWR": "COMPATIBLE",
        "OPENBLAS_CORETYPE": "Haswell",               # numpy's and faiss's matrix products (OpenBLAS)
        "FAISS_SIMD_LEVEL": "AVX2",                   # faiss's distance kernels (upper case: faiss aborts on others)
        "NPY_DISABLE_CPU_FEATURES": "X86_V4,AVX512_ICL,AVX512_SPR",  # numpy's ufuncs
    },
    "native": {},
}


def kernel_environment(level: str) -> dict[str, str]:
    """The variables that hold the CPU kernels to ``level`` (compute.cpu_kernels)."""
    if level not in _KERNEL_ENVIRONMENT:
        raise ValueError(f"compute.cpu_kernels must be one of {', '.join(CPU_KERNELS)}, got {level!r}")
    return dict(_KERNEL_ENVIRONMENT[level])


def cpu_kernels_of(params_path) -> str:
    """compute.cpu_kernels of a params file, read with yaml alone (before numpy or torch load);
    the default when the file or the key is missing or unreadable (the file's validation, which
    comes next, reports a bad value)."""
    import yaml

    try:
        with open(params_path, encoding="utf-8") as file:
            data = yaml.safe_load(file)
        level = data["compute"]["cpu_kernels"]
    except (OSError, UnicodeDecodeError, yaml.YAMLError, KeyError, TypeError):
        return DEFAULT_CPU_KERNELS
    return level if level in _KERNEL_ENVIRONMENT else DEFAULT_CPU_KERNELS


def cpu_kernels_level(configured: str) -> str:
    """The CPU kernel level in force: FASTFILL_CPU_KERNELS when the environment sets it (it wins
    over compute.cpu_kernels, as OMP_NUM_THREADS does over compute.threads), else ``configured``."""
    return os.environ.get("FASTFILL_CPU_KERNELS") or configured


def pin_cpu_kernels(level: str) -> str:
    """Hold this process's CPU kernels, and its subprocesses', to ``level``: FASTFILL_CPU_KERNELS
    when the environment sets it (it wins over compute.cpu_kernels, as OMP_NUM_THREADS does over
    compute.threads), else ``level``. Each library's variable is set unless the environment
    already sets it (a variable set by hand wins too). Returns the level. Call it before numpy,
    torch or faiss is imported; ``kernels_in_effect`` tells afterwards whether it came in time."""
    level = cpu_kernels_level(level)
    variables = kernel_environment(level)
    os.environ["FASTFILL_CPU_KERNELS"] = level
    for key, value in variables.items():
        os.environ.setdefault(key, value)
    return level


def kernels_in_effect(level: str) -> list[str]:
    """What differs between ``level`` and the kernels this process really runs: empty when they
    agree. A library loaded before the pin keeps the machine's kernels, and a variable set by hand
    to another level wins; either gives other bytes than a pinned run on another machine."""
    import sys

    problems = [f"{key}={os.environ.get(key)!r} (the level wants {value!r})"
                for key, value in kernel_environment(level).items() if os.environ.get(key) != value]
    if level == "avx2" and "torch" in sys.modules:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
        if capability not in ("AVX2", "DEFAULT"):
            problems.append(f"torch runs its {capability} kernels (it was imported before the pin)")
    if level == "avx2" and "faiss" in sys.modules:
        import faiss

        simd = faiss.SIMDConfig.get_level_name()
        if simd not in ("AVX2", "NONE"):
            problems.append(f"faiss runs its {simd} kernels (it was imported before the pin)")
    return problems


def onednn_below_bf16() -> bool:
    """Whether oneDNN is held below the AVX-512 bfloat16 instructions (compute.cpu_kernels):
    bfloat16 is then emulated, slower than float32, and precision ``auto`` trains in float32."""
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    return bool(isa) and isa not in ("ALL", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX",
                                     "AVX512_CORE_AMX_FP16", "AVX10_1_512", "AVX10_1_512_AMX",
                                     "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2")
