"""`--json` on the commands that answer (docs/json.md): stdout holds exactly one JSON object with
its ``schema`` key and the documented fields, and nothing else; the text output and the exit codes
are those of the same command without it; a known failure's document is fastfill.error/1. Shell
completion is on."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import typer
import yaml
from typer.testing import CliRunner

from fastfill.cli import app
from fastfill.cli.command_support import INPUT, REJECTED, SERVICE, USAGE
from fastfill.components.experiment.inference import embed
from fastfill.components.gallery.advice.estimate import (
    BytesToRead,
    BytesToWrite,
    DryRun,
    DryRunAdvice,
    Requests,
    SampleTimes,
    UpgradeCost,
)
from fastfill.components.gallery.advice.planning_cost import PlannedItems, PlanningEstimate, PlanningSeconds
from fastfill.components.gallery.store import open_store
from fastfill.components.gallery.store.lock import LOCK
from fastfill.components.gallery.upgrade import backfill
from fastfill.components.gallery.upgrade.outcome import Advice, Decision, Recommendation, UpgradeResult
from tests.gallery_cases import OLD, N, _gallery, _plan

ROOT = Path(__file__).resolve().parents[2]
FASTFILL = str(Path(sys.executable).with_name("fastfill"))
DOCS = (ROOT / "docs" / "json.md").read_text()
runner = CliRunner()


def _invoke(*args: str):
    return runner.invoke(app, list(args))


def _document(result, schema: str, code: int = 0) -> dict:
    """stdout is one JSON object (nothing before or after it) naming ``schema``; the exit code is ``code``."""
    assert result.exit_code == code, result.output
    document = json.loads(result.stdout)  # raises on anything else in stdout
    assert isinstance(document, dict) and document["schema"] == schema, result.stdout
    assert f"`{schema}`" in DOCS, f"{schema} is not documented in docs/json.md"
    return document


def _documented_fields(schema: str) -> list[str]:
    """The top-level fields of ``schema``'s table in docs/json.md (rows whose field has no dot)."""
    section = DOCS.split(f"## `{schema}`", 1)[1].split("\n## ", 1)[0]
    return [name for name in re.findall(r"^\| `([a-z_0-9]+)` \|", section, re.M) if name != "schema"]


def _params(tmp_path: Path, **mlflow) -> Path:
    """The repository's params.yaml with a private MLflow store (``mlflow`` keys override)."""
    data = yaml.safe_load((ROOT / "params.yaml").read_text())
    data["mlflow"] = {**data["mlflow"], "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", **mlflow}
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def quiet_env(monkeypatch):
    for name in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "FASTFILL_WEBHOOK_SECRET", "FASTFILL_STORE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def mid_upgrade(tmp_path, models, data):
    """A tiny gallery 3 chunks (21 items) into an upgrade."""
    gallery = _gallery(str(tmp_path / "store"), models, data)
    plan = _plan(gallery, models[2])
    for chunk in (0, 1, 2):
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, models[1])
    return str(tmp_path / "store")


# ---- the gallery's state, search, gc, unlock, convert: a real gallery, no services


def test_gallery_info_and_upgrade_status_are_the_same_state_with_their_schema(mid_upgrade):
    plain = _invoke("gallery", "info", "--store", mid_upgrade)
    assert plain.exit_code == 0 and "schema" not in json.loads(plain.stdout)  # without --json: as before
    info = _document(_invoke("gallery", "info", "--store", mid_upgrade, "--json"), "fastfill.gallery.info/1")
    status = _document(_invoke("upgrade", "status", "--store", mid_upgrade, "--json"), "fastfill.upgrade.status/1")
    assert {k: v for k, v in info.items() if k != "schema"} == json.loads(plain.stdout)
    assert {k: v for k, v in status.items() if k != "schema"} == json.loads(plain.stdout)
    assert status["state"] == "paused" and status["items"] == N and status["model"] == OLD.uri
    assert status["upgrade"]["chunks_done"] == 3 and status["upgrade"]["items_done"] == 21
    for field in _documented_fields("fastfill.upgrade.status/1"):
        # next: only after an interrupted run; index: only on a layout that serves the team's queries
        assert field in status or field in ("next", "index"), field
    assert "index" not in status  # this gallery is the parts layout's


