"""The one place that imports torchvision.

PyPI only carries CUDA builds of torchvision. Next to a CPU-only torch its compiled extension
(``torchvision._C``) does not load, and ``import torchvision`` then dies while registering fake
kernels for the compiled detection ops (``operator torchvision::nms does not exist``). The
project uses only the pure-Python parts of torchvision (datasets, ResNet-18), so when, and only
when, that specific failure happens, the two registration modules are replaced by empty
stand-ins and the import is retried. Where the extension loads (any CUDA machine) nothing here
is active. The compiled ops (``torchvision.ops.nms``, image decoding) stay unavailable on such a
machine, and nothing in the project calls them.
"""

from __future__ import annotations

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


torchvision = _import_torchvision()
EXTENSION_LOADED: bool = bool(torchvision.extension._has_ops())
