"""A retrieval team upgrading its gallery between two models this product never trained, through
the real CLI, measured.

1. **Two models of the team's own.** Two torchvision architectures, trained briefly here on
   Fashion-MNIST's training images made into RGB photos: the old one a MobileNetV3-Small
   (1,024-d embedding, 3x32x32 stretched, classes 0-4 only, exported to ONNX), the new one a
   ResNet-18 (512-d, 3x48x48 shorter side then centre crop, all classes, kept as a torchvision name
   and safetensors weights). Both take ImageNet's mean and std.
2. **Registered with ``fastfill model register``** into a fresh registry of each backend's scratch
   folder: the old one from its ONNX file as ``champion``, the new one from its architecture name
   and weights as ``challenger``.
3. **The gallery**: ``--items`` RGB JPEGs of mixed sizes (each side 28 to 112 pixels, a colour
   tint each) made from the Fashion-MNIST test split, a manifest with ids and URIs and no labels,
   and a judgments file (``--judged`` queries, class-level relevance). On S3 the images are
   uploaded to moto's server and adopted there.
4. **The team's commands** (``benchmarks/team_upgrade_backend.run_backend``): adopt (the old model
   embeds every image), the dry run with the judged queries and the advisor's stop, the upgrade
   that stops there, status, the upgrade to 100% through the judged promotion gate.
5. **FastFill-sigma against FCT-random on that pair**: the same gallery upgraded once more with
   ``gallery.upgrade.method: fct`` and ``order: random``; the gate's judged top-1 and mAP along
   the backfill of both.

Writes ``<out>.md`` and ``<out>.json`` (default ``reports/team_own_models``).

    .venv/bin/python benchmarks/team_own_models.py                 # 3000 items, local and S3
    .venv/bin/python benchmarks/team_own_models.py --items 600 --judged 60 --epochs 1   # a quick check
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.team_upgrade_backend import gate_curve, run_backend  # noqa: E402
from benchmarks.team_upgrade_commands import FASTFILL, ROOT, clean_env, error_lines, run_command  # noqa: E402
from benchmarks.team_upgrade_inputs import BUCKET, FASHION, backend_params, judged_pairs, start_s3  # noqa: E402

IMAGENET = ["--mean", "0.485,0.456,0.406", "--std", "0.229,0.224,0.225"]
OLD = {"architecture": "mobilenet_v3_small", "classes": [0, 1, 2, 3, 4],
       "preprocessing": dict(channels=3, height=32, width=32, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)),
       "options": ["--size", "32", "--channels", "3", "--resize", "stretch", *IMAGENET]}
NEW = {"architecture": "resnet18", "classes": list(range(10)),
       "preprocessing": dict(channels=3, height=48, width=48, resize="shorter_then_crop", resize_to=55,
                             mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)),
       "options": ["--size", "48", "--channels", "3", "--resize", "shorter-then-crop", "--resize-to", "55", *IMAGENET]}


def photo(grey: np.ndarray, rng: np.random.Generator):
    """A Fashion-MNIST image as a team's photo: RGB with a colour tint, resized to a random size
    (an RGB image, (H, W, 3), is tinted and resized the same way)."""
    from PIL import Image

    tint = rng.uniform(0.55, 1.0, size=3)
    pixels = grey if grey.ndim == 3 else grey[..., None]
    rgb = np.clip(pixels.astype(np.float64) * tint, 0, 255).astype(np.uint8)
    width, height = (int(x) for x in rng.integers(28, 113, size=2))
    return Image.fromarray(rgb, "RGB").resize((width, height), Image.Resampling.BICUBIC)


def fashion(split: str):
    from fastfill.components.experiment.data import load_raw_dataset
    from fastfill.components.platform.config import PrepareConfig

    with tempfile.TemporaryDirectory(prefix="team-own-models-idx-") as cache:
        raw = load_raw_dataset(PrepareConfig(dataset="fashion-mnist", source=FASHION), Path(cache))
    return raw.train if split == "train" else raw.test


def _encoded(picture) -> bytes:
    import io

    buffer = io.BytesIO()
    picture.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def train_model(spec: dict, images: np.ndarray, labels: np.ndarray, epochs: int, seed: int, threads: int):
    """A torchvision network of ``spec`` trained briefly (Adam, label smoothing) on the photos of
    ``images`` decoded by its preprocessing; returns (network, seconds, held-out accuracy)."""
    import torch

    from fastfill.components.experiment.vision import torchvision
    from fastfill.components.model_store.preprocessing import Preprocessing

    torch.set_num_threads(threads)
    prep = Preprocessing(**spec["preprocessing"])
    keep = np.isin(labels, spec["classes"])
    rng = np.random.default_rng(seed)
    pixels = np.stack([prep.decode(_encoded(photo(image, rng))) for image in images[keep]])
    targets = np.searchsorted(spec["classes"], labels[keep])
    held = max(1, len(pixels) // 10)
    torch.manual_seed(seed)
    net = torchvision.models.get_model(spec["architecture"], num_classes=len(spec["classes"]))
    optimiser = torch.optim.Adam(net.parameters(), lr=2e-3)
    loss = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    x = prep.normalise(torch.from_numpy(pixels).float() / 255).contiguous(memory_format=torch.channels_last)
    y = torch.from_numpy(targets).long()
    started = time.perf_counter()
    net.train()
    for _ in range(epochs):
        order = torch.randperm(len(x) - held) + held
        for start in range(0, len(order), 64):
            batch = order[start:start + 64]
            optimiser.zero_grad()
            loss(net(x[batch]), y[batch]).backward()
            optimiser.step()
    # the batch-norm statistics recomputed over the training photos: MobileNetV3's momentum (0.01)
    # leaves them near their initial values after a few hundred steps, and eval mode then collapses
    for module in net.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.reset_running_stats()
            module.momentum = None  # a cumulative average
    with torch.no_grad():
        for start in range(held, len(x), 256):
            net(x[start:start + 256])
    net.eval()
    with torch.no_grad():
        accuracy = float((net(x[:held]).argmax(1) == y[:held]).float().mean())
    return net, round(time.perf_counter() - started, 1), round(100 * accuracy, 2)


def embedder_pair(old_spec: dict, new_spec: dict, images: np.ndarray, labels: np.ndarray, epochs: int, seed: int,
                  cut=None):
    """A team's two models as the product loads them, trained here (``train_model``, 2 threads):
    (old ONNX embedder, new torchvision embedder from safetensors weights, held-out accuracies).
    ``cut(network)``, when given, changes the old network before its export (e.g. drops its
    classifier so the graph ends at the features a team exports for retrieval)."""
    import io

    import torch
    from safetensors.torch import load, save

    from fastfill.components.model_store.embedders import OnnxEmbedder, TorchvisionEmbedder
    from fastfill.components.model_store.preprocessing import Preprocessing

    old, _, old_accuracy = train_model(old_spec, images, labels, epochs, seed, 2)
    if cut is not None:
        cut(old)
    graph = io.BytesIO()
    torch.onnx.export(old.eval(), (torch.zeros(1, 3, 32, 32),), graph, dynamo=False, input_names=["images"],
                      dynamic_axes={"images": {0: "n"}})
    new, _, new_accuracy = train_model(new_spec, images, labels, epochs, seed + 1, 2)
    state = load(save({k: v.contiguous() for k, v in new.state_dict().items()}))
    old_embedder = OnnxEmbedder(graph.getvalue(), Preprocessing(**old_spec["preprocessing"]))
    new_embedder = TorchvisionEmbedder(new_spec["architecture"], state, Preprocessing(**new_spec["preprocessing"]))
    old_embedder.probe(), new_embedder.probe()
    return old_embedder, new_embedder, {"old_accuracy": old_accuracy, "new_accuracy": new_accuracy}


def write_report(out: Path, text: str, report: dict) -> Path:
    """``text`` printed and written to ``out``.md, ``report`` to ``out``.json (``out`` relative to
    the working folder unless absolute); returns the resolved ``out``."""
    print("\n" + text)
    out = out if out.is_absolute() else Path.cwd() / out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))
    return out


def team_models(folder: Path, items: int, epochs: int, seed: int) -> dict:
    import torch
    from safetensors.torch import save_file

    train = fashion("train")
    rng = np.random.default_rng(seed)
    index = np.sort(rng.choice(len(train.labels), size=min(items, len(train.labels)), replace=False))
    images, labels = train.images[index, 0], train.labels[index]
    out = {}
    old, seconds, accuracy = train_model(OLD, images, labels, epochs, seed, 2)
    torch.onnx.export(old, (torch.zeros(1, 3, 32, 32),), str(folder / "old-encoder.onnx"), dynamo=False,
                      input_names=["images"], output_names=["logits"], dynamic_axes={"images": {0: "n"}})
    out["old"] = {"file": str(folder / "old-encoder.onnx"), "train_seconds": seconds, "held_out_accuracy": accuracy,
                  "trained_on": f"{int(np.isin(labels, OLD['classes']).sum())} photos of classes 0-4"}
    new, seconds, accuracy = train_model(NEW, images, labels, epochs, seed + 1, 2)
    save_file({k: v.contiguous() for k, v in new.state_dict().items()}, str(folder / "new-encoder.safetensors"))
    out["new"] = {"file": str(folder / "new-encoder.safetensors"), "train_seconds": seconds,
                  "held_out_accuracy": accuracy, "trained_on": f"{len(labels)} photos of all 10 classes"}
    return out


def write_gallery(scratch: Path, items: int, judged: int, seed: int) -> dict:
    test = fashion("test")
    rng = np.random.default_rng(seed + 7)
    index = np.sort(rng.choice(len(test.labels), size=min(items, len(test.labels)), replace=False))
    folder = scratch / "images"
    folder.mkdir()
    size = 0
    for item in index:
        path = folder / f"{int(item)}.jpg"
        photo(test.images[item, 0], rng).save(path, quality=90)
        size += path.stat().st_size
    with open(scratch / "manifest.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", "uri"])
        writer.writerows((int(item), f"{int(item)}.jpg") for item in index)
    rows = judged_pairs(index, test.labels[index], judged, np.random.default_rng(seed + 1))
    with open(scratch / "judgments.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["query", "relevant"])
        writer.writerows(rows)
    return {"items": len(index), "bytes": size, "judged_queries": len({q for q, _ in rows}), "judged_rows": len(rows),
            "images": "RGB JPEG, sides 28-112 px, tinted, from the Fashion-MNIST test split"}


def upload(endpoint: str, folder: Path) -> str:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket=BUCKET)
    for path in sorted(folder.iterdir()):
        client.put_object(Bucket=BUCKET, Key=f"images/{path.name}", Body=path.read_bytes(), ContentType="image/jpeg")
    return f"s3://{BUCKET}/images"


def register(params_file: Path, folder: Path, models: dict, env: dict) -> list[dict]:
    steps = []
    for role, spec, alias, source in (("old", OLD, "champion", ["--onnx", models["old"]["file"]]),
                                      ("new", NEW, "challenger", ["--torchvision", NEW["architecture"], "--weights",
                                                                  models["new"]["file"]])):
        argv = [str(FASTFILL), "model", "register", *source, *spec["options"], "--alias", alias, "--json",
                "--params", str(params_file)]
        step = run_command(argv, folder, env, 600, None)
        step["name"] = f"model register ({role})"
        step["ok"] = step["rc"] == 0
        step["said"] = (json.loads(step["stdout"]).get("input") or "" if step["ok"] else
                        " / ".join(error_lines(step["stdout"], step["stderr"], 3)))
        print(f"  {step['name']}: {step['seconds']:.1f} s, exit {step['rc']}: {step['said']}", flush=True)
        steps.append(step)
    return steps


def team_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of a team's upgrade between its own two models (this script's and
    benchmarks/team_planning_time.py's): the gallery, the judged queries, the models' training,
    the upgrade's settings, the seed and the scratch folder."""
    parser.add_argument("--items", type=int, default=3000, help="gallery photos")
    parser.add_argument("--judged", type=int, default=300, help="judged queries")
    parser.add_argument("--train-items", type=int, default=12000, help="training photos of the two models")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--map-sample", type=int, default=1000, help="gallery.upgrade.map_sample")
    parser.add_argument("--chunk-size", type=int, default=150)
    parser.add_argument("--gain", type=float, default=0.1, help="--stop-when-gain-below")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path)
    return parser


