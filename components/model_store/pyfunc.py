"""The ``python_function`` flavour of every model the product registers (its ``loader_module``).

MLflow calls ``_load_pyfunc(data_path)`` with the version's ``fastfill/`` folder: a typed
description and its weights (safetensors or an ONNX graph). The network is built from the
description, so nothing stored in the registry runs as code: ``mlflow.pyfunc.load_model`` and
``mlflow models serve`` need this package installed, as a built-in flavour needs its library.

- an embedder's ``predict`` takes images, uint8 (N, C, H, W) in the model's preprocessing shape
  ((N, H, W) for one channel; any other size or channel count goes through the model's own resize
  rule), and returns float32 embeddings (N, d), the same the product computes;
- an alignment map's ``predict`` takes old features (N, d_old) and returns ``features``
  (N, d_new) and, when it has an uncertainty head, ``log_sigma2`` (N,).
"""

from __future__ import annotations

import numpy as np

from fastfill.components.experiment.inference import apply_alignment, embed
from fastfill.components.model_store.artifact import load_folder


class EmbedderModel:
    def __init__(self, module):
        self.module = module

    def predict(self, model_input, params=None):

        images = np.asarray(model_input)
        if images.ndim == 3:
            images = images[:, None]
        if images.dtype != np.uint8:
            images = np.clip(np.rint(images.astype(np.float64)), 0, 255).astype(np.uint8)
        return embed(self.module, images, batch_size=int((params or {}).get("batch_size", 256)))

    def unwrap_python_model(self):
        return self.module


class AlignmentModel:
    def __init__(self, module):
        self.module = module

    def predict(self, model_input, params=None):
        import torch

        old = np.ascontiguousarray(model_input, dtype=np.float32)
        if not hasattr(self.module, "uncertainty"):  # the unified space: its gallery side
            with torch.no_grad():
                return self.module.eval()(torch.from_numpy(old)).numpy()
        features, log_sigma2 = apply_alignment(self.module, old)
        if log_sigma2 is None:
            return features
        return {"features": features, "log_sigma2": log_sigma2}

    def unwrap_python_model(self):
        return self.module


def _load_pyfunc(data_path: str):

    module = load_folder(data_path, uri=data_path)
    kind = getattr(module, "fastfill_kind", "embedder")
    return AlignmentModel(module) if kind == "alignment" else EmbedderModel(module)
