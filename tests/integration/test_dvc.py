"""`dvc repro` in a temporary copy of the repository, with the real dvc CLI."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow  # `dvc repro` of the tiny pipeline: minutes on 2 cores


def _run(args, cwd, env, timeout=900):
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(args)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result.stdout + result.stderr


def _dvc(*args):
    return [str(Path(sys.executable).with_name("dvc")), *args]


def test_dvc_repro_reproduces_and_reruns_only_what_changed(repo_copy, cli_env):
    out = _run(_dvc("repro"), repo_copy, cli_env)
    for stage in ("prepare", "train@old", "train@new", "align@fct", "align@fastfill", "evaluate", "compare@0",
                  "comparison"):
        assert f"'{stage}'" in out, stage
    metrics = json.loads((repo_copy / "reports" / "metrics.json").read_text())
    assert {"old_old", "new_new", "fct", "fastfill"} <= set(metrics)
    comparison = json.loads((repo_copy / "reports" / "comparison.json").read_text())
    assert {"bct (random)", "ract (entropy)", "unified (random)", "fastfill (sigma)"} <= set(comparison["rows"])
    assert comparison["seeds"] == ["0"]
    assert "up to date" in _run(_dvc("status"), repo_copy, cli_env)

    # an alignment param changes: only that method's alignment, the evaluation and the
    # comparison (which trains every align method) re-run
    params = yaml.safe_load((repo_copy / "params.yaml").read_text())
    params["align"]["fastfill"]["epochs"] = 6  # 216 training pairs: 7 steps an epoch, 42 >= min_steps 30
    (repo_copy / "params.yaml").write_text(yaml.safe_dump(params))
    out = _run(_dvc("repro"), repo_copy, cli_env)
    ran = {line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage")}
    assert ran == {"align@fastfill", "evaluate", "compare@0", "comparison"}, out
    history = json.loads((repo_copy / "artifacts" / "align" / "fastfill" / "history.json").read_text())
    assert len(history) == 6


def test_fastfill_run_leaves_dvc_up_to_date(repo_copy, cli_env):
    """`fastfill run` records the pipeline's stages (not the comparison's) in dvc.lock."""
    _run([str(Path(sys.executable).with_name("fastfill")), "run"], repo_copy, cli_env)
    assert "up to date" in _run(_dvc("status", "--with-deps", "evaluate"), repo_copy, cli_env)
    out = _run(_dvc("repro", "evaluate"), repo_copy, cli_env)
    assert "Running stage" not in out, out