def scratch_folder(workdir: Path | None, prefix: str) -> Path:
    """``workdir`` (made if missing), or a new temporary folder; with the product's runtime
    defaults applied for this process."""
    from fastfill.components.platform import runtime

    runtime.apply_defaults()
    scratch = (workdir or Path(tempfile.mkdtemp(prefix=prefix))).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    return scratch


def main(argv: list[str] | None = None) -> int:
    parser = team_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--backends", default="local,s3")
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "team_own_models")
    args = parser.parse_args(argv)
    import yaml

    started = time.perf_counter()
    scratch = scratch_folder(args.workdir, "team-own-models-")
    print(f"scratch folder: {scratch}; training the team's two models ...", flush=True)
    models = team_models(scratch, args.train_items, args.epochs, args.seed)
    print(f"  old: {models['old']}\n  new: {models['new']}", flush=True)
    gallery = write_gallery(scratch, args.items, args.judged, args.seed)
    base = yaml.safe_load((ROOT / "params.yaml").read_text())
    base.pop("prepare", None)
    base["gallery"] = {"part_size": 500, "upgrade": {"map_sample": args.map_sample, "map_pairs": "gallery"}}
    report: dict = {"config": vars(args) | {"workdir": str(scratch), "out": str(args.out)}, "models": models,
                    "gallery": gallery, "machine": f"{os.cpu_count()} CPU cores", "runs": {}, "problems": []}
    env, server = clean_env(), None
    runs = [(b, "fastfill", "sigma") for b in args.backends.split(",") if b] + [("local", "fct", "random")]
    try:
        for backend, method, order in runs:
            name = f"{backend}-{method}-{order}"
            folder = scratch / name
            folder.mkdir()
            run_env = {**env, "PREFECT_HOME": str(folder / "prefect-home")}
            if backend == "s3":
                if server is None:
                    server, aws = start_s3()
                    report["s3_root"] = upload(aws["AWS_ENDPOINT_URL_S3"], scratch / "images")
                run_env.update(aws)
                store, root = f"s3://{BUCKET}/{name}", report["s3_root"]
            else:
                store, root = str(folder / "gallery"), str(scratch / "images")
            data = json.loads(json.dumps(base))
            data["gallery"]["upgrade"].update(method=method, order=order)
            params_file = backend_params(data, folder, store, args.chunk_size)
            print(f"[{name}]", flush=True)
            registered = register(params_file, folder, models, run_env)
            result = run_backend(name, folder, params_file, store, root, scratch / "manifest.csv",
                                 scratch / "judgments.csv", args.gain, run_env, 3600, False)
            result["register_steps"] = registered
            metrics = (result.get("mlflow") or {}).get("run", {}).get("metrics", {})
            maps = [v for _, v in sorted(metrics.get("gate.map", []))]
            result["judged_curve"] = [dict(point, map=round(100 * maps[i], 2) if i < len(maps) else None)
                                      for i, point in enumerate(gate_curve(metrics) or [])]
            report["runs"][name] = result
            for step in registered + result["steps"]:
                if not step["ok"]:
                    report["problems"].append({"run": name, "step": step["name"], "rc": step["rc"],
                                               "said": step["said"]})
    finally:
        if server is not None:
            server.stop()
    report["wall_seconds"] = round(time.perf_counter() - started, 1)
    for result in report["runs"].values():
        for step in result["steps"] + result["register_steps"]:
            step["stdout_tail"] = step.pop("stdout")[-3000:]
            step["stderr_tail"] = step.pop("stderr")[-3000:]
    write_report(args.out, markdown(report), report)
    return 1 if report["problems"] else 0


