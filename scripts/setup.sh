#!/usr/bin/env bash
# Sets up everything the project needs on a fresh Debian machine with Python 3.11:
# the Fashion-MNIST package, a virtual environment in .venv, and the pinned packages.
# Safe to re-run: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

DATASET_DIR=/usr/share/datasets/fashion-mnist
if [ ! -f "$DATASET_DIR/train-images-idx3-ubyte.gz" ]; then
    echo "setup: installing Debian package dataset-fashion-mnist"
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq dataset-fashion-mnist
fi

PY=${PYTHON:-python3.11}
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $PY"
    "$PY" -m venv .venv
fi

# Two variants, each with exactly one faiss build (both install the module `faiss`):
#   cpu (default)     .[cpu,test] with requirements.lock as constraints: torch stays the CPU build here
#   gpu (FASTFILL_GPU=1)  .[gpu,test] with requirements-gpu.lock on top: PyPI's CUDA build of torch,
#                     its CUDA libraries and faiss's GPU build (Linux x86_64, a driver for CUDA 13)
# A run without FASTFILL_GPU keeps the variant the .venv has; FASTFILL_GPU=0 goes back to cpu.
# The locks are the constraints: the resolver never backtracks.
stamp=.venv/.fastfill-installed
current=cpu
if [ -f "$stamp" ] && [ "$(cut -d' ' -f1 "$stamp")" = "gpu" ]; then current=gpu; fi
case "${FASTFILL_GPU:-}" in
    1) variant=gpu ;;
    0) variant=cpu ;;
    *) variant=$current ;;
esac
constraints=(-c requirements.lock)
if [ "$variant" = gpu ]; then constraints+=(-c requirements-gpu.lock); fi
want="$variant $(cat requirements.lock requirements-gpu.lock pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "setup: installing the $variant variant (.[$variant,test]) from the locks (a few minutes the first time)"
    echo "$variant pending" > "$stamp"
    # pip keeps what nothing requires any more, and an installed torch of the pinned version: the
    # other build of faiss goes first (never two distributions of `faiss`; where an older setup left
    # two, both go, as they overwrote each other's files), and so does torch's CUDA build when going
    # back to cpu. Going to gpu, torch===2.13.0 replaces the CPU build (2.13.0+cpu) by itself.
    remove=$(.venv/bin/python - "$variant" "$current" <<'PY'
import sys
from importlib.metadata import packages_distributions
variant, current = sys.argv[1:]
keep = {"cpu": "faiss-cpu", "gpu": "faiss-gpu"}[variant]
owners = {name.lower() for name in packages_distributions().get("faiss", [])}
remove = sorted(owners) if owners - {keep} else []
if variant == "cpu" and current == "gpu" and "torch" in packages_distributions():
    remove.append("torch")
print(" ".join(remove))
PY
)
    if [ -n "$remove" ]; then
        echo "setup: removing $remove (the other variant's)"
        # shellcheck disable=SC2086
        .venv/bin/pip uninstall -q -y $remove
    fi
    .venv/bin/pip install -q --disable-pip-version-check "${constraints[@]}" -e ".[$variant,test]"
    echo "$want" > "$stamp"
fi
echo "setup: ready (.venv)"
