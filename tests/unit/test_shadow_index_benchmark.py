"""benchmarks/shadow_index.py: the 0-30% area follows the product's *_auc rule (a plain mean over
the curve points), restricted to the points with alpha <= 0.3; the rows' numbers and the paired
difference come from the runs' curves as stored."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from fastfill.components.evaluation import curve_alphas

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("shadow_index", ROOT / "benchmarks" / "shadow_index.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_early_area_is_the_mean_of_the_points_up_to_30_percent():
    module = _script()
    alphas = curve_alphas(20)  # i / 21: the points i = 0..6 are <= 0.3, i = 7 (0.333) is not
    values = np.arange(22, dtype=float)
    assert module.early_area(alphas, values) == pytest.approx(3.0)  # mean of 0..6
    # a point exactly at the bound counts; the mean, not a trapezoid
    assert module.early_area([0.0, 0.1, 0.3, 0.4], [1.0, 0.0, 0.0, 9.0]) == pytest.approx(1 / 3)
    # over the whole curve it is the product's *_auc
    curve = {"alpha": list(alphas), "top1": list(values / 22), "map": list(values / 44)}
    numbers = module.curve_numbers(curve, upto=1.0)
    assert numbers["top1_early"] == pytest.approx(numbers["top1_auc"]) == pytest.approx(np.mean(values / 22))
    with pytest.raises(ValueError, match="no curve point"):
        module.early_area([0.5, 1.0], [1.0, 1.0])


def _curves(shift: float) -> dict:
    alphas = list(curve_alphas(20))
    curve = {"alpha": alphas, "top1": [0.5 + shift] * 22, "map": [0.4] * 22}
    rows = {"fct": {"random": curve}, "fastfill": {"random": curve, "sigma": curve},
            "dual_rrf": {"random": {**curve, "top1": [0.5 + 2 * shift] * 22}, "sigma": curve}}
    return {"reference": {"old_old": {"top1": 0.7}, "new_new": {"top1": 0.9}}, "curves": rows}


def test_summary_pairs_dual_random_with_fastfill_sigma_by_seed():
    module = _script()
    summary = module.summarize_size({"0": _curves(0.0), "1": _curves(0.1)})
    paired = summary["paired"]["top1_auc"]
    assert paired["per_seed"] == pytest.approx({"0": 0.0, "1": 0.1})
    assert paired["mean"] == pytest.approx(0.05) and paired["std"] == pytest.approx(np.std([0, 0.1], ddof=1))
    assert summary["rows"]["FastFill-sigma"]["map_early"]["mean"] == pytest.approx(0.4)
    assert "± " in module.markdown({"command": "fastfill sweep", "sizes": {"all": summary}})


def test_collect_checks_the_curves_against_metrics_json(tmp_path):
    module = _script()
    reports = tmp_path / "n-all" / "seed-0" / "reports"
    reports.mkdir(parents=True)
    curves = _curves(0.0)
    (reports / "curves.json").write_text(json.dumps(curves))
    metrics = {m: {"by_order": {o: {"top1_auc": float(np.mean(c["top1"])), "map_auc": float(np.mean(c["map"]))}
                                for o, c in by_order.items()}} for m, by_order in curves["curves"].items()}
    (reports / "metrics.json").write_text(json.dumps(metrics))
    found, _ = module.collect(tmp_path, ["all", "1000"], [0, 1])
    assert list(found) == ["all"] and list(found["all"]) == ["0"]
    metrics["fct"]["by_order"]["random"]["top1_auc"] += 0.01
    (reports / "metrics.json").write_text(json.dumps(metrics))
    with pytest.raises(ValueError, match="differs from metrics.json"):
        module.collect(tmp_path, ["all"], [0])
