"""No password reaches a record. A team's pgvector table on a real PostgreSQL whose role ``team``
must give its password (scram-sha-256) is adopted, upgraded, shown and searched through the CLI
three times: the password written raw in params.yaml's URI (``/ @ : # % ?`` and a space, no
percent-encoding), percent-encoded in FASTFILL_PG_URI, and in PGPASSWORD; and connections are
refused (a wrong password written raw in the URI, one in FASTFILL_PG_URI, a URI libpq cannot read)
without their lines showing it. Then every record is read for the password, in each of its forms:
every table of Prefect's database (flow and task runs with their parameters and states, logs,
events, artifacts) and its files, Prefect's stored results, MLflow's store (database and
artifacts), every object of the galleries' stores, and everything each command printed or logged."""

import json
import sqlite3
import time
from pathlib import Path
from urllib.parse import parse_qs, quote, quote_plus, urlsplit

import numpy as np
import pytest
import yaml

from fastfill.components.platform import secrets
from tests.integration.helpers import registry_models, split_images
from tests.pg import pg_uri

CANARY = "Cn4ry/@:#% x?Q9"  # the team's password: every character that ends a URI's user part early
WRONG = "Wr0ng/@:#% y?P8"  # a wrong one, as awkward


def _forms(secret: str) -> list[str]:
    """The ways a password can be written down: raw, percent-encoded, escaped for JSON."""
    return sorted({secret, quote(secret, safe=""), quote(secret), quote_plus(secret), json.dumps(secret)[1:-1]})


def _team_server(database: str) -> str:
    """The tests' PostgreSQL with a role ``team`` that logs in by password only (scram-sha-256,
    first line of pg_hba.conf) and a database of its own with pgvector; the socket's folder."""
    import psycopg
    from psycopg import sql

    admin = pg_uri()
    folder = parse_qs(urlsplit(admin).query)["host"][0]
    hba = Path(folder) / "pg_hba.conf"
    rule = "local all team scram-sha-256\n"
    if not hba.read_text().startswith(rule):
        hba.write_text(rule + hba.read_text())
    with psycopg.connect(admin, autocommit=True) as connection:
        connection.execute("SET password_encryption = 'scram-sha-256'")
        exists = connection.execute("SELECT 1 FROM pg_roles WHERE rolname = 'team'").fetchone()
        connection.execute(sql.SQL("{} ROLE team LOGIN PASSWORD {}").format(
            sql.SQL("ALTER" if exists else "CREATE"), sql.Literal(CANARY)))
        connection.execute(sql.SQL("CREATE DATABASE {} OWNER team").format(sql.Identifier(database)))
        connection.execute("SELECT pg_reload_conf()")
    with psycopg.connect(f"postgresql://postgres@/{database}?host={folder}", autocommit=True) as connection:
        connection.execute("CREATE EXTENSION vector")  # not a trusted extension: the superuser's
    with pytest.raises(psycopg.OperationalError, match="password"):  # the server asks team for it
        psycopg.connect(f"postgresql://team@/{database}?host={folder}", connect_timeout=5, password="")
    return folder


def _team_table(uri: str, table: str, ids, images: list[str], labels, features) -> None:
    """The team's own table: id, image path, label, its model's vectors."""
    import psycopg
    from pgvector.psycopg import register_vector
    from psycopg import sql

    with psycopg.connect(uri, password=CANARY, autocommit=True) as connection:
        register_vector(connection)
        connection.execute(sql.SQL("CREATE TABLE {} (id bigint PRIMARY KEY, image text, label bigint, embedding "
                                   "vector({}))").format(sql.Identifier(table), sql.Literal(features.shape[1])))
        with connection.cursor().copy(sql.SQL("COPY {} (id, image, label, embedding) FROM STDIN").format(
                sql.Identifier(table))) as copy:
            for row in zip(ids, images, labels, features):
                copy.write_row((int(row[0]), row[1], int(row[2]), row[3]))


