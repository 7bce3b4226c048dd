"""The layering, read from the source: components/ never imports Prefect, tasks/, flows/, cli/
or services/; its packages import only downward (platform < evaluation < experiment < model_store
< gallery); tasks/ never imports flows/, cli/ or services/; flows/ never imports cli/ or
services/; services/ never imports cli/ (the command line sits on top of everything)."""

import ast
import dataclasses
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RANK = {"platform": 0, "evaluation": 1, "experiment": 2, "model_store": 3, "gallery": 4}


def _imports(path: Path) -> list[str]:
    """The absolute imports of a file, the product's own named by their room (``fastfill.`` off)."""
    return [name.removeprefix("fastfill.") for name in _raw_imports(path)]


def _raw_imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def _modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def test_components_are_grouped_into_their_packages():
    loose = [p.name for p in (ROOT / "components").glob("*.py") if p.name != "__init__.py"]
    assert loose == [], f"modules outside a package: {loose}"
    assert {p.name for p in (ROOT / "components").iterdir() if p.is_dir() and p.name != "__pycache__"} == set(RANK)


@pytest.mark.parametrize("path", _modules("components"), ids=lambda p: str(p.relative_to(ROOT)))
def test_components_import_only_downward_and_never_the_orchestration(path):
    package = path.relative_to(ROOT / "components").parts[0]
    for name in _imports(path):
        top = name.split(".")[0]
        assert top not in {"prefect", "flows", "tasks", "cli", "services"}, f"{path.name} imports {name}"
        if top == "components" and len(name.split(".")) > 1 and name.split(".")[1] in RANK:
            target = name.split(".")[1]
            assert RANK[target] <= RANK[package], f"{package}/{path.name} imports {name}, a layer above it"


# each room and the rooms above it, which it never imports
ABOVE = {"tasks": {"flows", "cli", "services"}, "flows": {"cli", "services"}, "services": {"cli"}}


