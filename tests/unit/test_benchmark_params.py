"""The benchmark scripts build their configuration from the repository's params.yaml: it must
validate (a benchmark that fails on its first line is found here, not after an hour)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fastfill.components.platform.config import load_params

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_open_class_params_validate_from_the_repository_params(tmp_path):
    module = _script("open_class")
    params = module.open_class_params(load_params(ROOT / "params.yaml"), [6, 7, 8, 9], 300, 1, tmp_path)
    assert params.prepare.unseen_classes == [6, 7, 8, 9]
    assert params.prepare.train_per_class == 300
    assert "ract" in params.compatible and "ract" not in params.compare.compatible
    assert params.evaluate.orders["ract"][0] == "entropy"
    assert str(tmp_path) in str(params.paths.data)


def test_open_class_reads_a_count_or_all():
    import argparse

    import pytest

    module = _script("open_class")
    assert module._per_class("all") is None and module._per_class("300") == 300
    for bad in ("0", "many"):
        with pytest.raises(argparse.ArgumentTypeError, match="a positive count or all"):
            module._per_class(bad)
