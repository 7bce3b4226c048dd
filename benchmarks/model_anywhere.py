"""Does a registered version load and predict where the product is not installed?

Registers three models in a fresh MLflow store (an ONNX export and a torchvision ResNet-18 with
`fastfill model register`, and an alignment map of the product's own), then, for each version,
creates a clean virtualenv holding nothing but the version's own `requirements.txt`, loads the
version there with `mlflow.pyfunc.load_model` and compares its predictions with the product's.

    .venv/bin/python benchmarks/model_anywhere.py [--keep DIR]

Needs the package index (pip installs the pins; torch's CPU build as ENVIRONMENT.md describes).
Prints one line per version: the install's seconds and size, and whether the predictions are the
product's bytes. Exits 1 when any version fails to load or predicts other numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_PREDICT = """
import json, sys
import numpy as np
import mlflow.pyfunc
model = mlflow.pyfunc.load_model(sys.argv[1])
out = model.predict(np.load(sys.argv[2]))
out = out["features"] if isinstance(out, dict) else out
np.save(sys.argv[3], np.asarray(out))
print(json.dumps({"loader": sys.modules["fastfill.components"].__file__}))
"""


def _fastfill(work: Path, *args: str) -> dict:
    answer = subprocess.run([str(ROOT / ".venv/bin/fastfill"), *args, "--params", str(work / "params.yaml"), "--json"],
                            cwd=work, capture_output=True, text=True, check=False)
    if answer.returncode != 0:
        raise SystemExit(f"fastfill {' '.join(args)} failed:\n{answer.stdout}\n{answer.stderr[-2000:]}")
    return json.loads(answer.stdout)


def _models(work: Path) -> list[tuple[str, str, object]]:
    """(label, models:/ URI, input) of the three versions, registered in ``work``'s store."""
    import numpy as np
    import torch
    import yaml
    from safetensors.torch import save_file
    from torch import nn

    from fastfill.components.experiment.models import AlignmentMap
    from fastfill.components.experiment.vision import torchvision
    from fastfill.components.model_store import registered
    from fastfill.components.platform import registry
    from fastfill.components.platform.config import load_params

    (work / "params.yaml").write_text(yaml.safe_dump({"mlflow": {"tracking_uri": f"sqlite:///{work / 'mlflow.db'}",
                                                                 "registered_model": "team-embedder"}}))
    torch.manual_seed(0)
    small = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 16)).eval()
    torch.onnx.export(small, (torch.zeros(1, 3, 32, 32),), str(work / "small.onnx"), dynamo=False,
                      input_names=["images"], output_names=["embedding"],
                      dynamic_axes={"images": {0: "batch"}, "embedding": {0: "batch"}})
    save_file(torchvision.models.resnet18(num_classes=10).state_dict(), str(work / "resnet18.safetensors"))
    _fastfill(work, "model", "register", "--onnx", str(work / "small.onnx"), "--size", "32", "--channels", "3",
              "--mean", "0.5", "--std", "0.5", "--alias", "champion")
    _fastfill(work, "model", "register", "--torchvision", "resnet18", "--weights", str(work / "resnet18.safetensors"),
              "--size", "64", "--channels", "3", "--preset", "imagenet", "--alias", "challenger")
    client, experiment = registry.setup(load_params(work / "params.yaml").mlflow)
    run = client.create_run(experiment)
    h = AlignmentMap(16, 512, [64], uncertainty=True).eval()
    version = registered.register_alignment(client, run.info.run_id, h, np.zeros((1, 16), np.float32), "maps", {})
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(4, 3, 48, 40), dtype=np.uint8)
    return [("onnx embedder", "models:/team-embedder@champion", pixels),
            ("torchvision embedder", "models:/team-embedder@challenger", pixels),
            ("alignment map", f"models:/maps/{version}", rng.normal(size=(5, 16)).astype(np.float32))]


def _product_output(uri: str, data):
    from fastfill.components.experiment.inference import apply_alignment, embed
    from fastfill.components.model_store import registered

    model = registered.load_model(uri)
    if getattr(model, "fastfill_kind", "embedder") == "alignment":
        return apply_alignment(model, data)[0]
    return embed(model, data)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it (default: a temporary one)")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="model-anywhere-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    failed = 0
    try:
        import mlflow.artifacts
        import numpy as np

        for k, (label, uri, data) in enumerate(_models(work)):
            folder = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(work / f"version-{k}")))
            np.save(work / "input.npy", data)
            venv = work / f"venv-{k}"
            started = time.monotonic()
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            install = subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "-q", "-r",
                                      str(folder / "requirements.txt")], capture_output=True, text=True)
            seconds = time.monotonic() - started
            if install.returncode != 0:
                print(f"{label}: pip install -r requirements.txt failed\n{install.stderr[-2000:]}")
                failed += 1
                continue
            answer = subprocess.run([str(venv / "bin/python"), "-c", _PREDICT, str(folder), str(work / "input.npy"),
                                     str(work / "out.npy")], cwd=work, capture_output=True, text=True,
                                    env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
            if answer.returncode != 0:
                print(f"{label}: loading failed in the clean virtualenv\n{answer.stderr[-3000:]}")
                failed += 1
                continue
            loader = json.loads(answer.stdout.strip().splitlines()[-1])["loader"]
            same = np.array_equal(np.load(work / "out.npy"), _product_output(uri, data))
            failed += not same
            print(f"{label} ({uri}): a clean virtualenv from its requirements.txt ({seconds:.0f} s, "
                  f"{_size(venv) / 2**20:.0f} MiB) loads it from {Path(loader).relative_to(folder)}; "
                  f"predictions {'equal' if same else 'DIFFER from'} the product's; the version is "
                  f"{_size(folder) / 1024:.0f} KiB")
            shutil.rmtree(venv, ignore_errors=True)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
