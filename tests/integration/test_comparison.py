"""The comparison on a tiny configuration, two seeds side by side (each in its own process, as
`fastfill compare --jobs 2` runs them): every method is trained by the same flows, registered,
evaluated, and the table is complete; the flow follows how many of the seeds' stages are done."""

import json
import logging
import math
import os
import re
from contextlib import contextmanager

import pytest

from testkit.process_state import in_workdir, restored_environ
from testkit.tiny_demo import tiny_params

pytestmark = pytest.mark.slow  # minutes on 2 cores; `-m 'not slow'` skips them

# how often the flow looks at its seeds' processes (10 s in production): a seed's end is seen sooner
POLL_SECONDS = 0.5


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextmanager
def _flow_messages():
    """What the flows log while the block runs (Prefect's flow-run logger), as a list."""
    handler, logger = _Messages(), logging.getLogger("prefect.flow_runs")
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)


@pytest.fixture(scope="module")
def comparison(tmp_path_factory, image_folder, prefect_harness):
    """The comparison's (params, summary, workdir, the flow's log messages)."""
    from fastfill.components.platform.config import parse_params
    from fastfill.flows import compare
    from fastfill.flows.compare import compare_flow

    workdir = tmp_path_factory.mktemp("comparison")
    data = tiny_params(image_folder)
    data["mlflow"]["tracking_uri"] = f"sqlite:///{workdir / 'mlflow.db'}"
    data["compare"]["seeds"] = [0, 1]
    data["compare"]["jobs"] = 2
    # the compatible-training methods since FastFill, at the tiny models' 16 dimensions
    data["compare"]["compatible"].update(stationary={"loss": "stationary", "lam": 0.1, "tau": 0.1},
                                         bt2={"loss": "bt2", "lam": 10.0, "extra_dims": 4})
    data["compare"]["orders"].update(stationary=["random"], bt2=["random"])
    # the lambda-orthogonality affine map (online backfilling, compare.online, is on by default)
    data["compare"]["align"]["lambda_orth"] = {"architecture": "affine", "disc": True, "epochs": 3, "warmup_epochs": 1,
                                               "batch_size": 32, "min_steps": 30}
    data["compare"]["orders"]["lambda_orth"] = ["random"]
    params = parse_params(data)
    with in_workdir(workdir), pytest.MonkeyPatch.context() as patch, restored_environ("FASTFILL_PROGRESS"), \
            _flow_messages() as messages:
        patch.setattr(compare, "POLL_SECONDS", POLL_SECONDS)
        os.environ["FASTFILL_PROGRESS"] = "log"  # lines, also where stderr is a terminal (pytest -s)
        summary = compare_flow(params)
    return params, summary, workdir, messages


def _client(params):
    from fastfill.components.platform.registry import setup

    client, experiment = setup(params.mlflow)
    return client, experiment


