"""The data-size sweep's report: means over the seeds a size has, the claim, the check outcomes."""

import pytest

from fastfill.components.evaluation.sweep_report import plot_sweep, summarize_sweep, sweep_markdown


def _metrics(fct: float, sigma: float, random: float, outcome: str = "passed", order: str | None = None) -> dict:
    def curve(value):
        return {"top1_auc": value, "map_auc": value - 0.1, "top5_auc": value}

    return {"fct": {"top1_0": fct, "by_order": {"random": curve(fct)}},
            "fastfill": {"top1_0": sigma, "by_order": {"sigma": curve(sigma), "random": curve(random)},
                         "map_check": {"outcome": outcome, **({"fallback_order": order} if order else {})}}}


def test_claim_holds_only_where_sigma_is_not_below_fct(tmp_path):
    results = {"100": {"0": _metrics(0.50, 0.52, 0.51), "1": _metrics(0.50, 0.46, 0.45, "fallback")},
               "all": {"0": _metrics(0.80, 0.82, 0.81), "1": _metrics(0.80, 0.80, 0.80, "fallback", "random")}}
    summary = summarize_sweep(results, {"100": 1000, "all": 60000})
    small = summary["sizes"]["100"]
    assert small["rows"]["fastfill (sigma)"]["top1_auc"]["mean"] == pytest.approx(0.49)
    assert small["sigma_minus_fct"]["map_auc"] == pytest.approx(-0.01)
    assert not small["holds"] and summary["sizes"]["all"]["holds"] and not summary["holds_everywhere"]
    assert small["checks"] == {"0": "passed", "1": "fallback"}
    assert summary["sizes"]["all"]["checks"]["1"] == "fallback (random order)"
    text = sweep_markdown(summary)
    assert "| 100 | 1000 | 0,1 | fastfill (sigma) | 49.00 ± 4.24 |" in text
    assert "| all | -1.00 |" not in text and "**does not hold**" in text and "1: fallback" in text
    assert "1: fallback (random order)" in text
    plot_sweep(tmp_path / "sweep.png", summary)
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
