"""Helpers of the integration tests (not fixtures)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.gallery_cases import LAYOUTS

ROOT = Path(__file__).resolve().parents[2]


def copy_repository(target: Path, params: dict) -> Path:
    """The repository's tracked files (and new ones not yet added: a work tree as it would be
    committed) in a fresh git repo at ``target``, with ``params`` as params.yaml: a fresh clone,
    no outputs and no record of the default run's outputs."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    if not files:
        raise RuntimeError("git ls-files found nothing: run the tests from a git checkout")
    for name in files:
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    (target / "dvc.lock").unlink(missing_ok=True)
    shutil.rmtree(target / "reports", ignore_errors=True)
    (target / "params.yaml").write_text(yaml.safe_dump(params))
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com"]
    subprocess.run(git[:1] + ["init", "-q"], cwd=target, check=True)
    subprocess.run(git + ["add", "-A"], cwd=target, check=True)
    subprocess.run(git + ["commit", "-qm", "copy"], cwd=target, check=True)
    return target


def cli_environment(prefect_home: Path) -> dict:
    """Environment for CLI subprocesses: the project's venv first on PATH, a private Prefect home
    (so without PREFECT_API_URL each command starts a temporary Prefect server of its own), no
    MLflow tracking URI from the environment."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PREFECT_HOME"] = str(prefect_home)
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def registry_models(params):
    """(client, champion model, challenger model, champion version, challenger version)."""
    from fastfill.components.model_store import registered
    from fastfill.components.platform import registry

    client, _ = registry.setup(params.mlflow)
    name = params.mlflow.registered_model
    old = client.get_model_version_by_alias(name, "champion")
    new = client.get_model_version_by_alias(name, "challenger")
    return (client, registered.load_model(f"models:/{name}/{old.version}"),
            registered.load_model(f"models:/{name}/{new.version}"), str(old.version), str(new.version))


def split_images(params):
    """The prepared test split."""
    from fastfill.components.experiment.data import load_split
    from fastfill.components.platform.layout import Layout

    return load_split(Layout(params.paths).splits, "test")


def in_layout(params, tmp_path: Path, layout: str):
    """``params`` with gallery.layout ``layout``, and tmp_path/params.yaml (what the CLI reads)
    saying the same; returns the params."""
    settings = yaml.safe_load((tmp_path / "params.yaml").read_text())
    settings["gallery"]["layout"] = layout
    update = {"layout": layout}
    if layout == "pgvector":  # a table of the test's own on the tests' PostgreSQL
        from tests.pg import pg_gallery_config

        pgvector = pg_gallery_config(str(tmp_path)).pgvector.model_copy(update={"table": None})  # one per store
        settings["gallery"]["pgvector"] = {"uri": pgvector.uri}
        update["pgvector"] = pgvector
    if layout == "milvus":  # a Milvus Lite file of the test's own
        from tests.pg import milvus_gallery_config

        milvus = milvus_gallery_config(str(tmp_path / "gallery")).milvus.model_copy(update={"alias": None})
        settings["gallery"]["milvus"] = {"uri": milvus.uri}
        update["milvus"] = milvus
    if layout == "qdrant":  # a local-mode folder of the test's own
        from tests.pg import qdrant_gallery_config

        qdrant = qdrant_gallery_config(str(tmp_path / "gallery")).qdrant.model_copy(update={"alias": None})
        settings["gallery"]["qdrant"] = {"url": qdrant.url}
        update["qdrant"] = qdrant
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(settings))
    return params.model_copy(update={"gallery": params.gallery.model_copy(update=update)})


def run_then(owner, name: str, then):
    """``owner.name`` wrapped to call ``then()`` after each call (for monkeypatch.setattr)."""
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        result = original(*args, **kwargs)
        then()
        return result

    return wrapped


def killed_when(command: list[str], cwd: Path, env: dict, log_path: Path, ready, pause: float = 0.0,
                timeout: float = 240) -> str:
    """Start ``command`` in a process group of its own, SIGKILL the group ``pause`` seconds after
    ``ready()`` first holds, and return its output; fails if it ended before the kill."""
    import signal
    import time

    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and process.poll() is None:
            if ready():
                time.sleep(pause)
                os.killpg(process.pid, signal.SIGKILL)
                break
            time.sleep(0.02)
        process.wait(timeout=60)
    output = log_path.read_text()
    assert process.returncode == -signal.SIGKILL, f"{log_path.name}: ended before it could be killed:\n{output[-3000:]}"
    return output


def photo_folder(folder: Path, images, ids, labels=None) -> Path:
    """Each image as ``folder/item-NNNN.png`` and ``folder/items.csv`` naming them (id, uri, and
    label when given): a team's gallery to adopt. Returns the manifest's path."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for i, image in enumerate(images):
        Image.fromarray(image[0], mode="L").save(folder / f"item-{i:04d}.png")
    header = "id,uri" + (",label" if labels is not None else "")
    rows = [f"{item},item-{i:04d}.png" + (f",{labels[i]}" if labels is not None else "") for i, item in enumerate(ids)]
    (folder / "items.csv").write_text("\n".join([header, *rows]) + "\n")
    return folder / "items.csv"


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children, their children, ...), read from /proc."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found, frontier = [], [pid]
    while frontier:
        below = [child for child, parent in parents.items() if parent in frontier]
        found += below
        frontier = below
    return found


def assert_none_outlive(pids: list[int], timeout: float = 20) -> None:
    """Each of ``pids`` has ended within ``timeout`` seconds (a process killed hard must take
    what it started with it)."""
    import signal
    import time

    deadline = time.monotonic() + timeout
    while (left := [pid for pid in pids if Path(f"/proc/{pid}").exists() and not _zombie(pid)]) and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    shown = [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:200] for pid in left]
    for pid in left:  # the test fails, and leaves nothing running either
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, shown


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def layouts(*by_default: str) -> list:
    """The layouts for ``@pytest.mark.parametrize("layout", ...)`` of a test of minutes that its
    own layouts do not change: ``by_default`` in the default run, the others marked ``slow``
    (each layout's own behaviour is tests/gallery_cases.py's, on every layout in the unit tier)."""
    return [layout if layout in by_default else pytest.param(layout, marks=pytest.mark.slow) for layout in LAYOUTS]