def test_the_table_has_every_method_and_order_with_every_number(comparison):
    params, summary, workdir, _ = comparison
    seeded = params.for_comparison(0)
    expected = {"old/old", "new/new"} | {f"{m} ({o})" for m, orders in seeded.evaluate.orders.items() for o in orders}
    adapters = {f"adapter_{kind} (random)" for kind in ("procrustes", "low_rank", "residual_mlp")}
    assert set(seeded.evaluate.adapters) == {"procrustes", "low_rank", "residual_mlp"}  # compare.adapters' default
    duals = {f"dual_rrf ({order})" for order in ("random", "sigma")}
    assert seeded.evaluate.dual == ["rrf"]  # the tiny configuration's compare.dual
    onlines = {f"online_{kind} ({order})" for kind in ("metric_compatible", "residual_mlp")
               for order in ("random", "sigma")}
    assert seeded.evaluate.online == ["metric_compatible", "residual_mlp"]  # the tiny configuration's compare.online
    reranks = {f"rerank_{name} ({order})" for name in ("k5", "k5_sync2") for order in ("random", "sigma", "query")}
    assert [spec.method for spec in seeded.evaluate.rerank] == ["rerank_k5", "rerank_k5_sync2"]  # compare.rerank
    expected |= adapters | duals | onlines | reranks
    assert set(summary["rows"]) == expected
    assert {"bct (random)", "ract (entropy)", "ract (margin)", "ract (least_confidence)", "unified (random)",
            "rbt (random)", "l2_disc (random)", "fastfill (oracle)"} <= expected
    for label, row in summary["rows"].items():
        keys = ("top1_auc", "top5_auc", "map_auc", "top1_0", "top1_100", "map_0", "map_100")
        keys += ("nfr1_mean", "top1_early", "map_early") if row["kind"] == "method" else ()
        if row["kind"] == "method":  # what it costs while the upgrade runs
            assert "search" in row["cost_per_query"] and "backfill" in row["cost_per_item"], label
        for key in keys:
            stat = row[key]
            assert set(stat["per_seed"]) == {"0", "1"}, (label, key)
            assert all(0 <= v <= 1 for v in stat["per_seed"].values()), (label, key)
            assert math.isfinite(stat["std"]) and stat["std"] >= 0
    for label in adapters:
        assert summary["rows"][label]["description"].startswith("query-side adapter"), label
    for label in onlines:  # whether the curve rises monotonically, the paper's claim, is in the row
        row = summary["rows"][label]
        assert row["description"].startswith("online backfilling") and 0 <= row["monotone"]["mean"] <= 1
        assert all(math.isfinite(v) and v >= 0 for v in row["top1_max_drop"]["per_seed"].values()), label
    for label in reranks:  # no map: the old index's candidates ranked by the new model, at 0% old/old
        row = summary["rows"][label]
        assert row["description"].startswith("candidate reranking") and "5 candidates" in row["cost_per_query"]
        if "sync" not in label:
            assert row["top1_0"]["per_seed"] == summary["rows"]["old/old"]["top1_0"]["per_seed"], label
    assert summary["rows"]["lambda_orth (random)"]["description"].startswith("map (affine")
    # Procrustes is a similarity transform: once every item is backfilled through it, the ranking
    # is the new model's own, so its curve ends at new/new
    procrustes, paragon = summary["rows"]["adapter_procrustes (random)"], summary["rows"]["new/new"]
    for seed in ("0", "1"):
        assert procrustes["top1_100"]["per_seed"][seed] == pytest.approx(paragon["top1_0"]["per_seed"][seed], abs=0.01)
    # seeds really differ: the models were retrained with each seed
    assert any(row["top1_auc"]["std"] > 0 for row in summary["rows"].values() if row["kind"] == "method")
    reports = workdir / "reports"
    on_disk = json.loads((reports / "comparison.json").read_text())
    assert on_disk["rows"].keys() == summary["rows"].keys()
    text = (reports / "comparison.md").read_text()
    assert all(label in text for label in expected)
    assert (reports / "comparison.png").stat().st_size > 10_000
    checked = [item for item in summary["expectations"] if item["checked"]]
    assert len(checked) == 10 and all(item["seeds"] == 2 for item in checked)


def test_each_seed_trains_every_method_under_its_own_folder(comparison):
    params, _, workdir, _ = comparison
    for seed in (0, 1):
        root = workdir / "runs" / "compare" / f"seed-{seed}" / "artifacts"
        for method in ("fct", "fastfill", "l2_disc", "rbt", "unified", "lambda_orth"):
            assert (root / "align" / method / "map.pt").is_file(), (seed, method)
        # each row is its method's own map: the comparison runs no map check, so nothing falls back
        assert not list((root / "align").glob("*/check.json"))
        assert (root / "align" / "unified" / "query.npy").is_file()
        assert (root / "compatible" / "stationary" / "old" / "model.pt").is_file()
        for method in ("bct", "ract", "stationary", "bt2"):
            history = json.loads((root / "compatible" / method / "history.json").read_text())
            assert all(epoch["compatibility"] > 0 for epoch in history)
            assert (root / "compatible" / method / "logits.npy").is_file()
    old0 = (workdir / "runs/compare/seed-0/artifacts/features/new/test.npy").read_bytes()
    old1 = (workdir / "runs/compare/seed-1/artifacts/features/new/test.npy").read_bytes()
    assert old0 != old1


def test_each_seed_ran_in_its_own_process_with_its_own_log(comparison):
    params, _, workdir, _ = comparison
    for seed in (0, 1):
        text = (workdir / "runs" / "compare" / f"seed-{seed}.log").read_text()
        assert "training the fastfill map" in text and "training the ract new model" in text, text[-2000:]
        assert f"seed-{seed}" in text  # its own outputs folder
    assert all(params.for_comparison(0).align[m].check == "off" for m in params.for_comparison(0).align)


