import json

import numpy as np

from components.evaluation import backfill_curve, retrieval_metrics
from components.evaluation.reports import build_metrics, plot_curves, write_plot_data


def _inputs():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, 30)
    new = rng.normal(size=(30, 4)).astype(np.float32) + labels[:, None]
    old = new + rng.normal(size=(30, 4)).astype(np.float32)
    reference = {"old_old": retrieval_metrics(old, old, labels), "new_new": retrieval_metrics(new, new, labels)}
    curves = {"fct": {"random": backfill_curve(new, new, old, labels, rng.permutation(30), num_intermediate=3).to_dict()},
              "fastfill": {o: backfill_curve(new, new, old, labels, rng.permutation(30), num_intermediate=3).to_dict()
                           for o in ("random", "sigma")}}
    return reference, curves


def test_metrics_schema():
    reference, curves = _inputs()
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
    reference, curves = _inputs()
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