def _photos(folder: Path, images) -> list[str]:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for i, image in enumerate(images):
        Image.fromarray(image[0], mode="L").save(folder / f"item-{i:04d}.png")
    return [str(folder / f"item-{i:04d}.png") for i in range(len(images))]


def _prefect_records(since: float) -> list[tuple[str, str]]:
    """(where, text) of everything Prefect's server keeps: each row of each table of its
    database, the database's files as bytes, and the results flows stored from ``since`` on; once
    the run logs and events still queued in this process are sent and the server has written its
    events."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, PREFECT_SERVER_DATABASE_CONNECTION_URL

    APILogWorker.instance().drain()
    EventsWorker.drain_all()
    path = Path(PREFECT_SERVER_DATABASE_CONNECTION_URL.value().split("///", 1)[1])
    with sqlite3.connect(path, timeout=30) as database:
        tables = [name for (name,) in database.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        counted, stable = None, 0
        for _ in range(40):  # the server writes events in batches
            count = database.execute("SELECT count(*) FROM events").fetchone()[0] if "events" in tables else 0
            stable = stable + 1 if count == counted else 0
            if stable >= 3:
                break
            counted = count
            time.sleep(0.5)
        assert {"flow_run", "task_run", "log"} <= set(tables), tables
        records = [(f"prefect table {table}", repr(row)) for table in tables
                   for row in database.execute(f'SELECT * FROM "{table}"')]
        assert any("gallery-adopt-table" in text for where, text in records if where == "prefect table flow"), \
            "the adopt's flow is not in the database read"
    for file in path.parent.glob(path.name + "*"):
        records.append((str(file), file.read_bytes().decode("latin-1")))
    records += _files(Path(PREFECT_LOCAL_STORAGE_PATH.value()), since=since)
    return records


def _files(folder: Path, skip: Path | None = None, since: float = 0.0) -> list[tuple[str, str]]:
    """(path, bytes as text) of each file under ``folder`` (but ``skip``) written from ``since`` on."""
    return [(str(file), file.read_bytes().decode("latin-1")) for file in sorted(folder.rglob("*"))
            if file.is_file() and (skip is None or skip not in file.parents) and file.stat().st_mtime >= since]


def test_no_password_reaches_any_record(upgrade_env, prefect_harness, monkeypatch, capfd, caplog):
    import uuid

    from typer.testing import CliRunner

    from fastfill.cli import app
    from fastfill.components.experiment.inference import embed
    from fastfill.components.platform import registry

    params, tmp_path = upgrade_env
    started = time.time() - 1
    _, old_model, new_model, old_version, new_version = registry_models(params)
    split = split_images(params)
    paths = _photos(tmp_path / "photos", split.images)
    n = len(paths)
    ids = np.arange(n) + 7000
    old_features = embed(old_model, split.images)
    np.save(tmp_path / "queries.npy", embed(new_model, split.images[:3]))
    database = f"team_{uuid.uuid4().hex[:8]}"
    folder = _team_server(database)

    def uri(password: str | None = None) -> str:
        return f"postgresql://team{'' if password is None else ':' + password}@/{database}?host={folder}"

    secret = tmp_path / "secret"  # the params files that name the password: the user's own, not records
    secret.mkdir()
    settings = yaml.safe_load((tmp_path / "params.yaml").read_text())

    def params_file(name: str, server: str) -> str:
        data = {**settings, "gallery": {**settings["gallery"], "layout": "pgvector", "pgvector": {"uri": server}}}
        (secret / f"{name}.yaml").write_text(yaml.safe_dump(data))
        return str(secret / f"{name}.yaml")

    runner = CliRunner()
    outputs: list[tuple[str, str]] = []

    def cli(*args: str, env: dict | None = None, ok: bool = True):
        """One command, as in a process of its own: nothing taken by the commands before it."""
        monkeypatch.setattr(secrets, "_passwords", {})
        monkeypatch.setattr(secrets, "_secrets", set())
        environment = {"FASTFILL_PG_URI": None, "PGPASSWORD": None, **(env or {})}
        result = runner.invoke(app, list(args), env=environment)
        shown = result.output
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            shown += repr(result.exception)
        outputs.append((" ".join(args[:2]), shown))
        assert (result.exit_code == 0) == ok, shown
        return result.stdout if ok else shown

    modes = {"in params.yaml's URI, raw": (params_file("raw", uri(CANARY)), {}),
             "in FASTFILL_PG_URI, percent-encoded": (params_file("plain-env", uri()),
                                                     {"FASTFILL_PG_URI": uri(quote(CANARY, safe=""))}),
             "in PGPASSWORD": (params_file("plain-pgpassword", uri()), {"PGPASSWORD": CANARY})}
    for number, (mode, (params_path, env)) in enumerate(modes.items()):
        table, store = f"products_{number}", str(tmp_path / f"gallery-{number}")
        _team_table(uri(), table, ids, paths, split.labels, old_features)
        common = ["--store", store, "--params", params_path]
        shown = cli("gallery", "adopt", "--table", table, "--vector-column", "embedding", "--label-column", "label",
                    "--model", f"models:/embedder/{old_version}", *common, env=env)
        assert f"{n} items of table {table} adopted" in shown, (mode, shown)
        shown = cli("upgrade", *common, "--to", f"models:/embedder/{new_version}", "--no-gate", "--no-progress",
                    env=env)
        assert "complete:" in shown, (mode, shown)
        info = json.loads(cli("gallery", "info", *common, env=env))
        assert info["model"] == f"models:/embedder/{new_version}" and info["items"] == n, (mode, info)
        answer = json.loads(cli("search", *common, "--features", str(tmp_path / "queries.npy"), "-k", "3",
                                env=env).strip().splitlines()[-1])
        assert [row[0] for row in answer["ids"]] == [7000, 7001, 7002], (mode, answer)

    # refused: a wrong password written raw in the URI, one in FASTFILL_PG_URI, a URI libpq cannot
    # read (its password taken out first): one line that names the server, never the password
    first = ["--store", str(tmp_path / "gallery-0")]
    shown = cli("search", *first, "--params", params_file("wrong", uri(WRONG)), "--features",
                str(tmp_path / "queries.npy"), ok=False)
    assert "password authentication failed" in shown and f"postgresql://team@/{database}" in shown, shown
    shown = cli("gallery", "adopt", "--table", "products_0", "--model", f"models:/embedder/{old_version}",
                "--store", str(tmp_path / "refused"), "--params",
                modes["in PGPASSWORD"][0], env={"FASTFILL_PG_URI": uri(quote(WRONG, safe=""))}, ok=False)
    assert "password authentication failed" in shown, shown
    shown = cli("search", *first, "--params", modes["in PGPASSWORD"][0], "--features", str(tmp_path / "queries.npy"),
                env={"FASTFILL_PG_URI": uri(WRONG) + "&bogus=1"}, ok=False)
    assert 'invalid URI query parameter: "bogus"' in shown, shown

    # a params.yaml with a mistake elsewhere: its error lines show the sections, not the password
    (secret / "mistake.yaml").write_text(yaml.safe_dump({**settings, "gallery": {
        **settings["gallery"], "upgrade": {"method": "nope"}, "pgvector": {"uri": uri(CANARY)}}}))
    shown = cli("gallery", "info", *first, "--params", str(secret / "mistake.yaml"), ok=False)
    assert "gallery.upgrade.method names 'nope'" in shown, shown

    captured = capfd.readouterr()
    client, _ = registry.setup(params.mlflow)
    artifacts = Path(urlsplit(client.get_experiment_by_name(params.mlflow.experiment).artifact_location).path)
    records = [*outputs, ("stdout", captured.out), ("stderr", captured.err), ("log records", caplog.text),
               *_prefect_records(started), *_files(tmp_path, skip=secret), *_files(artifacts)]
    assert any(where.endswith("mlflow.db") for where, _ in records) and any("gallery-2" in w for w, _ in records)
    leaks = [(where, form) for where, text in records for form in [*_forms(CANARY), *_forms(WRONG)] if form in text]
    assert not leaks, leaks
