"""benchmarks/later_methods.py: the neighbour lists and their overlap, against literal answers."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("later_methods", ROOT / "benchmarks" / "later_methods.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_nearest_excludes_the_item_itself_and_matches_a_brute_force_sort():
    module = _script()
    points = np.array([[0.0], [1.0], [3.0], [7.0]], dtype=np.float32)
    assert module.nearest(points, 2).tolist() == [[1, 2], [0, 2], [1, 0], [2, 1]]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 5)).astype(np.float32)
    d = ((x[:, None, :].astype(np.float64) - x[None, :, :]) ** 2).sum(-1)
    np.fill_diagonal(d, np.inf)
    expected = np.argsort(d, axis=1, kind="stable")[:, :4]
    assert np.array_equal(module.nearest(x, 4, block=64), expected)  # blocks change nothing
    with pytest.raises(ValueError, match="k must be"):
        module.nearest(points, 4)


def test_a_rotation_keeps_every_neighbourhood_and_a_shuffle_keeps_about_k_over_n():
    module = _script()
    rng = np.random.default_rng(1)
    x = rng.normal(size=(500, 8)).astype(np.float32)
    q, _ = np.linalg.qr(rng.normal(size=(8, 8)))
    base = module.nearest(x, 10)
    assert module.neighbours_shared(base, module.nearest((x @ q).astype(np.float32), 10)) == 1.0
    shuffled = module.nearest(x[rng.permutation(500)], 10)
    assert module.neighbours_shared(base, shuffled) < 0.1
    assert module.neighbours_shared(np.array([[1, 2]]), np.array([[2, 3]])) == 0.5


def _row(method, **means):
    return {"method": method, "headline": True, **{k: {"mean": v, "std": 0.0} for k, v in means.items()}}


def test_the_figures_where_a_later_method_is_above_fastfill_are_named():
    module = _script()
    report = {"rows": {
        "fastfill (sigma)": _row("fastfill", top1_auc=0.80, map_auc=0.70, nfr1_mean=0.05),
        "online_metric_compatible (random)": _row("online_metric_compatible", top1_auc=0.81, map_auc=0.60,
                                                  nfr1_mean=0.04),
        "bt2 (random)": _row("bt2", top1_auc=0.70, map_auc=0.50, nfr1_mean=0.09),
        "fct (random)": _row("fct", top1_auc=0.90, map_auc=0.90)}}
    above = module.above_fastfill(report)
    assert set(above) == {"online_metric_compatible (random)", "bt2 (random)"}  # FCT is not a later method
    assert above["online_metric_compatible (random)"] == ["top1_auc 81.00 vs 80.00", "nfr1_mean 4.00 vs 5.00"]
    assert above["bt2 (random)"] == []
    table = module.rows_table(report)
    assert table[2].startswith("| fastfill (sigma) | 80.00 ± 0.00 | 70.00 ± 0.00 |")
    assert [line.split(" |")[0] for line in table[2:]] == ["| fastfill (sigma)", "| fct (random)", "| bt2 (random)",
                                                           "| online_metric_compatible (random)"]


def test_a_tuning_grid_is_every_combination_of_its_axes():
    spec = importlib.util.spec_from_file_location("tune_compatible", ROOT / "scripts" / "tune_compatible.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.grid_points(["lam=0.1,1", "tau=0.2"]) == [{"lam": 0.1, "tau": 0.2}, {"lam": 1.0, "tau": 0.2}]
    assert module.grid_points([]) == [{}]
    with pytest.raises(ValueError, match="KEY=v1,v2"):
        module.grid_points(["lam"])