def test_search_answers_with_its_document(mid_upgrade, tmp_path, models, data):
    old, new, _ = models
    np.save(tmp_path / "q.npy", embed(new, data[0][:2]))
    plain = _invoke("search", "--store", mid_upgrade, "--features", str(tmp_path / "q.npy"), "-k", "4")
    found = _document(_invoke("search", "--store", mid_upgrade, "--features", str(tmp_path / "q.npy"), "-k", "4",
                              "--json"), "fastfill.search/1")
    assert {k: v for k, v in found.items() if k != "schema"} == json.loads(plain.stdout)
    assert np.array(found["ids"]).shape == (2, 4) and found["backfilled"] == 21
    assert set(_documented_fields("fastfill.search/1")) <= set(found)


def test_unlock_gc_and_convert(mid_upgrade, tmp_path):
    store = open_store(mid_upgrade)
    store.put_json(LOCK, {"upgrade": "u1", "pid": 4242, "host": "elsewhere", "token": "secret-token"})
    unlocked = _document(_invoke("upgrade", "unlock", "--store", mid_upgrade, "--json"), "fastfill.upgrade.unlock/1")
    assert unlocked["removed"] is True and unlocked["lock"]["pid"] == 4242 and "token" not in unlocked["lock"]
    again = _document(_invoke("upgrade", "unlock", "--store", mid_upgrade, "--json"), "fastfill.upgrade.unlock/1")
    assert again == {"schema": "fastfill.upgrade.unlock/1", "store": store.uri, "removed": False, "lock": None}

    refused = _invoke("gallery", "gc", "--store", mid_upgrade, "--json")  # refused during an upgrade, both ways
    assert _document(refused, "fastfill.error/1", INPUT)["error"].startswith("upgrade embedder-v1-to-embedder-v2 is in")
    assert _invoke("gallery", "gc", "--store", mid_upgrade).exit_code == INPUT

    refused = _invoke("gallery", "convert", "--store", mid_upgrade, "--to", str(tmp_path / "lance"), "--json")
    error = _document(refused, "fastfill.error/1", INPUT)  # refused during an upgrade
    assert error["exit_code"] == INPUT and error["error"] in refused.stderr
    assert _invoke("gallery", "convert", "--store", mid_upgrade, "--to", str(tmp_path / "lance")).exit_code == INPUT


def test_gc_and_convert_answer_what_they_did(tmp_path, models, data):
    source = str(tmp_path / "g")
    _gallery(source, models, data)
    collected = _document(_invoke("gallery", "gc", "--store", source, "--json"), "fastfill.gallery.gc/1")
    assert collected == {"schema": "fastfill.gallery.gc/1", "store": open_store(source).uri, "deleted_features": 0,
                         "deleted_upgrade_objects": 0, "kept_team_columns": []}
    converted = _document(_invoke("gallery", "convert", "--store", source, "--to", str(tmp_path / "lance"), "--json"),
                          "fastfill.gallery.convert/1")
    assert converted["layout"] == "lance" and converted["items"] == N and converted["dim"] == OLD.dim
    assert converted["in_place"] is False and set(_documented_fields("fastfill.gallery.convert/1")) <= set(converted)


# ---- failures: the same exit code, the error's document on stdout, the line on stderr


def test_a_known_failure_keeps_its_exit_code_and_answers_an_error_document(tmp_path):
    (tmp_path / "empty").mkdir()
    plain = _invoke("gallery", "info", "--store", str(tmp_path / "empty"))
    assert plain.exit_code == INPUT and plain.stdout == "" and "error: no gallery at" in plain.stderr
    answered = _invoke("gallery", "info", "--store", str(tmp_path / "empty"), "--json")
    error = _document(answered, "fastfill.error/1", INPUT)
    assert error == {"schema": "fastfill.error/1", "error": error["error"], "exit_code": INPUT}
    assert f"error: {error['error']}" in answered.stderr and error["error"].startswith("no gallery at")

    for args in (["upgrade", "--budget", "2x"], ["upgrade", "--target-top1", "85%"]):  # usage: 2, both ways
        assert _invoke(*args).exit_code == USAGE
        assert _document(_invoke(*args, "--json"), "fastfill.error/1", USAGE)["exit_code"] == USAGE
    bad = tmp_path / "bad.yaml"
    bad.write_text("gallery: {upgrade: {chunk_size: -1}}\n")
    assert _invoke("doctor", "--params", str(bad)).exit_code == USAGE
    assert _document(_invoke("doctor", "--params", str(bad), "--json"), "fastfill.error/1", USAGE)


