"""Backfill throughput through the whole path against bare embedding, side by side.

Bare: ``embed(model, images)`` on all items in one process (the floor a backfill can't beat).
Pipeline: the upgrade flow's backfill phase on a stored gallery: Prefect tasks per chunk with
bounded concurrency, each reading its images from the store, embedding them with the same
model, writing the features and then its completion marker, with the flow logging progress
to MLflow and a Prefect artifact. Both run on the same items with the same model; repetitions
alternate, and the median of each is reported with their ratio.

    .venv/bin/python benchmarks/backfill_throughput.py                 # local folder store
    .venv/bin/python benchmarks/backfill_throughput.py --store s3      # a moto S3 server, its own process

With ``--images files`` the gallery is adopted where its images are: one PNG file per item
(the Fashion-MNIST images, repeated and lightly augmented, shifted and flipped, to reach
``--items``) in a local folder, or in the S3 bucket with ``--store s3``; each chunk reads and
decodes its images by URI. Bare embedding takes the same images already in memory.

    .venv/bin/python benchmarks/backfill_throughput.py --images files --items 100000 --chunk-sizes 1000 --concurrency 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastfill.components.platform import runtime  # noqa: E402,F401  (Prefect settings before Prefect loads)


def _images(n: int) -> tuple[np.ndarray, str]:
    import tempfile as _tempfile

    from fastfill.components.experiment.data import DataError, load_raw_dataset, load_split
    from fastfill.components.platform.config import load_params

    try:
        images = load_split(Path("data/splits"), "test").images
        source = "Fashion-MNIST test split (data/splits)"
    except (FileNotFoundError, DataError):
        try:  # the raw test set from the Debian package, as the prepare stage reads it
            images = load_raw_dataset(load_params("params.yaml").prepare, Path(_tempfile.mkdtemp())).test.images
            source = "Fashion-MNIST test set (dataset-fashion-mnist)"
        except Exception:  # noqa: BLE001 - no dataset here: random images of the same shape
            images = np.random.default_rng(0).integers(0, 256, size=(n, 1, 28, 28), dtype=np.uint8)
            source = "random 28x28 images (no Fashion-MNIST here)"
    if images.ndim == 3:
        images = images[:, None]
    reps = -(-n // len(images))
    return np.concatenate([images] * reps)[:n], source


def _models():
    import torch

    from fastfill.components.experiment.models import AlignmentMap, Embedder
    from fastfill.components.platform.config import load_params

    params = load_params("params.yaml")
    torch.manual_seed(0)
    old = Embedder(params.train.old, 1, list(range(5))).eval()
    new = Embedder(params.train.new, 1, list(range(10))).eval()
    h = AlignmentMap(old.embedding_dim, new.embedding_dim, [256], uncertainty=True).eval()
    return params, old, new, h


def _augment(images: np.ndarray) -> np.ndarray:
    """Light augmentation, so repeated images are not identical: a shift of up to 2 pixels and a
    horizontal flip, drawn per item."""
    rng = np.random.default_rng(0)
    out = np.empty_like(images)
    for i, image in enumerate(images):
        dy, dx = rng.integers(-2, 3, size=2)
        shifted = np.roll(image, (int(dy), int(dx)), axis=(1, 2))
        out[i] = shifted[:, :, ::-1] if rng.random() < 0.5 else shifted
    return out


def _write_files(images: np.ndarray, root: str) -> float:
    """One PNG per item under ``root`` (a folder or s3://bucket/prefix); returns the mean bytes."""
    import io
    from concurrent.futures import ThreadPoolExecutor

    from PIL import Image

    if root.startswith("s3://"):
        import boto3

        client = boto3.client("s3")
        bucket, _, prefix = root[5:].partition("/")

        def put(name: str, data: bytes) -> None:
            client.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=data)
    else:
        os.makedirs(root, exist_ok=True)

        def put(name: str, data: bytes) -> None:
            Path(root, name).write_bytes(data)

    def write(i: int) -> int:
        buffer = io.BytesIO()
        Image.fromarray(images[i, 0], mode="L").save(buffer, format="PNG")
        put(f"{i}.png", buffer.getvalue())
        return buffer.tell()

    with ThreadPoolExecutor(16) as pool:
        sizes = list(pool.map(write, range(len(images))))
    return float(np.mean(sizes))


