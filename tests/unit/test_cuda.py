"""The CUDA paths (marked ``gpu``; skipped, and reported as skipped, on a machine without CUDA):
training, embedding (pinned copies, mixed precision) and search (the index's copy on the GPU)
give what the CPU gives, within the precision asked for."""

import numpy as np
import pytest
import torch

from fastfill.components.experiment.inference import apply_alignment, autocast_dtype, embed
from fastfill.components.experiment.map_training import train_alignment
from fastfill.components.experiment.models import AlignmentMap, Embedder
from fastfill.components.gallery.search.index import GallerySearch, GpuCopy
from fastfill.components.gallery.upgrade import backfill
from fastfill.components.platform.config import AlignConfig, IndexConfig, TrainConfig
from tests.gallery_cases import N, _gallery, _plan, make_data, make_models

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")]
CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def _model_and_images(n=300, seed=0):
    torch.manual_seed(seed)
    model = Embedder(TrainConfig(backbone="cnn", width=16, embedding_dim=32), 1, list(range(10))).eval()
    images = np.random.default_rng(seed).integers(0, 256, size=(n, 1, 28, 28), dtype=np.uint8)
    return model, images


def test_embedding_on_the_gpu_in_float32_matches_the_cpu():
    model, images = _model_and_images()
    on_cpu = embed(model, images, device=CPU)
    on_gpu = embed(model, images, device=CUDA, precision="fp32")
    np.testing.assert_allclose(on_gpu, on_cpu, atol=1e-3)
    # batches smaller than the input and a ragged last one: the pipelined copies keep their order
    np.testing.assert_allclose(embed(model, images, batch_size=7, device=CUDA, precision="fp32"), on_gpu, atol=1e-4)


def test_mixed_precision_embedding_is_close_to_float32_and_returned_as_float32():
    model, _ = _model_and_images()
    rng = np.random.default_rng(3)  # ten kinds of image: retrieval by label means something
    labels = np.repeat(np.arange(10), 30)
    prototypes = rng.integers(0, 256, size=(10, 1, 28, 28))
    images = np.clip(prototypes[labels] + rng.normal(0, 40, size=(300, 1, 28, 28)), 0, 255).astype(np.uint8)
    exact = embed(model, images, device=CUDA, precision="fp32")
    assert autocast_dtype(CUDA, "auto") in (torch.bfloat16, torch.float16)

    def top1(features):
        d = ((features[:, None] - features[None]) ** 2).sum(-1)
        np.fill_diagonal(d, np.inf)
        return (labels[d.argmin(1)] == labels).mean()

    for precision in ("auto", "bf16", "fp16"):
        mixed = embed(model, images, batch_size=64, device=CUDA, precision=precision)
        assert mixed.dtype == np.float32 and np.isfinite(mixed).all()
        assert not np.array_equal(mixed, exact), f"{precision}: autocast did not change the arithmetic"
        cosine = (mixed * exact).sum(1) / np.linalg.norm(mixed, axis=1) / np.linalg.norm(exact, axis=1)
        assert cosine.min() > 0.99, (precision, cosine.min())
        assert abs(top1(mixed) - top1(exact)) <= 0.02, (precision, top1(mixed), top1(exact))


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
    cpu_out, cpu_sigma = apply_alignment(h, old, device=CPU)
    np.testing.assert_allclose(gpu_out, cpu_out, atol=1e-4)
    np.testing.assert_allclose(gpu_sigma, cpu_sigma, atol=1e-4)


@pytest.mark.parametrize("distance", ["l2", "cosine"])
def test_the_index_copy_on_the_gpu_finds_what_faiss_on_the_cpu_finds(distance):
    import faiss

    rng = np.random.default_rng(2)
    vectors = rng.normal(size=(5000, 32)).astype(np.float32)
    queries = rng.normal(size=(300, 32)).astype(np.float32)
    if distance == "cosine":
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    ids = rng.permutation(100000)[:5000].astype(np.int64)
    index = faiss.IndexIDMap2(faiss.IndexFlatIP(32) if distance == "cosine" else faiss.IndexFlatL2(32))
    index.add_with_ids(vectors, ids)
    copy = GpuCopy.choose(IndexConfig(device="cuda"), distance)
    copy.QUERY_SCORES = 5000 * 7  # seven queries at a time: the batching is exercised

    def agree():
        want_scores, want_ids = index.search(queries, 10)
        got_scores, got_ids = copy.search(index, queries, 10)
        assert got_ids.dtype == np.int64 and got_ids.shape == want_ids.shape
        assert (got_ids == want_ids).mean() > 0.999  # exact search; only float near-ties may swap
        np.testing.assert_allclose(got_scores, want_scores, rtol=1e-4, atol=1e-4)

    agree()
    assert not copy.stale
    replaced = ids[:200]  # an upgrade's chunk lands: vectors replaced by id on the CPU index
    index.remove_ids(replaced)
    index.add_with_ids(rng.normal(size=(200, 32)).astype(np.float32), replaced)
    copy.stale = True
    agree()


def test_gallery_search_runs_on_the_gpu_and_follows_an_upgrade(tmp_path):
    models, data = make_models(), make_data()
    _, new, h = models
    gallery = _gallery(str(tmp_path / "store"), models, data)
    on_gpu = GallerySearch(gallery, index=IndexConfig(device="cuda"))
    on_cpu = GallerySearch(gallery, index=IndexConfig(device="cpu"))
    assert on_gpu.searched_on.startswith("cuda") and on_cpu.searched_on == "cpu (faiss)"
    queries = gallery.all_features(gallery.model)[:9]
    np.testing.assert_array_equal(on_gpu.search(queries, 5)[0], on_cpu.search(queries, 5)[0])

    plan = _plan(gallery, h)
    assert on_gpu.refresh() == 0 and on_cpu.refresh() == 0  # the plan: both rebuild for the new model
    for chunk in (0, 1, 2):
        backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, new, device=CPU)
    assert on_gpu.refresh() == 3 and on_cpu.refresh() == 3 and on_gpu.gpu.stale
    queries = embed(new, data[0][:9], device=CPU)
    gpu_ids, gpu_distances = on_gpu.search(queries, 5)
    cpu_ids, cpu_distances = on_cpu.search(queries, 5)
    np.testing.assert_array_equal(gpu_ids, cpu_ids)
    np.testing.assert_allclose(gpu_distances, cpu_distances, rtol=1e-4, atol=1e-5)


def test_a_chunk_backfilled_on_the_gpu_in_mixed_precision_is_close_to_the_cpu(tmp_path):
    models, data = make_models(), make_data()
    _, new, h = models
    stores = []
    for name, device, precision in (("cpu", CPU, "auto"), ("gpu", CUDA, "auto")):
        gallery = _gallery(str(tmp_path / name), models, data)
        plan = _plan(gallery, h)
        for chunk in range(plan.num_chunks):
            backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, new, device=device, precision=precision)
        stores.append(backfill.mixed_features(gallery, plan))
    (cpu, cpu_done), (gpu, gpu_done) = stores
    assert cpu_done.all() and gpu_done.all() and gpu.dtype == np.float32 and len(gpu) == N
    cosine = (cpu * gpu).sum(1) / np.linalg.norm(cpu, axis=1) / np.linalg.norm(gpu, axis=1)
    assert cosine.min() > 0.99, cosine.min()
