"""The whole pipeline on a tiny configuration, under Prefect's test harness, with a temporary
MLflow store: registry aliases, registered maps, runs and the metrics schema."""

import json

import numpy as np
import pytest

ROWS = ("old_old", "new_new", "fct", "fastfill")
POINT_KEYS = {f"{m}_{p}" for m in ("top1", "top5", "map") for p in ("0", "100", "auc")}


@pytest.fixture
def finished_pipeline(tiny_pipeline):
    return tiny_pipeline


def test_pipeline_writes_reports_and_registers_models(finished_pipeline):
    from mlflow import MlflowClient

    params, metrics, workdir = finished_pipeline
    # metrics.json: every row, every number, fractions in [0, 1]
    on_disk = json.loads((workdir / "reports" / "metrics.json").read_text())
    assert on_disk == json.loads(json.dumps(metrics))
    for row in ROWS:
        assert POINT_KEYS <= set(on_disk[row]), row
        for key in POINT_KEYS:
            assert 0.0 <= on_disk[row][key] <= 1.0
    if on_disk["fastfill"]["map_check"].get("fallback_order") == "random":  # no sigma head, so no tau
        assert "kendall_tau" not in on_disk["fastfill"]
    else:
        assert -1.0 <= on_disk["fastfill"]["kendall_tau"] <= 1.0
    assert set(on_disk["fastfill"]["by_order"]) == {"random", "sigma", "oracle"}
    # at 100% backfill every method's gallery is the new model's: new/new exactly
    for row in ("fct", "fastfill"):
        assert on_disk[row]["top1_100"] == pytest.approx(on_disk["new_new"]["top1_0"])
        assert on_disk[row]["map_100"] == pytest.approx(on_disk["new_new"]["map_0"])
    assert (workdir / "reports" / "backfill.png").read_bytes()[:4] == b"\x89PNG"
    assert (workdir / "reports" / "plots" / "top1.csv").is_file()

    client = MlflowClient(params.mlflow.tracking_uri, registry_uri=params.mlflow.tracking_uri)
    old = json.loads((workdir / "artifacts" / "registry" / "models-old.json").read_text())
    new = json.loads((workdir / "artifacts" / "registry" / "models-new.json").read_text())
    assert str(client.get_model_version_by_alias("embedder", "champion").version) == old["version"]
    assert str(client.get_model_version_by_alias("embedder", "challenger").version) == new["version"]
    for method in ("fct", "fastfill"):
        entry = json.loads((workdir / "artifacts" / "registry" / f"align-{method}.json").read_text())
        version = client.get_model_version("embedder-alignment", entry["version"])
        assert version.tags["from_version"] == old["version"]
        assert version.tags["to_version"] == new["version"]
        assert version.tags["method"] == method
    # every map but the l2-only one is checked against it; the outcome is on the version, the run and in metrics
    fastfill = client.get_model_version(
        "embedder-alignment", json.loads((workdir / "artifacts" / "registry" / "align-fastfill.json").read_text())["version"])
    assert fastfill.tags["check"] in ("passed", "fallback", "warned") and fastfill.tags["check_policy"] == "fallback"
    run = client.get_run(fastfill.tags["run_id"])
    assert run.data.tags["check"] == fastfill.tags["check"]
    assert {"check.map.top1_auc", "check.reference.map_auc", "best_val_top1"} <= set(run.data.metrics)
    check = on_disk["fastfill"]["map_check"]
    assert check["outcome"] == fastfill.tags["check"]
    assert (check["outcome"] == "passed") == (check["map_top1_auc"] >= check["reference_top1_auc"]
                                               and check["map_map_auc"] >= check["reference_map_auc"])
    assert "map_check" not in on_disk["fct"]

    # the champion loads by alias with its classifier head, and embeds like the stored features
    import torch

    from fastfill.components.model_store import registered
    from fastfill.components.platform import registry

    registry.setup(params.mlflow)
    champion = registered.load_model("models:/embedder@champion")
    test_images = np.load(workdir / "data" / "splits" / "test_images.npy")[:5]
    with torch.no_grad():
        features = champion(torch.from_numpy(test_images).float() / 255)
        assert champion.classify(features).shape == (5, 3)
    stored = np.load(workdir / "artifacts" / "features" / "old" / "test.npy")[:5]
    assert np.allclose(features.numpy(), stored, atol=1e-5)