def test_the_command_line_parser_s_own_errors_print_no_document():
    result = _invoke("upgrade", "--chunk-size", "many", "--json")
    assert result.exit_code == USAGE and result.stdout == ""


# ---- the upgrade: its result and its dry run (the flow's answer given, the command real)

RESULTS = {
    "rejected": UpgradeResult(
        state="rejected", upgrade_id="embedder-v1-to-embedder-v2", chunks_done=9, chunks=9, items_done=72, items=72,
        fraction=1.0, complete=True, failed_images=0, mlflow_run_id="abc123",
        advice=Advice(recommendation=None, fractions=[0.0, 0.5, 1.0], top1=[0.2, 0.6, 0.8]),
        promotion=Decision("embedder-v1-to-embedder-v2", passed=False,
                           reasons=["negative flip rate at top-1 32.95% is above the maximum"],
                           numbers={"champion_top1": 0.5, "top1_auc": np.float64(0.589), "nfr1_mean": 0.33,
                                    "fraction_to_gain": None, "top1": np.array([0.1, 0.7])})),
    "paused": UpgradeResult(
        state="paused", upgrade_id="u", chunks_done=3, chunks=9, items_done=24, items=72, fraction=24 / 72,
        complete=False, failed_images=0, stopped="recommended", mlflow_run_id="r", message="stopped at 24/72 items",
        advice=Advice(recommendation=Recommendation.from_dict({"fraction": 0.3, "gain_below": 0.1, "top1": 0.7,
                                                               "top1_full": 0.8, "metric": "top1", "items": 24}),
                      fractions=[0.0, 0.3, 1.0])),
    "up-to-date": UpgradeResult(state="up-to-date", model="models:/embedder/1", items=72, items_done=72, fraction=1.0,
                                complete=True),
}


@pytest.fixture
def upgrade_answers(monkeypatch):
    """`fastfill upgrade` with the flow's answer given (``answers[0]``), the services taken as up."""
    import fastfill.cli.command_support
    import fastfill.flows.upgrade

    answers = []

    def run_upgrade_file(*args, **kwargs):
        print("a line the flow printed")  # not the answer: it must stay off stdout with --json
        return answers[0]

    monkeypatch.setattr(fastfill.cli.command_support, "require_services", lambda config: None)
    monkeypatch.setattr(fastfill.flows.upgrade, "run_upgrade_file", run_upgrade_file)
    return answers


@pytest.mark.parametrize("state, code", [("rejected", REJECTED), ("paused", 0), ("up-to-date", 0)])
def test_the_upgrade_answers_its_result_with_the_same_exit_code(upgrade_answers, tmp_path, state, code):
    upgrade_answers.append(RESULTS[state])
    args = ["upgrade", "--store", str(tmp_path / "g"), "--no-progress"]
    text = _invoke(*args)
    assert text.exit_code == code and "a line the flow printed" in text.stdout
    answered = _invoke(*args, "--json")
    document = _document(answered, "fastfill.upgrade/2", code)
    assert "a line the flow printed" not in answered.stdout and "a line the flow printed" in answered.stderr
    fields = _documented_fields("fastfill.upgrade/2")
    assert set(fields) == set(document) - {"schema"}, "every documented field, always present"
    assert document["state"] == state and document["store"] == str(tmp_path / "g")
    assert isinstance(document["seconds"], float)
    if state == "rejected":
        assert "promotion gate: REJECTED" in text.stdout
        numbers = document["promotion"]["numbers"]
        assert document["promotion"]["passed"] is False and numbers["top1_auc"] == 0.589
        assert numbers["top1"] == [0.1, 0.7] and numbers["fraction_to_gain"] is None
        assert document["stopped"] is None and document["message"] is None
    elif state == "paused":
        assert ("budget advisor: recommended stop for a gain below 0.1 top-1 points per 5% is 30% (predicted top-1 "
                "70.00%, 80.00% at 100%); stopped there") in text.stdout
        assert document["stopped"] == "recommended"
        assert list(document["advice"]["recommendation"].items()) == [  # the record as it was, in its order
            ("fraction", 0.3), ("gain_below", 0.1), ("top1", 0.7), ("top1_full", 0.8), ("metric", "top1"), ("items", 24)]
        assert document["promotion"] is None
    else:
        assert text.stdout.splitlines()[-1] == ("up-to-date: the gallery is already built with models:/embedder/1; "
                                                "nothing to upgrade")
        assert document["message"] == "the gallery is already built with models:/embedder/1; nothing to upgrade"
        assert document["upgrade"] is None and document["items_done"] == 72


