import json

from components.evaluation.reports import build_metrics, plot_curves, write_plot_data
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
    from components.evaluation.reports import flatten_numbers

    nested = {"fastfill": {"top1_auc": 0.9, "order": "sigma", "by_order": {"random": {"map_auc": 0.8}}}, "n": 3}
    assert flatten_numbers(nested) == {"fastfill.top1_auc": 0.9, "fastfill.by_order.random.map_auc": 0.8, "n": 3}
