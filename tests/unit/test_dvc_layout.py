"""What DVC and the comparison are given, read without running them: the pipeline's dvc.yaml and
the committed dvc.lock agree stage by stage, the comparison is a DVC project of its own, its
models have registry names of their own, the remote `stack`, and the flat summary rows that
`dvc metrics show` prints."""

import configparser
import json
import re
from pathlib import Path

import pytest
import yaml

from fastfill.components.evaluation.reports import ROW_KEYS, method_colours, plot_curves, summary_rows, write_summary
from fastfill.components.platform.config import ConfigError, load_params, parse_params
from tests.synthetic import tiny_curves

ROOT = Path(__file__).resolve().parents[2]


def _expand(value, variables: dict):
    """${a.b} of dvc.yaml, from ``variables``."""
    def lookup(match):
        out = variables
        for part in match.group(1).split("."):
            out = out[part]
        return str(out)
    return re.sub(r"\$\{([^}]+)\}", lookup, value)


def _declared_stages() -> dict[str, dict]:
    """The pipeline's stages as DVC expands them: name -> cmd, deps, params, outs (metrics included)."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    stages = {}
    for name, stage in yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"].items():
        if "foreach" in stage:
            items = stage["foreach"]
            items = list(_expand_ref(items, params)) if isinstance(items, str) else items
            expanded = {f"{name}@{item}": (stage["do"], {**params, "item": item, "key": item}) for item in items}
        else:
            expanded = {name: (stage, params)}
        for full, (body, variables) in expanded.items():
            outs = [next(iter(o)) if isinstance(o, dict) else o for o in body.get("outs", []) + body.get("metrics", [])]
            stages[full] = {"cmd": _expand(body["cmd"], variables),
                            "deps": sorted(_expand(d, variables) for d in body.get("deps", [])),
                            "params": sorted(_expand(p, variables) for p in body.get("params", [])),
                            "outs": sorted(_expand(o, variables) for o in outs)}
    return stages


def _expand_ref(reference: str, params: dict):
    out = params
    for part in reference.strip("${}").split("."):
        out = out[part]
    return out


def test_the_committed_dvc_lock_records_exactly_the_pipelines_stages_as_dvc_yaml_declares_them():
    declared = _declared_stages()
    assert set(declared) == {"prepare", "train@old", "train@new", "align@fct", "align@fastfill", "evaluate"}
    lock = yaml.safe_load((ROOT / "dvc.lock").read_text())["stages"]
    assert set(lock) == set(declared)  # no comparison stage, nothing missing
    for name, stage in declared.items():
        recorded = lock[name]
        assert recorded["cmd"] == stage["cmd"], name
        assert sorted(d["path"] for d in recorded.get("deps", [])) == stage["deps"], name
        assert sorted(recorded.get("params", {}).get("params.yaml", {})) == stage["params"], name
        assert sorted(o["path"] for o in recorded.get("outs", [])) == stage["outs"], name


def test_the_comparison_is_a_dvc_project_of_its_own_that_reads_the_same_params():
    root = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    assert not {"compare", "comparison"} & set(root["stages"])  # a bare `dvc repro` never starts it
    assert (ROOT / "comparison" / ".dvc" / "config").is_file()  # a DVC subrepo: the root's dvc status skips it
    comparison = yaml.safe_load((ROOT / "comparison" / "dvc.yaml").read_text())
    assert comparison["vars"] == ["../params.yaml"]
    assert set(comparison["stages"]) == {"compare", "comparison"}
    seed = comparison["stages"]["compare"]
    assert seed["foreach"] == "${compare.seeds}" and seed["do"]["cmd"].startswith("cd .. && fastfill stage compare")
    listed = seed["do"]["params"][0]["../params.yaml"]
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for key in listed:  # every key DVC reads is in params.yaml (DVC fails on a missing one)
        section, _, sub = key.partition(".")
        assert section in params and (not sub or sub in params[section]), key
    assert "compare.seeds" not in listed  # a seed added does not re-run the others


def test_the_stack_remote_points_at_the_local_stack_and_is_not_the_default():
    config = configparser.ConfigParser()
    config.read(ROOT / ".dvc" / "config")
    remote = config["'remote \"stack\"'"]  # DVC writes the section name quoted
    assert remote["url"].startswith("s3://dvc-cache/")
    assert remote["endpointurl"] == "http://127.0.0.1:9000"  # local-stack.sh's default FASTFILL_S3_PORT
    assert "remote" not in config["core"]  # not the default: a fresh clone's dvc commands never need it
    script = (ROOT / "infra" / "local-stack.sh").read_text()
    assert '"dvc-cache"' in script and 'S3_PORT="${FASTFILL_S3_PORT:-9000}"' in script
    assert "/dvc_plots/" in (ROOT / ".gitignore").read_text().splitlines()


def test_the_comparisons_models_get_registry_names_of_their_own():
    params = load_params(ROOT / "params.yaml")
    assert (params.compare.registered_model, params.compare.alignment_model) == (
        "embedder-comparison", "embedder-comparison-alignment")
    seeded = params.for_comparison(1)
    assert seeded.mlflow.registered_model == "embedder-comparison"
    assert seeded.mlflow.alignment_model == "embedder-comparison-alignment"
    assert params.mlflow.registered_model == "embedder"  # production's names are left as they are
    assert seeded.mlflow.tracking_uri == params.mlflow.tracking_uri


@pytest.mark.parametrize("key, value", [("registered_model", "embedder"), ("alignment_model", "embedder"),
                                        ("registered_model", "embedder-alignment")])
def test_a_comparison_name_equal_to_a_production_one_is_refused(key, value):
    data = yaml.safe_load((ROOT / "params.yaml").read_text())
    data["compare"][key] = value
    with pytest.raises(ConfigError, match=rf"invalid configuration\n  compare\.{key}: '{value}' is a registered "
                                          "model of production"):
        parse_params(data)


def test_a_comparison_seeds_configuration_survives_being_validated_again():
    """Prefect validates a flow's parameters again: the seed's copy, whose mlflow names are the
    comparison's, must pass and keep them."""
    from fastfill.components.platform.config import Params

    seeded = load_params(ROOT / "params.yaml").for_comparison(0)
    again = Params.model_validate(seeded.model_dump(mode="json"))
    assert again.mlflow.registered_model == "embedder-comparison"
    assert again.mlflow.alignment_model == "embedder-comparison-alignment"


