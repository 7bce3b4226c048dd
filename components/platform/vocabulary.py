"""The names every layer shares, defined once: backfill orders, distances, adapters, precisions,
registry aliases, the upgrade flow's name. Each set of names is a Literal type (what the
configuration's fields are declared with) and the tuple of its names (what the code that acts on
a name, or lists them, imports)."""

from __future__ import annotations

from typing import Literal, get_args

# Orders of a map into the new space: FastFill's sigma, and the baselines and analysis orders.
MapOrder = Literal["random", "sigma", "oracle", "distance"]
MAP_ORDERS = get_args(MapOrder)
# Orders of a compatible new model (RACT): the new classifier's uncertainty on old features.
CompatibleOrder = Literal["random", "least_confidence", "margin", "entropy"]
COMPATIBLE_ORDERS = get_args(CompatibleOrder)
Order = Literal[MapOrder, CompatibleOrder]
ORDERS = get_args(Order)
# What a real gallery upgrade can order by (the others need the new features or a classifier).
# usage: the items queries hit most first (a per-item weight); usage_sigma: the expected gain per
# item, its weight times its predicted error (sigma^2), the two combined.
GalleryOrder = Literal["sigma", "random", "usage", "usage_sigma"]
GALLERY_ORDERS = get_args(GalleryOrder)

# The shadow-index playbook (components.evaluation.fusion): the old query searches the items not
# yet re-embedded, the new query those that are, and the two ranked lists are merged by reciprocal
# rank fusion or by scores normalised per list (min-max or z-score).
Merge = Literal["rrf", "score_minmax", "score_zscore"]
MERGES = get_args(Merge)
# Online backfilling (Seo et al., WACV 2025): the new model's query searches the re-embedded items,
# the same query mapped back into the old space (a reverse transformation) the others, and the two
# lists are merged by their raw distances, which the reverse transformation makes comparable.
ONLINE_MERGE = "distance"
# `fastfill search --merge`: the shadow index's merges, or online backfilling's ("online": the new
# model's query alone, the upgrade's stored reverse transformation giving its old-space twin), or
# candidate reranking ("rerank", components.evaluation.rerank: the old query's top K in the old
# features of every item, those already re-embedded ranked by the new query's distance).
SEARCH_MERGES = (*MERGES, "online", "rerank")
# candidate reranking's default depth K, the candidates per query (EmbedFlow's default too):
# gallery.upgrade.rerank_depth, `search --merge rerank --depth`, the advisor's rerank way
RERANK_DEPTH = 50

Distance = Literal["l2", "cosine"]
DISTANCES = get_args(Distance)

# Query-side adapters (components.experiment.adapters): new queries mapped into the old space.
AdapterKind = Literal["procrustes", "low_rank", "residual_mlp"]
ADAPTERS = get_args(AdapterKind)
# Online backfilling's reverse transformations: any adapter, or the paper's metric-compatible one
# (trained so that the two spaces' distances rank one list; it needs the pairs' class labels).
OnlineReverse = Literal[AdapterKind, "metric_compatible"]
ONLINE_REVERSES = get_args(OnlineReverse)

# Precision of a training's forward passes (components.experiment.training.training_dtype).
TrainingPrecision = Literal["fp32", "bf16", "auto"]
TRAINING_PRECISIONS = get_args(TrainingPrecision)
# Precision of embedding images (components.experiment.inference.autocast_dtype).
Precision = Literal["auto", "fp32", "bf16", "fp16"]
PRECISIONS = get_args(Precision)

CHAMPION = "champion"      # the model the gallery serves
CHALLENGER = "challenger"  # the model an upgrade moves to
ROLE_ALIASES = {"old": CHAMPION, "new": CHALLENGER}

# The gallery upgrade's flow (flows/upgrade.py): its runs, found by this name, end in "Rejected"
# on a rejection.
UPGRADE_FLOW = "gallery-upgrade"

# The deployments `fastfill serve` creates (flows/deployments.py), by "flow/deployment" name.
UPGRADE_DEPLOYMENT = "upgrade-gallery/upgrade"
POLL_DEPLOYMENT = "registry-watcher/poll"  # no schedule: pausing it pauses the RegistryWatcher
