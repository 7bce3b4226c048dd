import json

from fastfill.components.evaluation.reports import build_metrics, plot_curves, write_plot_data
from tests.synthetic import tiny_curves


def test_metrics_schema():
    reference, curves = tiny_curves()
    metrics = build_metrics(reference, curves, {"fct": "random", "fastfill": "sigma"}, {"fastfill": 0.5})
    keys = {f"{m}_{p}" for m in ("top1", "top5", "map") for p in ("0", "100", "auc")}
    for row in ("old_old", "new_new", "fct", "fastfill"):
        assert keys <= set(metrics[row])
    assert metrics["fastfill"]["kendall_tau"] == 0.5 and metrics["fastfill"]["order"] == "sigma"
    assert metrics["fastfill"]["top1_auc"] == curves["fastfill"]["sigma"]["top1_auc"]
    assert set(metrics["fastfill"]["by_order"]) == {"random", "sigma"}
    assert metrics["headroom"]["new_new_minus_fct_top1_0"] == reference["new_new"]["top1"] - curves["fct"]["random"]["top1"][0]
    json.dumps(metrics)  # plain JSON


def test_plot_data_and_png(tmp_path):
    reference, curves = tiny_curves()
    paths = write_plot_data(tmp_path / "plots", reference, curves)
    header = paths[0].read_text().splitlines()[0].split(",")
    assert header == ["alpha", "old_old", "new_new", "fct-random", "fastfill-random", "fastfill-sigma"]
    assert len(paths[0].read_text().splitlines()) == 1 + 5
    png = plot_curves(tmp_path / "b.png", reference, curves)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_flatten_numbers_keeps_numbers_under_dotted_keys():
    from fastfill.components.evaluation.reports import flatten_numbers

    nested = {"fastfill": {"top1_auc": 0.9, "order": "sigma", "by_order": {"random": {"map_auc": 0.8}}}, "n": 3}
    assert flatten_numbers(nested) == {"fastfill.top1_auc": 0.9, "fastfill.by_order.random.map_auc": 0.8, "n": 3}


def test_the_shadow_index_rows_take_their_headline_from_the_configuration(tmp_path):
    """dual_<merge> rows (two orders each) next to the maps: the headline is evaluate.dual_orders'
    first, and every report writer gives them their lines."""
    import numpy as np

    from fastfill.components.evaluation import dual_curves
    from fastfill.components.evaluation.reports import summary_rows, write_summary
    from fastfill.components.platform.config import EvaluateConfig

    reference, curves = tiny_curves()
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 3, 30)
    new, old = rng.normal(size=(30, 4)).astype(np.float32), rng.normal(size=(30, 5)).astype(np.float32)
    for order in ("sigma", "random"):
        for merge, curve in dual_curves(old, new, old, new, labels, rng.permutation(30), merges=["rrf", "score_minmax"],
                                        num_intermediate=3).items():
            curves.setdefault(f"dual_{merge}", {})[order] = curve.to_dict()
    config = EvaluateConfig(dual=["rrf", "score_minmax"], dual_orders=["sigma", "random"])
    metrics = build_metrics(reference, curves, config.headlines, {})
    assert metrics["dual_rrf"]["order"] == "sigma" and metrics["dual_score_minmax"]["order"] == "sigma"
    assert metrics["dual_rrf"]["top1_0"] == curves["dual_rrf"]["sigma"]["top1"][0]
    assert "new_new_minus_dual_rrf_top1_0" in metrics["headroom"]
    assert {"dual_rrf-sigma", "dual_rrf-random", "dual_score_minmax-random"} <= set(summary_rows(reference, curves))
    assert (write_summary(tmp_path, reference, curves)[-1]).name == "dual_score_minmax-random.json"
    header = write_plot_data(tmp_path / "plots", reference, curves)[0].read_text().splitlines()[0]
    assert header.endswith("dual_rrf-sigma,dual_rrf-random,dual_score_minmax-sigma,dual_score_minmax-random")
    assert plot_curves(tmp_path / "b.png", reference, curves, headline=config.headlines).stat().st_size > 0
