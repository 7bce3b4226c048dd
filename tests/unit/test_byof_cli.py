"""`fastfill evaluate --features DIR`: the bring-your-own-features evaluation through the CLI."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from fastfill.cli import app
from fastfill.components.evaluation import backfill_curve, dual_curves

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


def _old_query(folder, n=40, d=5, seed=1):
    rng = np.random.default_rng(seed)
    raw_old = rng.normal(size=(n, d)).astype(np.float32) + np.load(folder / "labels.npy")[:, None]
    old_query = raw_old + rng.normal(scale=0.3, size=(n, d)).astype(np.float32)
    np.save(folder / "old_query.npy", old_query)
    return old_query, raw_old


def test_old_queries_add_the_shadow_index_curves_on_the_old_models_own_gallery(tmp_path):
    new, mapped, labels = _write(tmp_path / "f")
    old_query, raw_old = _old_query(tmp_path / "f")
    np.save(tmp_path / "f" / "gallery_old_raw.npy", raw_old)  # a map's folder: gallery_old.npy is transformed
    result = runner.invoke(app, ["evaluate", "--features", str(tmp_path / "f"), "--old-query",
                                 str(tmp_path / "f" / "old_query.npy"), "--out", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    assert "dual rrf: top1_auc" in result.output and "dual score_zscore" in result.output
    data = json.loads((tmp_path / "r.json").read_text())
    order = np.load(tmp_path / "f" / "order.npy")
    assert data["top1"] == pytest.approx(backfill_curve(new, new, mapped, labels, order).top1.tolist())
    expected = dual_curves(old_query, new, raw_old, new, labels, order)
    assert set(data["dual"]) == {"rrf", "score_minmax", "score_zscore"}
    for merge, curve in expected.items():
        assert data["dual"][merge]["map"] == pytest.approx(curve.map.tolist())
        assert data["dual"][merge]["top1"][0] == pytest.approx(curve.top1[0])
    plain = json.loads(runner.invoke(app, ["evaluate", "--features", str(tmp_path / "f")]).output)
    assert "dual" not in plain  # without --old-query, the map's curve alone, as before


def test_without_a_raw_file_the_old_gallery_is_taken_as_the_old_models_own(tmp_path):
    new, _, labels = _write(tmp_path / "f", order=False)
    old_query, raw_old = _old_query(tmp_path / "f", d=6)
    np.save(tmp_path / "f" / "gallery_old.npy", raw_old)  # a method without a map: one old gallery
    result = runner.invoke(app, ["evaluate", "--features", str(tmp_path / "f"), "--old-query",
                                 str(tmp_path / "f" / "old_query.npy"), "--distance", "cosine"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    expected = dual_curves(old_query, new, raw_old, new, labels, None, distance="cosine", merges=["rrf"])["rrf"]
    assert data["dual"]["rrf"]["top5"] == pytest.approx(expected.top5.tolist())


def test_old_queries_that_do_not_fit_are_named_with_what_to_do(tmp_path):
    _write(tmp_path / "f")
    folder = tmp_path / "f"
    old_query, raw_old = _old_query(folder, d=5)  # gallery_old.npy has 6 dims: a map's, not the old model's
    result = runner.invoke(app, ["evaluate", "--features", str(folder), "--old-query", str(folder / "old_query.npy")])
    assert result.exit_code == 2
    assert "old_query.npy" in result.output and "gallery_old.npy" in result.output
    assert "gallery_old_raw.npy" in result.output
    np.save(folder / "old_query.npy", old_query[:-1])
    np.save(folder / "gallery_old_raw.npy", raw_old)
    result = runner.invoke(app, ["evaluate", "--features", str(folder), "--old-query", str(folder / "old_query.npy")])
    assert result.exit_code == 2 and "39 rows" in result.output and "labels.npy" in result.output
    missing = runner.invoke(app, ["evaluate", "--features", str(folder), "--old-query", str(tmp_path / "none.npy")])
    assert missing.exit_code == 2 and "--old-query" in missing.output and "none.npy" in missing.output
    np.save(folder / "old_query.npy", np.zeros(40, dtype=np.int64))
    flat = runner.invoke(app, ["evaluate", "--features", str(folder), "--old-query", str(folder / "old_query.npy")])
    assert flat.exit_code == 2 and "2-D float array" in flat.output


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
