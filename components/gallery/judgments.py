"""Judged queries: a retrieval team's golden set as the truth of the promotion gate.

``gallery.upgrade.judgments`` names a CSV or Parquet file (a local path or ``s3://bucket/key``)
with two columns, one judged pair a row:

- ``query``: a gallery item id (that item's features are the query), or anything else, taken
  as the URI of a query image (``s3://...``, an absolute path, or a path the caller resolves,
  e.g. under the gallery's image root);
- ``relevant``: the id of a gallery item relevant to that query. A query with several relevant
  items has several rows.

``load_judgments`` reads, checks and resolves the file against the gallery's ids;
``measure_judged_gate`` measures the promotion gate's numbers with it on the whole gallery;
``agreement_at`` is the label-free fallback for galleries with neither labels nor judgments.

Protocol of ``measure_judged_gate`` (that of ``components.gallery.promotion.measure_gate`` and
``components.evaluation``, on the whole gallery): each query ranks every gallery item except
itself (a query that is a gallery item never retrieves itself and is never its own relevant
item); top-1 is a hit when the nearest item is relevant; AP is ``(1/R) * sum_k k / rank_k`` over
the query's ``R`` relevant items in the full ranking. Ties are pessimistic, as in
``components.evaluation``: an irrelevant item at exactly the distance of a relevant one ranks
before it. (A relevant item's distance is computed apart from the blocks it is compared with, so
an exact tie, such as a duplicate image judged irrelevant, can come out one float32 rounding
either way.)
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

import numpy as np

from components.evaluation import curve_alphas, pairwise_distances
from components.gallery.catalog import GalleryError

COLUMNS = ("query", "relevant")
_INTEGER = re.compile(r"[+-]?\d+")
# The distances of one gallery block to every query, per side: the block's width is chosen so
# that this many bytes hold them (the sort is in place; pairwise_distances' temporaries add a
# small multiple, one side at a time).
BLOCK_BYTES = 64 << 20


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


def _read_bytes(uri: str) -> bytes:
    """The file's bytes, from a local path (``file://`` accepted) or ``s3://bucket/key`` through
    the store's S3 client (endpoint from AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, gallery.s3's
    retries and timeouts)."""
    if not uri.startswith("s3://"):
        path = uri.removeprefix("file://")
        try:
            with open(path, "rb") as handle:
                return handle.read()
        except FileNotFoundError:
            raise GalleryError(f"judgments file {uri} does not exist; fix gallery.upgrade.judgments or create "
                               "the file (CSV or Parquet, columns query, relevant)") from None
        except OSError as error:
            raise GalleryError(f"judgments file {uri} cannot be read ({error.strerror}); check the path and its "
                               "permissions") from None
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    from components.gallery.store import s3_client, s3_endpoint

    bucket, _, key = uri[len("s3://"):].partition("/")
    if not bucket or not key:
        raise GalleryError(f"judgments file {uri}: an S3 location needs a bucket and a key, s3://BUCKET/KEY; fix "
                           "gallery.upgrade.judgments")
    endpoint = s3_endpoint()
    try:
        return s3_client(endpoint).get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as error:
        code = error.response.get("Error", {}).get("Code", "")
        if code in ("NoSuchKey", "404"):
            why, todo = "does not exist", "upload it or fix gallery.upgrade.judgments"
        elif code == "NoSuchBucket":
            why, todo = f"is in a bucket that does not exist at {endpoint or 'AWS'}", "check the URI and the endpoint"
        elif code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            why, todo = f"cannot be read: access denied ({code})", "check the AWS credentials"
        else:
            why, todo = f"cannot be read: S3 {code or error}", "check the endpoint and try again"
        raise GalleryError(f"judgments file {uri} {why}; {todo}") from None
    except NoCredentialsError:
        raise GalleryError(f"judgments file {uri} cannot be read: no AWS credentials; set AWS_ACCESS_KEY_ID and "
                           "AWS_SECRET_ACCESS_KEY or an AWS profile") from None
    except BotoCoreError as error:
        raise GalleryError(f"judgments file {uri} cannot be read from the S3 endpoint {endpoint or 'AWS'} "
                           f"({type(error).__name__}); check that it is up and AWS_ENDPOINT_URL_S3 is right, "
                           "then try again") from None


def _table(uri: str, data: bytes):
    """The file as a pyarrow table: Parquet by its magic bytes, CSV otherwise (both columns read
    as text, so ids keep their digits and URIs stay as written)."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    if not data.strip():
        raise GalleryError(f"judgments file {uri} is empty; write a header `query,relevant` and one row per "
                           "judged pair")
    try:
        if data[:4] == b"PAR1":
            return pq.read_table(io.BytesIO(data))
        if uri.lower().endswith((".parquet", ".pq")):
            raise GalleryError(f"judgments file {uri} is not a Parquet file (no PAR1 header); write it again as "
                               "Parquet or CSV")
        return pacsv.read_csv(io.BytesIO(data), convert_options=pacsv.ConvertOptions(
            column_types={name: pa.string() for name in COLUMNS}, strings_can_be_null=True))
    except (pa.ArrowInvalid, OSError) as error:
        raise GalleryError(f"judgments file {uri} cannot be parsed as {'Parquet' if data[:4] == b'PAR1' else 'CSV'} "
                           f"({' '.join(str(error).split())[:200]}); write it as CSV or Parquet with columns "
                           "query, relevant") from None


