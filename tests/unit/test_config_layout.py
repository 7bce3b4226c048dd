"""The configuration's schema by part, read from the source: the shared base (config_base), the
pipeline's sections (config_pipeline: data, training, methods; config_evaluation: the evaluation
and the comparison), the gallery's and the upgrade's (config_gallery), the services'
(config_services), and the whole with its loading (config.py). Each file stays short enough to
read as one part, and each part imports only the base (the evaluation also the pipeline's methods
it names): never the root, never a part beside it."""

import ast
import inspect
from pathlib import Path

import pytest

from fastfill.components.platform import (
    config,
    config_base,
    config_evaluation,
    config_gallery,
    config_pipeline,
    config_services,
)

ROOT = Path(__file__).resolve().parents[2]
PLATFORM = ROOT / "components" / "platform"
MOST_LINES = 450

# each configuration module and the configuration modules it may import
MAY_IMPORT = {
    "config_base": set(),
    "config_pipeline": {"config_base"},
    "config_evaluation": {"config_base", "config_pipeline"},
    "config_gallery": {"config_base"},
    "config_services": {"config_base"},
    "config": {"config_base", "config_pipeline", "config_evaluation", "config_gallery", "config_services"},
}
PARTS = (config_base, config_pipeline, config_evaluation, config_gallery, config_services)


def _config_imports(path: Path) -> set[str]:
    """The configuration modules (config, config_<part>) that ``path`` imports, by file name."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        for name in names:
            if name.startswith("fastfill.components.platform.config"):
                found.add(name.removeprefix("fastfill.components.platform.").split(".")[0])
    return found


def test_the_configuration_modules_are_the_ones_named_here():
    assert {p.stem for p in PLATFORM.glob("config*.py")} == set(MAY_IMPORT)


@pytest.mark.parametrize("name", sorted(MAY_IMPORT))
def test_each_configuration_file_holds_one_part(name):
    lines = len((PLATFORM / f"{name}.py").read_text().splitlines())
    assert lines < MOST_LINES, f"components/platform/{name}.py has {lines} lines: split its part by what it configures"


@pytest.mark.parametrize("name", sorted(MAY_IMPORT))
def test_each_part_imports_only_the_base(name):
    """The pipeline's sections know nothing of the gallery's or the services', nor these of the
    pipeline's or of one another's; only the root puts the parts together."""
    found = _config_imports(PLATFORM / f"{name}.py") - {name}
    assert found <= MAY_IMPORT[name], f"{name}.py imports {sorted(found - MAY_IMPORT[name])}"


def test_every_section_is_still_importable_from_config():
    """``from fastfill.components.platform.config import <Section>`` keeps working for every section."""
    for part in PARTS:
        for name, value in vars(part).items():
            if inspect.isclass(value) and issubclass(value, config.Section) and value.__module__ == part.__name__:
                assert getattr(config, name, None) is value, f"config does not export {part.__name__}.{name}"
                assert name in config.__all__, f"{name} is missing from config.__all__"


def test_every_section_of_params_is_defined_in_a_part():
    """Params holds only the parts' sections; config.py defines no section of its own."""
    homes = {part.__name__ for part in PARTS}
    defined_here = [name for name, value in vars(config).items() if inspect.isclass(value)
                    and issubclass(value, config.Section) and value.__module__ == config.__name__]
    assert defined_here == ["Params"], defined_here
    for field in config.Params.model_fields.values():
        section = field.annotation
        for argument in getattr(section, "__args__", ()):  # TrainSection | None
            if inspect.isclass(argument) and issubclass(argument, config.Section):
                section = argument
        if inspect.isclass(section) and issubclass(section, config.Section):
            assert section.__module__ in homes, f"{section.__name__} is defined in {section.__module__}"
