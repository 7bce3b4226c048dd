"""Every third-party distribution that the project's Python code imports is declared in
pyproject.toml, not only brought in by another dependency.

Each ``import x`` and ``from x import ...`` (at any depth of a module, lazy imports too) is mapped to
the installed distributions that provide the top-level module ``x``
(``importlib.metadata.packages_distributions``). The standard library and the project's own
packages and modules are left out. The installed package (the folders of
``[tool.setuptools.packages.find]``) may count on the dependencies and on the cpu and gpu extras
(one of them installs faiss); the rest (tests, testkit, benchmarks, scripts, infra) also on the test
extra.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIPPED_DIRS = {"__pycache__", "node_modules", "build", "dist"}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    return _canonical(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement.strip()).group(0))


def declared(pyproject: dict) -> dict[str, set[str]]:
    """{"": the dependencies, extra: its requirements} as canonical distribution names."""
    project = pyproject["project"]
    out = {"": {_requirement_name(r) for r in project.get("dependencies", [])}}
    for extra, requirements in project.get("optional-dependencies", {}).items():
        out[extra] = {_requirement_name(r) for r in requirements}
    return out


def python_files(root: Path) -> list[Path]:
    """The project's Python files: hidden folders (.venv, .git, ...) and build outputs left out."""
    return sorted(path for path in root.rglob("*.py")
                  if not any(part.startswith(".") or part in SKIPPED_DIRS or part.endswith(".egg-info")
                             for part in path.relative_to(root).parts[:-1]))


def imported_modules(path: Path) -> set[str]:
    """The top-level names of the absolute imports in a file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def undeclared(root: Path, pyproject: dict, providers: dict[str, list[str]]) -> dict[str, list[str]]:
    """{file relative to root: what it imports that no declared distribution provides, as
    'module (distribution, ...)'}."""
    groups = declared(pyproject)
    package_dir = pyproject["tool"]["setuptools"]["package-dir"]  # {"fastfill.components": "components", ...}
    package_dirs = set(package_dir.values())
    own = {path.name for path in root.iterdir() if path.is_dir()} | {path.stem for path in root.glob("*.py")} | \
        {name.split(".")[0] for name in package_dir}
    problems: dict[str, list[str]] = {}
    for path in python_files(root):
        relative = path.relative_to(root)
        in_package = relative.parts[0] in package_dirs
        allowed = set().union(*(names for extra, names in groups.items() if not (in_package and extra == "test")))
        # a script's sibling modules (benchmarks/x.py importing benchmarks/y.py as `y`)
        siblings = {other.stem for other in path.parent.glob("*.py")} | \
            {other.name for other in path.parent.iterdir() if other.is_dir()}
        for module in sorted(imported_modules(path)):
            if module in sys.stdlib_module_names or module in own or module in siblings or module == "__future__":
                continue
            # a module of an optional extra that is not installed here is declared by its distribution's name
            distributions = providers.get(module, []) or ([module] if _canonical(module) in allowed - groups[""] else [])
            if not {_canonical(d) for d in distributions} & allowed:
                problems.setdefault(str(relative), []).append(
                    f"{module} ({', '.join(sorted(set(distributions))) or 'not installed'})")
    return problems


def test_every_imported_distribution_is_declared():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    problems = undeclared(ROOT, pyproject, packages_distributions())
    assert problems == {}, "imported but not declared in pyproject.toml (dependencies, or the test extra " \
                           "outside the package):\n" + "\n".join(f"  {f}: {', '.join(p)}" for f, p in problems.items())


def test_the_check_names_an_undeclared_import(tmp_path):
    (tmp_path / "components").mkdir()
    (tmp_path / "components" / "a.py").write_text("import os\nimport numpy\n\n\ndef f():\n    from tqdm import tqdm\n")
    (tmp_path / "components" / "b.py").write_text("from . import a\nfrom fastfill.components import a\nimport moto\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("import moto.server\nimport helper\n")
    (tmp_path / "tests" / "helper.py").write_text("")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "x.py").write_text("import anything_at_all\n")
    pyproject = {"project": {"dependencies": ["numpy>=2"], "optional-dependencies": {"test": ["moto[server]==5.2.5"]}},
                 "tool": {"setuptools": {"package-dir": {"fastfill.components": "components"}}}}
    providers = {"numpy": ["numpy"], "tqdm": ["tqdm"], "moto": ["moto"]}
    assert undeclared(tmp_path, pyproject, providers) == {
        "components/a.py": ["tqdm (tqdm)"],
        # the package may not count on the test extra
        "components/b.py": ["moto (moto)"],
    }
