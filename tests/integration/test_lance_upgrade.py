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
from typer.testing import CliRunner

from cli import app
from components.gallery.layouts.lance_table import LanceGallery
from tests.environment import new_bucket
from tests.integration.helpers import (
    assert_none_outlive, cli_environment, descendants, lance_params as _lance, photo_folder, registry_models,
    split_images,
)


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

    # a budget of half the gallery, in whole chunks of 8: 4 chunks (32 of 72 items), then a pause
    paused = runner.invoke(app, ["upgrade", "--params", lance_params, "--budget", "50%"])
    assert paused.exit_code == 0 and "paused: 32 of 72 items backfilled" in paused.output, paused.output
    assert table.upgrade() is not None and len(table.landed_chunks()) == 4
    assert int(table.mixed()[1].sum()) == 32 and table.model().version == old_version

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
    assert again.exit_code == 0 and "up-to-date" in again.output, again.output
    refused = runner.invoke(app, ["upgrade", "--dry-run", "--params", lance_params])
    assert refused.exit_code != 0 and "--dry-run: not available on the lance layout yet" in refused.output

    # rolled back: the table's previous serving tag, and the registry with it
    rolled = runner.invoke(app, ["gallery", "rollback", "--params", lance_params])
    assert rolled.exit_code == 0 and "champion moved back" in rolled.output, rolled.output
    assert table.model().version == old_version and table.upgrade() is None
    np.testing.assert_allclose(table.features(), embed(old_model, split.images), rtol=1e-4, atol=1e-4)
    champion = client.get_model_version_by_alias(params.mlflow.registered_model, "champion")
    assert str(champion.version) == old_version
    assert client.get_model_version(params.mlflow.registered_model, new_version).tags["promotion"] == "rolled-back"
    assert [name for _, name, _ in table.serving_tags()] == ["serving-1", "serving-2", "serving-3"]
    from components.gallery.triggers.claims import claimed
    from components.gallery.store import open_store

    # the rolled-back version is claimed: the watcher and the webhook do not start it again
    assert claimed(open_store(store), params.mlflow.registered_model, new_version)["source"] == "rollback"


def test_an_abort_of_the_table_takes_the_lock_records_and_claims(upgrade_env, prefect_harness):
    from components.gallery.triggers.claims import claimed
    from components.gallery.store.lock import acquire_lock
    from components.gallery.store import open_store

    params, tmp_path = upgrade_env
    _, _, _, old_version, new_version = registry_models(params)
    lance_params = _lance(tmp_path)
    runner = CliRunner()
    assert runner.invoke(app, ["gallery", "ingest", "--params", lance_params]).exit_code == 0
    table, store = LanceGallery(params.gallery.store), open_store(params.gallery.store)
    paused = runner.invoke(app, ["upgrade", "--params", lance_params, "--budget", "25%"])
    assert paused.exit_code == 0 and "paused" in paused.output, paused.output
    upgrade = table.upgrade()

    held = acquire_lock(store, "another-upgrade", log=lambda _: None, renew=False)  # another process at work
    try:
        refused = runner.invoke(app, ["upgrade", "abort", "--params", lance_params])
    finally:
        held.release()
    assert refused.exit_code == 6 and f"cannot abort upgrade {upgrade.id} now" in refused.output, refused.output
    assert table.upgrade() is not None and not store.exists(f"upgrades/{upgrade.id}/aborted.json")

    aborted = runner.invoke(app, ["upgrade", "abort", "--params", lance_params])
    assert aborted.exit_code == 0 and f"aborted upgrade {upgrade.id}" in aborted.output, aborted.output
    assert table.upgrade() is None and table.model().version == old_version
    record = store.get_json(f"upgrades/{upgrade.id}/aborted.json")
    assert record["to"] == upgrade.new.uri and record["chunks_done"] >= 1 and record["by"]["pid"]
    assert claimed(store, params.mlflow.registered_model, new_version)["source"] == "abort"
    assert not store.exists("upgrades/lock.json")
    again = runner.invoke(app, ["upgrade", "abort", "--params", lance_params])
    assert again.exit_code == 6 and "no upgrade in progress to abort" in again.output, again.output