def _as_id(value) -> int | None:
    """An integer item id from a cell (int, integral float, or digits in text), else None."""
    if isinstance(value, (bool, np.bool_)) or value is None:
        return None
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return int(value) if np.isfinite(value) and float(value).is_integer() else None
    text = str(value).strip()
    return int(text) if _INTEGER.fullmatch(text) else None


def _first(values, count: int = 5) -> str:
    shown = ", ".join(str(v) for v in values[:count])
    return shown + (", ..." if len(values) > count else "")


def load_judgments(uri: str, ids: np.ndarray | list) -> Judgments:
    """Read the judgments at ``uri`` (CSV or Parquet; local or ``s3://``) and resolve them
    against the gallery's item ``ids`` (position order). Every problem is a GalleryError of one
    line that names the file, what is wrong and what to do."""
    uri = str(uri)
    table = _table(uri, _read_bytes(uri))
    missing = [name for name in COLUMNS if name not in table.column_names]
    if missing:
        raise GalleryError(f"judgments file {uri} lacks the column{'s' if len(missing) > 1 else ''} "
                           f"{', '.join(missing)} (it has: {', '.join(table.column_names) or 'none'}); name the "
                           "columns query and relevant")
    if table.num_rows == 0:
        raise GalleryError(f"judgments file {uri} has no rows; add one row per judged pair (query, relevant)")
    queries = table.column("query").to_pylist()
    relevant = table.column("relevant").to_pylist()

    def rows(mask) -> str:  # file rows, 1-based after the header
        return _first([int(r) + 1 for r in np.flatnonzero(mask)])

    blank = np.array([q is None or (isinstance(q, str) and not q.strip()) for q in queries])
    if blank.any():
        raise GalleryError(f"judgments file {uri}: {int(blank.sum())} rows have no query (rows {rows(blank)}); "
                           "give each row a gallery item id or an image URI")
    relevant_ids = [_as_id(v) for v in relevant]
    not_ids = np.array([r is None for r in relevant_ids])
    if not_ids.any():
        bad = [relevant[i] for i in np.flatnonzero(not_ids)]
        raise GalleryError(f"judgments file {uri}: {int(not_ids.sum())} relevant values are not item ids (rows "
                           f"{rows(not_ids)}: {_first(bad, 3)}); `relevant` must hold gallery item ids")

    ids = np.asarray(ids, dtype=np.int64)
    sorter = np.argsort(ids, kind="stable")

    def positions_of(values: np.ndarray) -> np.ndarray:
        """Gallery positions of item ids, -1 where no item has the id."""
        if not len(ids):
            return np.full(len(values), -1, dtype=np.int64)
        slot = np.clip(np.searchsorted(ids, values, sorter=sorter), 0, len(ids) - 1)
        found = sorter[slot]
        return np.where(ids[found] == values, found, -1)

    relevant_positions = positions_of(np.asarray(relevant_ids, dtype=np.int64))
    unknown = relevant_positions < 0
    if unknown.any():
        names = list(dict.fromkeys(relevant_ids[i] for i in np.flatnonzero(unknown)))
        raise GalleryError(f"judgments file {uri}: {len(names)} relevant ids are not in the gallery ({_first(names)}; "
                           f"{int(unknown.sum())} rows); remove those rows or ingest the items first")

    query_ids = [_as_id(q) for q in queries]
    numeric = np.array([q is not None for q in query_ids])
    query_positions = np.full(len(queries), -1, dtype=np.int64)
    if numeric.any():
        query_positions[numeric] = positions_of(np.asarray([query_ids[i] for i in np.flatnonzero(numeric)],
                                                           dtype=np.int64))
    stray = numeric & (query_positions < 0)
    if stray.any():
        names = list(dict.fromkeys(query_ids[i] for i in np.flatnonzero(stray)))
        raise GalleryError(f"judgments file {uri}: {len(names)} queries look like item ids but are not in the "
                           f"gallery ({_first(names)}; rows {rows(stray)}); fix the ids, or give an image URI")

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


