"""benchmarks/candidate_rerank.py: the rows over seeds with the difference to FastFill-sigma paired
seed by seed, the depth advice per group, and the section it writes into the comparison reports
(replaced, never appended twice)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from fastfill.components.evaluation.rerank import RerankVariant

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("candidate_rerank", ROOT / "benchmarks" / "candidate_rerank.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(module, shift: float) -> dict:
    numbers = dict.fromkeys(module.KEYS, 0.5)
    curve = {"alpha": [0.0, 0.5, 1.0], "top1": [0.5, 0.6, 0.7], "map": [0.4, 0.4, 0.4]}
    rerank = {**numbers, "top1_auc": 0.5 + shift, "map_auc": 0.2}
    gap = {"queries": 10, "native": {"top1": 0.8, "map": 0.7},
           "by_depth": {50: {"restricted": {}, "gap": {"top1": 0.005, "map": 0.3}, "recall": 0.1, "precision": 0.9},
                        200: {"restricted": {}, "gap": {"top1": 0.0, "map": 0.2}, "recall": 0.3, "precision": 0.8}}}
    return {"rows": {"fastfill (sigma)": numbers, "fct (random)": numbers, "rerank_k50 (random)": rerank,
                     "old/old": {"top1_0": 0.6, "map_0": 0.4}, "new/new": {"top1_0": 0.8, "map_0": 0.7}},
            "curves": {"fastfill (sigma)": curve, "rerank_k50 (random)": curve},
            "sync_spent": {"rerank_k50 (random)": 0.0}, "gap": {"all": gap, "unseen": gap},
            "seconds": {}}


def test_rows_are_paired_with_fastfill_seed_by_seed_and_advised():
    module = _script()
    entry = module.summarize_size({"0": _run(module, 0.01), "1": _run(module, 0.03)}, [RerankVariant(50)])
    paired = entry["rows"]["rerank_k50 (random)"]["paired_minus_fastfill_sigma"]["top1_auc"]
    assert paired["per_seed"] == {"0": pytest.approx(0.01), "1": pytest.approx(0.03)}
    assert paired["mean"] == pytest.approx(0.02)
    assert entry["gap"]["unseen"]["advice"]["top1"]["label"] == "SAFE"
    assert entry["gap"]["all"]["advice"]["map"]["label"] == "UNSAFE"
    assert module.wins(entry) == ["rerank_k50 (random) top-1~ +2.00 ± 1.41"]


def test_the_comparison_reports_get_one_section(tmp_path):
    module = _script()
    entry = module.summarize_size({"0": _run(module, 0.01)}, [RerankVariant(50)])
    summary = {"command": "fastfill sweep ...", "sizes": {"all": entry, "1000": entry}}
    (tmp_path / "comparison.md").write_text("# Comparison\n\nrows\n")
    (tmp_path / "comparison.json").write_text(json.dumps({"rows": {}}))
    written = module.attach_to_comparison(summary, tmp_path)
    assert written == [tmp_path / "comparison.md", tmp_path / "comparison.json"]  # no comparison-1000.* here
    first = (tmp_path / "comparison.md").read_text()
    module.attach_to_comparison(summary, tmp_path)
    again = (tmp_path / "comparison.md").read_text()
    assert again == first and again.count(module.MARK_START) == 1 and again.startswith("# Comparison\n\nrows\n")
    assert "| rerank_k50 (random) | 51.00 |" in again
    data = json.loads((tmp_path / "comparison.json").read_text())
    assert set(data["candidate_reranking"]["rows"]) >= {"rerank_k50 (random)", "fastfill (sigma)"}
