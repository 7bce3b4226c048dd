from pathlib import Path

import pytest
import yaml

from fastfill.components.platform.config import ConfigError, load_params, parse_params

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


def test_the_comparison_covers_every_method_of_the_papers():
    params = load_params(ROOT / "params.yaml")
    seeded = params.for_comparison(2)
    assert set(seeded.align) == {"fct", "fastfill", "disc", "l2_disc", "l2_uncertainty", "disc_uncertainty",
                                 "rbt", "unified", "lambda_orth"}
    assert seeded.align["lambda_orth"].architecture == "affine"
    assert seeded.evaluate.online == ["metric_compatible", "residual_mlp"]
    assert {name: c.loss for name, c in seeded.compatible.items()} == {"bct": "bct", "ract": "ract",
                                                                      "ract_vanilla": "ract",
                                                                      "stationary": "stationary", "bt2": "bt2"}
    assert not seeded.compatible["ract_vanilla"].new_to_new
    assert seeded.align["unified"].architecture == "unified" and seeded.align["rbt"].architecture == "rbt"
    # the headline order of each method is the first it lists, and every method is evaluated
    assert seeded.evaluate.headline_order["fastfill"] == "sigma"
    assert seeded.evaluate.headline_order["ract"] == "entropy"
    assert set(seeded.evaluate.orders) == set(seeded.align) | set(seeded.compatible)
    assert {c.seed for c in seeded.align.values()} == {2} and seeded.train.new.seed == 2
    assert seeded.paths.artifacts == Path("runs/compare/seed-2/artifacts")
    assert seeded.paths.data == params.paths.data
    assert params.compatible == {}  # the main pipeline trains no compatible model


def test_the_comparison_trains_every_method_at_one_precision_and_checks_no_map():
    import yaml

    params = load_params(ROOT / "params.yaml")
    seeded = params.for_comparison(0)
    assert params.align["fastfill"].check == "fallback" and params.train.new.precision == "fp32"  # the pipeline's
    trainings = [seeded.train.old, seeded.train.new, *seeded.align.values()]
    assert {c.precision for c in trainings} == {params.compare.precision} == {"auto"}
    # the map check's fallback would evaluate FCT's map in another method's row
    assert {c.check for c in seeded.align.values()} == {"off"}
    data = yaml.safe_load((ROOT / "params.yaml").read_text())
    data["compare"]["precision"] = None  # each configuration keeps its own
    data["align"]["fct"]["precision"] = "bf16"
    kept = parse_params(data).for_comparison(0)
    assert kept.align["fct"].precision == "bf16" and kept.align["fastfill"].precision == "fp32"
    data["compare"]["precision"] = "fp16"
    with pytest.raises(ConfigError, match="precision"):
        parse_params(data)


@pytest.mark.parametrize("change, message", [
    (lambda d: d["compare"]["orders"].__setitem__("bct", ["sigma"]), r"order 'sigma' does not apply to a compatible"),
    (lambda d: d["compare"]["orders"].__setitem__("fct", ["entropy"]), r"order 'entropy' does not apply to an alignment"),
    (lambda d: d["compare"]["orders"].__setitem__("unified", ["oracle"]), r"unified.*random only"),
    (lambda d: d["compare"]["orders"].__setitem__("bcd", ["random"]), r"names method 'bcd'"),
    (lambda d: d["compare"]["orders"].pop("rbt"), r"no entry for \['rbt'\]"),
    (lambda d: d["compare"]["orders"].__setitem__("rbt", []), r"rbt lists no order"),
    (lambda d: d["compare"]["align"].__setitem__("fct", {"l2": True}), r"compare.align.fct is defined twice"),
    (lambda d: d["compare"]["align"]["unified"].__setitem__("disc", True), r"unified trains its own fixed loss"),
    (lambda d: d["compare"]["compatible"].__setitem__("x", {"loss": "lwf"}), r"compare.compatible.x.loss"),
    (lambda d: d["compare"]["compatible"]["bct"].__setitem__("new_to_new", False), r"new_to_new applies to loss: ract"),
])
def test_bad_comparison_settings_are_named(change, message):
    data = _default()
    change(data)
    with pytest.raises(ConfigError, match=message):
        parse_params(data)


def test_a_unified_map_cannot_drive_a_stored_gallery_upgrade():
    data = _default()
    data["align"]["shared"] = {"architecture": "unified"}
    data["gallery"]["upgrade"]["method"] = "shared"
    with pytest.raises(ConfigError, match="unified map"):
        parse_params(data)


@pytest.mark.parametrize("option, value, key", [
    ("--max-items-per-second", "0", "gallery.upgrade.max_items_per_second"),
    ("--concurrency", "0", "gallery.upgrade.max_concurrency"),
])
def test_a_bad_upgrade_option_is_refused_naming_its_key(option, value, key):
    from typer.testing import CliRunner

    from fastfill.cli import app

    result = CliRunner().invoke(app, ["upgrade", option, value, "--dry-run"])
    assert result.exit_code == 2 and "the command's options: invalid configuration" in result.output
    assert f"{key}: Input should be greater than 0" in result.output and "pydantic.dev" not in result.output


def test_the_configuration_page_is_generated_from_the_definitions():
    import subprocess
    import sys

    checked = subprocess.run([sys.executable, str(ROOT / "scripts" / "config_docs.py"), "--check"],
                             capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert "| `gallery.upgrade.chunk_size` |" in page and "| `align.<name>.uncertainty` |" in page
    assert "|  |\n" not in page  # every key says what it does


def test_the_maps_are_registered_beside_the_embedder_by_default():
    from fastfill.components.platform.config import parse_params

    assert parse_params({"mlflow": {"registered_model": "icon-embedder"}}).mlflow.alignment_model == \
        "icon-embedder-alignment"
    assert parse_params({}).mlflow.alignment_model == "embedder-alignment"
    named = parse_params({"mlflow": {"registered_model": "a", "alignment_model": "maps"}})
    assert named.mlflow.alignment_model == "maps"


def test_a_host_without_a_params_file_takes_the_defaults(tmp_path, monkeypatch):
    """A team's upgrade host holds none of the pipeline's files: no params.yaml at the default path
    is the defaults, and so is an empty one; a file named explicitly must exist; a folder or a file
    that is not UTF-8 is one line that says what to do."""
    from fastfill.components.platform.config import ConfigError, load_params, parse_params

    monkeypatch.chdir(tmp_path)
    assert load_params() == parse_params({})
    assert load_params(tmp_path / "params.yaml") == parse_params({})  # as a command hands it to its flows
    (tmp_path / "params.yaml").write_text("")
    assert load_params("params.yaml") == parse_params({})
    with pytest.raises(ConfigError, match="other.yaml: no such file; pass an existing params file"):
        load_params(tmp_path / "other.yaml")
    with pytest.raises(ConfigError, match=r"is a folder, not a params file; pass the file in it \(--params "):
        load_params(tmp_path)
    (tmp_path / "latin.yaml").write_bytes("gallery:\n  store: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin.yaml: not UTF-8 text \(byte 0xe9 at offset 21\); save it as UTF-8"):
        load_params(tmp_path / "latin.yaml")
