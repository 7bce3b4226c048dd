"""The names every layer shares, defined once: backfill orders, distances, adapters, precisions,
registry aliases, the upgrade flow's name. Configuration validates against these tuples, and the
code that acts on a name imports them."""

from __future__ import annotations

# Orders of a map into the new space: FastFill's sigma, and the baselines and analysis orders.
MAP_ORDERS = ("random", "sigma", "oracle", "distance")
# Orders of a compatible new model (RACT): the new classifier's uncertainty on old features.
COMPATIBLE_ORDERS = ("random", "least_confidence", "margin", "entropy")
ORDERS = MAP_ORDERS + COMPATIBLE_ORDERS[1:]
# What a real gallery upgrade can order by (the others need the new features or a classifier).
GALLERY_ORDERS = ("sigma", "random")

DISTANCES = ("l2", "cosine")

# Query-side adapters (components.experiment.adapters): new queries mapped into the old space.
ADAPTERS = ("procrustes", "low_rank", "residual_mlp")

# Precision of a training's forward passes (components.experiment.training.training_dtype).
TRAINING_PRECISIONS = ("fp32", "bf16", "auto")
# Precision of embedding images (components.experiment.inference.autocast_dtype).
PRECISIONS = ("auto", "fp32", "bf16", "fp16")

CHAMPION = "champion"      # the model the gallery serves
CHALLENGER = "challenger"  # the model an upgrade moves to
ROLE_ALIASES = {"old": CHAMPION, "new": CHALLENGER}

# The gallery upgrade's flow (flows/upgrade.py): its runs, found by this name, end in "Rejected"
# on a rejection.
UPGRADE_FLOW = "gallery-upgrade"
