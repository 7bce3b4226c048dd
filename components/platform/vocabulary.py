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
# usage: the items queries hit most first (a per-item weight); usage_sigma: the expected gain per
# item, its weight times its predicted error (sigma^2), the two combined.
GALLERY_ORDERS = ("sigma", "random", "usage", "usage_sigma")

# The shadow-index playbook (components.evaluation.fusion): the old query searches the items not
# yet re-embedded, the new query those that are, and the two ranked lists are merged by reciprocal
# rank fusion or by scores normalised per list (min-max or z-score).
MERGES = ("rrf", "score_minmax", "score_zscore")
# Online backfilling (Seo et al., WACV 2025): the new model's query searches the re-embedded items,
# the same query mapped back into the old space (a reverse transformation) the others, and the two
# lists are merged by their raw distances, which the reverse transformation makes comparable.
ONLINE_MERGE = "distance"
# `fastfill search --merge`: the shadow index's merges, or online backfilling's ("online": the new
# model's query alone, the upgrade's stored reverse transformation giving its old-space twin).
SEARCH_MERGES = (*MERGES, "online")

DISTANCES = ("l2", "cosine")

# Query-side adapters (components.experiment.adapters): new queries mapped into the old space.
ADAPTERS = ("procrustes", "low_rank", "residual_mlp")
# Online backfilling's reverse transformations: any adapter, or the paper's metric-compatible one
# (trained so that the two spaces' distances rank one list; it needs the pairs' class labels).
ONLINE_REVERSES = (*ADAPTERS, "metric_compatible")

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