def test_the_flow_shows_how_many_of_every_seeds_stages_are_done(comparison):
    """The seeds ran in processes of their own; the flow counted their stages from their outputs."""
    *_, messages = comparison
    lines = [m for m in messages if m.startswith("comparison of seeds 0, 1: ")]
    assert lines, messages[-20:]
    # two seeds of 13 stages: the old and new models, 6 maps, 4 compatible models, the evaluation
    assert re.fullmatch(r"comparison of seeds 0, 1: done, 26/26 stages \(100%\) in .+, .+", lines[-1]), lines


def test_a_failing_seed_is_named_with_its_log_once_the_others_are_done(tmp_path, image_folder, prefect_harness,
                                                                        monkeypatch):
    from fastfill.components.platform.config import parse_params
    from fastfill.flows import compare
    from fastfill.flows.compare import compare_flow

    monkeypatch.setattr(compare, "POLL_SECONDS", POLL_SECONDS)
    monkeypatch.setenv("FASTFILL_PROGRESS", "log")
    data = tiny_params(image_folder)
    data["mlflow"]["tracking_uri"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    data["compare"]["seeds"] = [0, 1]
    monkeypatch.setenv("FASTFILL_DEVICE", "no-such-device")  # the seeds' processes inherit it
    with in_workdir(tmp_path), _flow_messages() as messages, pytest.raises(RuntimeError) as raised:
        compare_flow(parse_params(data), jobs=2)
    stopped = "comparison of seeds 0, 1: stopped at 0/20 stages (0%) in "
    assert any(m.startswith(stopped) for m in messages), messages[-10:]
    message = str(raised.value)
    assert "seeds [0, 1] of the comparison failed" in message and "fastfill compare --seed 0" in message
    assert "seed-0.log" in message and "seed-1.log" in message and "no-such-device" in message
    assert (tmp_path / "runs" / "compare" / "seed-1.log").is_file()


def test_compatible_models_are_registered_versions_and_no_alias_moves(comparison):
    """Under the comparison's own names: production's registered models get no version."""
    params, _, _, _ = comparison
    client, _ = _client(params)
    for production in (params.mlflow.registered_model, params.mlflow.alignment_model):
        assert client.search_model_versions(f"name = '{production}'") == []
    versions = client.search_model_versions(f"name = '{params.compare.registered_model}'")
    by_method = {}
    for version in versions:
        by_method.setdefault(version.tags.get("method", version.tags.get("role")), []).append(version)
    # per seed: old, new, bct, ract, stationary, bt2
    assert {k: len(v) for k, v in by_method.items()} == {"old": 2, "new": 2, "bct": 2, "ract": 2, "stationary": 2,
                                                         "bt2": 2}
    assert all(v.tags["compatible_with"] in {str(o.version) for o in by_method["old"]}
               for v in by_method["bct"] + by_method["bt2"])
    # stationary representations' gallery is built by their own simplex-trained old model
    assert all(v.tags["compatible_with"] == "its own old model" for v in by_method["stationary"])
    assert client.get_registered_model(params.compare.registered_model).aliases == {}
    maps = client.search_model_versions(f"name = '{params.compare.alignment_model}'")
    assert sorted({v.tags["method"] for v in maps}) == ["fastfill", "fct", "l2_disc", "lambda_orth", "rbt", "unified"]


def test_the_table_and_plot_are_logged_to_mlflow(comparison):
    params, summary, _, _ = comparison
    client, experiment = _client(params)
    runs = client.search_runs([experiment], filter_string="attributes.run_name = 'comparison'")
    assert len(runs) == 1
    run = runs[0]
    assert run.data.tags["seeds"] == "0,1"
    assert run.data.metrics["fastfill.sigma.top1_auc"] == pytest.approx(summary["rows"]["fastfill (sigma)"]["top1_auc"]["mean"])
    assert run.data.metrics["old_old.map_auc"] == pytest.approx(summary["rows"]["old/old"]["map_auc"]["mean"])
    logged = {item.path for item in client.list_artifacts(run.info.run_id)}
    assert {"comparison.md", "comparison.json", "comparison.png"} <= logged
