"""Every kind of embedder gives the same features when several threads embed with one model at
once as when they embed one at a time (the backfill runs chunks in threads over one model)."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from fastfill.components.experiment.models import Embedder
from fastfill.components.model_store.embedders import ModuleEmbedder
from fastfill.components.model_store.preprocessing import Preprocessing
from fastfill.components.model_store.sources import from_onnx, from_torchvision
from fastfill.components.platform.config import TrainConfig

INPUT = Preprocessing(channels=3, height=24, width=24, mean=(0.5,), std=(0.25,))
THREADS, ROUNDS, BATCH = 6, 4, 5


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (BATCH, 3, 24, 24), generator=generator, dtype=torch.uint8).float()
            for _ in range(THREADS * ROUNDS)]


def _small_net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 24), nn.ReLU(), nn.Linear(24, 7)).eval()


def _concurrent_equals_sequential(embed) -> None:
    batches = _batches()
    with torch.no_grad():
        alone = [embed(b).numpy().copy() for b in batches]
        with ThreadPoolExecutor(THREADS) as pool:
            together = [out.numpy() for out in pool.map(lambda b: embed(b), batches)]
    for i, (a, b) in enumerate(zip(alone, together)):
        assert a.shape == b.shape and a.dtype == b.dtype, i
        assert a.tobytes() == b.tobytes(), f"batch {i}: other features when embedded beside other threads"


def test_a_torchvision_model_read_at_its_head_embeds_the_same_from_many_threads(tmp_path):
    from safetensors.torch import save_file

    from fastfill.components.experiment.vision import torchvision

    torch.manual_seed(2)
    save_file(torchvision.models.resnet18(num_classes=6).state_dict(), str(tmp_path / "w.safetensors"))
    source = from_torchvision("resnet18", tmp_path / "w.safetensors", INPUT)
    _concurrent_equals_sequential(source.embedder.embed_pixels)


@pytest.mark.parametrize("layer", [None, "6"])  # the head's input (pre-hook), a named layer's output (hook)
def test_a_torch_module_read_at_a_layer_embeds_the_same_from_many_threads(layer):
    net = _small_net()
    embedder = ModuleEmbedder(net, INPUT, layer=layer, head=None if layer else "8")
    _concurrent_equals_sequential(embedder.embed_pixels)


def test_an_onnx_model_embeds_the_same_from_many_threads(tmp_path):
    net = _small_net()
    torch.onnx.export(net, (torch.zeros(1, 3, 24, 24),), str(tmp_path / "m.onnx"), dynamo=False,
                      input_names=["images"], output_names=["embedding"],
                      dynamic_axes={"images": {0: "batch"}, "embedding": {0: "batch"}})
    source = from_onnx(tmp_path / "m.onnx", INPUT)
    _concurrent_equals_sequential(source.embedder.embed_pixels)


def test_the_projects_own_model_embeds_the_same_from_many_threads():
    torch.manual_seed(4)
    model = Embedder(TrainConfig(backbone="cnn_small", width=8, embedding_dim=16), 3, list(range(4))).eval()
    _concurrent_equals_sequential(lambda b: model(b / 255.0))


def test_a_copied_module_embedder_keeps_its_own_capture_state():
    import copy
    import pickle

    embedder = ModuleEmbedder(_small_net(), INPUT, head="8")
    batch = _batches()[0]
    with torch.no_grad():
        expected = embedder.embed_pixels(batch)
        for twin in (copy.deepcopy(embedder), pickle.loads(pickle.dumps(embedder))):
            assert torch.equal(twin.embed_pixels(batch), expected)
            assert torch.equal(twin.classify(expected), embedder.classify(expected))  # the head alone: no capture
