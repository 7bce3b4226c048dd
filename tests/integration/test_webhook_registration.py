"""`fastfill webhook register`, `list` and `delete` against a real MLflow store (SQL backend, as
webhooks need): registering twice keeps one webhook and moves it to the new URL; duplicates left
by older releases are folded into one; delete by name or id, and an unknown one is refused."""

import yaml
from typer.testing import CliRunner

from fastfill.components.platform import registry
from fastfill.components.platform.config import parse_params
from testkit.tiny_demo import tiny_params


def _setup(tmp_path, monkeypatch):
    data = tiny_params(tmp_path / "images")
    data["mlflow"] = {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
                      "artifact_location": str(tmp_path / "artifacts")}
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("FASTFILL_WEBHOOK_SECRET", "s3cret")
    client, _ = registry.setup(parse_params(data).mlflow)
    return path, client


def _hooks(client):
    return sorted(client.list_webhooks(), key=lambda hook: hook.webhook_id)


def test_register_is_idempotent_and_list_and_delete_work(tmp_path, monkeypatch):
    from fastfill.cli import app

    params, client = _setup(tmp_path, monkeypatch)
    runner = CliRunner()
    # MLflow's default: https only, no private addresses (the store is in this process, so its server's settings
    # are this process's environment)
    monkeypatch.delenv("MLFLOW_WEBHOOK_ALLOWED_SCHEMES", raising=False)
    refused = runner.invoke(app, ["webhook", "register", "-p", str(params), "--url", "http://127.0.0.1:8787/"])
    assert refused.exit_code == 6 and "MLFLOW_WEBHOOK_ALLOWED_SCHEMES=https,http" in refused.output, refused.output
    assert _hooks(client) == []
    monkeypatch.setenv("MLFLOW_WEBHOOK_ALLOWED_SCHEMES", "https,http")  # as infra/local-stack.sh starts its server
    monkeypatch.setenv("MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS", "true")
    first = runner.invoke(app, ["webhook", "register", "-p", str(params), "--url", "http://127.0.0.1:8787/"])
    assert first.exit_code == 0 and "registered -> http://127.0.0.1:8787/" in first.output, first.output
    again = runner.invoke(app, ["webhook", "register", "-p", str(params), "--url", "http://127.0.0.1:8787/"])
    assert again.exit_code == 0 and "already registered" in again.output and "unchanged" in again.output
    assert len(_hooks(client)) == 1

    moved = runner.invoke(app, ["webhook", "register", "-p", str(params), "--url", "http://127.0.0.1:9999/"])
    assert moved.exit_code == 0 and "updated from http://127.0.0.1:8787/" in moved.output, moved.output
    (hook,) = _hooks(client)
    assert hook.url == "http://127.0.0.1:9999/" and hook.name == "fastfill-upgrade"

    # two of the same name, as an older release left them: registering folds them into one
    client.create_webhook(name="fastfill-upgrade", url="http://127.0.0.1:1/", events=["model_version_alias.created"])
    folded = runner.invoke(app, ["webhook", "register", "-p", str(params), "--url", "http://127.0.0.1:9999/"])
    assert folded.exit_code == 0 and "deleted: a duplicate of" in folded.output, folded.output
    assert [h.webhook_id for h in _hooks(client)] == [hook.webhook_id]

    other = client.create_webhook(name="someone-else", url="http://127.0.0.1:2/",
                                  events=["model_version.created"])
    listed = runner.invoke(app, ["webhook", "list", "-p", str(params)])
    assert listed.exit_code == 0
    lines = listed.output.strip().splitlines()
    assert len(lines) == 2 and any(hook.webhook_id in line and "http://127.0.0.1:9999/" in line for line in lines)
    assert any("someone-else" in line and "model_version.created" in line for line in lines)

    unknown = runner.invoke(app, ["webhook", "delete", "-p", str(params), "--name", "nope"])
    assert unknown.exit_code == 6 and "no webhook named 'nope'" in unknown.output
    assert "someone-else" in unknown.output  # what is there, to pick from
    gone = runner.invoke(app, ["webhook", "delete", "-p", str(params)])
    assert gone.exit_code == 0 and f"webhook {hook.webhook_id} (fastfill-upgrade) deleted" in gone.output
    by_id = runner.invoke(app, ["webhook", "delete", "-p", str(params), "--id", other.webhook_id])
    assert by_id.exit_code == 0 and _hooks(client) == []
    empty = runner.invoke(app, ["webhook", "list", "-p", str(params)])
    assert empty.exit_code == 0 and "no webhooks" in empty.output
