"""The product installs as one package, ``fastfill``, whose sub-packages are the repository's
folders where they are (pyproject.toml's package-dir): no generic top-level names (``cli``,
``components``, ...) in a site-packages where another project's could collide with them."""

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROOMS = ("cli", "components", "flows", "services", "tasks")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _folders() -> set[str]:
    """fastfill.<dotted folder> for every package folder of the rooms."""
    return {"fastfill." + ".".join(init.parent.relative_to(ROOT).parts)
            for room in ROOMS for init in (ROOT / room).rglob("__init__.py")}


def test_the_package_list_names_every_folder_of_the_rooms():
    setuptools = _pyproject()["tool"]["setuptools"]
    assert setuptools["package-dir"] == {f"fastfill.{room}": room for room in ROOMS}
    assert set(setuptools["packages"]) == _folders(), "pyproject.toml's packages and the folders differ"
    assert _pyproject()["project"]["scripts"]["fastfill"] == "fastfill.cli:run"


def test_the_wheel_holds_one_top_level_package(tmp_path):
    """A wheel built from the sources puts every module under fastfill/ and nothing else at the top."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for room in ROOMS:
        shutil.copytree(ROOT / room, source / room, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(tmp_path / "wheel")], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    [wheel] = (tmp_path / "wheel").glob("fastfill-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"fastfill"}, tops
    modules = {name for name in names if name.endswith(".py")}
    expected = {f"fastfill/{path.relative_to(ROOT)}" for room in ROOMS for path in (ROOT / room).rglob("*.py")}
    assert modules == expected
    assert "fastfill/__init__.py" not in modules  # a namespace: the rooms are its sub-packages
