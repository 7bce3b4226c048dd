import pytest

from fastfill.components.evaluation.seed_report import seeds_markdown, summarize_seeds


def _metrics(shift: float) -> dict:
    point = {k: 0.5 + shift for k in ("top1_0", "top1_100", "top1_auc", "top5_auc", "map_auc")}
    return {
        "new_new": dict(point),
        "fastfill": {**point, "nfr1_mean": 0.01, "kendall_tau": 0.6 + shift, "order": "sigma",
                     "by_order": {"sigma": dict(point), "random": {**point, "map_auc": 0.4}}},
        "headroom": {"new_new_minus_fastfill_top1_0": 0.03 + shift},
    }


def test_summary_has_mean_std_and_each_seed():
    summary = summarize_seeds({0: _metrics(0.0), 1: _metrics(0.02), 2: _metrics(0.04)})
    top1 = summary["fastfill"]["top1_auc"]
    assert top1["mean"] == pytest.approx(0.52)
    assert top1["std"] == pytest.approx(0.02)
    assert top1["per_seed"] == {"0": 0.5, "1": 0.52, "2": 0.54}
    assert summary["fastfill"]["by_order"]["random"]["map_auc"]["std"] == pytest.approx(0.0)
    assert summary["fastfill"]["kendall_tau"]["mean"] == pytest.approx(0.62)
    assert summary["headroom"]["new_new_minus_fastfill_top1_0"]["mean"] == pytest.approx(0.05)
    assert "nfr1_mean" not in summary["new_new"]


def test_markdown_lists_every_row_and_order():
    text = seeds_markdown({"seeds": [0, 1], "rows": summarize_seeds({0: _metrics(0.0), 1: _metrics(0.02)})})
    assert "| fastfill (random) |" in text and "| new_new |" in text
    assert "51.00 ± 1.41 (50.00, 52.00)" in text
    assert "Kendall tau" in text
