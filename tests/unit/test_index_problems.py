"""A served index that cannot serve is reported, in one line, by `fastfill upgrade status` (the
index's ``problem``), `fastfill status` (an ``index`` line) and `fastfill doctor` (the store FAILs),
as `fastfill search` names it: a Lance serving table whose data files are torn or garbage, or that
is gone, a pgvector view and a Milvus alias dropped by another writer."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from fastfill.cli import app
from fastfill.cli.command_support import SERVICE
from fastfill.components.gallery.upgrade.status import gallery_status
from tests.gallery_cases import _gallery

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


@pytest.fixture
def quiet_env(monkeypatch):
    for name in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "FASTFILL_WEBHOOK_SECRET", "FASTFILL_STORE"):
        monkeypatch.delenv(name, raising=False)


def _params(tmp_path: Path) -> str:
    """The repository's params.yaml with a private MLflow store (never made: tracking FAILs)."""
    data = yaml.safe_load((ROOT / "params.yaml").read_text())
    data["mlflow"] = {**data["mlflow"], "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _damage(folder: Path, how: str) -> None:
    """Every data file of the Lance table at ``folder``: cut to half, or its bytes replaced."""
    for path in (folder / "data").iterdir():
        size = path.stat().st_size
        if how == "torn":
            with open(path, "r+b") as handle:
                handle.truncate(size // 2)
        else:
            path.write_bytes(os.urandom(size))


@pytest.mark.parametrize("how", ["torn", "garbage"])
def test_a_damaged_lance_serving_table_is_reported_by_status_and_doctor(quiet_env, tmp_path, models, data, how):
    store = tmp_path / "store"
    gallery = _gallery(str(store), models, data, layout="lance")
    assert gallery_status(gallery).index.problem is None
    params = _params(tmp_path)
    healthy = runner.invoke(app, ["doctor", "--params", params, "--store", str(store), "--json"])
    assert json.loads(healthy.stdout)["checks"]["store"]["state"] == "ok", healthy.output

    _damage(store / "serving.lance", how)
    problem = gallery_status(gallery).index.problem
    assert problem.startswith(f"{store / 'serving.lance'}: the serving table cannot be read (") and "\n" not in problem
    assert "restore it from a copy, or delete it" in problem

    status = runner.invoke(app, ["upgrade", "status", "--params", params, "--store", str(store), "--json"])
    assert status.exit_code == 0, status.output
    assert json.loads(status.stdout)["index"]["problem"] == problem

    doctor = runner.invoke(app, ["doctor", "--params", params, "--store", str(store)])
    assert doctor.exit_code == SERVICE
    (line,) = [line for line in doctor.stdout.splitlines() if line.split()[1] == "store"]
    assert line.startswith("FAIL") and line.endswith(f"; its serving index: {problem}"), line

    state = runner.invoke(app, ["status", "--params", params, "--store", str(store)])
    assert f"index    {problem}" in state.stdout.splitlines(), state.stdout


def test_a_lance_serving_table_that_is_gone_is_reported(tmp_path, models, data):
    import shutil

    store = tmp_path / "store"
    gallery = _gallery(str(store), models, data, layout="lance")
    shutil.rmtree(store / "serving.lance")
    index = gallery_status(gallery).index
    assert index.serving is None and not index.as_manifest_says
    assert index.problem.startswith(f"{store / 'serving.lance'}: serves no model (serving, or its record of the "
                                       "model it serves, is gone")


def test_a_dropped_pgvector_view_is_reported(tmp_path, models, data):
    """On the tests' PostgreSQL (tests/pg.py)."""
    gallery = _gallery(str(tmp_path / "store"), models, data, layout="pgvector")
    index = gallery.index
    assert gallery_status(gallery).index.problem is None
    index.execute(f'DROP VIEW "{index.view}"')
    index.close()
    found = gallery_status(gallery).index
    assert found.serving is not None  # the serving row is there: the view a reader queries is not
    problem = found.problem
    assert problem.startswith(index.where) and index.view in problem and "\n" not in problem, problem
    gallery.index.close()


def test_a_dropped_milvus_alias_is_reported(tmp_path, models, data):
    """On a Milvus Lite file (tests/pg.py): the alias the team's service searches is gone."""
    gallery = _gallery(str(tmp_path / "store"), models, data, layout="milvus")
    index = gallery.index
    assert gallery_status(gallery).index.problem is None
    index.client().drop_alias(index.alias)
    found = gallery_status(gallery).index
    assert found.serving is None and not found.as_manifest_says
    assert found.problem.startswith(f"{index.where}: serves no model ({index.alias}, or its record")


def test_a_pgvector_server_that_does_not_answer_is_a_service_failure(quiet_env, tmp_path, models, data, monkeypatch):
    """Not the index's problem: `fastfill upgrade status` ends with 5 (a service does not answer),
    as `fastfill search` does, and doctor FAILs the store."""
    import socket

    store = tmp_path / "store"
    _gallery(str(store), models, data, layout="pgvector").index.close()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("FASTFILL_PG_URI", f"postgresql://u@127.0.0.1:{port}/db")
    params = _params(tmp_path)
    status = runner.invoke(app, ["upgrade", "status", "--params", params, "--store", str(store)])
    assert status.exit_code == SERVICE and "cannot connect to PostgreSQL" in status.output, status.output
    doctor = runner.invoke(app, ["doctor", "--params", params, "--store", str(store), "--json"])
    store_check = json.loads(doctor.stdout)["checks"]["store"]
    assert store_check["state"] == "fail" and "cannot connect to PostgreSQL" in store_check["text"], store_check
