"""What FastFill's discriminative term is worth when the new model's head does not know the
gallery's classes, and whether a label-free substitute recovers it.

For a team's pair of models (``benchmarks/team_own_models``: a MobileNetV3-Small as ONNX, the
old one, and a ResNet-18 from torchvision, the new one, both trained briefly here), on two data
sets made into RGB photos of mixed sizes:

- ``fashion``: Fashion-MNIST (the default data), 10 classes;
- ``bars``: the synthetic bars of ``components/experiment/tiny_demo`` at 28x28, 10 classes.

The map (``align.fastfill`` of params.yaml) trains on ``--pairs`` items of the training split
(old features from the ONNX model, new from the torchvision one, both through the product's
embedders) with the discriminative term's classes taken from:

- ``fct (random)``: for reference, the l2-only map of ``align.fct`` in random order;
- ``off``: no discriminative term (l2 and the uncertainty head only);
- ``labels``: the true labels (rows of the new head, which was trained on those classes);
- ``predicted``: the new head's predicted classes (what the upgrade uses without labels);
- ``pseudo-K``: K-means (K clusters) of the new features of the sample, with a linear head fitted
  on them: what a team without a head could use.

Each map's sigma-ordered backfill curve is measured on ``--gallery`` test photos against their
labels (top1_auc, map_auc, in %), ``--seeds`` seeds. Writes ``<out>.md`` and ``<out>.json``
(default ``reports/disc_term``).

    .venv/bin/python benchmarks/disc_term_study.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.team_own_models import NEW, OLD, _encoded, embedder_pair, fashion, photo, write_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def bars(count: int, seed: int):
    from testkit.tiny_demo import class_image

    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=count)
    return np.stack([class_image(int(label), rng, 28, 10) for label in labels]), labels.astype(np.int64)


def data(name: str, train_items: int, pairs: int, gallery: int, seed: int):
    """(training images, labels), (pair images, labels), (gallery images, labels): grey 28x28
    (``shapes``: RGB 48x48, ``benchmarks/team_shapes``)."""
    if name in ("bars", "shapes"):
        from benchmarks.team_shapes import shapes

        images, labels = (shapes if name == "shapes" else bars)(train_items + pairs + gallery, seed)
        cut = [train_items, train_items + pairs]
        return ((images[:cut[0]], labels[:cut[0]]), (images[cut[0]:cut[1]], labels[cut[0]:cut[1]]),
                (images[cut[1]:], labels[cut[1]:]))
    train, test = fashion("train"), fashion("test")
    rng = np.random.default_rng(seed)
    chosen = rng.permutation(len(train.labels))[:train_items + pairs]
    shown = np.sort(rng.choice(len(test.labels), size=gallery, replace=False))
    return ((train.images[chosen[:train_items], 0], train.labels[chosen[:train_items]]),
            (train.images[chosen[train_items:], 0], train.labels[chosen[train_items:]]),
            (test.images[shown, 0], test.labels[shown]))


def embedders(train_images, train_labels, epochs: int, seed: int, penultimate: bool = False):
    """The team's two models as the product loads them: (old ONNX embedder, new torchvision embedder).
    The old model's ONNX graph ends in its classifier's logits (5-d), or with ``penultimate`` one
    layer earlier, at the 1,024-d features a team exports a MobileNetV3-Small for retrieval."""
    import torch

    def cut(network) -> None:
        network.classifier[-1] = torch.nn.Identity()

    return embedder_pair(OLD, NEW, train_images, train_labels, epochs, seed, cut if penultimate else None)


def features(model, images, seed: int) -> np.ndarray:
    """The model's features of the images as photos (the same photo for both models: the seed)."""
    from fastfill.components.experiment.inference import embed

    rng = np.random.default_rng(seed)
    files = [_encoded(photo(image, rng)) for image in images]
    return embed(model, np.stack([model.preprocessing.decode(f) for f in files]), batch_size=256)


def pseudo_classes(new: np.ndarray, k: int, seed: int):
    """K-means clusters of the new features and a linear head fitted on them: (rows, head)."""
    import torch
    from sklearn.cluster import KMeans

    rows = KMeans(n_clusters=k, n_init=4, random_state=seed).fit_predict(new).astype(np.int64)
    torch.manual_seed(seed)
    head = torch.nn.Linear(new.shape[1], k, bias=False)
    optimiser = torch.optim.Adam(head.parameters(), lr=1e-2)
    x, y = torch.from_numpy(new), torch.from_numpy(rows)
    for _ in range(300):
        optimiser.zero_grad()
        torch.nn.functional.cross_entropy(head(x), y).backward()
        optimiser.step()
    return rows, head.eval().requires_grad_(False)


