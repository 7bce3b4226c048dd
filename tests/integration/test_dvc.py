"""`dvc repro` in a temporary copy of the repository, with the real dvc CLI: the pipeline in the
repository's dvc.yaml, the comparison in its own DVC project (comparison/).

One copy serves both tests: `fastfill run` on the fresh clone; then DVC's side back to a fresh
clone's (no dvc.lock, no outputs, no DVC cache) and `dvc repro`: the same pipeline again, stage by
stage, which must give the same bytes."""

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fastfill.components.evaluation.reports import ROW_KEYS
from testkit.tiny_demo import tiny_params
from tests.integration.helpers import cli_environment, copy_repository

pytestmark = pytest.mark.slow  # `dvc repro` of the tiny pipeline: minutes on 2 cores

PIPELINE = {"prepare", "train@old", "train@new", "align@fct", "align@fastfill", "evaluate"}
LINES = {"old_old", "new_new", "fct-random", "fastfill-random", "fastfill-sigma", "fastfill-oracle"}
UP_TO_DATE = "Data and pipelines are up to date."


def _run(args, cwd, env, timeout=900):
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(args)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result.stdout + result.stderr


def _dvc(*args):
    return [str(Path(sys.executable).with_name("dvc")), *args]


def _ran(out: str) -> set[str]:
    return {line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage")}


def _versions(repo: Path) -> dict[str, int]:
    """Versions per registered model in the copy's MLflow store (sqlite:///mlruns.db)."""
    with sqlite3.connect(repo / "mlruns.db") as db:
        return dict(db.execute("SELECT name, COUNT(*) FROM model_versions GROUP BY name").fetchall())


def _outputs(lock: dict) -> dict[str, str]:
    return {out["path"]: out["md5"] for stage in lock["stages"].values() for out in stage.get("outs", [])}


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory, prefect_harness) -> dict:
    """Here (for the module, in place of conftest's), the commands' flows run on the test
    session's Prefect server: each command would otherwise start a temporary server of its own,
    seconds each, and DVC runs a command per stage (the CLI's tests cover the temporary server)."""
    from prefect.settings import get_current_settings

    return {**cli_environment(tmp_path_factory.mktemp("prefect-home")), "PREFECT_API_URL": get_current_settings().api.url}


@pytest.fixture(scope="module")
def fastfill_run(tmp_path_factory, image_folder, cli_env) -> tuple[Path, dict]:
    """A fresh clone after `fastfill run`, and what DVC said about it right then: (repo, facts)."""
    repo = copy_repository(tmp_path_factory.mktemp("dvc") / "repo", tiny_params(image_folder))
    facts = {"run": _run([str(Path(sys.executable).with_name("fastfill")), "run"], repo, cli_env)}
    facts["status"] = _run(_dvc("status"), repo, cli_env)
    facts["repro"] = _run(_dvc("repro"), repo, cli_env)
    facts["lock"] = yaml.safe_load((repo / "dvc.lock").read_text())
    facts["comparison_locked"] = (repo / "comparison" / "dvc.lock").exists()
    facts["comparison_status"] = _run(_dvc("--cd", "comparison", "status"), repo, cli_env)
    facts["versions"] = _versions(repo)
    return repo, facts


