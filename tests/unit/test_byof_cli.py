"""`fastfill evaluate --features DIR`: the bring-your-own-features evaluation through the CLI."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from components.evaluation import backfill_curve
from cli import app

runner = CliRunner()


def _write(folder, n=40, d=6, seed=0, order=True):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 4, n)
    new = rng.normal(size=(n, d)).astype(np.float32) + labels[:, None]
    old = new + rng.normal(scale=1.5, size=(n, d)).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "query.npy", new)
    np.save(folder / "gallery_new.npy", new)
    np.save(folder / "gallery_old.npy", old)
    np.save(folder / "labels.npy", labels)
    if order:
        np.save(folder / "order.npy", rng.permutation(n))
    return new, old, labels


def test_evaluate_writes_the_curve_json(tmp_path):
    new, old, labels = _write(tmp_path / "f")
    result = runner.invoke(app, ["evaluate", "--features", str(tmp_path / "f"), "--out", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "r.json").read_text())
    for key in ("alpha", "top1", "top5", "map", "nfr1"):
        assert len(data[key]) == 22
    for key in ("top1_auc", "top5_auc", "map_auc"):
        assert 0.0 <= data[key] <= 1.0
    expected = backfill_curve(new, new, old, labels, np.load(tmp_path / "f" / "order.npy"))
    assert data["top1"] == pytest.approx(expected.top1.tolist())
    assert data["map_auc"] == pytest.approx(float(np.mean(expected.map)))


def test_evaluate_defaults_to_the_identity_order_and_cosine(tmp_path):
    new, old, labels = _write(tmp_path / "f", order=False)
    result = runner.invoke(app, ["evaluate", "--features", str(tmp_path / "f"), "--distance", "cosine"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    expected = backfill_curve(new, new, old, labels, np.arange(len(labels)), distance="cosine")
    assert data["map"] == pytest.approx(expected.map.tolist())


def test_missing_file_is_named(tmp_path):
    _write(tmp_path / "f")
    (tmp_path / "f" / "labels.npy").unlink()
    result = runner.invoke(app, ["evaluate", "--features", str(tmp_path / "f")])
    assert result.exit_code == 2
    assert "labels.npy" in result.output


def test_bad_order_is_reported(tmp_path):
    _write(tmp_path / "f")
    np.save(tmp_path / "f" / "order.npy", np.zeros(40, dtype=np.int64))
    result = runner.invoke(app, ["evaluate", "--features", str(tmp_path / "f")])
    assert result.exit_code == 2
    assert "order" in result.output


def test_mismatched_dimensions_are_reported(tmp_path):
    _write(tmp_path / "f")
    np.save(tmp_path / "f" / "gallery_old.npy", np.zeros((40, 3), dtype=np.float32))
    result = runner.invoke(app, ["evaluate", "--features", str(tmp_path / "f")])
    assert result.exit_code == 2
    assert "gallery_old" in result.output


def test_a_bad_params_file_stops_the_cli_with_the_key(tmp_path):
    (tmp_path / "params.yaml").write_text("train:\n  old: {epochs: 0}\n  new: {}\nalign: {fct: {}}\n")
    result = runner.invoke(app, ["run", "--params", str(tmp_path / "params.yaml")])
    assert result.exit_code == 2
    assert "train.old.epochs" in result.output


def test_an_unknown_method_is_refused(tmp_path):
    import shutil
    from pathlib import Path

    shutil.copy(Path(__file__).resolve().parents[2] / "params.yaml", tmp_path / "params.yaml")
    result = runner.invoke(app, ["stage", "align", "--method", "bct", "--params", str(tmp_path / "params.yaml")])
    assert result.exit_code == 2
    assert "bct" in result.output and "fastfill" in result.output
