"""The gallery served from Milvus (``layout: milvus``): one collection per model version, behind an
alias the team's service searches. A collection holds one row per item: ``id`` (the team's id,
integer or text), ``embedding``, ``source`` (``embedded``: the model embedded the item's image;
``mapped``: h(old)) and ``model`` (the model version whose space the row is in)::

    client.search("gallery", data=[query], limit=10, filter='model == "models:/embedder/2"',
                  output_fields=["source"])

During an upgrade:

- **the switch** (the gallery pointed at a planned upgrade): the new model's collection is made
  and filled with the mixed gallery (h(old), and the chunks embedded while planning), its index
  built and loaded, then the alias moves to it (``alter_alias``: one step for every reader). A
  query embedded for the model the alias served a moment before matches no row of the new
  collection (``filter model == ...``): no answer, never another space's;
- **each chunk** upserts its rows (new features, ``source = embedded``): Milvus has no
  transactions, so a chunk's completion record is its marker in the store, written after the
  upsert; a chunk retried after a kill upserts the same rows again (the same bytes);
- **the finish** keeps the collection the chunks filled; **reject, abort and rollback** move the
  alias back to the collection of the model the manifest serves; ``fastfill gallery gc`` drops the
  other models' collections.

Everything that is not a vector stays in the gallery's store, as on the pgvector layout: the
manifest (its ``index`` names the server, the alias, the id type and the gallery's id, ``owner``),
the items table, the lock and each upgrade's objects. The server: a Milvus server by
``http://host:19530`` (a token in ``MILVUS_TOKEN``), or Milvus Lite, a local ``.db`` file (one
process at a time may open it).

The Milvus is the team's (components/gallery/layouts/ownership.py): each collection the product
makes carries the gallery's mark (the collection property ``fastfill.gallery``, and its
description where the server keeps one); the product drops, replaces or moves the alias away from
no collection without this gallery's mark, and a name held by anything else (the team's
collection, another gallery's alias) is refused in one line before any write. A collection or the
alias dropped by another writer is a DamagedObject, one line.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from collections.abc import Iterable
from contextlib import contextmanager
from urllib.parse import unquote, urlsplit

import numpy as np

from fastfill.components.gallery.layouts.catalog import (
    EMBEDDED,
    MAPPED,
    MILVUS,
    GalleryError,
    PartsWriter,
    Serving,
    StoredItems,
    check_features,
    dim_of,
)
from fastfill.components.gallery.layouts.item_ids import id_array, is_text
from fastfill.components.gallery.layouts.ownership import (
    OWNER_KEY,
    STORE_KEY,
    NotOurs,
    mark,
    new_owner,
    owner_of,
    read_mark,
    refusal,
)
from fastfill.components.gallery.layouts.served import FeaturesById, ServedGallery
from fastfill.components.gallery.store import DamagedObject, ObjectMissing, Store, StoreError
from fastfill.components.gallery.upgrade.stored import Plan, iter_mixed_parts
from fastfill.components.platform.registry import ModelRef
from fastfill.components.platform.secrets import password_for, redact, take_password

TOKEN_ENV = "MILVUS_TOKEN"
METRICS = {"l2": "L2", "cosine": "COSINE"}
MAX_DIM = 32768  # Milvus's largest float vector
ROWS_PER_CALL = 5000
MARK_PROPERTY = "fastfill.gallery"  # the collection property that holds the product's mark
ROLE = "collection"
ALIAS_SETTING = "gallery.milvus.alias"  # the collections' names derive from the alias
SERVER_SCHEMES = ("http://", "https://", "tcp://", "unix:")
NOT_THERE = 100  # Milvus's code for a collection (or alias) that does not exist


class MilvusError(StoreError):
    """The Milvus server cannot be reached or refused a call (retried as a store error)."""


class _Quiet(logging.Filter):
    """pymilvus logs every failed call with its traceback before it raises; a call made here
    raises the product's one-line error instead (``Collections.calling``), so pymilvus's record
    of it is dropped. Per thread: other code's calls, and other threads', log as before."""

    def __init__(self):
        super().__init__()
        self.local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(self.local, "depth", 0)


_QUIET = _Quiet()
logging.getLogger("pymilvus.decorators").addFilter(_QUIET)


@contextmanager
def _quiet():
    """pymilvus's records of failed calls dropped in this thread, for the block (which raises
    the failures itself)."""
    local = _QUIET.local
    local.depth = getattr(local, "depth", 0) + 1
    try:
        yield
    finally:
        local.depth -= 1


def _milvus_failure(error: BaseException) -> bool:
    """A failure pymilvus or gRPC raised (the server's answer, or no answer)."""
    from pymilvus.exceptions import MilvusException

    return isinstance(error, MilvusException) or type(error).__module__.split(".")[0] == "grpc"  # grpc.RpcError's


def is_lite(uri: str) -> bool:
    """A Milvus Lite file (a local path), not a server's address."""
    return not str(uri).startswith(SERVER_SCHEMES)


def is_lite_database(path: str) -> bool:
    """A folder Milvus Lite made (what it keeps behind a ``.db`` path: its lock and collections)."""
    return os.path.isfile(os.path.join(path, "LOCK")) and os.path.isdir(os.path.join(path, "collections"))


def check_lite_file(uri: str) -> str:
    """A Milvus Lite ``uri`` is a ``.db`` path that is free or Milvus Lite's own: Milvus Lite would
    take any existing directory as its data folder, and writes its files into it."""
    if not is_lite(uri):
        return uri
    if not str(uri).endswith(".db") or (os.path.isdir(uri) and not is_lite_database(uri)):
        what = "is a directory that is not a Milvus Lite database" if os.path.isdir(uri) else "does not end in .db"
        example = os.path.join(uri, "milvus.db") if os.path.isdir(uri) else "milvus.db"
        raise GalleryError(f"gallery.milvus.uri {uri} {what}; give the path of a Milvus Lite .db file (e.g. {example}), "
                           "or a Milvus server (http://host:19530). Nothing was written.")
    return uri


def _name(text: str, what: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,254}", text or ""):
        raise GalleryError(f"{what} {text!r} is not a Milvus name (letters, digits and _, not starting with a digit)")
    return text


def collection_of(alias: str, model: ModelRef) -> str:
    """The collection of ``model``'s vectors: ``<alias>_emb_<name>_v<version>``."""
    name = re.sub(r"[^A-Za-z0-9_]+", "_", f"{alias}_emb_{model.name}_v{model.version}")
    return name if len(name) <= 200 else f"{name[:180]}_{hashlib.sha1(name.encode()).hexdigest()[:12]}"


def default_alias(store_uri: str) -> str:
    return "gallery_" + hashlib.sha1(str(store_uri).rstrip("/").encode()).hexdigest()[:10]


def milvus_settings(config, distance: str, store_uri: str = "") -> dict:
    """The manifest's ``index`` of a new Milvus gallery from ``gallery.milvus`` (``config``), with
    the new gallery's id (``owner``) that marks its collections, and its store."""
    return {"kind": MILVUS, "uri": check_lite_file(config.uri),
            "alias": _name(config.alias or default_alias(store_uri), ALIAS_SETTING),
            OWNER_KEY: new_owner(), STORE_KEY: str(store_uri),
            "distance": distance, "ann": config.ann, "hnsw_m": config.hnsw_m,
            "hnsw_ef_construction": config.hnsw_ef_construction, "ef_search": config.ef_search, "collections": {}}


class Collections:
    """The server side of a Milvus gallery: its models' collections and the alias. ``store_uri``:
    the gallery's store (names a gallery made before galleries had ids). ``reclaim``: a new
    gallery's writer, which replaces what a killed write into the same store left (marked with
    that store)."""

    def __init__(self, settings: dict, store_uri: str = "", reclaim: bool = False):
        self.settings = settings
        self.alias = settings["alias"]
        self.view = self.alias  # what the team's service searches
        self.metric = METRICS[settings.get("distance", "l2")]
        self.store_uri = settings.get(STORE_KEY) or str(store_uri)
        self.owner = owner_of(settings, self.store_uri)
        self.reclaim = reclaim
        self._client = None

    @property
    def where(self) -> str:
        return f"Milvus {self.settings['uri']} alias {self.alias}"

    @property
    def server(self) -> str:
        return f"Milvus {self.settings['uri']}"

    def client(self):
        if self._client is None:
            from pymilvus import MilvusClient

            uri = check_lite_file(take_password(self.settings["uri"]))
            password = password_for(uri)  # a password written in gallery.milvus.uri, kept in memory only
            user = urlsplit(uri).username if password is not None else None
            credentials = {"user": unquote(user or ""), "password": password} if password is not None else {}
            try:
                with _quiet():
                    self._client = MilvusClient(uri, token=os.environ.get(TOKEN_ENV, ""), **credentials)
            except Exception as error:  # noqa: BLE001 - pymilvus raises its own kinds and grpc's
                raise MilvusError(f"cannot reach {self.where}: {redact(' '.join(str(error).split()))[:300]}") from None
        return self._client

    @contextmanager
    def calling(self, what: str):
        """A call to the server about ``what`` (a collection, the alias): pymilvus's logged
        traceback of a failure is not printed, the failure is raised in one line instead: a
        DamagedObject when the object is not there (dropped by another writer), else a MilvusError."""
        try:
            with _quiet():
                yield
        except Exception as error:
            if not _milvus_failure(error):
                raise
            text = " ".join(str(error).split())[:300]
            if getattr(error, "code", None) == NOT_THERE or re.search(r"(collection|alias)\b.*\b(not exist|not found)",
                                                                      text):
                raise DamagedObject(f"{self.server}: {what} is not there ({text}): dropped by another writer? "
                                    "`fastfill upgrade status` says what the gallery serves; restore it, or adopt the "
                                    "gallery again") from None
            raise MilvusError(f"{self.server}: {what}: {text}") from None

    # ---- whose collections

    def mark_text(self) -> str:
        return mark(self.owner, ROLE, self.store_uri)

    def aliases(self) -> list[str]:
        with self.calling("the aliases"):
            return list(self.client().list_aliases().get("aliases", []))

    def target(self) -> str | None:
        """The collection the alias points at (None: no alias of that name)."""
        if self.alias not in self.aliases():
            return None
        with self.calling(f"the alias {self.alias}"):
            return self.client().describe_alias(self.alias)["collection_name"]

    def mark_of(self, name: str) -> dict | None:
        """The product's mark on the collection ``name`` (None: none, the team's)."""
        with self.calling(f"the collection {name}"):
            described = self.client().describe_collection(name)
        return (read_mark((described.get("properties") or {}).get(MARK_PROPERTY))
                or read_mark(described.get("description")))

    def is_ours(self, found: dict | None) -> bool:
        if found is None:
            return False
        return found.get("gallery") == self.owner or (self.reclaim and found.get("store") == self.store_uri)

    def ours(self, name: str) -> bool:
        """Whether the collection ``name`` (which exists) carries this gallery's mark."""
        return self.is_ours(self.mark_of(name))

    def refused(self, what: str, name: str, found: dict | None) -> NotOurs:
        """The one line refusing to touch the collection ``name`` (``what``: how it is named); an
        unmarked one might be this gallery's from an earlier release: the line says how to mark it."""
        return refusal(what, found, self.owner, ALIAS_SETTING,
                       mark_it=f"MilvusClient(uri).alter_collection_properties('{name}', "
                               f"{{'{MARK_PROPERTY}': '{self.mark_text()}'}})")

    def check_collection(self, name: str) -> None:
        """The collection name ``name`` is free or this gallery's collection; else NotOurs."""
        if name in self.aliases():
            raise refusal(f"{self.server}: the alias {name} (a name this gallery's collection would take)",
                          None, self.owner, ALIAS_SETTING)
        if self.exists(name):
            found = self.mark_of(name)
            if not self.is_ours(found):
                raise self.refused(f"{self.server}: the collection {name}", name, found)

    def check_alias(self) -> None:
        """The alias is free, or points at a collection of this gallery's; else NotOurs."""
        target = self.target()
        if target is None:
            if self.exists(self.alias):
                raise refusal(f"{self.server}: the collection {self.alias} (a name the alias would take)",
                              self.mark_of(self.alias), self.owner, ALIAS_SETTING)
            return
        if not self.exists(target):
            raise DamagedObject(f"{self.server}: the alias {self.alias} points at the collection {target}, which is not "
                                "there (dropped by another writer?); restore it, or drop the alias")
        found = self.mark_of(target)
        if not self.is_ours(found):
            raise self.refused(f"{self.server}: the alias {self.alias} (it points at the collection {target})", target,
                               found)

    def check_names(self, *names: str) -> None:
        """Every name this gallery would write (the alias, the collections ``names``) is free or
        this gallery's; before any write."""
        self.check_alias()
        for name in names:
            self.check_collection(name)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def collection(self, model: ModelRef) -> str:
        adopted = self.settings.get("collections", {}).get(model.key)
        return adopted or collection_of(self.alias, model)

    def exists(self, name: str) -> bool:
        with self.calling(f"the collection {name}"):
            return self.client().has_collection(name)

    def count(self, name: str) -> int:
        with self.calling(f"the collection {name}"):
            rows = self.client().query(name, filter="", output_fields=["count(*)"])
        return int(rows[0]["count(*)"])

    def serving(self) -> Serving | None:
        """Which collection the alias points at and the model its rows are in (None before any)."""
        collection = self.target()
        if collection is None:
            return None
        client = self.client()
        with self.calling(f"the collection {collection} (the alias {self.alias}'s)"):
            rows = client.query(collection, filter="", output_fields=["model"], limit=1)
            fields = client.describe_collection(collection)["fields"]
        uri = rows[0]["model"] if rows else None
        found = re.fullmatch(r"models:/(.+)/([^/]+)", uri or "")
        dim = next((int(f["params"]["dim"]) for f in fields if f["name"] == "embedding"), None)
        return Serving(uri, found.group(1) if found else None, found.group(2) if found else None, dim, collection)

    def chunk_done(self, upgrade_id: str) -> set[int] | None:
        """None: Milvus has no transactions, so a chunk's record is its marker in the store."""
        return None

    def create(self, name: str, model: ModelRef, text_ids: bool) -> None:
        """A new collection marked as this gallery's, for ``model``'s vectors, with its ANN index.
        One of this gallery's of that name (a switch or a write cut short, an aborted upgrade's)
        is dropped first; any other holder of the name is refused (NotOurs) before any write."""
        from pymilvus import DataType

        client = self.client()
        self.check_collection(name)
        if self.exists(name):
            with self.calling(f"the collection {name}"):
                client.drop_collection(name)
        schema = client.create_schema(auto_id=False, description=self.mark_text())
        if text_ids:
            schema.add_field("id", DataType.VARCHAR, is_primary=True, max_length=1024)
        else:
            schema.add_field("id", DataType.INT64, is_primary=True)
        schema.add_field("embedding", DataType.FLOAT_VECTOR, dim=dim_of(model))
        schema.add_field("source", DataType.VARCHAR, max_length=16)
        schema.add_field("model", DataType.VARCHAR, max_length=512)
        index = client.prepare_index_params()
        if self.settings.get("ann", "hnsw") == "hnsw":
            index.add_index("embedding", index_type="HNSW", metric_type=self.metric,
                            params={"M": int(self.settings.get("hnsw_m", 16)),
                                    "efConstruction": int(self.settings.get("hnsw_ef_construction", 64))})
        else:
            index.add_index("embedding", index_type="FLAT", metric_type=self.metric)
        with self.calling(f"the collection {name}"):
            client.create_collection(name, schema=schema, properties={MARK_PROPERTY: self.mark_text()})
            # not waiting for the build of an empty collection's index: the wait asks the server for a
            # timestamp, which Milvus Lite does not implement, and its gRPC server logs a traceback
            client.create_index(name, index, sync=False)
            client.load_collection(name)

    def write(self, name: str, model: ModelRef, ids: np.ndarray, vectors: np.ndarray, sources, insert=False) -> None:
        sources = [sources] * len(ids) if isinstance(sources, str) else list(sources)
        rows = [{"id": item, "embedding": vector, "source": source, "model": model.uri}
                for item, vector, source in zip(ids.tolist(), np.asarray(vectors, dtype=np.float32), sources)]
        client = self.client()
        for start in range(0, len(rows), ROWS_PER_CALL):
            block = rows[start:start + ROWS_PER_CALL]
            with self.calling(f"the collection {name}"):
                (client.insert if insert else client.upsert)(name, block)

    def seal(self, name: str, chunk: bool = False) -> None:
        """The rows written into ``name`` sealed into segments its index covers (``flush``): Milvus
        Lite scans a growing segment row by row at every search (at 100,000 rows half way through
        an upgrade, 2.5 s a search unflushed against 0.26 s flushed; docs/serving.md). After a bulk
        write (the switch, a new gallery) always; after a ``chunk`` only on Milvus Lite: a server
        indexes its growing segments itself and limits flushes (by default about one per ten
        seconds per collection)."""
        if chunk and not is_lite(self.settings["uri"]):
            return
        with self.calling(f"the collection {name}"):
            self.client().flush(name)

    def read(self, name: str, ids: np.ndarray, dim: int, vector_field: str = "embedding") -> np.ndarray:
        out = np.empty((len(ids), dim), dtype=np.float32)
        text = is_text(ids)
        for start in range(0, len(ids), ROWS_PER_CALL):
            block = [str(v) for v in ids[start:start + ROWS_PER_CALL]] if text else \
                [int(v) for v in ids[start:start + ROWS_PER_CALL]]
            with self.calling(f"the collection {name}"):
                got = self.client().get(name, ids=block, output_fields=[vector_field])
            found = {row["id"]: row[vector_field] for row in got}
            for k, item in enumerate(block):
                if item not in found:
                    raise DamagedObject(f"{self.where} collection {name}: item {item!r} has no row (deleted by another "
                                        "writer?); restore it, or adopt the collection again")
                out[start + k] = found[item]
        return out

    def point(self, name: str) -> None:
        """The alias moves to ``name`` (created the first time): one step for every reader. An
        alias that points at a collection not this gallery's (the team's, another gallery's) is
        refused (NotOurs), and so is a collection of the alias's name."""
        client = self.client()
        self.check_alias()
        target = self.target()
        with self.calling(f"the collection {name}"):
            client.load_collection(name)
            if target is None:
                client.create_alias(name, self.alias)
            elif target != name:
                client.alter_alias(name, self.alias)

    def drop(self, name: str) -> None:
        """The collection ``name`` dropped when it is there and this gallery's (else NotOurs)."""
        if not self.exists(name):
            return
        found = self.mark_of(name)
        if not self.is_ours(found):
            raise self.refused(f"{self.server}: the collection {name}", name, found)
        with self.calling(f"the collection {name}"):
            self.client().drop_collection(name)

    def product_distances(self, distances: list) -> np.ndarray:
        """Milvus's distances as the product gives them: squared L2 (Milvus's L2), or 1 - cosine."""
        values = np.asarray(distances, dtype=np.float64)
        return values if self.metric == "L2" else 1.0 - values

    def embedded_count(self) -> int:
        with self.calling(f"the alias {self.alias}"):
            rows = self.client().query(self.alias, filter=f'source == "{EMBEDDED}"', output_fields=["count(*)"])
        return int(rows[0]["count(*)"])

    def model_collections(self) -> list[str]:
        """The collections of this gallery's models: named after the alias and marked as its own
        (a team's collection of a like name is not one)."""
        with self.calling("the collections"):
            names = self.client().list_collections()
        return sorted(n for n in names if n.startswith(f"{self.alias}_emb_") and self.ours(n))

    def search(self, queries: np.ndarray, k: int, model: str | None = None) -> tuple[list, list, list, list]:
        """The alias's k nearest rows of each query: (ids, distances, models, sources) per query;
        ``model``: the model the queries were embedded with (rows of another model match nothing)."""
        params = {"ef": max(int(self.settings.get("ef_search", 100)), k)} if self.settings.get("ann") == "hnsw" else {}
        with self.calling(f"the alias {self.alias}"):
            found = self.client().search(self.alias, data=np.asarray(queries, dtype=np.float32).tolist(),
                                         limit=int(k), filter=f'model == "{model}"' if model else "",
                                         output_fields=["source", "model"], search_params={"params": params})
        ids, distances, models, sources = [], [], [], []
        for hits in found:
            ids.append([hit["id"] for hit in hits])
            distances.append([float(hit["distance"]) for hit in hits])
            models.append({hit["entity"]["model"] for hit in hits})
            sources.append([hit["entity"]["source"] for hit in hits])
        return ids, distances, models, sources


class MilvusGallery(StoredItems, FeaturesById, ServedGallery[Collections, str]):
    """A gallery whose vectors are Milvus collections behind the alias queries are served from;
    the manifest, items and upgrade objects are in its store."""

    layout = MILVUS
    records_upgrade = False  # the alias says which collection serves; the manifest which upgrade

    def _open_index(self, settings: dict) -> Collections:
        return Collections(settings, self.store.uri)

    def _rows(self, model: ModelRef, ids: np.ndarray) -> np.ndarray:
        name = self.index.collection(model)
        if not self.index.exists(name):
            if model.key == self.model.key:  # the gallery's own model: its collection was made, then dropped
                raise DamagedObject(f"{self.index.where}: the collection {name} of the gallery's model {model.uri} is "
                                    "not there (dropped by another writer?); restore it, or adopt the gallery again")
            raise ObjectMissing(f"{self.index.where} holds no features of {model.uri} (no collection {name})")
        serving = self.index.serving()
        dim = model.dim or (serving.dim if serving is not None and serving.dim else 0)
        return check_features(self.index.read(name, ids, dim), model.dim, f"{self.index.where} collection {name}")

    def write_features(self, model: ModelRef, parts: Iterable[tuple[int, np.ndarray]]) -> None:
        index = self.index
        name = index.collection(model)
        serving = index.serving()
        if serving is not None and serving.vectors == name:  # the chunks filled it (the finish)
            for _ in parts:
                pass
            return
        ids = self.ids()
        index.create(name, model, is_text(ids))
        for part, features in parts:
            start, stop = self.part_bounds(part)
            index.write(name, model, ids[start:stop], features, EMBEDDED, insert=True)

    def missing_features(self, model: ModelRef) -> list[str]:
        name = self.index.collection(model)
        if not self.index.exists(name):
            return [f"{self.index.where} collection {name}"]
        rows = self.index.count(name)
        return [f"{self.index.where} collection {name}: {self.num_items - rows} rows missing"] \
            if rows != self.num_items else []

    def collect_features(self) -> int:
        """Drop the collections of models the gallery no longer serves: only this gallery's
        (marked), never the one the alias points at."""
        index = self.index
        keep = {index.collection(self.model), index.target()}
        drop = [n for n in index.model_collections() if n not in keep]
        drop += [n for n in self.manifest()["index"].get("collections", {}).values()
                 if n not in keep and n not in drop and index.exists(n) and index.ours(n)]
        for name in drop:
            index.drop(name)
        return len(drop)

    def check_sources(self, sequential: bool = False) -> None:
        if not sequential:
            missing = self.missing_features(self.model)
            if missing:
                raise GalleryError(f"{missing[0]} (the gallery's model {self.model.uri}). Nothing was written.")

    def cannot_serve(self, model: ModelRef, task_runner: str = "threads") -> str | None:
        """Milvus holds vectors of up to 32,768 dimensions; a Milvus Lite file is one process's,
        so a backfill by Dask workers (processes of their own) cannot write it."""
        if int(model.dim or 0) > MAX_DIM:
            return (f"{model.uri} embeds into {int(model.dim or 0):,} dimensions; a Milvus float vector holds at most "
                    f"{MAX_DIM:,}. Keep this gallery in another layout (`fastfill gallery convert --layout lance`)")
        uri = self.manifest()["index"].get("uri", "")
        if task_runner == "dask" and is_lite(uri):
            return (f"gallery.upgrade.task_runner is dask, but this gallery's Milvus is the Milvus Lite file {uri}, "
                    "which one process at a time may open; the Dask workers could not write their chunks. Use "
                    "task_runner threads, or a Milvus server (gallery.milvus.uri http://host:19530)")
        try:  # the new model's collection: free or this gallery's, as the alias
            self.index.check_names(self.index.collection(model))
        except NotOurs as refused:
            return str(refused).removesuffix(" Nothing was written.").rstrip(".")
        return None

    def _target(self, model: ModelRef) -> str:
        return self.index.collection(model)

    def _point(self, target: str, model: ModelRef, upgrade_id: str | None) -> None:
        """The alias moved to the collection ``target`` (``alter_alias``: one step for every reader)."""
        self.index.point(target)

    def _prepare_switch(self, plan: Plan, name: str) -> None:
        index = self.index
        ids = self.ids()
        index.create(name, plan.new, is_text(ids))
        for part, features, backfilled in iter_mixed_parts(self, plan):
            start, stop = self.part_bounds(part)
            index.write(name, plan.new, ids[start:stop], features, [EMBEDDED if b else MAPPED for b in backfilled],
                        insert=True)
        index.seal(name)

    def serve_chunk(self, plan, chunk: int, positions: np.ndarray, features: np.ndarray, embedded: np.ndarray) -> None:
        index = self.index
        name = index.collection(plan.new)
        index.write(name, plan.new, self.ids()[np.asarray(positions, dtype=np.int64)], features,
                    [EMBEDDED if e else MAPPED for e in embedded])
        index.seal(name, chunk=True)

    @staticmethod
    def writer(store: Store, model: ModelRef, part_size: int, settings: dict | None = None) -> MilvusWriter:
        if settings is None:
            raise GalleryError("a Milvus gallery is written with its settings (gallery.milvus)")
        return MilvusWriter(store, model, part_size, settings)


class MilvusWriter:
    """Writes a new Milvus gallery: the items as the parts layout's objects in the store, the
    features as the model's collection; the alias points at it after ``close``."""

    def __init__(self, store: Store, model: ModelRef, part_size: int, settings: dict):
        self.parts = PartsWriter(store, model, part_size)
        self.model, self.settings = model, dict(settings)
        self.settings.setdefault(OWNER_KEY, new_owner())  # a new gallery: its id marks its collections
        self.settings.setdefault(STORE_KEY, store.uri)
        self.index = Collections(self.settings, store.uri, reclaim=True)
        self.name = self.index.collection(model)
        self._created = False

    def write(self, start: int, items, features: np.ndarray, images: np.ndarray | None = None) -> None:
        ids = id_array(items.column("id"))
        if not self._created:
            self.index.check_names(self.name)  # the alias and the collection: free, or a killed write's of this store
            self.index.create(self.name, self.model, is_text(ids))
            self._created = True
        self.parts.write_items(start, items, images)
        self.index.write(self.name, self.model, ids, features, EMBEDDED, insert=True)

    def close(self) -> None:
        self.index.seal(self.name)
        self.index.point(self.name)

    def manifest_fields(self) -> dict:
        return {"index": self.settings}
