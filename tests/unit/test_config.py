from pathlib import Path

import pytest
import yaml

from components.config import ConfigError, load_params, parse_params

ROOT = Path(__file__).resolve().parents[2]


def _default() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


def test_the_committed_params_are_valid():
    params = load_params(ROOT / "params.yaml")
    assert set(params.align) == {"fct", "fastfill"}
    assert params.align["fastfill"].uncertainty and not params.align["fct"].uncertainty
    assert params.evaluate.curve_points == 20


def test_unknown_key_is_named():
    data = _default()
    data["align"]["fastfill"]["learning_rate"] = 0.1
    with pytest.raises(ConfigError, match=r"align\.fastfill\.learning_rate: unknown key"):
        parse_params(data)


def test_unknown_top_level_section_is_named():
    data = _default()
    data["trian"] = {}
    with pytest.raises(ConfigError, match=r"trian: unknown key"):
        parse_params(data)


@pytest.mark.parametrize("path, value, key", [
    (("train", "old", "epochs"), 0, "train.old.epochs"),
    (("train", "new", "backbone"), "vit", "train.new.backbone"),
    (("evaluate", "distance"), "manhattan", "evaluate.distance"),
    (("align", "fct", "lr"), "fast", "align.fct.lr"),
    (("prepare", "test_per_class"), -1, "prepare.test_per_class"),
])
def test_bad_value_is_named(path, value, key):
    data = _default()
    node = data
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    with pytest.raises(ConfigError) as error:
        parse_params(data)
    assert key in str(error.value)


def test_sigma_order_needs_an_uncertainty_head():
    data = _default()
    data["evaluate"]["orders"]["fct"] = ["random", "sigma"]
    with pytest.raises(ConfigError, match=r"fct.*uncertainty"):
        parse_params(data)


def test_evaluated_methods_must_exist():
    data = _default()
    data["evaluate"]["orders"]["bct"] = ["random"]
    with pytest.raises(ConfigError, match="bct"):
        parse_params(data)


def test_an_alignment_method_needs_a_loss():
    data = _default()
    data["align"]["fct"]["l2"] = False
    with pytest.raises(ConfigError, match="at least one of l2 or disc"):
        parse_params(data)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_params(tmp_path / "params.yaml")
    (tmp_path / "params.yaml").write_text("train: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_params(tmp_path / "params.yaml")


def test_with_seed_reseeds_every_stage_but_the_split():
    params = load_params(ROOT / "params.yaml").with_seed(7)
    assert params.train.old.seed == params.train.new.seed == 7
    assert all(cfg.seed == 7 for cfg in params.align.values())
    assert params.evaluate.seed == 7
    assert params.prepare.seed == 0
