"""The one place that imports torchvision.

PyPI only carries CUDA builds of torchvision. Next to a CPU-only torch its compiled extension
(``torchvision._C``) does not load, and ``import torchvision`` then dies while registering fake
kernels for the compiled detection ops (``operator torchvision::nms does not exist``). The
project uses only the pure-Python parts of torchvision (datasets, ResNet-18), so when, and only
when, that specific failure happens, the two registration modules are replaced by empty
stand-ins and the import is retried. Where the extension loads (any CUDA machine) nothing here
is active. The compiled ops (``torchvision.ops.nms``, image decoding) stay unavailable on such a
machine, and nothing in the project calls them.

torchvision loads on first use (``vision.torchvision``, or ``from ... import torchvision``): it
takes about 2 s (it loads torch's compiler stack), which a command that never builds a
torchvision network (the tiny CNN, an ONNX model, a status) does not pay.
"""

from __future__ import annotations

import functools
import sys
import types

_STUBBED = ("torchvision._meta_registrations", "torchvision._autograd_registrations")


def _import_torchvision():
    try:
        import torchvision
    except RuntimeError as error:
        if "torchvision::" not in str(error):
            raise
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        for name in _STUBBED:
            sys.modules[name] = types.ModuleType(name)
        import torchvision
    return torchvision


@functools.cache
def _loaded():
    return _import_torchvision()


def __getattr__(name: str):
    if name == "torchvision":
        return _loaded()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