def curve(config, pair_old, pair_new, rows, head, gallery_old, gallery_new, labels) -> dict:
    import torch

    from fastfill.components.evaluation.ordering import random_order, sigma_order
    from fastfill.components.evaluation.retrieval import backfill_curve
    from fastfill.components.experiment.inference import apply_alignment
    from fastfill.components.experiment.map_training import train_alignment

    h, _ = train_alignment(config, pair_old, pair_new, rows, head, device=torch.device("cpu"), log=lambda *_: None)
    transformed, log_sigma2 = apply_alignment(h, gallery_old, device=torch.device("cpu"))
    order = sigma_order(log_sigma2) if log_sigma2 is not None else random_order(len(labels), config.seed)
    measured = backfill_curve(gallery_new, gallery_new, transformed, labels, order)
    return {"top1_auc": round(100 * measured.top1_auc, 2), "map_auc": round(100 * measured.map_auc, 2),
            "top1_0": round(100 * float(measured.top1[0]), 2)}


def study_configs():
    """The process set up as the stages are (threads, runtime defaults) and the maps' configurations
    from params.yaml: (align.fastfill, align.fct)."""
    import torch
    import yaml

    from fastfill.components.platform import runtime
    from fastfill.components.platform.config import AlignConfig

    runtime.apply_defaults()
    torch.set_num_threads(2)
    align = yaml.safe_load((ROOT / "params.yaml").read_text())["align"]
    return AlignConfig(**align["fastfill"]), AlignConfig(**align["fct"])


def arguments(args) -> dict:
    """A run's arguments as JSON values."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", default="fashion,bars")
    parser.add_argument("--train-items", type=int, default=12000)
    parser.add_argument("--pairs", type=int, default=5000)
    parser.add_argument("--gallery", type=int, default=3000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--pseudo", type=int, nargs="+", default=[10, 50], help="K of the pseudo-classes")
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "disc_term")
    args = parser.parse_args(argv)
    import torch

    base, fct = study_configs()
    started = time.perf_counter()
    results: dict = {"config": arguments(args), "runs": []}
    for dataset in args.datasets.split(","):
        for seed in args.seeds:
            (train_x, train_y), (pair_x, pair_y), (gallery_x, gallery_y) = data(
                dataset, args.train_items, args.pairs, args.gallery, seed)
            old, new, accuracy = embedders(train_x, train_y, args.epochs, seed)
            pair_old, pair_new = features(old, pair_x, seed + 11), features(new, pair_x, seed + 11)
            gallery_old, gallery_new = features(old, gallery_x, seed + 12), features(new, gallery_x, seed + 12)
            head = new.classifier.eval().requires_grad_(False)
            with torch.no_grad():
                predicted = head(torch.from_numpy(pair_new)).argmax(1).numpy().astype(np.int64)
            variants = {"fct (random)": (np.zeros(len(pair_y), np.int64), head, fct),
                        "off": (np.zeros(len(pair_y), np.int64), head, base.model_copy(update={"disc": False})),
                        "labels": (pair_y.astype(np.int64), head, base),
                        "predicted": (predicted, head, base)}
            for k in args.pseudo:
                rows, fitted = pseudo_classes(pair_new, k, seed)
                variants[f"pseudo-{k}"] = (rows, fitted, base)
            seeded = {name: (rows, fitted, config.model_copy(update={"seed": seed}))
                      for name, (rows, fitted, config) in variants.items()}
            row = {"dataset": dataset, "seed": seed, **accuracy,
                   "predicted_agrees_with_labels": round(100 * float((predicted == pair_y).mean()), 2)}
            for name, (rows, fitted, config) in seeded.items():
                row[name] = curve(config, pair_old, pair_new, rows, fitted, gallery_old, gallery_new, gallery_y)
                print(f"{dataset} seed {seed} {name}: {row[name]}", flush=True)
            results["runs"].append(row)
    results["wall_seconds"] = round(time.perf_counter() - started, 1)
    write_report(args.out, markdown(results), results)
    return 0


def markdown(results: dict) -> str:
    names = [k for k in results["runs"][0] if isinstance(results["runs"][0][k], dict)] if results["runs"] else []
    lines = ["# The discriminative term without the gallery's labels", "",
             f"`benchmarks/disc_term_study.py` ({results['wall_seconds']:.0f} s). FastFill maps (align.fastfill), "
             "sigma order, on the test photos; top1_auc / map_auc in %.", "",
             "| data set | seed | old / new accuracy | head agrees with labels | "
             + " | ".join(names) + " |", "|---|---|---|---|" + "---|" * len(names)]
    for row in results["runs"]:
        cells = [f"{row[n]['top1_auc']} / {row[n]['map_auc']}" for n in names]
        lines.append(f"| {row['dataset']} | {row['seed']} | {row['old_accuracy']} / {row['new_accuracy']} | "
                     f"{row['predicted_agrees_with_labels']}% | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
