"""How the gallery's items are asked for: a usage weight per item (how many queries hit it), and
the backfill orders built on it.

The weights come from one of two places:

- the items table's optional ``weight`` column (a number >= 0 per item), set when the gallery
  is adopted from a manifest file that has such a column;
- a query log, ``gallery.upgrade.usage_log``: a CSV or Parquet file (a local path or
  ``s3://bucket/key``, read as the judgments file is) with columns ``query`` (any id of a
  logged query) and ``hit`` (the id of a gallery item that query returned), one row per hit.
  An item's weight is the number of distinct logged queries that hit it; an item never hit
  weighs 0. The log wins over the column when both exist.

``backfill_order`` turns an order's name (``gallery.upgrade.order``) and what is known of the
items (log sigma^2, weights) into the permutation the backfill follows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastfill.components.evaluation.ordering import (
    check_weights,
    expected_gain_order,
    random_order,
    sigma_order,
    usage_order,
)
from fastfill.components.gallery.inputs.table_files import TableFile
from fastfill.components.gallery.layouts.catalog import Gallery, GalleryError
from fastfill.components.platform.vocabulary import GALLERY_ORDERS

WEIGHT = "weight"  # the items table's usage column
LOG_COLUMNS = ("query", "hit")
USAGE_LOG = TableFile("usage log", "gallery.upgrade.usage_log", LOG_COLUMNS, "hit of a logged query")
USAGE_ORDERS = tuple(kind for kind in GALLERY_ORDERS if kind.startswith("usage"))  # the orders that need weights


@dataclass
class Usage:
    """Per-item usage weights (position order) and where they come from."""

    source: str
    weights: np.ndarray
    queries: int = 0  # distinct logged queries (0 when the weights come from the items table)
    repeats: int = 0  # rows that repeated a (query, hit) pair, counted once

    def describe(self) -> str:
        """One line for the log."""
        hit = int((self.weights > 0).sum())
        where = f"query log {self.source}: {self.queries} queries" if self.queries else self.source
        return (f"usage weights from {where}; {hit} of {len(self.weights)} items hit "
                f"({100 * hit / max(1, len(self.weights)):.1f}%), total weight {self.weights.sum():g}"
                + (f"; {self.repeats} repeated rows counted once" if self.repeats else ""))


def load_usage_log(uri: str, ids: np.ndarray | list) -> Usage:
    """Count the query log at ``uri`` against the gallery's item ``ids`` (position order): each
    item's weight is the number of distinct logged queries that hit it. Unknown item ids,
    blank queries and hits that are not ids are refused, naming how many and a few of them."""
    uri = str(uri)
    queries, _, positions = USAGE_LOG.queries_and_items(
        uri, USAGE_LOG.read(uri), "hit", ids, query_is="the id of the logged query",
        unknown="remove those rows, or log against this gallery's ids")
    query_keys = [str(q).strip() for q in queries]
    pairs = set(zip(query_keys, positions.tolist()))
    weights = np.bincount(np.fromiter((p for _, p in pairs), dtype=np.int64, count=len(pairs)),
                          minlength=len(ids)).astype(np.float64)
    return Usage(uri, weights, queries=len(set(query_keys)), repeats=len(positions) - len(pairs))


def stored_weights(gallery: Gallery) -> np.ndarray | None:
    """The items table's ``weight`` column for every item, or None when the gallery has none."""
    if WEIGHT not in gallery.items_part(0).column_names:
        return None
    return np.concatenate([gallery.items_part(p).column(WEIGHT).to_numpy(zero_copy_only=False).astype(np.float64)
                           for p in range(gallery.num_parts)])


def usage_weights(gallery: Gallery, usage_log: str | None) -> Usage:
    """The gallery's usage weights: counted from ``usage_log`` when one is given, else its items
    table's ``weight`` column; a GalleryError naming both ways when there is neither."""
    return weights_of(usage_log, gallery.ids, lambda: stored_weights(gallery), f"the gallery at {gallery.store.uri}",
                      "the items table's")


def weights_of(usage_log: str | None, ids, stored, where: str, column_of: str) -> Usage:
    """Usage weights for either layout: counted from ``usage_log`` against ``ids()`` when a log is
    given, else ``stored()`` (the ``weight`` column, or None without one); ``where`` names the
    gallery ("the gallery at ...", "the table ..."), ``column_of`` whose column it is."""
    if usage_log:
        return load_usage_log(usage_log, ids())
    weights = stored()
    if weights is None:
        raise GalleryError(f"the usage orders ({', '.join(USAGE_ORDERS)}) need per-item usage weights, and {where} "
                           "has none: give a query log (--usage-log FILE or gallery.upgrade.usage_log: CSV/Parquet "
                           f"with columns query, hit), or adopt it from a manifest with a {WEIGHT} column; else use "
                           "order sigma or random")
    return Usage(f"{column_of} {WEIGHT} column", checked_weights(weights, f"{where}: the {WEIGHT} column"))


def checked_weights(weights: np.ndarray, what: str) -> np.ndarray:
    """``weights`` as float64 when they are usage weights (``ordering.check_weights``), else a
    GalleryError that starts with ``what``."""

    try:
        return check_weights(weights)
    except ValueError as error:
        raise GalleryError(f"{what}: {error}") from None


def map_order(kind: str) -> str:
    """The order an upgrade's map is chosen, checked and fitted for (the registry's choice and the
    map check know sigma and random): sigma for the usage orders, which use the map's uncertainty
    head (usage_sigma needs it; usage breaks its ties by it); else ``kind`` itself."""
    return "sigma" if kind in USAGE_ORDERS else kind


def order_after_map(kind: str, decided: str) -> str:
    """The backfill order once the map for ``map_order(kind)`` is chosen and checked, which
    decided ``decided``: a usage order stays, but goes by usage alone when the map's sigma order
    was not shown to help (decided random); any other order is what was decided."""
    if kind not in USAGE_ORDERS:
        return decided
    return kind if decided == "sigma" else "usage"


def backfill_order(kind: str, num_items: int, seed: int, log_sigma2: np.ndarray | None = None,
                   weights: np.ndarray | None = None) -> np.ndarray:
    """The backfill order ``kind`` of ``num_items`` items: random (seeded), sigma (least
    certain first), usage (most-hit first; ties by sigma when known, else by position) or
    usage_sigma (weight x sigma^2 first, the items never hit after them in sigma order)."""

    if kind not in GALLERY_ORDERS:
        raise GalleryError(f"unknown backfill order {kind!r}; use one of {', '.join(GALLERY_ORDERS)}")
    if kind == "random":
        return random_order(num_items, seed)
    if log_sigma2 is None and kind != "usage":
        raise GalleryError(f"the {kind} order needs an alignment map with an uncertainty head (FastFill); this map "
                           "has none: use order random" + (" or usage" if kind == "usage_sigma" else "")
                           + ", or a map trained with uncertainty: true")
    if kind == "sigma":
        assert log_sigma2 is not None  # refused above without it
        return sigma_order(log_sigma2)
    if weights is None:
        raise GalleryError(f"the {kind} order needs per-item usage weights (components.gallery.upgrade.usage.usage_weights)")
    weights = checked_weights(weights, f"the {kind} order")
    if len(weights) != num_items:
        raise GalleryError(f"the {kind} order: {len(weights)} usage weights for {num_items} items")
    if kind == "usage":
        return usage_order(weights, log_sigma2)
    assert log_sigma2 is not None  # refused above without it
    return expected_gain_order(weights, log_sigma2)
