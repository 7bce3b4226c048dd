"""The parts layout's reliability checks, run against an upgrade of a Lance table
(gallery.layout lance): a second upgrade started at each moment around the first one's finish,
an upgrade refused while another holds the lock (and `upgrade unlock`), and the CLI's process
group SIGKILLed in each phase on S3 then run again. Invariants: exactly one upgrade runs, every
item is in the table once with the features an uninterrupted upgrade gives, the table, the
registry and the lock agree."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from cli import app
from components.gallery.upgrade import ending, planning
from components.gallery.layouts.lance_table import LanceGallery
from components.gallery.store.lock import LOCK, UpgradeLocked, acquire_lock
from components.gallery.store import open_store
from components.platform.config import load_params as load
from components.platform.registry import ModelRef, alias_version, setup
from tests.integration.helpers import cli_environment, killed_when, lance_params, registry_models, run_then

GATE = {"gate": True, "min_top1_auc_gain": -1.0, "max_nfr1": 1.0, "max_fraction_to_gain": 1.0}


def _ingested(params_path: str) -> None:
    result = CliRunner().invoke(app, ["gallery", "ingest", "--params", params_path])
    assert result.exit_code == 0, result.output


def _agree(params, table: LanceGallery, uid: str, new_version: str) -> None:
    """The table serves the new version, holds each item once; the registry and the records agree."""
    client, _ = setup(params.mlflow)
    name = params.mlflow.registered_model
    store = open_store(table.store_uri)
    assert table.model().version == new_version and table.upgrade() is None
    positions = table.items(["position"]).column("position").to_numpy()
    assert np.array_equal(positions, np.arange(table.num_items()))  # nothing lost, nothing twice
    assert not os.path.exists(table.backfill_uri) or table.backfill_uri.startswith("s3://")
    assert str(client.get_model_version_by_alias(name, "champion").version) == new_version
    assert client.get_model_version(name, new_version).tags["promotion"] == "passed"
    assert alias_version(client, name, "challenger") is None  # cleared by the promotion
    decided = ending.decision(store, uid)
    assert decided["passed"] and decided["registry_recorded"]
    assert not store.exists(LOCK)


@pytest.mark.parametrize("offset", ["read-before-lock", "after-decision", "after-finish", "after-registry"])
def test_a_second_table_upgrade_around_the_first_s_finish_never_runs_it_again(upgrade_env, prefect_harness,
                                                                             monkeypatch, offset):
    """The second upgrade to the same challenger, started at each moment around the first one's
    end: it read the table before the first took the lock (then finds it upgraded under the lock:
    up-to-date), or starts while the first holds the lock (refused, naming the holder)."""
    import flows.lance_upgrade as flu

    params, tmp_path = upgrade_env
    path = lance_params(tmp_path, **GATE)
    _ingested(path)
    params = load(Path(path))
    _, _, _, old_version, new_version = registry_models(params)
    table = LanceGallery(params.gallery.store)
    second = {}

    def start_the_second():
        if second:
            return
        try:
            second["result"] = flu.table_upgrade_flow(params)
        except UpgradeLocked as error:
            second["refused"] = str(error)

    if offset == "read-before-lock":
        real_acquire = flu.acquire_lock

        def the_first_finishes_meanwhile(*args, **kwargs):
            if not second:
                with monkeypatch.context() as patch:
                    patch.setattr(flu, "acquire_lock", real_acquire)
                    second["first"] = flu.table_upgrade_flow(params)
            return real_acquire(*args, **kwargs)

        monkeypatch.setattr(flu, "acquire_lock", the_first_finishes_meanwhile)
        second["result"] = flu.table_upgrade_flow(params)
        first = second.pop("first")
    else:
        owner, function = {"after-decision": (ending, "write_decision"), "after-finish": (LanceGallery, "finish"),
                           "after-registry": (flu, "follow_decision")}[offset]
        monkeypatch.setattr(owner, function, run_then(owner, function, start_the_second))
        first = flu.table_upgrade_flow(params)
        monkeypatch.undo()
    assert first["state"] == "complete", first
    if offset == "read-before-lock":
        assert second["result"]["state"] == "up-to-date" and "another run upgraded it" in second["result"]["message"]
    else:
        assert "is being upgraded" in second["refused"] and "by process" in second["refused"], second
    uid = planning.upgrade_id(ModelRef(params.mlflow.registered_model, old_version),
                              ModelRef(params.mlflow.registered_model, new_version))
    _agree(params, table, uid, new_version)
    assert [name for _, name, _ in table.serving_tags()] == ["serving-1", "serving-2"]  # one finish, one tag
    assert flu.table_upgrade_flow(params)["state"] == "up-to-date"  # and once more, later


def test_a_held_lock_refuses_a_table_upgrade_until_unlocked(upgrade_env, prefect_harness):
    params, tmp_path = upgrade_env
    path = lance_params(tmp_path)
    _ingested(path)
    store = open_store(params.gallery.store)
    held = acquire_lock(store, "another-upgrade", log=lambda m: None)  # this live process holds it
    runner = CliRunner()
    result = runner.invoke(app, ["upgrade", "--params", path])
    assert result.exit_code == 6, result.output  # bad input: the gallery is locked
    assert "is being upgraded: upgrade another-upgrade by process" in result.output
    assert "fastfill upgrade unlock" in result.output
    table = LanceGallery(params.gallery.store)
    assert table.upgrade() is None and not store.list("upgrades/" + "models")  # refused before planning
    assert [key for key in store.list("upgrades/") if key != LOCK] == []
    result = runner.invoke(app, ["upgrade", "unlock", "--params", path])
    assert result.exit_code == 0 and "removed the lock of upgrade another-upgrade" in result.output, result.output
    held.release()


@pytest.mark.slow
def test_a_table_upgrade_killed_in_each_phase_on_s3_completes_exactly_once(s3_endpoint, upgrade_env,
                                                                          prefect_harness):
    """The CLI's process group SIGKILLed at a random moment of the planning, the backfill, the
    ending (fold and gate) and right after the decision (the finish's steps, the registry), the
    same command run again after each kill; then the table holds every item once with
    features bit-identical to an uninterrupted upgrade's, and the table, registry and lock agree."""
    from prefect.settings import get_current_settings

    from components.platform import registry
    from tests.environment import new_bucket

    params, tmp_path = upgrade_env
    store_uri = f"s3://{new_bucket(s3_endpoint)}/galleries/chaos"
    path = lance_params(tmp_path, store=store_uri, **GATE)
    _ingested(path)
    params = load(Path(path))
    client, _, _, old_version, new_version = registry_models(params)
    name = params.mlflow.registered_model
    uid = planning.upgrade_id(ModelRef(name, old_version), ModelRef(name, new_version))
    store, table = open_store(store_uri), LanceGallery(store_uri)
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "cli", "upgrade", "--params", path, "--chunk-size", "4", "--concurrency", "1"]
    # the session's Prefect server: the kills take the CLI, not a server of its own
    env = {**cli_environment(tmp_path / "prefect-home"), "PREFECT_API_URL": get_current_settings().api.url,
           "FASTFILL_PROGRESS": "off"}
    rng = random.Random(0)

    def planning_started():
        return store.exists(planning.upgrade_key(uid, "plan.json"))

    def backfilling(at_least=rng.randint(1, 4)):
        return table.upgrade() is not None and len(table.landed_chunks()) >= at_least

    def ending_started():
        plan = planning.load_plan(store, uid)
        return (plan is not None and table.upgrade() is not None
                and len(table.landed_chunks()) == -(-plan.num_items // plan.chunk_size))

    def decided():  # then the finish's steps and the registry's run
        return ending.decision(store, uid) is not None

    killed_at = []
    for phase, started in (("planning", planning_started), ("backfill", backfilling), ("ending", ending_started),
                           ("decided", decided)):
        pause = {"planning": rng.uniform(0, 0.05), "backfill": rng.uniform(0, 0.3)}.get(phase, 0)
        killed_when(command, root, env, tmp_path / f"killed-{phase}.log", started, pause)
        killed_at.append((phase, len(table.landed_chunks()), ending.decision(store, uid) is not None))
    print("killed at (phase, chunks landed, decision recorded):", killed_at)

    resumed = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    _agree(params, table, uid, new_version)
    chaos = table.features()

    # an uninterrupted upgrade of the same gallery, the champion set back to where the chaos began
    client.set_registered_model_alias(name, "champion", old_version)
    reference = lance_params(tmp_path, store=str(tmp_path / "reference"), **GATE)
    _ingested(reference)
    done = CliRunner().invoke(app, ["upgrade", "--params", reference, "--to", f"models:/{name}/{new_version}",
                                    "--chunk-size", "4", "--concurrency", "1"])
    assert done.exit_code == 0, done.output
    np.testing.assert_array_equal(chaos, LanceGallery(str(tmp_path / "reference")).features())
    assert registry.alias_version(client, name, "champion") == new_version