def test_summary_rows_are_flat_with_the_same_keys_per_line(tmp_path):
    reference, curves = tiny_curves()
    rows = summary_rows(reference, curves)
    assert set(rows) == {"old_old", "new_new", "fct-random", "fastfill-sigma", "fastfill-random"}
    for name in ("fct-random", "fastfill-sigma", "fastfill-random"):
        assert tuple(rows[name]) == ROW_KEYS
    assert set(rows["old_old"]) == set(ROW_KEYS) - {"nfr1_mean"}  # a fixed gallery has no flips
    assert rows["fastfill-sigma"]["top1_auc"] == curves["fastfill"]["sigma"]["top1_auc"]
    assert rows["fastfill-sigma"]["top1_0"] == curves["fastfill"]["sigma"]["top1"][0]
    assert rows["new_new"]["map_auc"] == reference["new_new"]["map"]

    directory = tmp_path / "summary"
    directory.mkdir()
    (directory / "rbt-random.json").write_text("{}")  # a method no longer evaluated
    written = write_summary(directory, reference, curves)
    assert sorted(p.name for p in directory.iterdir()) == sorted(p.name for p in written)
    assert "rbt-random.json" not in {p.name for p in written}
    loaded = json.loads((directory / "fastfill-sigma.json").read_text())
    assert loaded == rows["fastfill-sigma"] and all(isinstance(v, float) for v in loaded.values())


def test_each_method_has_its_own_colour_and_none_is_a_reference_grey(tmp_path):
    import matplotlib.colors

    methods = [f"m{i}" for i in range(15)]
    colours = method_colours(methods)
    assert len({matplotlib.colors.to_hex(c) for c in colours.values()}) == 15
    for colour in colours.values():
        red, green, blue = matplotlib.colors.to_rgb(colour)
        assert max(red, green, blue) - min(red, green, blue) > 0.05  # not a grey (nor black)
    reference, curves = tiny_curves()
    png = plot_curves(tmp_path / "b.png", reference, curves, headline={"fct": "random", "fastfill": "sigma"})
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# What a stage loads that cannot change its outputs' bytes: the run's MLflow records, the Prefect
# policy and server, and the registry's and gallery's plumbing that tasks/tracking.py brings in.
_NOT_COMPUTING = ("flows/_stage.py", "tasks/_policy.py", "tasks/temporary_server.py", "tasks/tracking.py")
_COMPUTING = ("components/experiment/", "components/evaluation/", "tasks/", "flows/",
              "components/platform/layout.py", "components/platform/runtime.py")


@pytest.mark.parametrize("stage, module", [("prepare", "fastfill.flows.prepare"), ("train@old", "fastfill.flows.train"),
                                           ("align@fastfill", "fastfill.flows.align"),
                                           ("evaluate", "fastfill.flows.evaluate")])
def test_every_stage_depends_on_what_it_imports(stage, module):
    """Each stage's deps list, file by file, every module it loads that computes its outputs (the
    experiment's and evaluation's components, its flow and tasks, the layout and the CPU pin)."""
    import subprocess
    import sys

    loaded = subprocess.run(
        [sys.executable, "-c", f"import sys, {module}; print('\\n'.join(m.__file__ for m in list(sys.modules.values()) "
         "if getattr(m, '__file__', None)))"], cwd=ROOT, capture_output=True, text=True, check=True)
    files = set()
    for name in loaded.stdout.split():
        path = Path(name).resolve()
        if ROOT not in path.parents or ".venv" in path.parts or path.name == "__init__.py":
            continue
        relative = str(path.relative_to(ROOT))
        if relative.startswith(_COMPUTING) and relative not in _NOT_COMPUTING:
            files.add(relative)
    assert f"{module.removeprefix('fastfill.').replace('.', '/')}.py" in files
    deps = set(_declared_stages()[stage]["deps"])
    assert files <= deps, f"the {stage} stage imports {sorted(files - deps)}, which dvc.yaml does not list"


def test_the_stages_declare_the_params_and_data_they_read():
    stages = _declared_stages()
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert params["prepare"]["source"] in stages["prepare"]["deps"]  # the dataset's files
    for method in params["align"]:
        assert "evaluate.distance" in stages[f"align@{method}"]["params"]  # the map check's distance
