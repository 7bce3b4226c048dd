"""Judged queries: a retrieval team's golden set as the truth of the promotion gate.

``gallery.upgrade.judgments`` names a CSV or Parquet file (a local path or ``s3://bucket/key``)
with two columns, one judged pair a row:

- ``query``: a gallery item id (that item's features are the query), or anything else, taken
  as the URI of a query image (``s3://...``, an absolute path, or a path the caller resolves,
  e.g. under the gallery's image root);
- ``relevant``: the id of a gallery item relevant to that query. A query with several relevant
  items has several rows.

``load_judgments`` reads, checks and resolves the file against the gallery's ids into
``Judgments``; ``store_judged`` / ``stored_judged`` keep the resolved queries beside an upgrade's
plan. The gate's numbers with them (``measure_judged_gate``, re-exported here for the flows and
tasks that measure the gate) are ``components.gallery.judged_gate``'s.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

import numpy as np

from components.gallery.catalog import GalleryError
from components.gallery.judged_gate import measure_judged_gate

__all__ = ["COLUMNS", "JUDGED", "Judgments", "load_judgments", "measure_judged_gate", "store_judged", "stored_judged"]

COLUMNS = ("query", "relevant")
_INTEGER = re.compile(r"[+-]?\d+")


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
# An upgrade's judged queries, kept beside its plan (the gate measures them when the backfill ends)

JUDGED = "eval/judgments.json"


def store_judged(store, upgrade: str, judged: Judgments, new_queries: np.ndarray, champion_queries: np.ndarray) -> None:
    """The resolved judgments and both sides' query features, under ``upgrades/<upgrade>/eval/``."""
    from components.gallery.planning import upgrade_key

    store.put_array(upgrade_key(upgrade, "eval/judged_new.npy"), np.asarray(new_queries, dtype=np.float32))
    store.put_array(upgrade_key(upgrade, "eval/judged_champion.npy"), np.asarray(champion_queries, dtype=np.float32))
    store.put_json(upgrade_key(upgrade, JUDGED), {
        "source": judged.source, "query_positions": judged.query_positions.tolist(), "query_uris": judged.query_uris,
        "relevant": [r.tolist() for r in judged.relevant]})


def stored_judged(store, upgrade: str) -> tuple[Judgments, np.ndarray, np.ndarray] | None:
    """(judgments, new-model query features, champion query features) of a planned upgrade, or None."""
    from components.gallery.planning import upgrade_key
    from components.gallery.store import ObjectMissing

    try:
        record = store.get_json(upgrade_key(upgrade, JUDGED))
    except ObjectMissing:
        return None
    judged = Judgments(record["source"], np.asarray(record["query_positions"], dtype=np.int64), record["query_uris"],
                       [np.asarray(r, dtype=np.int64) for r in record["relevant"]])
    return (judged, store.get_array(upgrade_key(upgrade, "eval/judged_new.npy")),
            store.get_array(upgrade_key(upgrade, "eval/judged_champion.npy")))