def test_the_dry_run_answers_its_plan(monkeypatch, tmp_path):
    import fastfill.cli.command_support
    import fastfill.flows.upgrade

    cost = UpgradeCost(
        store=str(tmp_path), items=np.int64(72), parts=4, chunks=9, chunk_size=8, images="packed parts in the store",
        bytes_to_read=BytesToRead(features=4608, images=18432, finish=9216, total=32256),
        bytes_to_write=BytesToWrite(plan=5472, backfill=4608, finish=4608),
        requests=Requests(plan=17, backfill=22, finish=28, total=67),
        sample=SampleTimes(items=64, failed=0, read_seconds_per_item=1e-4, embed_seconds_per_item=float("nan")),
        estimated_backfill_seconds=np.float32(0.5), note="n")
    planning = PlanningEstimate(PlannedItems(map_sample=60, evaluation_sample=40, evaluation_outside_map_sample=30,
                                             total=90, share_of_gallery=0.125),
                                PlanningSeconds(embedding=9.0, map_training=4.0, reference_training=3.0, total=16.0),
                                seconds_at_most=60.0, note="n")
    plan = DryRun("models:/embedder/1", "models:/embedder/2", cost=cost, truth="the gallery's labels",
                  map_pairs="this host's new-train split",
                  advice=DryRunAdvice(note="no prediction yet: the registry has no map"), planning=planning)
    monkeypatch.setattr(fastfill.cli.command_support, "require_services", lambda config: None)
    monkeypatch.setattr(fastfill.cli.upgrade_commands, "estimate_upgrade", lambda *args: plan)
    text = _invoke("upgrade", "--dry-run", "--store", str(tmp_path))
    assert text.exit_code == 0 and text.stdout.startswith("dry run: nothing written. models:/embedder/1 -> ")
    assert "planning embeds 90 items (12.5% of the gallery" in text.stdout
    assert ("planning takes about 16 s (embedding 9 s, the map's training 4 s, the check's reference 3 s), at most "
            "60 s") in text.stdout
    document = _document(_invoke("upgrade", "--dry-run", "--store", str(tmp_path), "--json"),
                         "fastfill.upgrade.dry_run/1")
    assert document["written"] is False and document["items"] == 72 and document["estimated_backfill_seconds"] == 0.5
    assert document["sample"]["embed_seconds_per_item"] is None  # NaN is not JSON: null
    assert document["advice"] == {"note": "no prediction yet: the registry has no map"}
    # each part an object of its fields, in the order they always had
    assert list(document)[:13] == ["schema", "written", "from", "to", "in_progress", "resumes", "store", "items",
                                   "parts", "chunks", "chunk_size", "images", "bytes_to_read"]
    assert list(document["bytes_to_read"]) == ["features", "images", "finish", "total"]
    assert list(document["requests"]) == ["plan", "backfill", "finish", "total"]
    assert list(document["sample"]) == ["items", "failed", "read_seconds_per_item", "embed_seconds_per_item"]
    assert document["planning"] == {
        "embeds": {"map_sample": 60, "evaluation_sample": 40, "evaluation_outside_map_sample": 30, "total": 90,
                   "share_of_gallery": 0.125, "evaluation_standard_error": None},
        "seconds": {"embedding": 9.0, "map_training": 4.0, "reference_training": 3.0, "total": 16.0},
        "seconds_at_most": 60.0, "note": "n"}
    assert list(document["planning"]["seconds"]) == ["embedding", "map_training", "reference_training", "total"]
    assert set(_documented_fields("fastfill.upgrade.dry_run/1")) <= set(document)


