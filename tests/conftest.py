"""Marks every test under tests/integration with ``integration``, so the tiers can be chosen
with ``-m`` as well as by folder, keeps every test not marked ``gpu`` on the CPU, and lays the
tests out for pytest-xdist's workers (``--dist loadgroup``, in addopts):

- a module whose tests share a fixture set up once per module or class (a pipeline run, a
  comparison, a stack) runs whole on one worker, so that fixture is set up once; so does every
  module of the unit tier (short files: a file is fine-grained enough);
- the other integration tests go one by one to whichever worker is free, so a module of many
  slow tests (each layout of each upgrade test) is spread over the workers instead of bounding
  the run's wall time on one of them;
- the ``slow`` integration tests are sent first and the unit tier last (the order in which the
  workers are handed work is the collection's: ``--no-loadscope-reorder``), so the run does not
  end waiting on one long test started late."""

# The tests compute as the product does: every library's CPU kernels pinned (compute.cpu_kernels'
# default) before any test loads numpy or torch, so that one process never mixes kernels loaded
# before the pin with kernels loaded after it (an exact comparison of two embeddings would see it).
from fastfill.components.platform.runtime import DEFAULT_CPU_KERNELS, pin_cpu_kernels

pin_cpu_kernels(DEFAULT_CPU_KERNELS)

import pytest  # noqa: E402


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/integration/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.integration)
    whole = {_module(item) for item in items if item.get_closest_marker("integration") is None
             or _shares_module_state(item)}
    # slow integration tests first, then the other integration tests, the unit tier last; a module
    # that runs whole stays in one piece, where its first test goes
    rank = {}
    for item in items:
        key = _module(item) if _module(item) in whole else item.nodeid
        rank[key] = min(rank.get(key, 3), 2 if item.get_closest_marker("integration") is None
                        else 0 if item.get_closest_marker("slow") else 1)
        if key == _module(item):
            item.add_marker(pytest.mark.xdist_group(key))
    items.sort(key=lambda item: rank[_module(item) if _module(item) in whole else item.nodeid])


def _module(item) -> str:
    return item.nodeid.split("::", 1)[0]


def _shares_module_state(item) -> bool:
    """Whether the test uses a fixture set up once for its module, class or package."""
    info = getattr(item, "_fixtureinfo", None)
    return any(definitions[-1].scope in ("module", "class", "package")
               for definitions in (info.name2fixturedefs.values() if info else ()) if definitions)


@pytest.fixture(autouse=True)
def _cpu_unless_marked_gpu(request, monkeypatch):
    """Tests not marked ``gpu`` run on the CPU on any machine (``FASTFILL_DEVICE=cpu``, which
    subprocesses inherit too), so their exact comparisons hold on a GPU machine as well; the
    CUDA paths have their own tests, marked ``gpu``."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("FASTFILL_DEVICE", "cpu")
