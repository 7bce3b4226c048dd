"""`fastfill upgrade` on a gallery kept as a Lance table (gallery.layout lance), through the CLI
with the pipeline's registry, on a folder and on S3 (moto over HTTP): planned, backfilled in
chunks, gated, finished, champion moved;
a gate that rejects leaves the table serving the champion's features; an upgrade killed in its
backfill resumes from its committed chunks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from cli import app
from components.gallery.lance_table import LanceGallery
from tests.environment import new_bucket
from tests.integration.helpers import cli_environment, registry_models, split_images


def _lance(tmp_path, store: str | None = None, **promotion) -> str:
    settings = yaml.safe_load((tmp_path / "params.yaml").read_text())
    settings["gallery"]["layout"] = "lance"
    if store is not None:
        settings["gallery"]["store"] = store
    settings["promotion"] = {**settings.get("promotion", {}), **promotion}
    path = tmp_path / "lance.yaml"
    path.write_text(yaml.safe_dump(settings))
    return str(path)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_an_upgrade_of_a_lance_table_end_to_end(upgrade_env, prefect_harness, request, where):
    from components.experiment.inference import embed

    params, tmp_path = upgrade_env
    client, old_model, new_model, old_version, new_version = registry_models(params)
    split = split_images(params)
    store = params.gallery.store
    if where == "s3":
        store = f"s3://{new_bucket(request.getfixturevalue('s3_endpoint'))}/gallery"
    # the gate measured on the labelled sample, with thresholds the tiny models pass
    lance_params = _lance(tmp_path, gate=True, max_nfr1=1.0, min_top1_auc_gain=-1.0, store=store)
    runner = CliRunner()
    ingested = runner.invoke(app, ["gallery", "ingest", "--params", lance_params])
    assert ingested.exit_code == 0, ingested.output
    table = LanceGallery(store)

    done = runner.invoke(app, ["upgrade", "--params", lance_params])
    assert done.exit_code == 0, done.output
    assert "complete: upgrade" in done.output and f"the table serves models:/{params.mlflow.registered_model}/" \
        f"{new_version}" in done.output
    assert table.model().version == new_version and table.upgrade() is None
    np.testing.assert_allclose(table.features(), embed(new_model, split.images), rtol=1e-4, atol=1e-4)
    champion = client.get_model_version_by_alias(params.mlflow.registered_model, "champion")
    assert str(champion.version) == new_version
    tags = client.get_model_version(params.mlflow.registered_model, new_version).tags
    assert tags["promotion"] == "passed" and float(tags["promotion.champion_top1"]) > 0  # measured, not ungated
    assert [name for _, name, _ in table.serving_tags()] == ["serving-1", "serving-2"]
    again = runner.invoke(app, ["upgrade", "--params", lance_params])
    assert again.exit_code == 0 and "up to date" in again.output, again.output
    refused = runner.invoke(app, ["upgrade", "--budget", "0.5", "--params", lance_params])
    assert refused.exit_code != 0 and "--budget: not available on the lance layout yet" in refused.output


def test_a_rejected_upgrade_leaves_the_champion_s_features(upgrade_env, prefect_harness):
    params, tmp_path = upgrade_env
    _, _, _, old_version, _ = registry_models(params)
    lance_params = _lance(tmp_path, gate=True, min_top1_auc_gain=0.9)  # no challenger gains 90 points
    runner = CliRunner()
    assert runner.invoke(app, ["gallery", "ingest", "--params", lance_params]).exit_code == 0
    table = LanceGallery(params.gallery.store)
    before = table.features()
    rejected = runner.invoke(app, ["upgrade", "--params", lance_params])
    assert rejected.exit_code != 0 and "rejected" in rejected.output, rejected.output
    assert table.model().version == old_version and table.upgrade() is None
    assert np.array_equal(table.features(), before)
    assert not os.path.exists(table.backfill_uri)


def test_an_upgrade_killed_in_its_backfill_resumes(upgrade_env, prefect_harness):
    params, tmp_path = upgrade_env
    _, _, _, _, new_version = registry_models(params)
    lance_params = _lance(tmp_path)
    assert CliRunner().invoke(app, ["gallery", "ingest", "--params", lance_params]).exit_code == 0
    table = LanceGallery(params.gallery.store)
    env = {**cli_environment(tmp_path), "FASTFILL_PROGRESS": "off"}
    child = subprocess.Popen([sys.executable, "-m", "cli", "upgrade", "--params", lance_params, "--concurrency", "1",
                              "--chunk-size", "2"],
                             env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and child.poll() is None:
        if table.upgrade() is not None and len(table.landed_chunks()) >= 2:
            break
        time.sleep(0.2)
    assert child.poll() is None, child.stdout.read()
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    landed = table.landed_chunks()
    assert table.upgrade() is not None and landed
    vectors, backfilled, _ = table.mixed()  # queries meanwhile: the whole gallery, mixed
    assert len(vectors) == table.num_items() and np.isfinite(vectors).all()

    resumed = CliRunner().invoke(app, ["upgrade", "--params", lance_params])
    assert resumed.exit_code == 0 and "complete" in resumed.output, resumed.output
    assert table.model().version == new_version and table.upgrade() is None
