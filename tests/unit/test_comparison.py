"""The comparison report: statistics over seeds, the papers' expectations checked per seed, the
table and the plot."""

import math
from pathlib import Path

import pytest

from fastfill.components.evaluation.comparison import (
    check_expectations,
    comparison_markdown,
    describe_dual,
    describe_method,
    plot_comparison,
    ranking,
    summarize,
)
from fastfill.components.platform.config import AlignConfig, CompatibleConfig

ALPHA = [0.0, 0.5, 1.0]
KEYS = ("top1", "top5", "map")


def _curve(top1, mapv):
    out = {"alpha": ALPHA, "top1": top1, "top5": [min(1.0, v + 0.1) for v in top1], "map": mapv,
           "nfr1": [0.0, 0.01, 0.02]}
    for key in KEYS:
        out[f"{key}_auc"] = sum(out[key]) / 3
    return out


def _summary(curve):
    s = {f"{k}_0": curve[k][0] for k in KEYS} | {f"{k}_100": curve[k][-1] for k in KEYS}
    s |= {f"{k}_auc": curve[f"{k}_auc"] for k in KEYS} | {f"{k}_trapz": curve[f"{k}_auc"] for k in KEYS}
    return s | {"nfr1_mean": 0.01}


def _seed(fastfill_sigma_top1: float):
    """One seed's metrics.json and curves.json: fastfill (sigma, random), fct, ract, bct."""
    curves = {
        "fastfill": {"sigma": _curve([0.6, fastfill_sigma_top1, 0.8], [0.4, 0.5, 0.6]),
                     "random": _curve([0.6, 0.65, 0.8], [0.4, 0.45, 0.6])},
        "fct": {"random": _curve([0.55, 0.66, 0.8], [0.35, 0.44, 0.6])},
        "ract": {"entropy": _curve([0.5, 0.6, 0.75], [0.3, 0.4, 0.55])},
        "bct": {"random": _curve([0.45, 0.55, 0.7], [0.25, 0.35, 0.5])},
    }
    reference = {"old_old": {"top1": 0.5, "top5": 0.7, "map": 0.3}, "new_new": {"top1": 0.8, "top5": 0.9, "map": 0.6}}
    metrics = {name: {f"{k}_{p}": point[k] for k in KEYS for p in ("0", "100", "auc")} for name, point in reference.items()}
    headline = {"fastfill": "sigma", "fct": "random", "ract": "entropy", "bct": "random"}
    for method, by_order in curves.items():
        metrics[method] = {"order": headline[method], **_summary(by_order[headline[method]]),
                           "by_order": {o: _summary(c) for o, c in by_order.items()}}
    metrics["fastfill"]["kendall_tau"] = 0.5
    return metrics, {"reference": reference, "curves": curves}, headline


@pytest.fixture
def summary():
    (m0, c0, headline), (m1, c1, _) = _seed(0.75), _seed(0.62)
    descriptions = {"fastfill": "map", "fct": "map", "ract": "new model", "bct": "new model"}
    return summarize({"0": m0, "1": m1}, {"0": c0, "1": c1}, descriptions, headline)


def test_every_row_has_mean_std_and_per_seed_values(summary):
    assert list(summary["rows"]) == ["old/old", "new/new", "fastfill (sigma)", "fastfill (random)", "fct (random)",
                                     "ract (entropy)", "bct (random)"]
    sigma = summary["rows"]["fastfill (sigma)"]["top1_auc"]
    values = [(0.6 + 0.75 + 0.8) / 3, (0.6 + 0.62 + 0.8) / 3]
    assert sigma["per_seed"] == pytest.approx({"0": values[0], "1": values[1]})
    assert sigma["mean"] == pytest.approx(sum(values) / 2)
    assert sigma["std"] == pytest.approx(abs(values[0] - values[1]) / math.sqrt(2))
    assert summary["rows"]["fastfill (sigma)"]["headline"] and not summary["rows"]["fastfill (random)"]["headline"]
    assert summary["rows"]["fastfill (sigma)"]["kendall_tau"]["mean"] == 0.5
    assert summary["mean_curves"]["fastfill (sigma)"]["top1"] == pytest.approx([0.6, (0.75 + 0.62) / 2, 0.8])


