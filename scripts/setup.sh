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

# The lock is the constraints file: the resolver never backtracks, and torch stays the CPU build here.
stamp=.venv/.fastfill-installed
want="$(cat requirements.lock pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "setup: installing packages from requirements.lock (a few minutes the first time)"
    .venv/bin/pip install -q --disable-pip-version-check -c requirements.lock -e ".[test]"
    echo "$want" > "$stamp"
fi
# FASTFILL_GPU=1: faiss's GPU build in place of faiss-cpu (both install the module `faiss`).
# Torch's CUDA build comes from your platform's torch index; this step does not change torch.
if [ "${FASTFILL_GPU:-0}" = "1" ] && ! .venv/bin/python -c "import faiss, sys; sys.exit(not hasattr(faiss, 'StandardGpuResources'))" 2>/dev/null; then
    echo "setup: replacing faiss-cpu with faiss's GPU build (the gpu extra)"
    .venv/bin/pip uninstall -q -y faiss-cpu
    .venv/bin/pip install -q --disable-pip-version-check -e ".[gpu]"
fi
echo "setup: ready (.venv)"