def test_dvc_repro_reproduces_the_pipeline_and_the_comparison_only_when_asked(fastfill_run, cli_env):
    repo_copy, first = fastfill_run
    # a fresh clone again (no dvc.lock, no outputs, no DVC cache), but for the MLflow store: this
    # run registers new versions
    subprocess.run(["git", "clean", "-fdxq", "-e", "mlruns.db", "-e", "mlartifacts"], cwd=repo_copy, check=True)
    assert not (repo_copy / "dvc.lock").exists() and not (repo_copy / ".dvc" / "cache").exists()
    assert not (repo_copy / "artifacts").exists() and (repo_copy / "mlruns.db").is_file()
    out = _run(_dvc("repro"), repo_copy, cli_env)
    assert _ran(out) == PIPELINE, out  # a bare `dvc repro` never starts the comparison
    assert not (repo_copy / "runs").exists()
    metrics = json.loads((repo_copy / "reports" / "metrics.json").read_text())
    assert {"old_old", "new_new", "fct", "fastfill"} <= set(metrics)
    assert _run(_dvc("status"), repo_copy, cli_env).strip() == UP_TO_DATE
    with sqlite3.connect(repo_copy / "mlruns.db") as db:  # stages run one by one close their parent run too
        parents = {status for (status,) in db.execute("SELECT status FROM runs WHERE name = 'pipeline'")}
    assert parents == {"FINISHED"}, parents

    # `dvc metrics show`: one row per line of the plot, one column per number
    table = _run(_dvc("metrics", "show"), repo_copy, cli_env).strip().splitlines()
    assert table[0].split() == ["Path", *sorted(ROW_KEYS)], table[0]
    assert {row.split()[0] for row in table[1:]} == {f"reports/summary/{line}.json" for line in LINES}
    fastfill = next(row.split() for row in table if row.startswith("reports/summary/fastfill-sigma.json"))
    assert float(fastfill[1 + sorted(ROW_KEYS).index("top1_auc")]) == pytest.approx(
        metrics["fastfill"]["by_order"]["sigma"]["top1_auc"], abs=1e-5)

    # `dvc plots show`: each chart with its title and axis labels, one colour per line
    shown = json.loads(_run(_dvc("plots", "show", "--json", "--split"), repo_copy, cli_env))["data"]
    for name in ("top1_along_backfill", "map_along_backfill", "top5_along_backfill"):
        content, anchors = shown[name][0]["content"], shown[name][0]["anchor_definitions"]
        assert content["encoding"]["color"]["field"] == "field", content["encoding"]  # not the revision
        assert anchors["<DVC_METRIC_TITLE>"].endswith("against the fraction of the gallery backfilled")
        assert anchors["<DVC_METRIC_X_LABEL>"].startswith("fraction of the gallery backfilled")
        assert anchors["<DVC_METRIC_Y_LABEL>"].split()[0] in ("top-1", "top-5", "mAP")
        assert {point["field"] for point in anchors["<DVC_METRIC_DATA>"]} == LINES, name
    _run(_dvc("plots", "show"), repo_copy, cli_env)
    page = (repo_copy / "dvc_plots" / "index.html").read_text()
    # offline: the plotting scripts are in the page (.dvc/plots/offline.html), nothing from a CDN
    assert "<script src=" not in page and "cdn.jsdelivr" not in page, page[:2000]
    assert "vegaEmbed(" in page and page.count("<script>") >= 3
    ignored = subprocess.run(["git", "check-ignore", "-q", "dvc_plots/index.html"], cwd=repo_copy)
    assert ignored.returncode == 0  # .gitignore keeps the rendered plots out of git

    # the same commit and configuration as `fastfill run`'s: every tracked output byte for byte
    # (dvc.lock holds each output's content hash, a folder's from its files'); the registry's
    # answers (new versions, run ids) are recorded beside the outputs, not in them
    again = _outputs(yaml.safe_load((repo_copy / "dvc.lock").read_text()))
    first_outputs = _outputs(first["lock"])
    assert again == first_outputs, {path: (first_outputs.get(path), md5) for path, md5 in again.items()
                                    if first_outputs.get(path) != md5}
    before = _versions(repo_copy)
    assert before == {"embedder": 4, "embedder-alignment": 4}, before  # registered twice, identical weights
    assert (repo_copy / "artifacts" / "registry" / "models-new.json").is_file()

    # the comparison: its own DVC project, reproduced only when asked, registered under its own names
    out = _run(_dvc("--cd", "comparison", "repro"), repo_copy, cli_env, timeout=1500)
    assert _ran(out) == {"compare@0", "comparison"}, out
    comparison = json.loads((repo_copy / "reports" / "comparison.json").read_text())
    assert {"bct (random)", "ract (entropy)", "unified (random)", "fastfill (sigma)"} <= set(comparison["rows"])
    assert comparison["seeds"] == ["0"]
    assert _run(_dvc("--cd", "comparison", "status"), repo_copy, cli_env).strip() == UP_TO_DATE
    assert _run(_dvc("status"), repo_copy, cli_env).strip() == UP_TO_DATE
    after = _versions(repo_copy)
    assert after["embedder"] == 4 and after["embedder-alignment"] == 4, after  # production untouched
    assert after["embedder-comparison"] == 4  # old, new, bct, ract
    assert after["embedder-comparison-alignment"] == 5  # fct, fastfill, l2_disc, rbt, unified
    with sqlite3.connect(repo_copy / "mlruns.db") as db:
        assert db.execute("SELECT COUNT(*) FROM registered_model_aliases WHERE name LIKE 'embedder-comparison%'"
                          ).fetchone() == (0,)

    # an alignment param changes: in the pipeline only that method's alignment and the evaluation
    # re-run; the comparison (which trains every align method) sees it too, but only when asked
    params = yaml.safe_load((repo_copy / "params.yaml").read_text())
    params["align"]["fastfill"]["epochs"] = 6  # 216 training pairs: 7 steps an epoch, 42 >= min_steps 30
    (repo_copy / "params.yaml").write_text(yaml.safe_dump(params))
    out = _run(_dvc("repro"), repo_copy, cli_env)
    assert _ran(out) == {"align@fastfill", "evaluate"}, out
    history = json.loads((repo_copy / "artifacts" / "align" / "fastfill" / "history.json").read_text())
    assert len(history) == 6
    status = _run(_dvc("--cd", "comparison", "status"), repo_copy, cli_env)
    assert "compare@0" in status and "align" in status, status


def test_fastfill_run_leaves_dvc_up_to_date(fastfill_run):
    """`fastfill run` on a fresh clone records the pipeline's stages in dvc.lock: `dvc status` is
    clean and `dvc repro` has nothing to do; dvc.lock holds the pipeline's stages and nothing else."""
    _, facts = fastfill_run
    assert "dvc.lock updated" in facts["run"], facts["run"]
    assert facts["status"].strip() == UP_TO_DATE
    assert "Running stage" not in facts["repro"], facts["repro"]
    assert set(facts["lock"]["stages"]) == PIPELINE
    assert facts["versions"] == {"embedder": 2, "embedder-alignment": 2}, facts["versions"]
    assert not facts["comparison_locked"]
    # the comparison's project knows its stages have not run, without disturbing the pipeline's
    status = facts["comparison_status"]
    assert "compare@0" in status and "comparison" in status, status