def test_expectations_are_checked_on_the_mean_and_on_each_seed(summary):
    found = {item["claim"]: item for item in summary["expectations"]}
    beats_fct = found["FastFill > FCT in top1_auc"]
    # seed 0: fastfill-sigma 0.7167 > fct 0.67; seed 1: 0.6733 > 0.67 as well
    assert beats_fct["holds_per_seed"] == {"0": True, "1": True} and beats_fct["holds_on_mean"]
    sigma = found["FastFill: sigma order > random order in top1_auc"]
    assert sigma["holds_per_seed"] == {"0": True, "1": False}  # 0.62 < 0.65 on seed 1
    assert sigma["seeds_holding"] == 1
    assert found["RACT > BCT in map_auc"]["holds_on_mean"]
    missing = found["l2+disc > l2 (both random) in top1_auc"]
    assert not missing["checked"] and "l2_disc" in missing["why"]


def test_a_claim_that_fails_is_reported_as_failing(summary):
    rows = summary["rows"]
    rows["bct (random)"]["top1_auc"]["per_seed"] = {"0": 0.99, "1": 0.99}
    rows["bct (random)"]["top1_auc"]["mean"] = 0.99
    item = next(i for i in check_expectations(summary, {"ract": "entropy", "bct": "random"})
                if i["claim"] == "RACT > BCT in top1_auc")
    assert not item["holds_on_mean"] and item["seeds_holding"] == 0
    assert "does NOT hold" in comparison_markdown({**summary, "expectations": [item]})


def test_the_table_ranking_and_plot(summary, tmp_path):
    text = comparison_markdown(summary)
    for label in summary["rows"]:
        assert f"| {label} |" in text or f"| **{label}** |" in text
    assert "| **fastfill (sigma)** |" in text and "| fastfill (random) |" in text
    assert "Seeds: 0, 1." in text and "top-1~ s1" in text
    assert [label for label, _ in ranking(summary, "top1_auc")] == ["fastfill (sigma)", "fct (random)",
                                                                    "ract (entropy)", "bct (random)"]
    plot_comparison(tmp_path / "c.png", summary)
    assert (tmp_path / "c.png").stat().st_size > 10_000


def test_seeds_with_different_methods_are_refused():
    (m0, c0, headline), (m1, c1, _) = _seed(0.7), _seed(0.7)
    del m1["bct"]
    with pytest.raises(ValueError, match="same configuration"):
        summarize({"0": m0, "1": m1}, {"0": c0, "1": c1}, {}, headline)


def test_methods_are_described_in_the_terms_of_the_methods_page():
    assert describe_method(AlignConfig(l2=True, disc=True, uncertainty=True)) == "map (MLP), l2+disc+uncertainty"
    assert describe_method(AlignConfig(architecture="rbt", rbt_blocks=2)) == "map (2 RBT blocks), l2"
    assert "unified space, 4 RBT" in describe_method(AlignConfig(architecture="unified", rbt_blocks=4))
    assert "BCT influence" in describe_method(CompatibleConfig(loss="bct"))
    assert "vanilla" in describe_method(CompatibleConfig(loss="ract", new_to_new=False))


def test_every_method_of_a_20_curve_plot_has_its_own_colour_and_the_papers_methods_stand_out():
    from fastfill.components.evaluation.comparison import curve_styles

    methods = ["fct", "fastfill", "bct", "ract", "disc", "l2_disc", "l2_uncertainty", "disc_uncertainty", "rbt",
               "unified", "ract_vanilla", "adapter_procrustes", "adapter_low_rank", "adapter_residual_mlp"]
    labels, headline = [], {}
    for method in methods:
        for i, order in enumerate(("sigma", "random", "oracle") if method == "fastfill" else ("random", "entropy")):
            label = f"{method} ({order})"
            labels.append(label)
            headline[label] = i == 0
    assert len(labels) >= 20
    styles = curve_styles(labels, headline)
    colours = {label.split(" (")[0]: styles[label]["color"] for label in labels if headline[label]}
    assert len(set(colours.values())) == len(methods)  # no two methods share a colour
    for label in labels:
        method = label.split(" (")[0]
        assert styles[label]["color"] == colours[method]  # a method's orders share its colour
        assert (styles[label]["linestyle"] == "-") == headline[label]
    widths = {label: style["linewidth"] for label, style in styles.items()}
    assert widths["fastfill (sigma)"] > widths["disc (random)"] > widths["fastfill (random)"]
    assert styles["fastfill (random)"]["linestyle"] != styles["fastfill (oracle)"]["linestyle"]


