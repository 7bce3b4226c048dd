"""The CUDA paths against the CPU, side by side in one run, on a machine with a GPU.

1. Quality of mixed precision: an embedder trained on 8,000 Fashion-MNIST test images (on the
   GPU), then top-1 and mAP (leave-one-out retrieval) of the other 2,000 embedded on the CPU in
   float32, on the GPU in float32 and on the GPU under autocast (``precision: auto``).
2. Embedding throughput (``embed``, batch 512 as the upgrade's default, and 2048): CPU float32,
   GPU float32, GPU autocast; items per second and the ratios; for the trained CNN and for an
   untrained resnet18 (the heavier backbone the configuration offers).
3. Search: a flat index of ``--gallery`` random vectors (d = 128), ``--queries`` queries, k = 10:
   faiss on the CPU against the index's copy on the GPU (``gallery.index.device``), queries per
   second, the copy's load time and how often the two return the same ids.
4. Backfill: every chunk of an upgrade of a ``--backfill-items`` gallery in a local store,
   ``backfill_chunk`` one after another on the CPU and on the GPU (autocast): items per second,
   and the cosine between the two runs' features.

    python benchmarks/gpu_paths.py --fashion /usr/share/datasets/fashion-mnist --out gpu_paths.json

Without ``--fashion`` the images are random (parts 2 to 4 time the same work; part 1 is left out).
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CPU_NAME = "cpu"


def _idx(path: Path, header: int) -> np.ndarray:
    with gzip.open(path) as f:
        return np.frombuffer(f.read()[header:], dtype=np.uint8)


def fashion_test(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    images = _idx(folder / "t10k-images-idx3-ubyte.gz", 16).reshape(-1, 1, 28, 28)
    labels = _idx(folder / "t10k-labels-idx1-ubyte.gz", 8).astype(np.int64)
    return images, labels


def timed(fn, repeats: int = 3) -> tuple[float, object]:
    """Median seconds of ``repeats`` calls after one warm-up, and the last result."""
    fn()
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return float(np.median(times)), result


def quality(images, labels, cuda) -> dict:
    import torch

    from fastfill.components.evaluation.retrieval import retrieval_metrics
    from fastfill.components.experiment.data import Split
    from fastfill.components.experiment.inference import embed
    from fastfill.components.experiment.training import TrainingRun, train_embedder
    from fastfill.components.platform.config import TrainConfig

    train, test = slice(0, 8000), slice(8000, 10000)
    pixels = images[train].astype(np.float32) / 255.0
    model, _ = train_embedder(TrainConfig(epochs=5), Split(images[train], labels[train]), list(range(10)),
                              (float(pixels.mean()), float(pixels.std())), run=TrainingRun(device=cuda, log=lambda m: None))
    model = model.eval()
    out = {}
    for name, device, precision in ((CPU_NAME, torch.device("cpu"), "fp32"), ("cuda fp32", cuda, "fp32"),
                                    ("cuda auto", cuda, "auto")):
        features = embed(model, images[test], device=device, precision=precision)
        out[name] = {k: round(100 * v, 2) for k, v in retrieval_metrics(features, features, labels[test]).items()}
        out[name]["features"] = features
    exact = out[CPU_NAME].pop("features")
    for name in ("cuda fp32", "cuda auto"):
        features = out[name].pop("features")
        cosine = (features * exact).sum(1) / np.linalg.norm(features, axis=1) / np.linalg.norm(exact, axis=1)
        out[name]["min_cosine_to_cpu"] = round(float(cosine.min()), 6)
    return out, model


def throughput(model, images, cuda, batch_sizes=(512, 2048), cpu_items: int = 20000) -> dict:
    """Items per second of ``embed`` on the CPU (float32, the first ``cpu_items`` images) and on
    the GPU in float32 and under autocast, at each batch size."""
    import torch

    from fastfill.components.experiment.inference import embed

    out = {}
    for batch in batch_sizes:
        row = {}
        for name, device, precision in ((CPU_NAME, torch.device("cpu"), "fp32"), ("cuda fp32", cuda, "fp32"),
                                        ("cuda auto", cuda, "auto")):
            some = images[:cpu_items] if device.type == "cpu" else images
            seconds, _ = timed(functools.partial(embed, model, some, batch_size=batch, device=device,
                                                 precision=precision), repeats=1 if device.type == "cpu" else 3)
            row[name] = round(len(some) / seconds)
        row["ratio cuda fp32 / cpu"] = round(row["cuda fp32"] / row[CPU_NAME], 1)
        row["ratio cuda auto / cpu"] = round(row["cuda auto"] / row[CPU_NAME], 1)
        row["ratio cuda auto / cuda fp32"] = round(row["cuda auto"] / row["cuda fp32"], 2)
        out[f"batch {batch}"] = row
    return out


def search(n: int, queries: int) -> dict:
    import faiss

    from fastfill.components.gallery.search.index import GpuCopy
    from fastfill.components.platform.config import IndexConfig

    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((n, 128), dtype=np.float32)
    q = rng.standard_normal((queries, 128), dtype=np.float32)
    index = faiss.IndexIDMap2(faiss.IndexFlatL2(128))
    index.add_with_ids(vectors, np.arange(n, dtype=np.int64))
    del vectors
    copy = GpuCopy.choose(IndexConfig(device="cuda"), "l2")
    started = time.perf_counter()
    copy.load(index)
    load = time.perf_counter() - started
    cpu_seconds, (_, cpu_ids) = timed(lambda: index.search(q, 10), repeats=1)
    gpu_seconds, (_, gpu_ids) = timed(lambda: copy.search(index, q, 10))
    return {"items": n, "queries": queries, "gpu copy": copy.name, "copy load s": round(load, 3),
            "cpu queries/s": round(queries / cpu_seconds), "gpu queries/s": round(queries / gpu_seconds),
            "ratio gpu / cpu": round(cpu_seconds / gpu_seconds, 1),
            "same ids": round(float((cpu_ids == gpu_ids).mean()), 5)}


def backfill(model, images, cuda) -> dict:
    import torch

    from fastfill.components.experiment.models import AlignmentMap
    from fastfill.components.gallery.layouts.catalog import PartsGallery, ingest
    from fastfill.components.gallery.store import open_store
    from fastfill.components.gallery.upgrade import backfill, planning
    from fastfill.components.platform.registry import ModelRef

    old, new = ModelRef("embedder", "1", 64), ModelRef("embedder", "2", model.embedding_dim)
    torch.manual_seed(0)
    h = AlignmentMap(64, model.embedding_dim, [256], uncertainty=True).eval()
    features = np.random.default_rng(1).standard_normal((len(images), 64), dtype=np.float32)
    out, results = {"items": len(images), "chunk_size": 1000}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, device in ((CPU_NAME, torch.device("cpu")), ("cuda auto", cuda)):
            store = open_store(str(Path(tmp) / name))
            ingest(store, images, features, old, part_size=10000)
            gallery = PartsGallery(store)
            uid = planning.upgrade_id(old, new)
            for part in range(gallery.num_parts):
                planning.transform_part(gallery, uid, h, part)
            plan = planning.Plan(uid, old, new, "models:/embedder-alignment/1", "sigma", 1000, len(images), 0, "l2")
            planning.commit_plan(gallery, plan, planning.make_order(gallery, uid, "sigma", 0))
            backfill.backfill_chunk(gallery, plan.upgrade_id, 0, model, device=device)  # warm-up (first-call costs)
            started = time.perf_counter()
            for chunk in range(1, plan.num_chunks):
                backfill.backfill_chunk(gallery, plan.upgrade_id, chunk, model, device=device)
            out[f"{name} items/s"] = round((len(images) - plan.chunk_size) / (time.perf_counter() - started))
            results[name] = backfill.mixed_features(gallery, plan)[0]
    a, b = results[CPU_NAME], results["cuda auto"]
    cosine = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    out["ratio cuda / cpu"] = round(out["cuda auto items/s"] / out[f"{CPU_NAME} items/s"], 1)
    out["min cosine cuda vs cpu"] = round(float(cosine.min()), 6)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fashion", type=Path, help="folder of the Fashion-MNIST IDX files (t10k-*.gz)")
    parser.add_argument("--items", type=int, default=100000, help="images embedded for the throughput")
    parser.add_argument("--gallery", type=int, default=1000000, help="vectors in the search index")
    parser.add_argument("--queries", type=int, default=10000)
    parser.add_argument("--backfill-items", type=int, default=50000)
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_paths: no CUDA device on this machine; run it where there is one")
    cuda = torch.device("cuda")
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
               "cpu threads": torch.get_num_threads()}
    if args.fashion:
        images, labels = fashion_test(args.fashion)
        results["quality"], model = quality(images, labels, cuda)
        print("quality:", json.dumps(results["quality"]), flush=True)
    else:
        from fastfill.components.experiment.models import Embedder
        from fastfill.components.platform.config import TrainConfig

        images = np.random.default_rng(0).integers(0, 256, size=(10000, 1, 28, 28), dtype=np.uint8)
        model = Embedder(TrainConfig(), 1, list(range(10))).eval()
    many = np.concatenate([images] * -(-args.items // len(images)))[:args.items]
    results["embedding items/s"] = throughput(model, many, cuda)
    print("embedding items/s (cnn):", json.dumps(results["embedding items/s"]), flush=True)
    from fastfill.components.experiment.models import Embedder
    from fastfill.components.platform.config import TrainConfig

    resnet = Embedder(TrainConfig(backbone="resnet18"), 1, list(range(10))).eval()  # untrained: timing only
    results["embedding items/s, resnet18"] = throughput(resnet, many, cuda, cpu_items=5000)
    print("embedding items/s (resnet18):", json.dumps(results["embedding items/s, resnet18"]), flush=True)
    results["search"] = search(args.gallery, args.queries)
    print("search:", json.dumps(results["search"]), flush=True)
    results["backfill"] = backfill(model.cpu(), many[:args.backfill_items], cuda)
    print("backfill:", json.dumps(results["backfill"]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