def _fresh_gallery(uri: str, images, old, h, chunk_size: int, mlflow_uri: str, files_root: str | None = None):
    import pyarrow as pa

    from fastfill.components.experiment.inference import embed
    from fastfill.components.gallery.inputs.adopt import adopt
    from fastfill.components.gallery.layouts.catalog import PartsGallery, ingest
    from fastfill.components.gallery.store import open_store
    from fastfill.components.gallery.upgrade import planning
    from fastfill.components.platform.registry import ModelRef

    store = open_store(uri)
    old_ref, new_ref = ModelRef("bench", "1", old.embedding_dim), ModelRef("bench", "2", 128)
    if files_root is None:
        ingest(store, images, embed(old, images), old_ref, part_size=1000)
    else:
        table = pa.table({"id": np.arange(len(images)), "uri": [f"{i}.png" for i in range(len(images))]})
        adopt(store, table, old_ref, images.shape[1:], root=files_root, features=iter([embed(old, images)]),
              part_size=1000)
    gallery = PartsGallery(store)
    uid = planning.upgrade_id(old_ref, new_ref)
    for part in range(gallery.num_parts):
        planning.transform_part(gallery, uid, h, part)
    import mlflow

    client = mlflow.MlflowClient(mlflow_uri)
    experiment = client.get_experiment_by_name("bench") or client.get_experiment(client.create_experiment("bench"))
    run = client.create_run(experiment.experiment_id)
    plan = planning.Plan(uid, old_ref, new_ref, "none", "sigma", chunk_size, len(images), 0, "l2", run.info.run_id)
    planning.commit_plan(gallery, plan, planning.make_order(gallery, uid, "sigma", 0))
    return gallery, plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=10000)
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[1000, 250])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--store", choices=["local", "s3"], default="local")
    parser.add_argument("--images", choices=["packed", "files"], default="packed",
                        help="packed parts in the store (ingest), or one PNG file per item read by URI (adopt)")
    args = parser.parse_args()

    import torch
    from prefect import flow
    from prefect.task_runners import ThreadPoolTaskRunner

    from fastfill.components.experiment.inference import embed
    from fastfill.components.gallery.layouts.catalog import IMAGE_CACHE
    from fastfill.components.platform.config import parse_params
    from fastfill.flows.upgrade import backfill_plan

    images, source = _images(args.items)
    params, old, new, h = _models()
    work = Path(tempfile.mkdtemp(prefix="fastfill-bench-"))
    mlflow_uri = f"sqlite:///{work / 'mlflow.db'}"
    os.environ["MLFLOW_TRACKING_URI"] = mlflow_uri
    server = None
    if args.store == "s3":  # moto's server in its own process, as a real endpoint would be
        import socket
        import subprocess

        import boto3

        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        server = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.environ["AWS_ENDPOINT_URL_S3"] = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                boto3.client("s3").create_bucket(Bucket="bench")
                break
            except Exception:  # noqa: BLE001 - the server is still starting
                time.sleep(0.2)
    files_root = None
    if args.images == "files":
        images = _augment(images)
        files_root = str(work / "images") if args.store == "local" else "s3://bench/images"
        started = time.perf_counter()
        mean_bytes = _write_files(images, files_root)
        print(f"wrote {len(images)} PNG files ({mean_bytes:.0f} bytes each on average) to {files_root} in "
              f"{time.perf_counter() - started:.0f} s")

    print(f"{len(images)} items: {source}; model {params.train.new.backbone} width {params.train.new.width}; "
          f"device {'cuda' if torch.cuda.is_available() else 'cpu'}, {torch.get_num_threads()} torch threads; "
          f"store {args.store}, images {args.images}")

    @flow(name="benchmark-backfill")
    def run_backfill(run_params, gallery, uri, plan, model):
        return backfill_plan(run_params, gallery, plan, model)

    def bare() -> float:
        start = time.perf_counter()
        embed(new, images, batch_size=params.gallery.upgrade.batch_size)
        return len(images) / (time.perf_counter() - start)

    counter = iter(range(10**6))

    def pipeline(chunk_size: int, concurrency: int) -> float:
        index = next(counter)
        uri = str(work / f"store-{index}") if args.store == "local" else f"s3://bench/run-{index}"
        gallery, plan = _fresh_gallery(uri, images, old, h, chunk_size, mlflow_uri, files_root)
        data = params.model_dump(mode="json")
        data["gallery"]["upgrade"].update(chunk_size=chunk_size, max_concurrency=concurrency)
        data["mlflow"]["tracking_uri"] = mlflow_uri
        run_params = parse_params(data)
        IMAGE_CACHE._parts.clear()  # every run reads its images from the store
        runner = run_backfill.with_options(task_runner=ThreadPoolTaskRunner(max_workers=concurrency + 1))
        start = time.perf_counter()
        result = runner(run_params, gallery, uri, plan, new)
        seconds = time.perf_counter() - start
        assert result.complete, result
        if args.store == "local":
            shutil.rmtree(uri, ignore_errors=True)
        return len(images) / seconds

    bare()  # warm-up (oneDNN kernels, allocator)
    pipeline(args.chunk_sizes[0], args.concurrency[0])
    rows = []
    for chunk_size in args.chunk_sizes:
        for concurrency in args.concurrency:
            bare_runs, pipe_runs = [], []
            for _ in range(args.repeats):
                bare_runs.append(bare())
                pipe_runs.append(pipeline(chunk_size, concurrency))
            b, p = statistics.median(bare_runs), statistics.median(pipe_runs)
            rows.append((chunk_size, concurrency, b, p, p / b))
            print(f"chunk {chunk_size:>5}, concurrency {concurrency}: bare {b:8.0f} items/s, pipeline {p:8.0f} items/s, "
                  f"ratio {p / b:.3f}", flush=True)
    print("\n| chunk size | concurrency | bare items/s | pipeline items/s | pipeline / bare |")
    print("|---:|---:|---:|---:|---:|")
    for chunk_size, concurrency, b, p, ratio in rows:
        print(f"| {chunk_size} | {concurrency} | {b:.0f} | {p:.0f} | {ratio:.3f} |")
    if server is not None:
        server.terminate()
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