def test_the_shadow_index_rows_state_their_merge_and_their_cost():
    from fastfill.components.evaluation.comparison import DUAL_MERGES
    from fastfill.components.platform.vocabulary import MERGES

    assert set(DUAL_MERGES) == set(MERGES)
    for merge in MERGES:
        assert "two query embeddings and two searches per query" in describe_dual(merge)
    assert "reciprocal rank fusion" in describe_dual("rrf") and "z-scored" in describe_dual("score_zscore")
    (m0, c0, headline), (m1, c1, _) = _seed(0.7), _seed(0.7)
    for metrics, curves in ((m0, c0), (m1, c1)):
        curves["curves"]["dual_rrf"] = {"random": _curve([0.5, 0.7, 0.8], [0.3, 0.35, 0.6])}
        metrics["dual_rrf"] = {"order": "random", **_summary(curves["curves"]["dual_rrf"]["random"]),
                               "by_order": {"random": _summary(curves["curves"]["dual_rrf"]["random"])}}
    summary = summarize({"0": m0, "1": m1}, {"0": c0, "1": c1}, {"dual_rrf": describe_dual("rrf")},
                        {**headline, "dual_rrf": "random"})
    row = next(line for line in comparison_markdown(summary).splitlines() if line.startswith("| **dual_rrf (random)**"))
    assert "two searches per query" in row


def test_each_row_has_its_0_30_area_and_its_cost_in_the_table():
    from fastfill.components.evaluation.comparison import COSTS, early_area, method_cost

    # the mean of the points up to 30% backfilled, a point exactly at the bound included
    assert early_area([0.0, 0.1, 0.3, 0.4], [1.0, 0.0, 0.0, 9.0]) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="no curve point"):
        early_area([0.5, 1.0], [1.0, 1.0])
    (m0, c0, headline), (m1, c1, _) = _seed(0.75), _seed(0.62)
    costs = {"fastfill": method_cost(AlignConfig()), "fct": method_cost(AlignConfig()),
             "ract": method_cost(CompatibleConfig(loss="ract")), "bct": method_cost(CompatibleConfig(loss="bct"))}
    summary = summarize({"0": m0, "1": m1}, {"0": c0, "1": c1}, {}, headline, costs)
    row = summary["rows"]["fastfill (sigma)"]
    # the curve's points are at 0, 0.5, 1: only the first is in 0-30%
    assert row["top1_early"]["per_seed"] == {"0": 0.6, "1": 0.6} and row["map_early"]["mean"] == pytest.approx(0.4)
    assert row["cost_per_query"] == "1 embedding, 1 search" and "1 map pass" in row["cost_per_item"]
    assert "switch: nothing" in summary["rows"]["bct (random)"]["cost_per_item"]
    text = comparison_markdown(summary)
    assert "| top-1 0-30% | mAP 0-30% |" in text.splitlines()[4].replace("top-1~ | mAP~ | ", "")
    assert f"| fastfill (sigma) | {COSTS['map'][0]} | {COSTS['map'][1]} |" in text
    assert method_cost(CompatibleConfig(loss="stationary", lam=0.1)) == COSTS["stationary"]
    assert method_cost(AlignConfig(architecture="unified")) == COSTS["unified"]


def test_a_compatible_method_searched_by_its_own_distance_says_so():
    assert describe_method(CompatibleConfig(loss="bt2", distance="cosine")).endswith("; searched by cosine")
    assert "searched by" not in describe_method(CompatibleConfig(loss="bct"))


def test_the_comparison_at_a_size_has_its_own_splits_seeds_and_report(tmp_path):
    from fastfill.components.platform.config import load_params
    from fastfill.flows.compare import comparison_outputs

    params = load_params("params.yaml")
    sized = params.comparison_at_size(1000)
    assert sized.prepare.train_per_class == 1000
    assert sized.paths.data == Path(params.compare.out) / "n-1000" / "data"
    assert sized.for_comparison(2).paths.artifacts == Path(params.compare.out) / "n-1000" / "seed-2" / "artifacts"
    assert comparison_outputs(sized)["markdown"] == params.paths.reports / "comparison-1000.md"
    assert comparison_outputs(params)["json"] == params.paths.reports / "comparison.json"