# ---- doctor and status: what they check, as a document, with the same exit code


def test_doctor_and_status_answer_their_checks_with_the_same_exit_code(quiet_env, mid_upgrade, tmp_path):
    params = str(_params(tmp_path))  # its MLflow store does not exist: tracking and registry FAIL
    text = _invoke("doctor", "--params", params, "--store", mid_upgrade)
    assert text.exit_code == SERVICE
    doctor = _document(_invoke("doctor", "--params", params, "--store", mid_upgrade, "--json"), "fastfill.doctor/1",
                       SERVICE)
    assert doctor["ok"] is False and list(doctor["checks"]) == ["tracking", "registry", "store", "prefect", "webhook"]
    states = {name: check["state"] for name, check in doctor["checks"].items()}
    assert states == {"tracking": "fail", "registry": "fail", "store": "ok", "prefect": "not_set_up",
                      "webhook": "not_set_up"}
    assert doctor["checks"]["tracking"]["text"].startswith("no MLflow store at")
    for line in text.stdout.splitlines():  # the same texts as the lines
        state, name, said = line.split(None, 2)
        assert doctor["checks"][name]["text"] == said
    assert not (tmp_path / "mlflow.db").exists()

    text = _invoke("status", "--params", params, "--store", mid_upgrade)
    assert text.exit_code == SERVICE
    status = _document(_invoke("status", "--params", params, "--store", mid_upgrade, "--json"), "fastfill.status/1",
                       SERVICE)
    assert status["ok"] is False and status["gallery"]["state"] == "paused" and status["decision"] is None
    assert status["gallery"]["upgrade"]["items_done"] == 21
    assert status["lines"]["mlflow"].startswith("unavailable: no MLflow store at")
    assert list(status["lines"]) == [line.split()[0] for line in text.stdout.splitlines()]
    assert set(_documented_fields("fastfill.status/1")) <= set(status)


# ---- the registry's models and webhooks, a real (local) MLflow store


def test_model_list_and_webhook_list(quiet_env, tmp_path):
    from fastfill.components.model_store.catalogue import TAG_DIM, TAG_HEAD, TAG_INPUT, TAG_SOURCE
    from fastfill.components.platform import registry
    from fastfill.components.platform.config import load_params

    params = _params(tmp_path)
    client, _ = registry.setup(load_params(params).mlflow)
    client.create_registered_model("embedder")
    for dim, head in (("12", "none"), ("16", "6")):
        client.create_model_version("embedder", str(tmp_path / "nowhere"), tags={
            TAG_SOURCE: "onnx", TAG_DIM: dim, TAG_HEAD: head, TAG_INPUT: "3x20x20 RGB"})
    client.set_registered_model_alias("embedder", "champion", "1")

    text = _invoke("model", "list", "--params", str(params))
    assert text.exit_code == 0 and "champion" in text.stdout
    listed = _document(_invoke("model", "list", "--params", str(params), "--json"), "fastfill.model.list/1")
    assert listed["name"] == "embedder" and [v["version"] for v in listed["versions"]] == ["2", "1"]
    newest, oldest = listed["versions"]
    assert oldest == {"name": "embedder", "version": "1", "uri": "models:/embedder/1", "aliases": ["champion"],
                      "source": "onnx", "embedding_dim": 12, "head": None, "input": "3x20x20 RGB"}
    assert newest["embedding_dim"] == 16 and newest["head"] == 6 and newest["aliases"] == []
    assert set(_documented_fields("fastfill.model.list/1")) <= set(listed)
    # a name nothing is registered as has no versions: an empty answer, the registered names in the text
    missing = _document(_invoke("model", "list", "--params", str(params), "--name", "nothing", "--json"),
                        "fastfill.model.list/1")
    assert missing == {"schema": "fastfill.model.list/1", "name": "nothing", "versions": []}
    text = _invoke("model", "list", "--params", str(params), "--name", "nothing")
    assert text.exit_code == 0 and "no model is registered as nothing" in text.stdout
    assert "(registered: embedder)" in text.stdout and "`fastfill model register --onnx FILE --name nothing`" in text.stdout

    hooks = _document(_invoke("webhook", "list", "--params", str(params), "--json"), "fastfill.webhook.list/1")
    assert hooks == {"schema": "fastfill.webhook.list/1", "tracking": f"sqlite:///{tmp_path / 'mlflow.db'}",
                     "webhooks": []}


