"""Embedding throughput of a team's models through the product, against the bare runtime.

For an ONNX graph (onnxruntime) and a torchvision network (torch), both on the CPU with the same
threads and batch: images per second of

- the bare runtime: ``session.run`` / ``net(x)`` on batches already scaled by mean and std;
- the product: ``components.experiment.inference.embed`` of uint8 images through the registered
  kind of embedder (``OnnxEmbedder``, ``TorchvisionEmbedder``), which scales inside;

measured side by side in one run, alternating, best of ``--repeats``; the ratio is product / bare
(1.0: no overhead). Run: ``.venv/bin/python benchmarks/team_model_throughput.py``.
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from components.experiment.inference import embed
    from components.experiment.vision import torchvision
    from components.model_store.embedders import OnnxEmbedder, TorchvisionEmbedder
    from components.model_store.preprocessing import Preprocessing

    prep = Preprocessing(channels=3, height=args.size, width=args.size, mean=(0.485, 0.456, 0.406),
                         std=(0.229, 0.224, 0.225))
    pixels = np.random.default_rng(0).integers(0, 256, (args.images, *prep.shape), dtype=np.uint8)
    scaled = prep.normalise(torch.from_numpy(pixels).float() / 255)
    torch.manual_seed(0)
    rows = []

    net = torchvision.models.resnet18(num_classes=10).eval()
    graph = io.BytesIO()
    torch.onnx.export(torchvision.models.mobilenet_v3_small(num_classes=10).eval(), (scaled[:1],), graph,
                      dynamo=False, input_names=["images"], dynamic_axes={"images": {0: "n"}})
    onnx = OnnxEmbedder(graph.getvalue(), prep, threads=args.threads)
    onnx.probe()
    tv = TorchvisionEmbedder("resnet18", net.state_dict(), prep)
    tv.probe()
    bare_net = torchvision.models.resnet18(num_classes=10).eval()
    bare_net.load_state_dict(net.state_dict())
    bare_net.fc = torch.nn.Identity()

    def bare_onnx():
        for start in range(0, args.images, args.batch):
            onnx.session.run(None, {"images": scaled[start:start + args.batch].numpy()})

    def bare_torch():
        with torch.no_grad():
            for start in range(0, args.images, args.batch):
                bare_net(scaled[start:start + args.batch])

    for name, bare, model in (("onnx (mobilenet_v3_small)", bare_onnx, onnx), ("torchvision (resnet18)", bare_torch, tv)):
        product = lambda: embed(model, pixels, batch_size=args.batch, device=torch.device("cpu"))  # noqa: E731
        bare(), product()  # warm-up
        t_bare, t_product = [], []
        for _ in range(args.repeats):  # alternating: the machine's noise falls on both alike
            t_bare.append(_best(bare, 1))
            t_product.append(_best(product, 1))
        b, p = min(t_bare), min(t_product)
        rows.append((name, args.images / b, args.images / p, b / p))

    print(f"{args.images} images of {prep.shape}, batch {args.batch}, {args.threads} threads, best of {args.repeats}")
    print(f"{'model':<28} {'bare img/s':>11} {'product img/s':>14} {'ratio':>6}")
    for name, bare, product, ratio in rows:
        print(f"{name:<28} {bare:>11.1f} {product:>14.1f} {ratio:>6.2f}")


if __name__ == "__main__":
    main()