# ------------------------------------------------------------------------------------------------
# The gate's numbers with judgments


def _negatives_before(queries: np.ndarray, first: np.ndarray, rest: np.ndarray, order: np.ndarray, cuts: list[int],
                      judgments: Judgments, distance: str, block_bytes: int) -> np.ndarray:
    """For each cut ``m`` and each judged pair (query q, relevant item p), flattened in query
    order: how many irrelevant gallery items (q itself excluded) are at most as far from q as p
    is, in the gallery whose first ``m`` items of ``order`` have their ``first`` features and the
    others their ``rest`` ones. Shape ``(len(cuts), pairs)``.

    The gallery is walked once in backfill order, in blocks whose edges include every cut, so
    each block is wholly ``first`` or wholly ``rest`` at every cut. Per block and side: the
    distances of every query to it (relevant items and the query itself set to +inf), each row
    sorted in place, and each pair's two possible distances (its item on either side) counted
    into it by binary search. Running sums of these counts, taken at every cut, give the
    ``first`` part (blocks before the cut) and the ``rest`` part (the total minus the sum
    before the cut)."""
    n, count = len(order), len(judgments)
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    owner = np.repeat(np.arange(count), [len(r) for r in judgments.relevant])
    items = np.concatenate(judgments.relevant)
    item_rank = rank[items]
    pairs = len(items)
    starts = np.concatenate([[0], np.cumsum([len(r) for r in judgments.relevant])])

    # each pair's distance with its item on either side
    thresholds = np.empty((pairs, 2), dtype=np.float32)
    for q in range(count):
        span = slice(starts[q], starts[q + 1])
        thresholds[span, 0] = pairwise_distances(queries[q:q + 1], first[items[span]], distance)[0]
        thresholds[span, 1] = (thresholds[span, 0] if rest is first else
                               pairwise_distances(queries[q:q + 1], rest[items[span]], distance)[0])
    per_query = [thresholds[starts[q]:starts[q + 1]].ravel() for q in range(count)]

    # entries set to +inf in a block: every (query, relevant item) and (query, itself), by rank
    own = judgments.query_positions
    hide_q = np.concatenate([owner, np.flatnonzero(own >= 0)])
    hide_rank = np.concatenate([item_rank, rank[own[own >= 0]]])
    by_rank = np.argsort(hide_rank, kind="stable")
    hide_q, hide_rank = hide_q[by_rank], hide_rank[by_rank]

    width = max(256, block_bytes // (4 * max(1, count)))
    edges = np.unique(np.concatenate([np.arange(0, n, width), cuts, [n]]).astype(np.int64))
    cut_at = {}
    for index, cut in enumerate(cuts):
        cut_at.setdefault(int(cut), []).append(index)
    running = np.zeros((2, pairs, 2), dtype=np.int64)  # [side, pair, threshold side]
    snapshots = np.zeros((2, len(cuts), pairs), dtype=np.int64)  # running sums at each cut, the cut's threshold
    pair_index = np.arange(pairs)

    def snapshot(at: int) -> None:
        for index in cut_at.get(at, []):
            chosen = (item_rank >= cuts[index]).astype(np.int64)  # threshold side: 0 first, 1 rest
            snapshots[:, index] = running[:, pair_index, chosen]

    snapshot(0)
    for start, stop in zip(edges[:-1], edges[1:]):
        block = order[start:stop]
        lo, hi = np.searchsorted(hide_rank, [start, stop])
        for side, gallery in enumerate((first, rest)):
            if side and rest is first:  # one gallery (the champion's): the same counts
                running[1] = running[0]
                continue
            d = pairwise_distances(queries, gallery[block], distance)
            d[hide_q[lo:hi], hide_rank[lo:hi] - start] = np.inf
            d.sort(axis=1)
            counts = np.concatenate([np.searchsorted(d[q], per_query[q], side="right") for q in range(count)])
            running[side] += counts.reshape(pairs, 2)
            del d
        snapshot(int(stop))
    total = running[1][pair_index[None, :], (item_rank[None, :] >= np.asarray(cuts)[:, None]).astype(np.int64)]
    return snapshots[0] + total - snapshots[1]


def _scores(before: np.ndarray, judgments: Judgments) -> tuple[np.ndarray, np.ndarray]:
    """(top-1 hit, AP) per cut and query, from ``_negatives_before``'s counts: the relevant items
    of a query in order of distance are in order of their counts, and the k-th of them ranks at
    k + its count."""
    sizes = np.array([len(r) for r in judgments.relevant])
    owner = np.repeat(np.arange(len(sizes)), sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    k = np.arange(len(owner)) - starts[owner] + 1  # 1.. within each query's relevant items
    top1 = np.zeros((len(before), len(sizes)), dtype=bool)
    ap = np.zeros((len(before), len(sizes)))
    for row, counts in enumerate(before):
        ranked = counts[np.lexsort((counts, owner))]
        ap[row] = np.bincount(owner, weights=k / (k + ranked), minlength=len(sizes)) / sizes
        top1[row] = ranked[starts] == 0
    return top1, ap


def _check_inputs(judgments: Judgments, order: np.ndarray, **arrays) -> int:
    n = len(arrays["champion_gallery"])
    count = len(judgments)
    problems = [f"{name} has {len(array)} rows" for name, array in arrays.items()
                if len(array) != (count if name.endswith("queries") else n)]
    if problems or count < 1 or n < 2:
        raise ValueError(f"the judged gate needs {count} >= 1 queries and a gallery of n >= 2 items in every input "
                         f"(n = {n}): {'; '.join(problems) or 'too few'}")
    if len(order) != n or not np.array_equal(np.sort(order), np.arange(n)):
        raise ValueError(f"order must be a permutation of the {n} gallery positions")
    for q, relevant in enumerate(judgments.relevant):
        if not len(relevant) or relevant.min() < 0 or relevant.max() >= n or judgments.query_positions[q] in relevant:
            raise ValueError(f"judged query {q} needs relevant positions in [0, {n}) other than its own")
    return n


def measure_judged_gate(champion_queries: np.ndarray, champion_gallery: np.ndarray, new_queries: np.ndarray,
                        new_gallery: np.ndarray, transformed_gallery: np.ndarray, judgments: Judgments,
                        order: np.ndarray, *, distance: str = "l2", curve_points: int = 20,
                        block_bytes: int = BLOCK_BYTES) -> dict:
    """The promotion gate's numbers (``promotion.measure_gate``'s keys, plus ``map`` per alpha
    and ``champion_map``) on judged queries against the whole gallery.

    ``champion_queries`` / ``new_queries``: the judged queries' features (judgments order) by
    the champion / the challenger; ``champion_gallery``, ``new_gallery``,
    ``transformed_gallery``: every gallery item's features (positions 0..N-1); ``order``: the
    backfill order over the whole gallery. At alpha the gallery holds new features for
    ``order[:floor(alpha * N)]`` and transformed ones elsewhere, alpha = curve_alphas(curve_points).

    Memory: the inputs, plus one block of query-by-gallery distances (``block_bytes``, 64 MB by
    default, and pairwise_distances' temporaries) and a few int64 counts per judged pair and
    curve point; time: the distances to each gallery side once, and one row sort per block."""
    order = np.asarray(order, dtype=np.int64)
    n = _check_inputs(judgments, order, champion_queries=champion_queries, new_queries=new_queries,
                      champion_gallery=champion_gallery, new_gallery=new_gallery,
                      transformed_gallery=transformed_gallery)
    alphas = curve_alphas(curve_points)
    cuts = [(i * n) // (curve_points + 1) for i in range(len(alphas))]
    champion_before = _negatives_before(np.asarray(champion_queries), champion_gallery, champion_gallery,
                                        np.arange(n), [0], judgments, distance, block_bytes)
    right, champion_ap = (a[0] for a in _scores(champion_before, judgments))
    top1_hits, ap = _scores(_negatives_before(np.asarray(new_queries), new_gallery, transformed_gallery, order, cuts,
                                              judgments, distance, block_bytes), judgments)
    top1 = [float(hits.mean()) for hits in top1_hits]
    nfr1 = [float((right & ~hits).sum() / max(1, right.sum())) for hits in top1_hits]
    champion_top1 = float(right.mean())
    beyond = [float(a) for a, t in zip(alphas, top1) if t > champion_top1]
    return {"queries": len(judgments), "champion_top1": champion_top1, "alpha": [float(a) for a in alphas],
            "top1": top1, "nfr1": nfr1, "top1_auc": float(np.mean(top1)),
            "top1_auc_gain": float(np.mean(top1)) - champion_top1, "nfr1_mean": float(np.mean(nfr1)),
            "nfr1_end": nfr1[-1], "fraction_to_gain": beyond[0] if beyond else None,
            "map": [float(row.mean()) for row in ap], "champion_map": float(champion_ap.mean())}


# ------------------------------------------------------------------------------------------------
# Without labels or judgments


def agreement_at(queries: np.ndarray, mixed_gallery: np.ndarray, final_gallery: np.ndarray, positions: np.ndarray,
                 k: int = 10, distance: str = "l2") -> float:
    """Mean overlap, in %, of each query's top-k in ``mixed_gallery`` (the gallery mid-backfill)
    with its top-k in ``final_gallery`` (every item with new features). ``queries``: new
    features of sample items, ``positions``: their gallery positions (each excluded from its own
    top-k). It measures agreement with the finished upgrade, not correctness: 100 means the
    mixed gallery already answers as the finished one will, right or wrong."""
    positions = np.asarray(positions, dtype=np.int64)
    n = len(final_gallery)
    if len(mixed_gallery) != n or len(queries) != len(positions) or not len(positions) or n < 2:
        raise ValueError(f"agreement_at needs >= 1 query with a position each and two galleries of the same "
                         f">= 2 items, got {len(queries)} queries, {len(positions)} positions, galleries of "
                         f"{len(mixed_gallery)} and {n}")
    k = min(int(k), n - 1)
    width = max(k, BLOCK_BYTES // (4 * len(positions)))
    tops = []
    for gallery in (mixed_gallery, final_gallery):  # each query's k nearest, a block of the gallery at a time
        best = np.empty((len(positions), 0), dtype=np.float32)
        index = np.empty((len(positions), 0), dtype=np.int64)
        for start in range(0, n, width):
            d = pairwise_distances(queries, gallery[start:start + width], distance)
            own = (positions >= start) & (positions < start + d.shape[1])
            d[own, positions[own] - start] = np.inf
            near = _smallest(d, k)
            best = np.concatenate([best, np.take_along_axis(d, near, 1)], axis=1)
            index = np.concatenate([index, near + start], axis=1)
            keep = _smallest(best, k)
            best, index = np.take_along_axis(best, keep, 1), np.take_along_axis(index, keep, 1)
        tops.append(index)
    overlap = sum(len(np.intersect1d(a, b)) for a, b in zip(*tops))
    return 100.0 * overlap / (k * len(positions))


def _smallest(values: np.ndarray, k: int) -> np.ndarray:
    """Column indices of each row's k smallest values (all of them when a row has no more)."""
    if values.shape[1] <= k:
        return np.broadcast_to(np.arange(values.shape[1]), values.shape)
    return np.argpartition(values, k - 1, axis=1)[:, :k]


# ------------------------------------------------------------------------------------------------
# An upgrade's judged queries, kept beside its plan (the gate measures them when the backfill ends)

JUDGED = "eval/judgments.json"


def store_judged(store, upgrade: str, judged: Judgments, new_queries: np.ndarray, champion_queries: np.ndarray) -> None:
    """The resolved judgments and both sides' query features, under ``upgrades/<upgrade>/eval/``."""
    from components.gallery.plan import upgrade_key

    store.put_array(upgrade_key(upgrade, "eval/judged_new.npy"), np.asarray(new_queries, dtype=np.float32))
    store.put_array(upgrade_key(upgrade, "eval/judged_champion.npy"), np.asarray(champion_queries, dtype=np.float32))
    store.put_json(upgrade_key(upgrade, JUDGED), {
        "source": judged.source, "query_positions": judged.query_positions.tolist(), "query_uris": judged.query_uris,
        "relevant": [r.tolist() for r in judged.relevant]})


def stored_judged(store, upgrade: str) -> tuple[Judgments, np.ndarray, np.ndarray] | None:
    """(judgments, new-model query features, champion query features) of a planned upgrade, or None."""
    from components.gallery.plan import upgrade_key
    from components.gallery.store import ObjectMissing

    try:
        record = store.get_json(upgrade_key(upgrade, JUDGED))
    except ObjectMissing:
        return None
    judged = Judgments(record["source"], np.asarray(record["query_positions"], dtype=np.int64), record["query_uris"],
                       [np.asarray(r, dtype=np.int64) for r in record["relevant"]])
    return (judged, store.get_array(upgrade_key(upgrade, "eval/judged_new.npy")),
            store.get_array(upgrade_key(upgrade, "eval/judged_champion.npy")))