def _fastfill(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """The fastfill executable run in ``tmp_path``, with no MLflow or Prefect settings from the
    environment (the params file names the store)."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "MLFLOW_LOGGING_LEVEL", "PREFECT_API_URL")}
    return subprocess.run([FASTFILL, *args], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)


def _no_store_start_lines(result: subprocess.CompletedProcess) -> None:
    """MLflow's lines for a store it creates (its tables, alembic's migrations) reach neither stream."""
    for said in (result.stdout, result.stderr):
        for line in ("Creating initial MLflow database tables", "Updating database tables", "alembic"):
            assert line not in said, said


def test_a_new_registry_lists_no_models_quietly(tmp_path):
    """A newcomer's first command: `model list` on an MLflow store that does not exist yet (MLflow
    creates it) answers an empty list and says how to register a model, with none of MLflow's
    start-up lines; so does another command that opens a new store."""
    params = str(_params(tmp_path))
    database = tmp_path / "mlflow.db"
    text = _fastfill(tmp_path, "model", "list", "--params", params)
    assert text.returncode == 0, text.stderr[-2000:]
    assert text.stdout.startswith("no model is registered as embedder in sqlite:///")
    assert "register one with `fastfill model register --onnx FILE`" in text.stdout and "registered:" not in text.stdout
    _no_store_start_lines(text)
    assert database.exists()

    database.unlink()  # a new store again, now for --json: the same empty answer as a document
    listed = _fastfill(tmp_path, "model", "list", "--params", params, "--json")
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert json.loads(listed.stdout) == {"schema": "fastfill.model.list/1", "name": "embedder", "versions": []}
    _no_store_start_lines(listed)

    database.unlink()
    hooks = _fastfill(tmp_path, "webhook", "list", "--params", params)
    assert hooks.returncode == 0 and hooks.stdout.startswith("no webhooks on"), hooks.stderr[-2000:]
    _no_store_start_lines(hooks)


def test_watch_answers_one_check_only(quiet_env, tmp_path):
    result = _invoke("watch", "--params", str(_params(tmp_path)), "--every", "5", "--json")
    assert _document(result, "fastfill.error/1", USAGE)["error"].startswith("--json answers a single check")


def test_evaluate_answers_the_curve_and_still_writes_the_plain_file(tmp_path):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 4, 30)
    new = rng.normal(size=(30, 5)).astype(np.float32) + labels[:, None]
    folder = tmp_path / "f"
    folder.mkdir()
    for name, array in (("query", new), ("gallery_new", new), ("gallery_old", new + 1), ("labels", labels)):
        np.save(folder / f"{name}.npy", array)
    plain = json.loads(_invoke("evaluate", "--features", str(folder)).stdout)
    document = _document(_invoke("evaluate", "--features", str(folder), "--json", "--out", str(tmp_path / "r.json")),
                         "fastfill.evaluate/1")
    assert document["written"] == str(tmp_path / "r.json") and json.loads((tmp_path / "r.json").read_text()) == plain
    assert {k: v for k, v in document.items() if k not in ("schema", "written")} == plain
    assert _document(_invoke("evaluate", "--features", str(tmp_path / "none"), "--json"), "fastfill.error/1", USAGE)


# ---- every command that answers takes --json, and its schema is documented


ANSWERING = {("upgrade",), ("upgrade", "status"), ("upgrade", "unlock"), ("upgrade", "abort"), ("doctor",),
             ("status",), ("gallery", "info"), ("gallery", "gc"), ("gallery", "rollback"), ("gallery", "convert"),
             ("search",), ("evaluate",), ("watch",), ("model", "register"), ("model", "list"), ("model", "show"),
             ("webhook", "list")}


def _commands(group, path=()):
    for name in group.list_commands(None):  # a command group's module loads here (cli/__init__.py)
        command = group.get_command(None, name)
        yield (*path, name), command
        if hasattr(command, "list_commands"):
            yield from _commands(command, (*path, name))


def test_every_answering_command_takes_json_and_its_schema_is_documented():
    root = typer.main.get_command(app)
    with_json = {path for path, command in _commands(root) if any("--json" in p.opts for p in command.params)}
    assert ANSWERING <= with_json, ANSWERING - with_json
    for path in with_json:
        assert re.search(rf"^## `fastfill\.{re.escape('.'.join(path))}/\d+`$", DOCS, re.M), path
    assert "## `fastfill.upgrade.dry_run/1`" in DOCS and "## `fastfill.error/1`" in DOCS


# ---- stdout held for the document in a real process; shell completion


def test_in_a_process_stdout_holds_the_document_alone(mid_upgrade, tmp_path):
    """The fastfill executable, and a command whose child process writes to file descriptor 1."""
    result = subprocess.run([FASTFILL, "upgrade", "status", "--store", mid_upgrade, "--json"], capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["schema"] == "fastfill.upgrade.status/1"
    script = textwrap.dedent("""
        import subprocess, sys
        import typer
        from fastfill.cli.json_output import JsonOption, answer, answers_json

        app = typer.Typer()

        @app.command()
        @answers_json
        def child(as_json: JsonOption = False) -> None:
            subprocess.run(["echo", "from a child process"], check=True)
            print("from print")
            answer("fastfill.test/1", {"done": True})

        app()
    """)
    result = subprocess.run([sys.executable, "-c", script, "--json"], capture_output=True, text=True, timeout=120,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"schema": "fastfill.test/1", "done": True}
    assert "from a child process" in result.stderr and "from print" in result.stderr
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.stdout == "from a child process\nfrom print\n"  # without --json: untouched


def test_shell_completion_is_on():
    shown = _invoke("--help")
    assert "--install-completion" in shown.stdout and "--show-completion" in shown.stdout
    env = {**os.environ, "_FASTFILL_COMPLETE": "complete_bash", "COMP_WORDS": "fastfill gallery co", "COMP_CWORD": "2"}
    result = subprocess.run([FASTFILL], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.split() == ["convert"], result.stdout + result.stderr


def test_the_dry_runs_advice_keeps_its_keys_in_their_order():
    """The typed advice gives the document's ``advice`` as it always was: the prediction's keys,
    then the target (asked, or always for a resumed upgrade's stored prediction), the gate, the map."""
    from fastfill.components.gallery.advice.estimate import GatePrediction, PredictedGate, TargetAdvice

    curve = {"fractions": [0.0, 1.0], "top1": [0.5, 0.7], "recommendation": {"fraction": 1.0}}
    gate = PredictedGate(passed=False, reasons=["r"], queries=40, champion_top1=0.5, top1_auc=0.6, top1_auc_gain=0.1,
                         nfr1_mean=0.02, nfr1_end=0.01, fraction_to_gain=None, nfr1_relative=0.4)
    computed = DryRunAdvice(prediction=curve, gate=GatePrediction(gate), map_version="3", order="sigma",
                            target=TargetAdvice.from_dict({"target_top1": 0.6, "ways": [], "best": None, "line": "l",
                                                           "truth": "labels"})).to_dict()
    assert list(computed) == ["fractions", "top1", "recommendation", "target", "gate", "map_version", "order"]
    assert list(computed["gate"]) == ["passed", "reasons", "queries", "champion_top1", "top1_auc", "top1_auc_gain",
                                      "nfr1_mean", "nfr1_end", "fraction_to_gain", "nfr1_relative"]
    assert computed["target"] == {"target_top1": 0.6, "ways": [], "best": None, "line": "l", "truth": "labels"}
    untargeted = DryRunAdvice(prediction=curve, gate=GatePrediction(note="ungated"), map_version="3", order="random")
    assert list(untargeted.to_dict()) == ["fractions", "top1", "recommendation", "gate", "map_version", "order"]
    assert untargeted.to_dict()["gate"] == {"note": "ungated"}
    resumed = DryRunAdvice(prediction={**curve, "upgrade": "u"}, resumed=True).to_dict()
    assert list(resumed) == ["fractions", "top1", "recommendation", "upgrade", "target"] and resumed["target"] is None
    assert DryRunAdvice(note="n").to_dict() == {"note": "n"}
