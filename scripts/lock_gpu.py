"""Writes requirements-gpu.lock: the pins that the CUDA variant adds to requirements.lock.

    .venv/bin/python scripts/lock_gpu.py          # rewrites requirements-gpu.lock
    .venv/bin/python scripts/lock_gpu.py --check  # exits 1 when the file differs from a new resolution

`FASTFILL_GPU=1 bash scripts/setup.sh` installs ``.[gpu,test]`` with requirements.lock and this
file as constraints. The file is made from a dry run of exactly that install (pip's
``--dry-run --ignore-installed --report``), so it holds every distribution the CUDA variant
resolves that requirements.lock does not pin: faiss's GPU build, torch's CUDA libraries, triton.

torch has the same version in both variants, and on the project's machines its CPU build is a
local file (2.13.0+cpu) that pip prefers over PyPI's CUDA build of 2.13.0, since ``==2.13.0``
matches both. ``torch===2.13.0`` (exact string equality) matches only the build without a local
label, which is PyPI's CUDA build: it is how this file pins the build as well as the version.

The resolution is for the machine it runs on (Linux x86_64, Python 3.11, like faiss's GPU wheels).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_LOCK = ROOT / "requirements.lock"
GPU_LOCK = ROOT / "requirements-gpu.lock"
# distributions whose CUDA build has the CPU build's version: pinned with === (see above)
SAME_VERSION_OTHER_BUILD = ("torch",)


def canonicalize_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


HEADER = """\
# The CUDA variant's pins on top of requirements.lock: `FASTFILL_GPU=1 bash scripts/setup.sh`
# installs .[gpu,test] with both files as constraints. Written by scripts/lock_gpu.py from a dry
# run of that install (Linux x86_64, Python 3.11); run it again after changing requirements.lock
# or the gpu extra. torch===: exactly this version string, so PyPI's CUDA build and never a CPU
# build of the same version (2.13.0+cpu).
"""


def read_pins(path: Path) -> dict[str, str]:
    """{canonical name: version} of a lock's ``name==version`` lines."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[canonicalize_name(name)] = version.lstrip("=").strip()
    return pins


def resolve() -> list[dict]:
    """The dry run's resolved distributions (the report's ``install`` entries), the project
    itself left out."""
    cpu_pins = read_pins(CPU_LOCK)
    with tempfile.TemporaryDirectory() as tmp:
        builds = Path(tmp) / "builds.txt"
        builds.write_text("".join(f"{name}==={cpu_pins[name]}\n" for name in SAME_VERSION_OTHER_BUILD))
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                        "--dry-run", "--ignore-installed", "--report", str(report),
                        "-c", str(CPU_LOCK), "-c", str(builds), ".[gpu,test]"], cwd=ROOT, check=True)
        entries = json.loads(report.read_text())["install"]
    return [entry for entry in entries if "dir_info" not in entry["download_info"]]


def render(entries: list[dict]) -> str:
    cpu_pins = read_pins(CPU_LOCK)
    lines = []
    for entry in entries:
        name, version = entry["metadata"]["name"], entry["metadata"]["version"]
        key = canonicalize_name(name)
        if key in SAME_VERSION_OTHER_BUILD:
            lines.append(f"{name}==={version}")
        elif cpu_pins.get(key) != version:
            if key in cpu_pins:  # constrained by requirements.lock, so it cannot differ
                raise SystemExit(f"lock_gpu: {name} resolved to {version}, requirements.lock pins {cpu_pins[key]}")
            lines.append(f"{name}=={version}")
    return HEADER + "".join(f"{line}\n" for line in sorted(lines, key=str.lower))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with requirements-gpu.lock, write nothing")
    args = parser.parse_args()
    text = render(resolve())
    if args.check:
        if not GPU_LOCK.exists() or GPU_LOCK.read_text() != text:
            print("lock_gpu: requirements-gpu.lock is out of date; run scripts/lock_gpu.py", file=sys.stderr)
            return 1
        return 0
    GPU_LOCK.write_text(text)
    print(f"lock_gpu: wrote {GPU_LOCK.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
