"""A tiny demo of the whole pipeline: an ImageFolder of synthetic 16x16 PNGs with learnable
classes (a bright bar whose position and orientation encode the class), and a configuration that
trains, aligns, evaluates and compares on it in seconds on 2 cores.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def class_image(label: int, rng: np.random.Generator, size: int = 16, num_classes: int = 6) -> np.ndarray:
    """A bright bar whose position and orientation encode the class, jittered, on noise."""
    image = rng.integers(0, 60, size=(size, size)).astype(np.int32)
    offset = 2 + (label % (num_classes // 2)) * 4 + int(rng.integers(-1, 2))
    offset = int(np.clip(offset, 0, size - 3))
    if label < num_classes // 2:
        image[offset: offset + 3, 2: size - 2] += 170
    else:
        image[2: size - 2, offset: offset + 3] += 170
    return np.clip(image, 0, 255).astype(np.uint8)


def make_image_folder(root: Path, *, num_classes: int = 6, train_per_class: int = 40, test_per_class: int = 12,
                      size: int = 16, seed: int = 0) -> Path:
    """root/train/<class>/*.png and root/test/<class>/*.png."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split, count in (("train", train_per_class), ("test", test_per_class)):
        for label in range(num_classes):
            folder = root / split / f"class_{label:02d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                Image.fromarray(class_image(label, rng, size, num_classes)).save(folder / f"{i:04d}.png")
    return root


def tiny_params(image_folder: Path, *, curve_points: int = 4) -> dict:
    """A whole-pipeline configuration (params.yaml as a dict) that runs every stage in seconds on 2
    cores, on the ImageFolder at ``image_folder`` (``make_image_folder``'s)."""
    return {
        "paths": {"data": "data", "artifacts": "artifacts", "reports": "reports"},
        "compute": {"threads": 2},
        "prepare": {"dataset": "imagefolder", "source": str(image_folder), "image_size": 16, "channels": 1,
                    "old_classes": [0, 1, 2]},
        "train": {
            "old": {"backbone": "cnn_small", "width": 4, "embedding_dim": 16, "epochs": 2, "batch_size": 32},
            "new": {"backbone": "cnn", "width": 4, "embedding_dim": 16, "epochs": 2, "batch_size": 32},
        },
        "align": {
            "fct": {"hidden": [16, 16], "epochs": 3, "warmup_epochs": 1, "batch_size": 32, "min_steps": 30},
            "fastfill": {"hidden": [16, 16], "epochs": 3, "warmup_epochs": 1, "batch_size": 32, "min_steps": 30,
                         "disc": True, "uncertainty": True},
        },
        # dvc.yaml's align stages read evaluate.distance (the map check's), so the file must name it
        "evaluate": {"curve_points": curve_points, "distance": "l2"},
        "mlflow": {"tracking_uri": "sqlite:///mlruns.db", "artifact_location": "mlartifacts"},
        # without the gate: a complete upgrade switches the gallery and moves champion unchecked
        "promotion": {"gate": False},
        "compatible": {},
        "compare": {  # dvc.yaml reads compare.seeds and compare.out from the file itself
            "seeds": [0],
            "out": "runs/compare",
            "align": {
                "l2_disc": {"hidden": [16, 16], "epochs": 3, "warmup_epochs": 1, "batch_size": 32, "disc": True,
                            "min_steps": 30},
                "rbt": {"architecture": "rbt", "rbt_blocks": 1, "epochs": 3, "warmup_epochs": 1, "batch_size": 32,
                        "min_steps": 30, "hidden": [16, 16]},
                "unified": {"architecture": "unified", "rbt_blocks": 1, "epochs": 3, "warmup_epochs": 1,
                            "batch_size": 32, "min_steps": 30, "hidden": [16, 16]},
            },
            "compatible": {"bct": {"loss": "bct"}, "ract": {"loss": "ract"}},
            # every key comparison/dvc.yaml reads must be in params.yaml (DVC fails on a missing one)
            "adapters": ["procrustes", "low_rank", "residual_mlp"],
            "dual": ["rrf"],
            "online": ["metric_compatible", "residual_mlp"],
            "rerank": [{"depth": 5}, {"depth": 5, "sync": 2}],
            "precision": "auto",
            "orders": {"fct": ["random"], "fastfill": ["sigma", "random", "oracle"], "l2_disc": ["random"],
                       "rbt": ["random"], "unified": ["random"], "bct": ["random"],
                       "ract": ["entropy", "least_confidence", "margin", "random"]},
        },
    }
