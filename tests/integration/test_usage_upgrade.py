"""An upgrade in a usage order through the command line and the flow: refused before any work
without weights, predicted by the dry run, planned from a query log with the most-asked items
at the front; and a query log read from an S3 endpoint (moto's server)."""

import io

import boto3
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fastfill.components.evaluation.ordering import check_permutation
from fastfill.components.gallery.layouts.catalog import GalleryError, PartsGallery
from fastfill.components.gallery.store import open_store
from fastfill.components.gallery.upgrade import planning
from fastfill.components.gallery.upgrade.usage import load_usage_log
from tests.environment import new_bucket
from tests.integration.helpers import registry_models


def test_an_upgrade_in_usage_sigma_order_from_a_query_log(upgrade_env, prefect_harness):
    from typer.testing import CliRunner

    from fastfill.cli import app
    from fastfill.flows.ingest import ingest_flow
    from fastfill.flows.upgrade import upgrade_flow

    params, tmp_path = upgrade_env
    uri = str(tmp_path / "g")
    ingest_flow(params, uri)
    store = open_store(uri)
    ids = PartsGallery(store).ids()
    runner = CliRunner()
    common = ["--store", uri, "--params", str(tmp_path / "params.yaml"), "--no-progress", "--no-gate"]

    before = set(store.list(""))
    refused = runner.invoke(app, ["upgrade", *common, "--order", "usage_sigma"])
    assert refused.exit_code != 0 and "need per-item usage weights" in refused.output, refused.output
    assert "--usage-log" in refused.output and "Traceback" not in refused.output
    assert set(store.list("")) == before

    hot = [int(ids[5]), int(ids[11]), int(ids[30])]  # hit by 3, 2 and 1 logged queries
    log = tmp_path / "hits.csv"
    log.write_text("query,hit\n" + "".join(f"q{q},{item}\n" for q, item in
                                           [(0, hot[0]), (1, hot[0]), (2, hot[0]), (0, hot[1]), (3, hot[1]), (4, hot[2])]))
    dry = runner.invoke(app, ["upgrade", *common, "--order", "usage_sigma", "--usage-log", str(log), "--dry-run"])
    assert dry.exit_code == 0 and "predicted backfill curve" in dry.output, dry.output  # in the order asked for
    assert set(store.list("")) == before

    # a FastFill map trained by the upgrade and used unchecked: its uncertainty head gives sigma
    registry_models(params)[0].delete_registered_model(params.mlflow.alignment_model)
    align = {**params.align, "fastfill": params.align["fastfill"].model_copy(update={"check": "off"})}
    usage_params = params.model_copy(update={"align": align, "gallery": params.gallery.model_copy(update={
        "upgrade": params.gallery.upgrade.model_copy(update={"order": "usage_sigma", "usage_log": str(log)})})})
    result = upgrade_flow(usage_params, uri, budget=16, gate=False)
    plan = planning.load_plan(store, result.upgrade_id)
    assert plan.order_kind == "usage_sigma"
    order = check_permutation(planning.order_of(store, plan.upgrade_id), plan.num_items)
    rest = order[plan.prefilled:]  # after the items embedded while planning, the hot ones first
    front = [p for p in (5, 11, 30) if p in set(rest.tolist())]
    assert sorted(rest[:len(front)].tolist()) == sorted(front)
    assert np.isin([5, 11, 30], order[:plan.prefilled + len(front)]).all()


def test_a_query_log_is_read_from_s3(s3_endpoint):
    bucket = new_bucket(s3_endpoint)
    buffer = io.BytesIO()
    pq.write_table(pa.table({"query": ["a", "a", "b"], "hit": [5, 9, 5]}), buffer)
    boto3.client("s3", endpoint_url=s3_endpoint).put_object(Bucket=bucket, Key="logs/hits.parquet",
                                                            Body=buffer.getvalue())
    usage = load_usage_log(f"s3://{bucket}/logs/hits.parquet", np.array([9, 7, 5]))
    assert usage.weights.tolist() == [1, 0, 2] and usage.queries == 2
    with pytest.raises(GalleryError, match=rf"usage log s3://{bucket}/logs/missing.csv does not exist; upload it or "
                                           "fix gallery.upgrade.usage_log"):
        load_usage_log(f"s3://{bucket}/logs/missing.csv", np.array([9, 7, 5]))
