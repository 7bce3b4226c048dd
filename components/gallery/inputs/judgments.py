"""Judged queries: a retrieval team's golden set as the truth of the promotion gate.

``gallery.upgrade.judgments`` names a CSV or Parquet file (a local path or ``s3://bucket/key``,
read by ``components.gallery.inputs.table_files``) with two columns, one judged pair a row:

- ``query``: a gallery item id (that item's features are the query), or anything else, taken
  as the URI of a query image (``s3://...``, an absolute path, or a path the caller resolves,
  e.g. under the gallery's image root);
- ``relevant``: the id of a gallery item relevant to that query. A query with several relevant
  items has several rows.

``load_judgments`` reads, checks and resolves the file against the gallery's ids into
``Judgments``; ``store_judged`` / ``stored_judged`` keep the resolved queries beside an upgrade's
plan. The gate's numbers with them (``measure_judged_gate``, re-exported here for the flows and
tasks that measure the gate) are ``components.gallery.gate.judged_gate``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fastfill.components.gallery.gate.judged_gate import measure_judged_gate
from fastfill.components.gallery.inputs.table_files import TableFile, file_rows, first_few
from fastfill.components.gallery.layouts.catalog import GalleryError
from fastfill.components.gallery.layouts.item_ids import id_array, id_of, is_text, positions_of
from fastfill.components.gallery.store import ObjectMissing
from fastfill.components.gallery.upgrade.planning import upgrade_key

__all__ = ["COLUMNS", "JUDGED", "Judgments", "gate_judgments", "load_judgments", "measure_judged_gate", "store_judged",
           "stored_judged"]

COLUMNS = ("query", "relevant")


@dataclass
class Judgments:
    """Judged queries resolved against one gallery, the distinct queries in file order.

    ``query_positions[i]``: query i's gallery position, or -1 when it is an image;
    ``query_uris[i]``: its image URI, or None when it is a gallery item;
    ``relevant[i]``: the gallery positions relevant to query i (sorted, distinct, never the
    query's own position, never empty).
    """

    source: str
    query_positions: np.ndarray
    query_uris: list[str | None]
    relevant: list[np.ndarray]
    self_pairs: int = 0       # rows whose relevant item was the query itself (ignored)
    dropped_queries: int = 0  # queries left without a relevant item by that (ignored)
    duplicates: int = 0       # rows that repeated a (query, relevant) pair

    def __len__(self) -> int:
        return len(self.relevant)

    @property
    def pairs(self) -> int:
        return int(sum(len(r) for r in self.relevant))

    def in_sample(self, positions: np.ndarray) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
        """The queries that have a relevant item in a sample of the gallery (``positions``):
        ``(used, relevant, own)``, their indices here, their relevant items as places in the
        sample, and the place in the sample of each one's own item (-1: an image query, or an
        item outside the sample)."""
        slot = np.full(int(max(positions.max(), self.query_positions.max(), 0)) + 1, -1, dtype=np.int64)
        slot[positions] = np.arange(len(positions))
        relevant, used = [], []
        for i, rel in enumerate(self.relevant):
            inside = slot[rel[rel < len(slot)]]
            inside = inside[inside >= 0]
            if len(inside):
                relevant.append(inside)
                used.append(i)
        rows = np.asarray(used, dtype=np.int64)
        own = np.array([slot[p] if 0 <= p < len(slot) else -1 for p in self.query_positions[rows]], dtype=np.int64)
        return rows, relevant, own

    @property
    def image_queries(self) -> np.ndarray:
        """Indices of the queries given as image URIs (their features must be computed)."""
        return np.flatnonzero(self.query_positions < 0)

    def describe(self) -> str:
        """One line for the log."""
        images = len(self.image_queries)
        notes = [f"{count} {what} ignored" for count, what in (
            (self.self_pairs, "pairs of a query with itself"), (self.duplicates, "repeated pairs"),
            (self.dropped_queries, "queries with no other relevant item")) if count]
        return (f"judgments {self.source}: {len(self)} queries ({len(self) - images} gallery items, {images} images), "
                f"{self.pairs} relevant pairs ({self.pairs / max(1, len(self)):.1f} per query)"
                + (f"; {', '.join(notes)}" if notes else ""))


# ------------------------------------------------------------------------------------------------
# Loading

JUDGMENTS_FILE = TableFile("judgments file", "gallery.upgrade.judgments", COLUMNS, "judged pair")


def load_judgments(uri: str, ids: np.ndarray | list) -> Judgments:
    """Read the judgments at ``uri`` (CSV or Parquet; local or ``s3://``) and resolve them
    against the gallery's item ``ids`` (position order). Every problem is a GalleryError of one
    line that names the file, what is wrong and what to do."""
    uri = str(uri)
    ids = id_array(ids)
    queries, relevant_ids, relevant_positions = JUDGMENTS_FILE.queries_and_items(
        uri, JUDGMENTS_FILE.read(uri), "relevant", ids, query_is="a gallery item id or an image URI",
        unknown="remove those rows or ingest the items first")

    text = is_text(ids)
    query_ids = [id_of(q, text) for q in queries]
    named = np.array([q is not None for q in query_ids])
    query_positions = np.full(len(queries), -1, dtype=np.int64)
    if named.any():
        query_positions[named] = positions_of(ids, [query_ids[i] for i in np.flatnonzero(named)])
    # integer ids: a query of digits must be an item; text ids: a query that is no item's id is an image URI
    stray = named & (query_positions < 0) & (not text)
    if stray.any():
        names = list(dict.fromkeys(query_ids[i] for i in np.flatnonzero(stray)))
        raise GalleryError(f"judgments file {uri}: {len(names)} queries look like item ids but are not in the "
                           f"gallery ({first_few(names)}; rows {file_rows(stray)}); fix the ids, or give an image URI")

    # distinct queries in file order; a gallery item and an image are told apart by their key
    keys = [("item", int(p)) if p >= 0 else ("uri", str(q).strip()) for p, q in zip(query_positions, queries)]
    index: dict = {}
    members: list[list[int]] = []
    for key, position in zip(keys, relevant_positions):
        slot = index.setdefault(key, len(index))
        if slot == len(members):
            members.append([])
        members[slot].append(int(position))
    out_positions, out_uris, out_relevant = [], [], []
    self_pairs = duplicates = dropped = 0
    for (kind, value), slot in index.items():
        found = np.asarray(members[slot], dtype=np.int64)
        distinct = np.unique(found)
        duplicates += len(found) - len(distinct)
        if kind == "item":
            self_pairs += int((found == value).sum())
            distinct = distinct[distinct != value]
        if not len(distinct):
            dropped += 1
            continue
        out_positions.append(value if kind == "item" else -1)
        out_uris.append(None if kind == "item" else value)
        out_relevant.append(distinct)
    if not out_relevant:
        raise GalleryError(f"judgments file {uri}: every row pairs a query with itself; a query must name other "
                           "items as relevant")
    return Judgments(uri, np.asarray(out_positions, dtype=np.int64), out_uris, out_relevant,
                     self_pairs=self_pairs, dropped_queries=dropped, duplicates=duplicates)


def gate_judgments(uri: str, ids: np.ndarray | list, log: Callable[[str], None]) -> Judgments:
    """The judged queries an upgrade's gate measures against (``load_judgments``), and the line
    that says so."""
    judged = load_judgments(uri, ids)
    log(f"the gate measures against {judged.describe()}")
    return judged


# ------------------------------------------------------------------------------------------------
# An upgrade's judged queries, kept beside its plan (the gate measures them when the backfill ends)

JUDGED = "eval/judgments.json"


def store_judged(store, upgrade_id: str, judged: Judgments, new_queries: np.ndarray, champion_queries: np.ndarray) -> None:
    """The resolved judgments and both sides' query features, under ``upgrades/<upgrade>/eval/``."""

    store.put_array(upgrade_key(upgrade_id, "eval/judged_new.npy"), np.asarray(new_queries, dtype=np.float32))
    store.put_array(upgrade_key(upgrade_id, "eval/judged_champion.npy"), np.asarray(champion_queries, dtype=np.float32))
    store.put_json(upgrade_key(upgrade_id, JUDGED), {
        "source": judged.source, "query_positions": judged.query_positions.tolist(), "query_uris": judged.query_uris,
        "relevant": [r.tolist() for r in judged.relevant]})


def stored_judged(store, upgrade_id: str) -> tuple[Judgments, np.ndarray, np.ndarray] | None:
    """(judgments, new-model query features, champion query features) of a planned upgrade, or None."""

    try:
        record = store.get_json(upgrade_key(upgrade_id, JUDGED))
    except ObjectMissing:
        return None
    judged = Judgments(record["source"], np.asarray(record["query_positions"], dtype=np.int64), record["query_uris"],
                       [np.asarray(r, dtype=np.int64) for r in record["relevant"]])
    return (judged, store.get_array(upgrade_key(upgrade_id, "eval/judged_new.npy")),
            store.get_array(upgrade_key(upgrade_id, "eval/judged_champion.npy")))
