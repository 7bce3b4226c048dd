"""Embedding throughput of a team's models through the product, against the bare runtime.

For an ONNX graph (onnxruntime) and a torchvision network (torch), both on the CPU with the same
threads and batch: images per second of

- the bare runtime: ``session.run`` / ``net(x)`` on batches already scaled by mean and std;
- the product: ``components.experiment.inference.embed`` of uint8 images through the registered
  kind of embedder (``OnnxEmbedder``, ``TorchvisionEmbedder``), which scales inside;

measured side by side in one run, alternating, best of ``--repeats``; the ratio is product / bare
(1.0: no overhead).

Then the backfill's whole step on JPEG files of mixed sizes (read, decode by the model's
preprocessing, embed): read ahead of the model (``backfill.embed_streamed``, what a chunk does)
and read first then embedded, each against the bare runtime on the images already decoded.

Run: ``.venv/bin/python benchmarks/team_model_throughput.py`` (``--quick``: the small models only).
"""

from __future__ import annotations

import argparse
import functools
import io
import time

import numpy as np
import torch


def _best(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def _rows(args, onnx_arch: str, torch_arch: str, size: int, images: int) -> list[tuple]:
    import onnxruntime as ort

    from fastfill.components.experiment.inference import embed
    from fastfill.components.experiment.vision import torchvision
    from fastfill.components.model_store.embedders import OnnxEmbedder, TorchvisionEmbedder
    from fastfill.components.model_store.preprocessing import Preprocessing

    prep = Preprocessing(channels=3, height=size, width=size, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    pixels = np.random.default_rng(0).integers(0, 256, (images, *prep.shape), dtype=np.uint8)
    scaled = prep.normalise(torch.from_numpy(pixels).float() / 255).contiguous()
    torch.manual_seed(0)
    graph = io.BytesIO()
    torch.onnx.export(torchvision.models.get_model(onnx_arch, num_classes=10).eval(), (scaled[:1],), graph,
                      dynamo=False, input_names=["images"], dynamic_axes={"images": {0: "n"}})
    options = ort.SessionOptions()  # the bare runtime: its defaults, the same threads
    options.intra_op_num_threads = args.threads
    session = ort.InferenceSession(graph.getvalue(), sess_options=options, providers=["CPUExecutionProvider"])
    onnx = OnnxEmbedder(graph.getvalue(), prep, threads=args.threads)
    onnx.probe()
    net = torchvision.models.get_model(torch_arch, num_classes=10).eval()
    tv = TorchvisionEmbedder(torch_arch, net.state_dict(), prep)
    tv.probe()
    bare_net = torchvision.models.get_model(torch_arch, num_classes=10).eval()
    bare_net.load_state_dict(net.state_dict())
    batches = [scaled[start:start + args.batch] for start in range(0, images, args.batch)]
    arrays = [b.numpy() for b in batches]

    def bare_onnx():
        for batch in arrays:
            session.run(None, {"images": batch})

    def bare_torch():  # the whole network, its classifier included: the product reads its input
        with torch.no_grad():
            for batch in batches:
                bare_net(batch)

    files = _jpeg_files(images, size)
    rows = []
    for name, bare, model in ((f"onnx {onnx_arch} {size}px", bare_onnx, onnx),
                              (f"torchvision {torch_arch} {size}px", bare_torch, tv)):
        product = functools.partial(embed, model, pixels, batch_size=args.batch, device=torch.device("cpu"))
        streamed, sequential = _backfill_steps(model, files, args.batch)
        runs = {"bare": bare, "product": product, "streamed": streamed, "sequential": sequential}
        for run in runs.values():
            run()  # warm-up
        times: dict = {key: [] for key in runs}
        for _ in range(args.repeats):  # alternating: the machine's noise falls on all alike
            for key, run in runs.items():
                times[key].append(_best(run, 1))
        best = {key: min(value) for key, value in times.items()}
        rows.append((name, images / best["bare"], images / best["product"], best["bare"] / best["product"]))
        rows.append(("  backfill step, read ahead", images / best["bare"], images / best["streamed"],
                     best["bare"] / best["streamed"]))
        rows.append(("  backfill step, read first", images / best["bare"], images / best["sequential"],
                     best["bare"] / best["sequential"]))
    return rows


def _jpeg_files(count: int, size: int) -> list[str]:
    """``count`` JPEG photos of mixed sizes (around the model's input) in a temporary folder."""
    import atexit
    import shutil
    import tempfile

    from PIL import Image

    folder = tempfile.mkdtemp(prefix="throughput-jpegs-")
    atexit.register(shutil.rmtree, folder, True)
    rng = np.random.default_rng(1)
    paths = []
    for i in range(count):
        width, height = (int(x) for x in rng.integers(size // 2, 2 * size, size=2))
        path = f"{folder}/{i}.jpg"
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB").save(path, quality=90)
        paths.append(path)
    return paths


def _backfill_steps(model, files: list[str], batch: int):
    """(read ahead, read first): the backfill's read + decode + embed of ``files``."""
    from fastfill.components.experiment.inference import embed
    from fastfill.components.gallery.inputs.images import read_images
    from fastfill.components.gallery.upgrade.backfill import embed_streamed

    prep = model.preprocessing
    cpu = torch.device("cpu")

    def streamed():
        embed_streamed(lambda rows: read_images([files[r] for r in rows], prep, workers=1),
                       lambda images: embed(model, images, batch_size=batch, device=cpu),
                       len(files), model.embedding_dim, batch)

    def sequential():
        images, _ = read_images(files, prep, workers=1)
        embed(model, images, batch_size=batch, device=cpu)

    return streamed, sequential


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="only the small models")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = _rows(args, "mobilenet_v3_small", "resnet18", 128, 256)
    if not args.quick:
        rows += _rows(args, "resnet50", "convnext_tiny", 224, 64)
    print(f"batch {args.batch}, {args.threads} threads, best of {args.repeats}, CPU; ratio = product / bare")
    print(f"{'model':<36} {'bare img/s':>11} {'product img/s':>14} {'ratio':>6}")
    for name, bare, product, ratio in rows:
        print(f"{name:<36} {bare:>11.1f} {product:>14.1f} {ratio:>6.2f}")


if __name__ == "__main__":
    main()
