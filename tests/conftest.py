"""Marks every test under tests/integration with ``integration``, so the tiers can be chosen
with ``-m`` as well as by folder, keeps every test not marked ``gpu`` on the CPU, and lays the
tests out for pytest-xdist's workers (``--dist loadscope``, in addopts, with the scopes below):

- a module that defines a fixture set up once per module or class (a pipeline run, a comparison,
  a stack) runs whole on one worker, so that fixture is set up once; so does every module of the
  unit tier (short files: a file is fine-grained enough);
- the other integration tests go one by one to whichever worker is free, so a module of many
  slow tests (each layout of each upgrade test) is spread over the workers instead of bounding
  the run's wall time on one of them;
- the ``slow`` integration tests are handed out first and the unit tier last (in the collection's
  order: ``--no-loadscope-reorder``), so the run does not end waiting on one long test started
  late."""

# The tests compute as the product does: every library's CPU kernels pinned (compute.cpu_kernels'
# default) before any test loads numpy or torch, so that one process never mixes kernels loaded
# before the pin with kernels loaded after it (an exact comparison of two embeddings would see it).
from fastfill.components.platform.runtime import DEFAULT_CPU_KERNELS, pin_cpu_kernels

pin_cpu_kernels(DEFAULT_CPU_KERNELS)

import functools  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]  # the nodes' ids are relative to it


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/integration/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.integration)
    # slow integration tests first, then the other integration tests, the unit tier last; a module
    # that runs whole stays in one piece, where its first test goes
    rank = {}
    for item in items:
        if _shares_module_state(item) and not _runs_whole(_module(item)):
            raise pytest.UsageError(f"{item.nodeid} uses a fixture set up once per module or class that its module "
                                    "does not define: tests/conftest.py's _runs_whole must keep that module whole")
        rank[_scope(item.nodeid)] = min(rank.get(_scope(item.nodeid), 3),
                                        2 if item.get_closest_marker("integration") is None
                                        else 0 if item.get_closest_marker("slow") else 1)
    items.sort(key=lambda item: rank[_scope(item.nodeid)])


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope`` with this file's scopes (see above)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    return Scheduling(config, log)


def _module(nodeid_or_item) -> str:
    return str(getattr(nodeid_or_item, "nodeid", nodeid_or_item)).split("::", 1)[0]


def _scope(nodeid: str) -> str:
    """What one worker runs together: the test's module, or the test alone."""
    return _module(nodeid) if _runs_whole(_module(nodeid)) else nodeid


@functools.cache
def _runs_whole(module: str) -> bool:
    """A unit-tier module, or one that defines a fixture set up once per module, class or package."""
    if not module.startswith("tests/integration/"):
        return True
    source = (ROOT / module).read_text() if (ROOT / module).is_file() else ""
    return re.search(r"scope=[\"'](module|class|package)[\"']", source) is not None


def _shares_module_state(item) -> bool:
    """Whether the test uses a fixture set up once for its module, class or package."""
    info = getattr(item, "_fixtureinfo", None)
    return any(definitions[-1].scope in ("module", "class", "package")
               for definitions in (info.name2fixturedefs.values() if info else ()) if definitions)


@pytest.fixture(scope="session", autouse=True)
def _local_indexes_in_the_tests_temporary_folder(tmp_path_factory):
    """The Milvus Lite files and Qdrant folders of tests on an S3 store go under pytest's own
    temporary folder (tests/pg.py), which later runs remove even when this one was killed."""
    import tests.pg

    tests.pg.LOCAL_BASE = str(tmp_path_factory.getbasetemp())


@pytest.fixture(autouse=True)
def _cpu_unless_marked_gpu(request, monkeypatch):
    """Tests not marked ``gpu`` run on the CPU on any machine (``FASTFILL_DEVICE=cpu``, which
    subprocesses inherit too), so their exact comparisons hold on a GPU machine as well; the
    CUDA paths have their own tests, marked ``gpu``."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("FASTFILL_DEVICE", "cpu")
