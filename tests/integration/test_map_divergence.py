"""A FastFill map that diverges does not take the align stage down: with a huge learning rate
the training stops and restores finite weights, and a map whose outputs are still not finite
is replaced by the l2-only map under check fallback, or evaluated as a diverged row with the
check off, while the other rows complete."""

import json
import math
import shutil

import numpy as np
import pytest
import torch

from fastfill.components.platform.config import parse_params
from testkit.process_state import in_workdir
from testkit.tiny_demo import tiny_params


@pytest.fixture
def diverging(tiny_pipeline, image_folder, tmp_path, monkeypatch):
    """params whose fastfill map trains at lr 1e3, over a private copy of the tiny pipeline's
    artifacts and MLflow store; the trained fastfill map's weights are then set to NaN, as
    training left them before it stopped itself (its guard now restores finite ones, so the
    map check's own guard is only reached this way). Returns (params data, workdir, log lines)."""
    import fastfill.tasks.alignment

    _, _, pipeline_dir = tiny_pipeline
    shutil.copytree(pipeline_dir / "artifacts", tmp_path / "artifacts")
    shutil.copy(pipeline_dir / "store" / "mlflow.db", tmp_path / "mlflow.db")
    data = tiny_params(image_folder)
    data["paths"] = {"data": str(pipeline_dir / "data"), "artifacts": str(tmp_path / "artifacts"),
                     "reports": str(tmp_path / "reports")}
    data["mlflow"]["tracking_uri"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    data["align"]["fastfill"]["lr"] = 1e3
    said = []
    monkeypatch.setattr(fastfill.tasks.alignment, "log", lambda message: said.append(message) or print(message))
    train = fastfill.tasks.alignment.train_alignment

    def diverged(config, *args, **kwargs):
        h, history = train(config, *args, **kwargs)
        if config.uncertainty:  # the fastfill map; its l2-only reference is trained as it is
            with torch.no_grad():
                for parameter in h.parameters():
                    parameter.fill_(math.nan)
        return h, history

    monkeypatch.setattr(fastfill.tasks.alignment, "train_alignment", diverged)
    return data, tmp_path, said


def _version_tags(params, workdir, method):
    from mlflow import MlflowClient

    client = MlflowClient(params.mlflow.tracking_uri, registry_uri=params.mlflow.tracking_uri)
    entry = json.loads((workdir / "artifacts" / "registry" / f"align-{method}.json").read_text())
    version = client.get_model_version(params.mlflow.alignment_model, entry["version"])
    return version.tags, client.get_run(version.tags["run_id"])


def test_the_align_stage_falls_back_to_the_l2_map_from_a_diverged_map(diverging):
    from fastfill.flows.align import align_flow

    data, workdir, said = diverging
    params = parse_params(data)
    with in_workdir(workdir):
        align_flow(params, "fastfill")
    directory = workdir / "artifacts" / "align" / "fastfill"
    history = json.loads(directory.joinpath("history.json").read_text())
    assert history[-1]["diverged"]["reason"] and len(history) < 30  # the training stopped itself
    check = json.loads(directory.joinpath("check.json").read_text())
    assert check["action"] == "fallback" and check["message"].startswith("non-finite outputs")
    assert any(line.startswith("map check (fallback): non-finite outputs") for line in said)
    assert np.isfinite(np.load(directory / "gallery_old.npy")).all()  # the l2-only map's
    tags, run = _version_tags(params, workdir, "fastfill")
    assert tags["check"] == "fallback" and tags["check_reason"].startswith("non-finite outputs")
    assert run.data.tags["check_non_finite"].startswith("transformed features")
    assert run.data.metrics["check.non_finite"] == 1.0


def test_with_the_check_off_a_diverged_map_is_evaluated_as_a_diverged_row(diverging):
    from fastfill.flows.align import align_flow
    from fastfill.flows.evaluate import evaluate_flow

    data, workdir, said = diverging
    data["align"]["fastfill"]["check"] = "off"
    params = parse_params(data)
    with in_workdir(workdir):
        align_flow(params, "fastfill")
        evaluate_flow(params)
    metrics = json.loads((workdir / "reports" / "metrics.json").read_text())
    assert set(metrics["fastfill"]["by_order"]) == {"random", "sigma", "oracle"}
    assert all(math.isnan(row["top1_auc"]) for row in metrics["fastfill"]["by_order"].values())
    assert 0 < metrics["fct"]["top1_auc"] <= 1 and 0 < metrics["new_new"]["top1_auc"] <= 1
    curves = json.loads((workdir / "reports" / "curves.json").read_text())
    assert curves["curves"]["fastfill"]["sigma"]["diverged"].startswith("diverged: its outputs are not finite")
    assert (workdir / "reports" / "backfill.png").is_file()