def test_the_deployment_and_the_watcher_run_the_table_s_upgrade(upgrade_env, prefect_harness):
    """What the upgrade deployment runs (and the watcher and the webhook start) follows
    gallery.layout: the table's flow, and the watcher reads the table's model and upgrade."""
    from components.platform.config import load_params
    from flows.deployments import gallery_course, paused_upgrade, registry_candidate, upgrade_entry

    params, tmp_path = upgrade_env
    _, _, _, old_version, new_version = registry_models(params)
    lance_params = _lance(tmp_path)
    assert CliRunner().invoke(app, ["gallery", "ingest", "--params", lance_params]).exit_code == 0
    table, lance = LanceGallery(params.gallery.store), load_params(lance_params)
    assert registry_candidate(lance, params.gallery.store) == (new_version, None)  # the challenger is new

    paused = upgrade_entry(params_path=lance_params, budget=0.25)
    assert paused["state"] == "paused" and table.upgrade() is not None, paused
    upgrade = table.upgrade()
    assert gallery_course(lance, params.gallery.store) == (table.model(), upgrade.new)
    assert paused_upgrade(lance, params.gallery.store) == {"id": upgrade.id, "to": upgrade.new.uri}
    assert registry_candidate(lance, params.gallery.store)[1] == f"the gallery is already upgrading to version " \
                                                                 f"{new_version}"
    done = upgrade_entry(params_path=lance_params)
    assert done["state"] == "complete" and table.model().version == new_version, done
    assert gallery_course(lance, params.gallery.store) == (table.model(), None)
    assert paused_upgrade(lance, params.gallery.store) is None
    assert table.model().version == new_version != old_version


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
    below = descendants(child.pid)  # its temporary Prefect server among them
    os.kill(child.pid, signal.SIGKILL)  # the command alone, as the out-of-memory killer does
    child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert below, "the command started no temporary Prefect server"
    assert_none_outlive(below)
    landed = table.landed_chunks()
    assert table.upgrade() is not None and landed
    vectors, backfilled, _ = table.mixed()  # queries meanwhile: the whole gallery, mixed
    assert len(vectors) == table.num_items() and np.isfinite(vectors).all()

    # resumed with a throttle: after the first chunk, the rest start no faster than 8 items/s
    left = table.num_items() - 2 * len(landed)
    started = time.monotonic()
    resumed = CliRunner().invoke(app, ["upgrade", "--params", lance_params, "--max-items-per-second", "8",
                                       "--concurrency", "1", "--chunk-size", "2"])
    assert resumed.exit_code == 0 and "complete" in resumed.output, resumed.output
    assert time.monotonic() - started >= (left - 2) / 8, (left, resumed.output)
    assert table.model().version == new_version and table.upgrade() is None


