"""`--json` in a real upgrade, run as a user runs it (the `fastfill` executable in a subprocess,
the tests' Prefect server, a real MLflow store): the dry run, a paused run, `status`, an abort and
a rejection each print one document on stdout and nothing else, with the exit code the command
has without --json (3 for the rejection). The schemas are in docs/json.md."""

import json
import subprocess
import sys
from pathlib import Path

from tests.integration.helpers import registry_models
from tests.integration.test_cli_outcomes import _worse_version

FASTFILL = str(Path(sys.executable).with_name("fastfill"))


def _answer(args: list[str], env: dict, cwd: Path, schema: str, code: int = 0) -> dict:
    result = subprocess.run([FASTFILL, *args, "--json"], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == code, result.stdout[-3000:] + result.stderr[-3000:]
    document = json.loads(result.stdout)  # the whole of stdout: one document, nothing else
    assert document["schema"] == schema, document
    assert "Traceback" not in result.stderr
    return document


def test_a_real_upgrade_answers_in_json(upgrade_env, cli_env, prefect_harness):
    from prefect.settings import get_current_settings

    from fastfill.flows.ingest import ingest_flow

    params, tmp_path = upgrade_env
    env = {**cli_env, "PREFECT_API_URL": get_current_settings().api.url}
    uri = str(tmp_path / "gallery")
    ingest_flow(params, uri)
    _, _, _, old_version, new_version = registry_models(params)
    args = ["--params", str(tmp_path / "params.yaml"), "--store", uri]

    plan = _answer(["upgrade", *args, "--dry-run"], env, tmp_path, "fastfill.upgrade.dry_run/1")
    assert plan["written"] is False and plan["to"] == f"models:/embedder/{new_version}" and plan["items"] == 72
    assert plan["chunks"] == 9 and plan["estimated_backfill_seconds"] > 0
    planning = plan["planning"]  # the registry's maps are checked on the split: nothing to train
    assert planning["embeds"]["total"] == planning["embeds"]["evaluation_sample"] > 0
    assert planning["seconds"]["total"] == planning["seconds"]["embedding"] >= 0

    paused = _answer(["upgrade", *args, "--budget", "25%", "--progress"], env, tmp_path, "fastfill.upgrade/2")
    assert paused["state"] == "paused" and paused["stopped"] == "budget" and paused["items"] == 72
    assert paused["items_done"] == 24 and paused["chunks_done"] == 3 and paused["promotion"] is None
    assert paused["upgrade"] == f"embedder-v{old_version}-to-embedder-v{new_version}" and paused["mlflow_run_id"]

    status = _answer(["status", *args], env, tmp_path, "fastfill.status/1")
    assert status["ok"] is True and status["gallery"]["state"] == "paused"
    assert status["gallery"]["upgrade"]["items_done"] == 24 and status["mlflow_run_id"] == paused["mlflow_run_id"]
    assert status["lines"]["prefect"].endswith(", Paused)"), status["lines"]

    aborted = _answer(["upgrade", "abort", *args], env, tmp_path, "fastfill.upgrade.abort/1")
    assert aborted["state"] == "aborted" and aborted["items_done"] == 24
    assert aborted["model"] == f"models:/embedder/{old_version}"

    worse = _worse_version(params)
    rejected = _answer(["upgrade", *args, "--to", f"models:/embedder/{worse}", "--gate", "--no-progress"], env,
                       tmp_path, "fastfill.upgrade/2", code=3)  # the exit code of a rejection, as without --json
    assert rejected["state"] == "rejected" and rejected["promotion"]["passed"] is False
    assert rejected["promotion"]["reasons"] and isinstance(rejected["promotion"]["numbers"]["top1_auc"], float)
    assert rejected["complete"] is True and rejected["items_done"] == 72

    doctor = _answer(["doctor", *args], env, tmp_path, "fastfill.doctor/1")
    assert doctor["ok"] is True and doctor["checks"]["store"]["state"] == "ok"
    assert doctor["checks"]["registry"]["text"].startswith(f"embedder: champion -> v{old_version}")