def _area(curve: list[dict], key: str, upto: float = 1.0) -> float | None:
    values = [p[key] for p in curve if p.get(key) is not None and p["fraction"] <= upto + 1e-9]
    return round(float(np.mean(values)), 2) if values else None


def markdown(report: dict) -> str:
    models, gallery = report["models"], report["gallery"]
    lines = ["# A team's upgrade between two models of its own", "",
             f"`benchmarks/team_own_models.py` ({report['machine']}, {report['wall_seconds']:.0f} s in all). "
             f"Gallery: {gallery['items']} {gallery['images']}, adopted without labels; "
             f"{gallery['judged_queries']} judged queries ({gallery['judged_rows']} judged pairs).", "",
             "| model | source | trained here on | seconds | held-out accuracy |", "|---|---|---|---|---|",
             f"| old: {OLD['architecture']}, 3x32x32 stretched | ONNX | {models['old']['trained_on']} | "
             f"{models['old']['train_seconds']} | {models['old']['held_out_accuracy']}% |",
             f"| new: {NEW['architecture']}, 3x48x48 shorter side 55 then crop | torchvision + safetensors | "
             f"{models['new']['trained_on']} | {models['new']['train_seconds']} | {models['new']['held_out_accuracy']}% |",
             ""]
    for name, result in report["runs"].items():
        lines += [f"## {name}", "", "| step | seconds | exit | what it said |", "|---|---|---|---|"]
        for step in result["register_steps"] + result["steps"]:
            said = str(step["said"]).replace("|", "/")
            lines.append(f"| {step['name']} | {step['seconds']:.1f} | {step['rc']} | {said} |")
        lines.append("")
    curves = {name: r["judged_curve"] for name, r in report["runs"].items() if r.get("judged_curve")}
    if curves:
        lines += ["## Judged top-1 and mAP along the backfill (the promotion gate's curve, %)", "",
                  "| run | top-1 at 0% | top-1 area | top-1 area 0-30% | mAP at 0% | mAP area | mAP area 0-30% |",
                  "|---|---|---|---|---|---|---|"]
        for name, curve in curves.items():
            lines.append(f"| {name} | {curve[0]['top1']} | {_area(curve, 'top1')} | {_area(curve, 'top1', 0.3)} | "
                         f"{curve[0].get('map')} | {_area(curve, 'map')} | {_area(curve, 'map', 0.3)} |")
        lines.append("")
    if report["problems"]:
        lines += ["## Problems", ""] + [f"- {p['run']} {p['step']} (exit {p['rc']}): {p['said']}"
                                        for p in report["problems"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