def test_a_table_without_labels_is_gated_on_judged_queries(upgrade_env, prefect_harness):
    """A retrieval team's table: adopted from its images with no label column. A gated upgrade
    without judgments is refused before any work; with a judgments file (gallery items and an
    image outside the gallery as queries) it is measured on them against the whole table, and
    the champion's top-1 it records is the one a brute-force search of the stored features gives."""
    from PIL import Image

    from components.evaluation import pairwise_distances
    from components.experiment.inference import embed
    from components.gallery.upgrade import ending, planning
    from components.gallery.store import open_store
    from components.platform.registry import ModelRef

    params, tmp_path = upgrade_env
    _, old_model, _, old_version, new_version = registry_models(params)
    split = split_images(params)
    photos = tmp_path / "photos"
    photo_folder(photos, split.images, 900 + np.arange(len(split.images)))
    Image.fromarray(split.images[5][0], mode="L").save(photos / "outside.png")  # a query image, not an item
    lance_params = _lance(tmp_path, gate=True, max_nfr1=1.0, min_top1_auc_gain=-1.0)
    runner = CliRunner()
    adopted = runner.invoke(app, ["gallery", "adopt", "--manifest", str(photos / "items.csv"), "--params",
                                  lance_params])
    assert adopted.exit_code == 0, adopted.output
    table = LanceGallery(params.gallery.store)
    assert "label" not in table.dataset().schema.names

    refused = runner.invoke(app, ["upgrade", "--params", lance_params])
    assert refused.exit_code != 0 and "has no labels and no judged queries are configured" in refused.output
    assert table.upgrade() is None and table.model().version == old_version

    labels = split.labels  # known to the test only: they make the judgments, the table never sees them
    queries = list(range(0, len(labels), 7))
    rows = ["query,relevant"]
    for q in queries:
        rows += [f"{900 + q},{900 + p}" for p in np.flatnonzero(labels == labels[q]) if p != q]
    rows += [f"{photos / 'outside.png'},{900 + p}" for p in np.flatnonzero(labels == labels[5])]
    (tmp_path / "judged.csv").write_text("\n".join(rows) + "\n")
    done = runner.invoke(app, ["upgrade", "--params", lance_params, "--judgments", str(tmp_path / "judged.csv")])
    assert done.exit_code == 0 and "complete: upgrade" in done.output, done.output
    assert table.model().version == new_version

    name = params.mlflow.registered_model
    uid = planning.upgrade_id(ModelRef(name, old_version), ModelRef(name, new_version))
    numbers = ending.decision(open_store(params.gallery.store), uid)["numbers"]
    stored = embed(old_model, split.images)  # the champion's features the table held
    query_features = np.concatenate([stored[queries], embed(old_model, split.images[5:6])])
    distances = pairwise_distances(query_features, stored, params.gallery.distance)
    distances[np.arange(len(queries)), queries] = np.inf  # a gallery item never retrieves itself
    nearest = distances.argmin(1)
    query_labels = np.concatenate([labels[queries], labels[5:6]])
    # the outside image is item 5's pixels: its nearest item is item 5, relevant by construction
    assert numbers["champion_top1"] == pytest.approx(np.mean(labels[nearest] == query_labels))
    assert 0.0 <= numbers["top1_auc"] <= 1.0


def test_the_usage_orders_on_a_table_follow_a_query_log(upgrade_env, prefect_harness):
    """--order usage_sigma --usage-log on the lance layout: the map chosen for sigma as on the parts
    layout, the log counted against the table's ids, the items it hits backfilled first; a log
    naming unknown ids is refused before any work."""
    from components.gallery.upgrade import table_upgrade

    params, tmp_path = upgrade_env
    lance_params = _lance(tmp_path)
    runner = CliRunner()
    assert runner.invoke(app, ["gallery", "ingest", "--params", lance_params]).exit_code == 0
    table = LanceGallery(params.gallery.store)
    ids = table.items(["id"]).column("id").to_pylist()
    (tmp_path / "bad.csv").write_text("query,hit\nq1,no-such-item\n")
    refused = runner.invoke(app, ["upgrade", "--params", lance_params, "--order", "usage_sigma",
                                  "--usage-log", str(tmp_path / "bad.csv")])
    assert refused.exit_code != 0 and "no-such-item" in refused.output, refused.output
    assert "Traceback" not in refused.output and len(refused.output.strip().splitlines()) == 1, refused.output
    assert table.upgrade() is None  # nothing planned
    hit = [5, 17, 40, 63]  # positions the log hits, the last by three queries
    rows = [(f"q{i}", ids[p]) for i, p in enumerate(hit)] + [("q8", ids[63]), ("q9", ids[63])]
    (tmp_path / "log.csv").write_text("query,hit\n" + "".join(f"{q},{h}\n" for q, h in rows))
    paused = runner.invoke(app, ["upgrade", "--params", lance_params, "--order", "usage_sigma",
                                 "--usage-log", str(tmp_path / "log.csv"), "--budget", "1"])
    assert paused.exit_code == 0 and "paused" in paused.output, paused.output
    order = table_upgrade.order_of(table)
    assert order[0] == 63 and set(order[:4].tolist()) == set(hit)  # the most-hit first, then the other hits
