"""Marks every test under tests/integration with ``integration``, so the tiers can be chosen
with ``-m`` as well as by folder, and keeps every test not marked ``gpu`` on the CPU."""

# The tests compute as the product does: every library's CPU kernels pinned (compute.cpu_kernels'
# default) before any test loads numpy or torch, so that one process never mixes kernels loaded
# before the pin with kernels loaded after it (an exact comparison of two embeddings would see it).
from fastfill.components.platform.runtime import DEFAULT_CPU_KERNELS, pin_cpu_kernels

pin_cpu_kernels(DEFAULT_CPU_KERNELS)

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/integration/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(autouse=True)
def _cpu_unless_marked_gpu(request, monkeypatch):
    """Tests not marked ``gpu`` run on the CPU on any machine (``FASTFILL_DEVICE=cpu``, which
    subprocesses inherit too), so their exact comparisons hold on a GPU machine as well; the
    CUDA paths have their own tests, marked ``gpu``."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("FASTFILL_DEVICE", "cpu")