def test_pipeline_runs_are_nested_and_tagged(finished_pipeline):
    from mlflow import MlflowClient

    from fastfill.components.platform import registry

    params, _, workdir = finished_pipeline
    client = MlflowClient(params.mlflow.tracking_uri, registry_uri=params.mlflow.tracking_uri)
    experiment = client.get_experiment_by_name(params.mlflow.experiment)
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.info.run_name == "pipeline"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # the UI opens on training
    assert parents[0].data.params["train.new.backbone"] == "cnn" and "compare.seeds" not in parents[0].data.params
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert sorted(r.info.run_name for r in children) == sorted(
        ["prepare", "train-old", "train-new", "align-fct", "align-fastfill", "evaluate"])
    for run in children:
        assert run.info.status == "FINISHED"
        assert run.data.tags["git_commit"] and run.data.tags["data_version"].endswith(".dir")
    # the stages after prepare name the data as dvc.lock does (DVC's own hash of the splits folder)
    trained = next(r for r in children if r.info.run_name == "train-old")
    assert trained.data.tags["data_version"] == registry.data_version(workdir / "data" / "splits")
    evaluate = next(r for r in children if r.info.run_name == "evaluate")
    assert evaluate.data.params["evaluate.distance"] == "l2"
    history = client.get_metric_history(evaluate.info.run_id, "fastfill.sigma.top1")
    # curve_points 4 -> 6 points; step = the backfilled fraction in per mille
    assert [m.step for m in history] == [0, 200, 400, 600, 800, 1000]
    artifacts = {a.path for a in client.list_artifacts(evaluate.info.run_id)}
    assert {"backfill.png", "metrics.json"} <= artifacts
    align = next(r for r in children if r.info.run_name == "align-fastfill")
    # one point per epoch: 216 training pairs (24 held out) make 7 steps an epoch, min_steps 30 -> 5 epochs
    assert len(client.get_metric_history(align.info.run_id, "l2")) == 5
    assert len(client.get_metric_history(align.info.run_id, "disc")) == 5
    assert len(client.get_metric_history(align.info.run_id, "val_top1")) == 5


def test_training_progress_is_a_prefect_artifact(finished_pipeline):
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
    )

    _, _, workdir = finished_pipeline
    pipeline_run = UUID((workdir / "pipeline_flow_run").read_text())
    with get_client(sync_client=True) as client:
        # the pipeline's stages are its child flow runs; other tests share this Prefect server and its keys
        stages = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[pipeline_run])))
        ours = {pipeline_run} | {run.id for run in stages}
        for key in ("train-old", "train-new", "align-fct", "align-fastfill"):
            found = [artifact for artifact in client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]))) if artifact.flow_run_id in ours]
            assert len(found) == 1, (key, found)
            assert found[0].type == "progress" and float(found[0].data) == 100.0, (key, found[0].data)


@pytest.mark.slow  # a pipeline run per seed: about a minute on 2 cores
def test_seeds_command_reports_each_seed_and_the_spread(tiny_workdir, prefect_harness):
    from typer.testing import CliRunner

    from fastfill.cli import app

    tmp_path = tiny_workdir
    result = CliRunner().invoke(app, ["seeds", "--seed", "3", "--seed", "4"])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "reports" / "seeds.json").read_text())
    assert summary["seeds"] == [3, 4]
    top1 = summary["rows"]["fastfill"]["top1_auc"]
    per_seed = [json.loads((tmp_path / "runs" / f"seed-{s}" / "reports" / "metrics.json").read_text())["fastfill"]["top1_auc"]
                for s in (3, 4)]
    assert list(top1["per_seed"].values()) == per_seed
    assert top1["mean"] == pytest.approx(sum(per_seed) / 2)
    assert "| fastfill (sigma) |" in (tmp_path / "reports" / "seeds.md").read_text()


def test_a_stage_without_its_inputs_says_what_to_run(tiny_workdir, prefect_harness):
    from typer.testing import CliRunner

    from fastfill.cli import app

    result = CliRunner().invoke(app, ["stage", "train", "--role", "old"])
    assert result.exit_code == 6  # bad input: the splits are missing
    assert "run the prepare stage first" in result.output