@pytest.mark.parametrize("path", [p for room in ABOVE for p in _modules(room)], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_room_imports_a_room_above_it(path):
    room = path.relative_to(ROOT).parts[0]
    found = sorted({n for n in _imports(path) if n.split(".")[0] in ABOVE[room]})
    assert not found, f"{path.relative_to(ROOT)} imports {found}, from a room above {room}/"


ROOMS = ("components", "tasks", "flows", "services", "cli")


@pytest.mark.parametrize("folder", [*ROOMS, "tests", "testkit", "benchmarks", "scripts", "comparison", "infra"])
def test_the_product_is_imported_as_the_fastfill_package_only(folder):
    """Every import of the product names it as ``fastfill.<room>``: a bare ``components...``
    (found on the path from the repository's root) would load a second copy of a module beside
    the installed package's, with its own classes and state."""
    bare = [f"{path.relative_to(ROOT)}: {name}" for path in _modules(folder) for name in _raw_imports(path)
            if name.split(".")[0] in ROOMS]
    assert not bare, f"import these as fastfill.<...>: {bare}"


def test_the_rooms_are_packages():
    for room in ("components", "tasks", "flows", "services", "cli"):
        assert (ROOT / room / "__init__.py").is_file(), f"{room}/ is not a package"


PRODUCT = ("components", "tasks", "flows", "services", "cli", "benchmarks", "scripts", "infra")
SPECIAL = {"__init__.py", "__main__.py"}
# the two files whose length is the point: the metric protocol and the configuration schema
LONG_ALLOWED = {"components/evaluation/retrieval.py", "components/platform/config.py"}


def _product_files() -> list[Path]:
    return sorted(p for room in PRODUCT for p in (ROOT / room).rglob("*.py") if "__pycache__" not in p.parts)


def _dotted(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_module_shares_a_dotted_name_with_a_package():
    """A dotted name says which module is meant: never a module ``a/b.py`` beside a package
    ``a/b/`` (file names may repeat across packages: ``upgrade/status`` is not ``gallery/status``)."""
    modules = {_dotted(p) for p in _product_files() if p.name not in SPECIAL}
    packages = {_dotted(p / "__init__.py") for room in PRODUCT for p in (ROOT / room).rglob("*")
                if p.is_dir() and (p / "__init__.py").is_file()}
    assert not modules & packages, f"modules named as a package: {sorted(modules & packages)}"


GALLERY_ROOMS = {"store", "layouts", "inputs", "upgrade", "gate", "advice", "search", "triggers"}


def test_the_gallery_is_rooms_by_concern():
    """components/gallery/ holds sub-packages a newcomer can name, no loose modules."""
    gallery = ROOT / "components" / "gallery"
    loose = sorted(p.name for p in gallery.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules outside a room of components/gallery/: {loose}"
    rooms = {p.name for p in gallery.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert rooms == GALLERY_ROOMS, f"rooms of components/gallery/: {sorted(rooms)} (the docs name {sorted(GALLERY_ROOMS)})"


@pytest.mark.parametrize("path", _product_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_product_never_imports_the_testkit_or_the_tests(path):
    """testkit/ (fault proxies, tiny demo data, process probes) and tests/ are for tests and
    benchmarks; the product installed without them still works."""
    if path.relative_to(ROOT).parts[0] in {"benchmarks", "scripts"}:
        return
    found = sorted({n for n in _imports(path) if n.split(".")[0] in {"testkit", "tests"}})
    assert not found, f"{path.relative_to(ROOT)} imports {found}"


def test_no_module_alias_hides_which_module_is_meant():
    """``import a.b as c`` or ``from a import b as c`` of the product's own modules: none."""
    hidden = []
    for path in _product_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PRODUCT[:5]:
                hidden += [f"{path.relative_to(ROOT)}: {alias.name} as {alias.asname}" for alias in node.names
                           if alias.asname and alias.asname != alias.name]
            elif isinstance(node, ast.Import):
                hidden += [f"{path.relative_to(ROOT)}: {alias.name} as {alias.asname}" for alias in node.names
                           if alias.asname and alias.name.split(".")[0] in PRODUCT[:5]]
    assert not hidden, hidden


def test_no_file_is_long_enough_to_hold_several_ideas():
    """Size is a hint, not a rule that splits an idea: past 800 lines a file surely holds more
    than one (the metric protocol and the configuration schema are each one long idea)."""
    long = {str(p.relative_to(ROOT)): n for p in _product_files()
            if (n := len(p.read_text().splitlines())) >= 800 and str(p.relative_to(ROOT)) not in LONG_ALLOWED}
    assert not long, f"split these by idea: {long}"


# The modules that import some of the product's own modules inside a function, and why: each
# loads a heavy or optional library late (torch, scipy, Prefect's client, the upgrade flow), so
# that `fastfill --help`, the light commands (`status`, `doctor`, `model list`, `webhook list`)
# and the services' start-up go without it (never to break an import cycle: there is none,
# test_no_modules_import_each_other). Everywhere else the product's
# own imports are at the top. The CLI loads a command's module only when the command runs
# (cli/__init__.py, COMMANDS), so a command module imports what its commands need at its top.
LATE_LOADING = {
    "components/experiment/adapters.py": "torch: an MLP adapter's layers (the upgrade's plan loads without it)",
    "components/experiment/data.py": "torch: torchvision's datasets (data.DataError is every command's)",
    "components/experiment/map_check.py": "torch, and the pipeline's stages: those that import the check list "
                                           "what they load in dvc.yaml",
    "components/model_store/catalogue.py": "torch: a version's description (`fastfill model list`)",
    "components/gallery/advice/advisor.py": "scipy: the evaluation's ranking code (`fastfill status`)",
    "components/gallery/upgrade/backfill.py": "torch: embedding the images (a flow's tasks import the module)",
    "components/gallery/upgrade/planning.py": "torch and scipy: transforming features, the orders (a flow's tasks "
                                              "import the module)",
    "components/gallery/upgrade/pseudo_classes.py": "torch: the head's optimizer",
    "flows/deployments.py": "the upgrade and comparison flows, not at the services' start-up",
    "cli/doctor_commands.py": "Prefect's client, only where a server is named",
    "cli/model_commands.py": "torch: registering and describing a model, not `model list`",
    "cli/upgrade_commands.py": "the upgrade flow and torch, not `upgrade status`",
    "cli/webhook_commands.py": "Prefect: the receiver starts deployments, not `webhook list`",
}
LATE_MOST = 32  # in-function imports of the product's own modules, across the product


def _late_imports(path: Path) -> list[str]:
    """The imports of the product's own modules inside a function of ``path``."""
    late = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for sub in ast.walk(node):
                if isinstance(sub, ast.ImportFrom) and sub.module and sub.level == 0:
                    names = [sub.module]
                elif isinstance(sub, ast.Import):
                    names = [alias.name for alias in sub.names]
                else:
                    continue
                if any(name.removeprefix("fastfill.").split(".")[0] in PRODUCT[:5] for name in names):
                    late.append(f"line {sub.lineno}: {', '.join(names)}")
    return late


LATE_ROOMS = PRODUCT[:5]  # components, tasks, flows, services, cli


@pytest.mark.parametrize("path", [p for room in LATE_ROOMS for p in _modules(room)],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_our_own_modules_are_imported_at_the_top_or_load_a_library_late(path):
    """An import of the product's own modules inside a function hides the dependency graph: only
    the modules of LATE_LOADING, each for the reason written there, import late."""
    hidden = _late_imports(path)
    name = str(path.relative_to(ROOT))
    assert not hidden or name in LATE_LOADING, f"{name}: move to the top (or say in LATE_LOADING why not): {hidden}"


def test_few_of_our_own_modules_are_imported_late():
    late = {str(p.relative_to(ROOT)): n for room in LATE_ROOMS for p in _modules(room) if (n := len(_late_imports(p)))}
    assert sum(late.values()) < LATE_MOST, f"{sum(late.values())} in-function imports of the product's own modules: {late}"
    assert set(LATE_LOADING) <= {str(p.relative_to(ROOT)) for room in LATE_ROOMS for p in _modules(room)}


def _product_modules() -> dict[str, Path]:
    """The product's modules by dotted name (``components.gallery.layouts.catalog``)."""
    return {_dotted(p): p for room in LATE_ROOMS for p in _modules(room) if "__pycache__" not in p.parts}


def _import_graph() -> dict[str, set[str]]:
    """Which of the product's modules each imports: at the top, inside a function, or for the
    type checker alike (``from a import b`` names ``a`` and, where it is a module, ``a.b``)."""
    modules = _product_modules()
    graph = {}
    for name, path in modules.items():
        found = {n.removeprefix("fastfill.") for n in _raw_imports(path)}
        graph[name] = {n for n in found if n in modules and n != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_modules_import_each_other():
    """The product's modules import one another as a graph without a cycle: no two import each
    other, directly or around a circle (an import inside a function counts: it hides a cycle, it
    does not break it). A cycle would be held together by late imports and break on the next one."""
    cycle = _cycle(_import_graph())
    assert cycle is None, f"an import cycle: {' -> '.join(cycle)}"


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


# what the upgrade's decider never imports: it reads the store through its StoreView, and the real
# one (components/gallery/upgrade/gallery_view.py) is the flows' to build
DECIDER_NEVER = ("components.gallery.store", "components.gallery.layouts", "components.gallery.upgrade.backfill",
                 "components.gallery.upgrade.gallery_view", "pyarrow")


def test_the_decider_imports_no_store_layout_backfill_or_pyarrow():
    """components/gallery/upgrade/decider.py decides from values: no store, layout, backfill or
    pyarrow module among its imports (top, late or for the type checker)."""
    path = ROOT / "components" / "gallery" / "upgrade" / "decider.py"
    found = sorted({name for name in _imports(path) for banned in DECIDER_NEVER
                    if name == banned or name.startswith(banned + ".")})
    assert not found, f"decider.py imports {found}"
    assert "components.gallery.upgrade.outcome" in _imports(path)  # the check reads its imports at all


def test_the_upgrade_flow_file_only_binds():
    """flows/upgrade.py holds the flow, its entry points and its end states: the ports' adapters
    are flows/upgrade_ports.py's, and what they decide or compute is the components'."""
    lines = len((ROOT / "flows" / "upgrade.py").read_text().splitlines())
    assert lines <= 150, f"flows/upgrade.py has {lines} lines: adapters go to flows/upgrade_ports.py, logic to components/"


# Calls that write a gallery's store or MLflow, by the name they are called on: in the flows, each
# goes through a retried task of tasks/ instead (tests/unit/test_retried_writes.py lists them).
DIRECT_WRITES = {
    "reversal": {"abort", "rollback", "mark_rollback_recorded", "start_over"},
    "claims": {"claim", "put_claim", "record_start", "release"},
    "registry": {"record_rollback", "record_promotion", "log_metrics", "log_series", "log_params"},
    "client": {"set_tag", "set_terminated", "update_run", "log_batch", "set_registered_model_alias",
               "delete_registered_model_alias", "set_model_version_tag"},
    "store": {"put", "put_json", "delete"},
    "gallery": {"write_manifest"},
}
WRITING_FUNCTIONS = {"claim"}  # called by their own name once imported


@pytest.mark.parametrize("name", ["flows/upgrade.py", "flows/upgrade_ports.py", "flows/undo.py"])
def test_the_upgrade_abort_and_rollback_flows_write_only_through_tasks(name):
    path = ROOT / name
    direct = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute):
            owner = func.value.attr if isinstance(func.value, ast.Attribute) else getattr(func.value, "id", None)
            if func.attr in DIRECT_WRITES.get(owner, ()):
                direct.append(f"line {node.lineno}: {owner}.{func.attr}")
        elif isinstance(func, ast.Name) and func.id in WRITING_FUNCTIONS:
            direct.append(f"line {node.lineno}: {func.id}")
    assert not direct, f"{name} writes without a retried task: {direct}"


def _direct_writes(tree: ast.AST) -> list[ast.Call]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            owner = func.value.attr if isinstance(func.value, ast.Attribute) else getattr(func.value, "id", None)
            if func.attr in DIRECT_WRITES.get(owner, ()):
                found.append(node)
    return found


@pytest.mark.parametrize("name", ["tasks/upgrade_tracking.py", "tasks/upgrade_map.py"])
def test_the_upgrade_s_mlflow_writes_in_tasks_are_retried(name):
    """Each write of the upgrade's MLflow records is in a retried task's body, or in what is
    given to ``io_retried`` (a lambda, or a function defined beside the call): none is made once."""
    path = ROOT / name
    tree = ast.parse(path.read_text(), str(path))
    covered: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(  # @task(..., **IO_RETRIES)
                isinstance(d, ast.Call) and getattr(d.func, "id", None) == "task"
                and any(getattr(k.value, "id", None) == "IO_RETRIES" for k in d.keywords) for d in node.decorator_list):
            covered |= {id(call) for call in _direct_writes(node)}
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "io_retried" and node.args:
            given = node.args[0]
            named = getattr(given, "id", None)  # a function defined beside the call (each def of that name)
            for body in [given, *(d for d in ast.walk(tree) if isinstance(d, ast.FunctionDef) and d.name == named)]:
                covered |= {id(call) for call in _direct_writes(body)}
    plain = [f"line {call.lineno}: {ast.unparse(call.func)}" for call in _direct_writes(tree) if id(call) not in covered]
    assert not plain, f"{name} writes to MLflow without a retry: {plain}"
    assert covered  # the check finds the writes at all


PRODUCT_ROOMS = ("cli", "components", "flows", "services", "tasks")


def test_the_upgrade_decision_is_one_type():
    """``outcome.Decision`` is the promotion decision from the decider to decision.json and the
    result: the types it replaced (``Promotion``, ``GateDecision``) are named nowhere in the product."""
    from fastfill.components.gallery.upgrade import outcome

    assert not hasattr(outcome, "Promotion") and not hasattr(outcome, "GateDecision")
    named = []
    for room in PRODUCT_ROOMS:
        for path in sorted((ROOT / room).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                name = (node.id if isinstance(node, ast.Name) else node.name if isinstance(node, ast.ClassDef)
                        else node.attr if isinstance(node, ast.Attribute) else None)
                if name in ("Promotion", "GateDecision"):
                    named.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    assert not named, named


# the records whose id is an upgrade's: a field or attribute of theirs named ``id`` is one under another name
UPGRADE_RECORDS = ("Plan", "UpgradeInProgress")


def _ids_under_another_name(source: str) -> list[str]:
    """Parameters that hold an upgrade's id under another name than ``upgrade_id``: ``uid``, or
    ``upgrade`` typed ``str`` / ``str | None``; as ``line function(name)``. And a field (or an
    attribute set in a method, ``self.id = ...``) named ``id`` of an upgrade's record
    (``UPGRADE_RECORDS``: the plan, the status's upgrade in progress); as ``line Record.id``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name in UPGRADE_RECORDS:
            for inner in ast.walk(node):
                targets = ([inner.target] if isinstance(inner, ast.AnnAssign) else
                           inner.targets if isinstance(inner, ast.Assign) else [])
                for target in targets:
                    if ((isinstance(target, ast.Name) and target.id == "id")
                            or (isinstance(target, ast.Attribute) and target.attr == "id"
                                and isinstance(target.value, ast.Name) and target.value.id == "self")):
                        found.append(f"{inner.lineno} {node.name}.id")
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            args = node.args
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                annotation = ast.unparse(arg.annotation).replace(" ", "") if arg.annotation else None
                if arg.arg == "uid" or (arg.arg == "upgrade" and annotation in ("str", "str|None", "None|str")):
                    found.append(f"{node.lineno} {getattr(node, 'name', 'lambda')}({arg.arg})")
    return found


@pytest.mark.parametrize("room", ["flows", "tasks", "components"])
def test_an_upgrade_s_id_is_called_upgrade_id(room):
    wrong = [f"{path.relative_to(ROOT)}:{found}" for path in _modules(room)
             for found in _ids_under_another_name(path.read_text())]
    assert not wrong, f"an upgrade's id named otherwise than upgrade_id: {wrong}"


def test_the_id_name_check_finds_an_id_under_another_name():
    source = "def f(store, upgrade: str | None, uid):\n    pass\n\n\ndef g(upgrade: Config, upgrade_id: str):\n    pass\n"
    assert _ids_under_another_name(source) == ["1 f(upgrade)", "1 f(uid)"]
    record = ("class Plan:\n    id: str\n    old: str\n\n    def moved(self):\n        self.id = 'x'\n\n\n"
              "class Item:\n    id: int\n")
    assert _ids_under_another_name(record) == ["2 Plan.id", "6 Plan.id"]


def _string_key_reads(path: Path) -> list[str]:
    """The reads of a dict by a literal string key in ``path``: ``x["key"]`` and ``x.get("key")``."""
    reads = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value,
                                                                                                     str):
            reads.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            reads.append(f"line {node.lineno}: {ast.unparse(node)}")
    return reads


def test_the_upgrade_commands_read_typed_records():
    """cli/upgrade_commands.py reads the dry run, the advice and its recommendation, the gate, the
    lock and the abort as typed records' fields: no read of a dict by a string key is left."""
    reads = _string_key_reads(ROOT / "cli" / "upgrade_commands.py")
    assert not reads, reads


def _dict_fields(record: type) -> list[str]:
    """The fields of the dataclass ``record`` annotated as a dict (``dict``, ``dict | None``,
    ``dict[str, float]``, a ``list[dict]``), as ``Record.field: annotation``."""
    return [f"{record.__name__}.{field.name}: {field.type}" for field in dataclasses.fields(record)
            if re.search(r"\b(dict|Dict|Mapping)\b", str(field.type))]


def test_the_gallery_s_status_holds_typed_records():
    """`fastfill upgrade status`'s state (``GalleryStatus``) and the upgrade in progress it shows
    hold frozen records, never a dict: the lock, the served index, the prediction, the failed
    images, the decision (their ``to_dict`` is the JSON)."""
    from fastfill.components.gallery.store.lock import LockRecord
    from fastfill.components.gallery.upgrade.backfill import FailedImages
    from fastfill.components.gallery.upgrade.outcome import Decision
    from fastfill.components.gallery.upgrade.status import GalleryStatus, PredictedCurve, ServedIndex, UpgradeInProgress

    found = _dict_fields(GalleryStatus) + _dict_fields(UpgradeInProgress)
    assert not found, f"typed records, not dicts: {found}"
    records = (GalleryStatus, UpgradeInProgress, LockRecord, ServedIndex, PredictedCurve, FailedImages, Decision)
    loose = [record.__name__ for record in records if not record.__dataclass_params__.frozen]
    assert not loose, f"not frozen: {loose}"


def test_the_dict_field_check_finds_a_dict():
    @dataclasses.dataclass
    class Loose:
        lock: dict | None
        index: dict
        points: dict[str, float]
        failed: list[dict]
        name: str
        predicted: "dict | None" = None

    assert _dict_fields(Loose) == ["Loose.lock: dict | None", "Loose.index: <class 'dict'>",
                                   "Loose.points: dict[str, float]", "Loose.failed: list[dict]",
                                   "Loose.predicted: dict | None"]


MYPY_EXCEPTIONS_MOST = 5  # modules of the product that may still turn some of mypy's error codes off


def test_at_most_a_few_modules_turn_mypy_s_error_codes_off():
    """pyproject.toml's "modules not yet clean" (``disable_error_code`` overrides) stay a short
    list: a module is typed as the rest are, not kept out of mypy's checks."""
    import tomllib

    overrides = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"].get("overrides", [])
    excepted = set()
    for override in overrides:
        if override.get("disable_error_code"):
            modules = override["module"]
            excepted.update(m for m in ([modules] if isinstance(modules, str) else modules)
                            if m == "fastfill" or m.startswith("fastfill."))
    assert len(excepted) <= MYPY_EXCEPTIONS_MOST, (
        f"{len(excepted)} modules turn mypy's error codes off (at most {MYPY_EXCEPTIONS_MOST}): {sorted(excepted)}")
