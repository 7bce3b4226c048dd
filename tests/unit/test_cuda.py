"""The CUDA paths (marked ``gpu``; skipped, and reported as skipped, on a machine without CUDA):
training and inference on the GPU give what the same weights give on the CPU."""

import numpy as np
import pytest
import torch

from components.experiment.inference import apply_alignment, embed
from components.experiment.models import AlignmentMap, Embedder
from components.experiment.map_training import train_alignment
from components.platform.config import AlignConfig, TrainConfig

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")]
CUDA = torch.device("cuda")


def test_embedding_on_the_gpu_matches_the_cpu():
    torch.manual_seed(0)
    model = Embedder(TrainConfig(backbone="cnn", width=4, embedding_dim=12), 1, [0, 1, 2]).eval()
    images = np.random.default_rng(0).integers(0, 256, size=(40, 1, 16, 16), dtype=np.uint8)
    on_cpu = embed(model, images, device=torch.device("cpu"))
    on_gpu = embed(model, images, device=CUDA)
    np.testing.assert_allclose(on_gpu, on_cpu, atol=1e-3)


def test_a_map_trained_on_the_gpu_applies_alike_on_both_devices():
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 4, 300)
    new = (rng.normal(size=(4, 8))[labels] + 0.3 * rng.normal(size=(300, 8))).astype(np.float32)
    old = np.tanh(new @ rng.normal(size=(8, 6))).astype(np.float32)
    config = AlignConfig(hidden=[16], epochs=3, warmup_epochs=1, batch_size=64, min_steps=0, uncertainty=True,
                         validation_fraction=0.0)
    h, history = train_alignment(config, old, new, labels, torch.nn.Linear(8, 4, bias=False), device=CUDA,
                                 log=lambda message: None)
    assert isinstance(h, AlignmentMap) and np.isfinite(history[-1]["loss"])
    gpu_out, gpu_sigma = apply_alignment(h, old, device=CUDA)
    cpu_out, cpu_sigma = apply_alignment(h, old, device=torch.device("cpu"))
    np.testing.assert_allclose(gpu_out, cpu_out, atol=1e-4)
    np.testing.assert_allclose(gpu_sigma, cpu_sigma, atol=1e-4)
