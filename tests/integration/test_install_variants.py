"""The two installs of scripts/setup.sh resolve exactly one faiss build each, the variant's own,
and the locks' versions.

- cpu: ``.[cpu,test]`` with requirements.lock as constraints;
- gpu (``FASTFILL_GPU=1``): ``.[gpu,test]`` with requirements-gpu.lock on top: PyPI's CUDA build
  of torch (CUDA 13), faiss's GPU build and their CUDA libraries.

Each variant is resolved as setup.sh installs it, in a dry run (pip ``--dry-run
--ignore-installed --report``): nothing is installed, the CUDA stack is not downloaded, but the
resolution needs PyPI. The checks of a report run on crafted reports too, among them the layout
this replaced (faiss-cpu a base dependency and faiss-gpu in the gpu extra: both installed).

faiss's GPU build uses CUDA 12 libraries of its own beside torch's CUDA 13 ones: PyPI has no faiss
GPU build for the CUDA 13.0 that torch 2.13.0 pins (faiss-gpu-cuvs needs 13.2 or later). The check
is that faiss's CUDA is not newer than torch's: the driver torch's CUDA needs runs both. Whether
faiss's GPU index runs is for the ``gpu``-marked tests on a CUDA machine.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
# every PyPI distribution of faiss, CPU or GPU: each installs the module `faiss`
FAISS = {"faiss-cpu", "faiss-gpu", "faiss-gpu-cu11", "faiss-gpu-cu12", "faiss-gpu-cu13", "faiss-gpu-cuvs"}
VARIANTS = {
    "cpu": {"locks": ["requirements.lock"], "faiss": "faiss-cpu"},
    "gpu": {"locks": ["requirements.lock", "requirements-gpu.lock"], "faiss": "faiss-gpu"},
}
DRY_RUN_TIMEOUT_S = 480


def read_locks(paths: list[Path]) -> dict[str, SpecifierSet]:
    """{canonical name: the locks' specifiers, combined} (``name==v`` and ``name===v`` lines)."""
    pins: dict[str, SpecifierSet] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                requirement = Requirement(line)
                name = canonicalize_name(requirement.name)
                pins[name] = pins.get(name, SpecifierSet()) & requirement.specifier
    return pins


def _requirements(entry: dict) -> list[Requirement]:
    """A resolved distribution's own requirements on this platform (extras' ones left out)."""
    requirements = [Requirement(text) for text in entry["metadata"].get("requires_dist") or []]
    return [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]


def cuda_majors(entry: dict, resolved: dict[str, dict]) -> set[int]:
    """The CUDA major versions a distribution's requirements bring: nvidia-*-cuNN packages, and the
    resolved versions of cuda-toolkit and nvidia-cuda-runtime (their version is CUDA's)."""
    majors = set()
    for requirement in _requirements(entry):
        name = canonicalize_name(requirement.name)
        suffix = re.fullmatch(r"nvidia-.+-cu(\d+)", name)
        if suffix:
            majors.add(int(suffix.group(1)))
        elif name in ("cuda-toolkit", "nvidia-cuda-runtime") and name in resolved:
            majors.add(Version(resolved[name]["metadata"]["version"]).major)
    return majors


def check_report(report: dict, variant: str, pins: dict[str, SpecifierSet]) -> list[str]:
    """What is wrong with a pip ``--report`` of the variant's install; empty when nothing is."""
    problems = []
    resolved = {canonicalize_name(e["metadata"]["name"]): e for e in report["install"]}
    faiss = sorted(name for name in resolved if name in FAISS or name.startswith("faiss-gpu"))
    expected = VARIANTS[variant]["faiss"]
    if faiss != [expected]:
        problems.append(f"{variant}: faiss distributions {faiss}, expected exactly [{expected!r}]")
    if variant == "gpu":
        torch = resolved.get("torch")
        cuda = [r.name for r in _requirements(torch) if re.match(r"(nvidia|cuda)-", canonicalize_name(r.name))] \
            if torch else []
        if not cuda:
            problems.append("gpu: torch requires no CUDA packages (nvidia-*): not a CUDA build")
        missing = sorted({canonicalize_name(name) for name in cuda} - set(resolved))
        if missing:
            problems.append(f"gpu: torch's CUDA packages not resolved: {missing}")
        torch_cuda = cuda_majors(torch, resolved) if torch else set()
        for name in faiss:
            faiss_cuda = cuda_majors(resolved[name], resolved)
            if len(faiss_cuda) != 1 or len(torch_cuda) != 1:
                problems.append(f"gpu: one CUDA major each expected, {name} brings {sorted(faiss_cuda)}, "
                                f"torch {sorted(torch_cuda)}")
            elif faiss_cuda.pop() > min(torch_cuda):
                problems.append(f"gpu: {name}'s CUDA is newer than torch's {min(torch_cuda)}: "
                                f"a driver for torch may not run it")
    for name, entry in sorted(resolved.items()):
        version = entry["metadata"]["version"]
        if name in pins and not pins[name].contains(version, prereleases=True):
            problems.append(f"{variant}: {name} resolved to {version}, the locks pin {pins[name]}")
    return problems


def _dry_run(variant: str, workdir: Path) -> subprocess.Popen:
    """pip's dry run of the variant's install, on a copy of the project's metadata (so the two
    runs at once never build metadata in the same folder)."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, workdir / name)
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package in setuptools["packages"]:  # setuptools checks that each package's folder exists
        room, _, rest = package.removeprefix("fastfill.").partition(".")
        folder = workdir / setuptools["package-dir"][f"fastfill.{room}"] / rest.replace(".", "/")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "__init__.py").touch()
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
               "--dry-run", "--ignore-installed", "--report", str(workdir / "report.json")]
    for lock in VARIANTS[variant]["locks"]:
        command += ["-c", str(ROOT / lock)]
    command.append(f".[{variant},test]")
    return subprocess.Popen(command, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, dict]:
    """Both variants' reports, resolved at the same time (most of a run is waiting on PyPI)."""
    runs = {}
    try:
        for variant in VARIANTS:
            workdir = tmp_path_factory.mktemp(f"install_{variant}")
            runs[variant] = (_dry_run(variant, workdir), workdir)
        out = {}
        for variant, (process, workdir) in runs.items():
            try:
                _, stderr = process.communicate(timeout=DRY_RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{variant}: pip's dry run took more than {DRY_RUN_TIMEOUT_S} s")
            errors = [line for line in stderr.splitlines() if "it is neither a file nor a directory" not in line]
            assert process.returncode == 0, f"{variant}: pip's dry run failed:\n" + "\n".join(errors[-40:])
            out[variant] = json.loads((workdir / "report.json").read_text())
        return out
    finally:
        for process, _ in runs.values():
            if process.poll() is None:
                process.kill()
                process.wait()


# the dry runs: two resolutions of ~270 distributions against PyPI, 1.5-2 min on 2 cores
@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_resolves_one_faiss_and_the_locks(reports, variant):
    pins = read_locks([ROOT / lock for lock in VARIANTS[variant]["locks"]])
    assert check_report(reports[variant], variant, pins) == []


@pytest.mark.slow
def test_gpu_variant_is_pypi_torch_on_cuda_13_and_faiss_gpu_on_cuda_12(reports):
    resolved = {canonicalize_name(e["metadata"]["name"]): e for e in reports["gpu"]["install"]}
    torch = Version(resolved["torch"]["metadata"]["version"])
    assert torch.local is None, f"torch {torch}: a local build, not PyPI's CUDA build"
    assert read_locks([ROOT / "requirements.lock"])["torch"].contains(torch)
    assert cuda_majors(resolved["torch"], resolved) == {13}
    assert cuda_majors(resolved["faiss-gpu"], resolved) == {12}


def test_gpu_lock_only_adds_to_the_cpu_lock():
    """requirements-gpu.lock pins what requirements.lock does not, and torch's build (=== its
    version) on top of requirements.lock's version."""
    cpu = read_locks([ROOT / "requirements.lock"])
    gpu = read_locks([ROOT / "requirements-gpu.lock"])
    assert set(gpu) & set(cpu) == {"torch"}
    (cpu_torch,), (gpu_torch,) = cpu["torch"], gpu["torch"]
    assert (cpu_torch.operator, gpu_torch.operator, gpu_torch.version) == ("==", "===", cpu_torch.version)
    assert FAISS & set(gpu) == {"faiss-gpu"} and FAISS & set(cpu) == {"faiss-cpu"}


# The checks themselves, on crafted reports


def _entry(name: str, version: str, requires: list[str] = ()) -> dict:
    return {"metadata": {"name": name, "version": version, "requires_dist": list(requires)},
            "download_info": {"url": f"https://example.invalid/{name}-{version}.whl"}}


CUDA13_TORCH = _entry("torch", "2.13.0", ['cuda-toolkit[cudart]==13.0.3; platform_system == "Linux"',
                                          'nvidia-cudnn-cu13==9.20.0.48; platform_system == "Linux"',
                                          'optree>=0.13.0; extra == "optree"'])
CUDA13_LIBS = [_entry("cuda-toolkit", "13.0.3.0"), _entry("nvidia-cudnn-cu13", "9.20.0.48")]
FAISS_GPU = _entry("faiss-gpu", "1.15.1", ["numpy>=1.25", "nvidia-cuda-runtime-cu12<13,>=12.6"])
PINS = {"torch": SpecifierSet("==2.13.0"), "faiss-cpu": SpecifierSet("==1.15.1"), "faiss-gpu": SpecifierSet("==1.15.1")}


def test_check_catches_the_old_layout_two_faiss_and_cpu_torch():
    """faiss-cpu a base dependency and faiss-gpu in the gpu extra: both resolved, torch unchanged."""
    old = {"install": [_entry("torch", "2.13.0+cpu", ["filelock"]), _entry("faiss-cpu", "1.15.1"), FAISS_GPU,
                       _entry("nvidia-cuda-runtime-cu12", "12.9.79")]}
    problems = check_report(old, "gpu", PINS)
    assert any("faiss distributions ['faiss-cpu', 'faiss-gpu']" in p for p in problems), problems
    assert any("torch requires no CUDA packages" in p for p in problems), problems
    assert check_report(old, "cpu", PINS)[0].startswith("cpu: faiss distributions")


def test_check_accepts_a_consistent_report_and_catches_pins_and_cuda():
    good = {"install": [CUDA13_TORCH, *CUDA13_LIBS, FAISS_GPU, _entry("nvidia-cuda-runtime-cu12", "12.9.79")]}
    assert check_report(good, "gpu", PINS) == []

    unpinned = {"install": [_entry("torch", "2.14.0"), _entry("faiss-cpu", "1.15.0")]}
    assert check_report(unpinned, "cpu", PINS) == [
        "cpu: faiss-cpu resolved to 1.15.0, the locks pin ==1.15.1",
        "cpu: torch resolved to 2.14.0, the locks pin ==2.13.0"]

    newer_faiss = _entry("faiss-gpu", "1.15.1", ["nvidia-cuda-runtime<14,>=13.2"])
    cuda12_torch = _entry("torch", "2.13.0", ["nvidia-cuda-runtime-cu12==12.8.90"])
    mismatch = {"install": [cuda12_torch, newer_faiss, _entry("nvidia-cuda-runtime", "13.2.51"),
                            _entry("nvidia-cuda-runtime-cu12", "12.8.90")]}
    assert check_report(mismatch, "gpu", PINS) == ["gpu: faiss-gpu's CUDA is newer than torch's 12: "
                                                   "a driver for torch may not run it"]

    # requirements-gpu.lock's torch===2.13.0 on requirements.lock's ==2.13.0: the CPU build does not pass
    exact_build = {"torch": SpecifierSet("==2.13.0") & SpecifierSet("===2.13.0")}
    cpu_build = {"install": [_entry("torch", "2.13.0+cpu"), _entry("faiss-cpu", "1.15.1")]}
    (problem,) = check_report(cpu_build, "cpu", exact_build)
    assert problem.startswith("cpu: torch resolved to 2.13.0+cpu, the locks pin ")
    assert check_report(cpu_build, "cpu", {"torch": SpecifierSet("==2.13.0")}) == []
