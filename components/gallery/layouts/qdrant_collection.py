"""The gallery served from Qdrant (``layout: qdrant``): one collection per model version
(``<alias>_emb_<model>_v<version>``), behind an alias the team's service searches. A collection
holds one point per item: its vector, and a payload of ``id`` (the team's id, integer or text),
``source`` (``embedded``: the model embedded the item's image; ``mapped``: h(old)) and ``model``
(the model version whose space the point is in)::

    client.query_points("gallery", query=query, limit=10, with_payload=True,
                        query_filter=Filter(must=[FieldCondition(key="model",
                                                                 match=MatchValue(value="models:/embedder/2"))]))

Qdrant's point ids are unsigned integers or UUIDs: an item whose id is an integer of 0 or more is
the point of that number; any other id (text, a negative number) is the point
``uuid5(POINT_NAMESPACE, str(id))``, and the payload's ``id`` is the team's id either way (what a
search answers).

Why a collection per model version and not named vectors in one collection: every answer must be
in one model's space, and readers must move between spaces in one step. Behind an alias, a reader
queries one collection and ``update_collection_aliases`` (the alias deleted and created again in
one call) moves every reader at once, as Milvus's ``alter_alias``; a collection of the new model's
dimension is built beside the served one while queries go on, and gc drops a whole collection.
Named vectors would put both models' vectors on each point: the service's query names the vector,
so the switch would be a change of the service's code, not of the index; measured side by side
(benchmarks/qdrant_choice.py, docs/serving.md), a reader moving on its own found a named vector
half written (incomplete answers), the switch wrote a third more, and gc rewrote every point.

During an upgrade:

- **the switch**: the new model's collection is made and filled with the mixed gallery (h(old),
  and the chunks embedded while planning), then the alias moves to it. A query embedded for the
  model the alias served a moment before matches no point of the new collection (the filter on
  ``model``): no answer, never another space's;
- **each chunk** upserts its points (``source = embedded``), waiting for them to be applied; the
  chunk's completion record is its marker in the store, written after the upsert; a chunk retried
  after a kill upserts the same points again;
- **the finish** keeps the collection the chunks filled; **reject, abort and rollback** move the
  alias back to the collection of the model the manifest serves; ``fastfill gallery gc`` drops the
  other models' collections.

The manifest, the items table, the lock and each upgrade's objects stay in the gallery's store, as
on the Milvus layout. The server: a Qdrant server by ``http(s)://host:6333`` (an API key in
``QDRANT_API_KEY``, never stored), or Qdrant's local mode, a folder (one process at a time may open
it; within a process, every gallery on that folder shares one client).

The Qdrant is the team's (components/gallery/layouts/ownership.py): each collection the product
makes carries the gallery's mark in the collection's ``metadata`` (key ``fastfill.gallery``), which
Qdrant keeps with the collection's configuration, on a server and in local mode alike; a marker
point would be a row the team's searches could answer, and a naming convention alone cannot tell
the team's collection of a like name from ours. The product drops, or moves the alias away from, no
collection without this gallery's mark, and a name held by anything else (the team's collection,
another gallery's alias) is refused in one line before any write. A collection or the alias
dropped by another writer is a DamagedObject, one line.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import uuid
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from fastfill.components.gallery.layouts.catalog import (
    EMBEDDED,
    MAPPED,
    QDRANT,
    GalleryError,
    PartsWriter,
    Serving,
    StoredItems,
    check_features,
    dim_of,
)
from fastfill.components.gallery.layouts.item_ids import id_array
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
from fastfill.components.platform.secrets import redact

API_KEY_ENV = "QDRANT_API_KEY"
METRICS = {"l2": "Euclid", "cosine": "Cosine"}
MAX_DIM = 65536  # Qdrant's largest dense vector
POINTS_PER_CALL = 1000
MARK_KEY = "fastfill.gallery"  # the collection metadata key that holds the product's mark
ROLE = "collection"
ALIAS_SETTING = "gallery.qdrant.alias"  # the collections' names derive from the alias
SERVER_SCHEMES = ("http://", "https://")
POINT_NAMESPACE = uuid.UUID("6f1c3e2a-5b7d-4c8e-9a0f-1d2e3f4a5b6c")  # the UUID5 namespace of items' point ids


class QdrantError(StoreError):
    """The Qdrant server cannot be reached or refused a call (retried as a store error)."""


def is_local(url: str) -> bool:
    """Qdrant's local mode (a folder), not a server's URL."""
    return not str(url).startswith(SERVER_SCHEMES)


def point_id(item) -> int | str:
    """The Qdrant point id of the item ``item``: itself when an integer of 0 or more, else the
    UUID5 of its text."""
    if isinstance(item, (int, np.integer)) and int(item) >= 0:
        return int(item)
    return str(uuid.uuid5(POINT_NAMESPACE, str(item)))


def _name(text: str, what: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,254}", text or ""):
        raise GalleryError(f"{what} {text!r} is not a Qdrant name here (letters, digits and _, not starting with a "
                           "digit)")
    return text


def collection_of(alias: str, model: ModelRef) -> str:
    """The collection of ``model``'s vectors: ``<alias>_emb_<name>_v<version>``."""
    name = re.sub(r"[^A-Za-z0-9_]+", "_", f"{alias}_emb_{model.name}_v{model.version}")
    return name if len(name) <= 200 else f"{name[:180]}_{hashlib.sha1(name.encode()).hexdigest()[:12]}"


def default_alias(store_uri: str) -> str:
    return "gallery_" + hashlib.sha1(str(store_uri).rstrip("/").encode()).hexdigest()[:10]


def qdrant_settings(config, distance: str, store_uri: str = "") -> dict:
    """The manifest's ``index`` of a new Qdrant gallery from ``gallery.qdrant`` (``config``), with
    the new gallery's id (``owner``) that marks its collections, and its store."""
    url = str(config.url)
    if is_local(url) and os.path.isfile(url):
        raise GalleryError(f"gallery.qdrant.url {url} is a file; give a folder for Qdrant's local mode, or a Qdrant "
                           "server (http://host:6333). Nothing was written.")
    return {"kind": QDRANT, "url": url, "alias": _name(config.alias or default_alias(store_uri), ALIAS_SETTING),
            OWNER_KEY: new_owner(), STORE_KEY: str(store_uri),
            "distance": distance, "ann": config.ann, "hnsw_m": config.hnsw_m,
            "hnsw_ef_construction": config.hnsw_ef_construction, "ef_search": config.ef_search, "collections": {}}


class _Local:
    """The clients of Qdrant's local mode in this process, one per folder (the folder is locked by
    the client that opens it), shared by every gallery on it, with a lock serialising their calls."""

    guard = threading.Lock()
    open: dict[str, list] = {}  # folder -> [client, users, lock]

    @classmethod
    def take(cls, path: str):
        from qdrant_client import QdrantClient

        path = os.path.abspath(path)
        with cls.guard:
            if path not in cls.open:
                cls.open[path] = [QdrantClient(path=path), 0, threading.RLock()]
            cls.open[path][1] += 1
            return cls.open[path][0], cls.open[path][2]

    @classmethod
    def give(cls, path: str) -> None:
        path = os.path.abspath(path)
        with cls.guard:
            held = cls.open.get(path)
            if held is None:
                return
            held[1] -= 1
            if held[1] <= 0:
                del cls.open[path]
                held[0].close()


def local_client(path: str):
    """The client this process shares for the local-mode folder ``path`` (a team's own code in the
    same process reads it through this one); ``release_local(path)`` when done."""
    return _Local.take(path)[0]


def release_local(path: str) -> None:
    _Local.give(path)


class Collections:
    """The server side of a Qdrant gallery: its models' collections and the alias. ``reclaim``: a
    new gallery's writer, which replaces what a killed write into the same store left."""

    def __init__(self, settings: dict, store_uri: str = "", reclaim: bool = False):
        self.settings = settings
        self.alias = settings["alias"]
        self.view = self.alias  # what the team's service searches
        self.metric = METRICS[settings.get("distance", "l2")]
        self.store_uri = settings.get(STORE_KEY) or str(store_uri)
        self.owner = owner_of(settings, self.store_uri)
        self.reclaim = reclaim
        self.local = is_local(settings["url"])
        self._client: Any = None
        self._lock: Any = None

    @property
    def where(self) -> str:
        return f"Qdrant {self.settings['url']} alias {self.alias}"

    @property
    def server(self) -> str:
        return f"Qdrant {self.settings['url']}"

    def client(self):
        if self._client is None:
            try:
                if self.local:
                    self._client, self._lock = _Local.take(self.settings["url"])
                else:
                    from qdrant_client import QdrantClient

                    self._client = QdrantClient(url=self.settings["url"], api_key=os.environ.get(API_KEY_ENV) or None)
            except Exception as error:  # noqa: BLE001 - the client raises its own kinds, httpx's and grpc's
                raise QdrantError(f"cannot reach {self.where}: {redact(' '.join(str(error).split()))[:300]}") from None
        return self._client

    @contextmanager
    def calling(self, what: str) -> Iterator:
        """A call to Qdrant about ``what`` (a collection, the alias), in one line when it fails: a
        DamagedObject when the object is not there (dropped by another writer), else a QdrantError."""
        client = self.client()
        lock = self._lock
        try:
            if lock is not None:
                with lock, warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # local mode: "search_params has no effect"
                    yield client
            else:
                yield client
        except (NotOurs, DamagedObject, GalleryError):
            raise
        except Exception as error:
            text = " ".join(str(error).split())[:300]
            if re.search(r"(not found|doesn't exist|does not exist)", text, re.IGNORECASE):
                raise DamagedObject(f"{self.server}: {what} is not there ({redact(text)}): dropped by another writer? "
                                    "`fastfill upgrade status` says what the gallery serves; restore it, or adopt the "
                                    "gallery again") from None
            raise QdrantError(f"{self.server}: {what}: {redact(text)}") from None

    def close(self) -> None:
        if self._client is not None:
            if self.local:
                _Local.give(self.settings["url"])
            else:
                self._client.close()
            self._client, self._lock = None, None

    # ---- whose collections

    def mark_text(self) -> str:
        return mark(self.owner, ROLE, self.store_uri)

    def alias_map(self) -> dict[str, str]:
        with self.calling("the aliases") as client:
            return {a.alias_name: a.collection_name for a in client.get_aliases().aliases}

    def collections(self) -> list[str]:
        with self.calling("the collections") as client:
            return [c.name for c in client.get_collections().collections]

    def exists(self, name: str) -> bool:
        """A collection (not an alias) of that name is there."""
        return name in self.collections()

    def target(self) -> str | None:
        """The collection the alias points at (None: no alias of that name)."""
        return self.alias_map().get(self.alias)

    def mark_of(self, name: str) -> dict | None:
        """The product's mark on the collection ``name`` (None: none, the team's)."""
        with self.calling(f"the collection {name}") as client:
            metadata = client.get_collection(name).config.metadata or {}
        return read_mark(metadata.get(MARK_KEY))

    def is_ours(self, found: dict | None) -> bool:
        if found is None:
            return False
        return found.get("gallery") == self.owner or (self.reclaim and found.get("store") == self.store_uri)

    def ours(self, name: str) -> bool:
        return self.is_ours(self.mark_of(name))

    def refused(self, what: str, name: str, found: dict | None) -> NotOurs:
        return refusal(what, found, self.owner, ALIAS_SETTING,
                       mark_it=f"QdrantClient(...).update_collection('{name}', metadata={{'{MARK_KEY}': "
                               f"'{self.mark_text()}'}})")

    def check_collection(self, name: str) -> None:
        """The collection name ``name`` is free or this gallery's collection; else NotOurs."""
        if name in self.alias_map():
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

    def collection(self, model: ModelRef) -> str:
        adopted = self.settings.get("collections", {}).get(model.key)
        return adopted or collection_of(self.alias, model)

    def count(self, name: str) -> int:
        with self.calling(f"the collection {name}") as client:
            return int(client.count(name, exact=True).count)

    def serving(self) -> Serving | None:
        """Which collection the alias points at and the model its points are in (None before any)."""
        collection = self.target()
        if collection is None:
            return None
        with self.calling(f"the collection {collection} (the alias {self.alias}'s)") as client:
            points, _ = client.scroll(collection, limit=1, with_payload=["model"], with_vectors=False)
            vectors = client.get_collection(collection).config.params.vectors
        uri = points[0].payload.get("model") if points and points[0].payload else None
        found = re.fullmatch(r"models:/(.+)/([^/]+)", uri or "")
        dim = getattr(vectors, "size", None)
        return Serving(uri, found.group(1) if found else None, found.group(2) if found else None,
                       int(dim) if dim else None, collection)

    def chunk_done(self, upgrade_id: str) -> set[int] | None:
        """None: a chunk's record is its marker in the store."""
        return None

    def create(self, name: str, model: ModelRef) -> None:
        """A new collection marked as this gallery's, for ``model``'s vectors. One of this
        gallery's of that name (a switch or a write cut short) is dropped first; any other holder
        of the name is refused (NotOurs) before any write."""
        from qdrant_client import models as qm

        self.check_collection(name)
        if self.exists(name):
            with self.calling(f"the collection {name}") as client:
                client.delete_collection(name)
        hnsw = qm.HnswConfigDiff(m=int(self.settings.get("hnsw_m", 16)),
                                 ef_construct=int(self.settings.get("hnsw_ef_construction", 64)))
        with self.calling(f"the collection {name}") as client:
            client.create_collection(name, vectors_config=qm.VectorParams(size=dim_of(model),
                                                                          distance=qm.Distance(self.metric)),
                                     hnsw_config=hnsw, metadata={MARK_KEY: self.mark_text()})
            if not self.local:  # the filter on model, and the count of embedded points, by a payload index
                for field in ("model", "source"):
                    client.create_payload_index(name, field, qm.PayloadSchemaType.KEYWORD, wait=True)

    def write(self, name: str, model: ModelRef, ids: np.ndarray, vectors: np.ndarray, sources) -> None:
        from qdrant_client import models as qm

        sources = [sources] * len(ids) if isinstance(sources, str) else list(sources)
        vectors = np.asarray(vectors, dtype=np.float32)
        items = ids.tolist()
        for start in range(0, len(items), POINTS_PER_CALL):
            block = [qm.PointStruct(id=point_id(item), vector=vector.tolist(),
                                    payload={"id": item, "source": source, "model": model.uri})
                     for item, vector, source in zip(items[start:start + POINTS_PER_CALL],
                                                     vectors[start:start + POINTS_PER_CALL],
                                                     sources[start:start + POINTS_PER_CALL])]
            with self.calling(f"the collection {name}") as client:
                client.upsert(name, points=block, wait=True)

    def read(self, name: str, ids: np.ndarray, dim: int) -> np.ndarray:
        out = np.empty((len(ids), dim), dtype=np.float32)
        items = ids.tolist()
        for start in range(0, len(items), POINTS_PER_CALL):
            block = items[start:start + POINTS_PER_CALL]
            with self.calling(f"the collection {name}") as client:
                got = client.retrieve(name, ids=[point_id(i) for i in block], with_payload=["id"], with_vectors=True)
            found = {(row.payload or {}).get("id"): row.vector for row in got}
            for k, item in enumerate(block):
                if item not in found:
                    raise DamagedObject(f"{self.where} collection {name}: item {item!r} has no row (deleted by another "
                                        "writer?); restore it, or adopt the gallery again")
                out[start + k] = found[item]
        return out

    def point(self, name: str) -> None:
        """The alias moves to ``name`` (created the first time): the old alias deleted and the new
        one created in one ``update_collection_aliases`` call, one step for every reader."""
        from qdrant_client import models as qm

        self.check_alias()
        target = self.target()
        if target == name:
            return
        operations: list = []
        if target is not None:
            operations.append(qm.DeleteAliasOperation(delete_alias=qm.DeleteAlias(alias_name=self.alias)))
        operations.append(qm.CreateAliasOperation(create_alias=qm.CreateAlias(collection_name=name,
                                                                              alias_name=self.alias)))
        if not self.exists(name):
            raise DamagedObject(f"{self.server}: the collection {name} is not there (dropped by another writer?); "
                                "restore it, or adopt the gallery again")
        with self.calling(f"the collection {name}") as client:
            client.update_collection_aliases(change_aliases_operations=operations)

    def drop(self, name: str) -> None:
        """The collection ``name`` dropped when it is there and this gallery's (else NotOurs)."""
        if not self.exists(name):
            return
        found = self.mark_of(name)
        if not self.is_ours(found):
            raise self.refused(f"{self.server}: the collection {name}", name, found)
        with self.calling(f"the collection {name}") as client:
            client.delete_collection(name)

    def product_distances(self, distances: list) -> np.ndarray:
        """Qdrant's scores as the product's distances: squared L2 (Qdrant's Euclid is the L2
        distance), or 1 - cosine similarity."""
        values = np.asarray(distances, dtype=np.float64)
        return values ** 2 if self.metric == "Euclid" else 1.0 - values

    def embedded_count(self) -> int:
        from qdrant_client import models as qm

        embedded = qm.Filter(must=[qm.FieldCondition(key="source", match=qm.MatchValue(value=EMBEDDED))])
        with self.calling(f"the alias {self.alias}") as client:
            return int(client.count(self.alias, count_filter=embedded, exact=True).count)

    def model_collections(self) -> list[str]:
        """The collections of this gallery's models: named after the alias and marked as its own
        (a team's collection of a like name is not one)."""
        return sorted(n for n in self.collections() if n.startswith(f"{self.alias}_emb_") and self.ours(n))

    def _size(self) -> int | None:
        """The length of the vectors of the collection the alias points at now."""
        with self.calling(f"the alias {self.alias}") as client:
            size = getattr(client.get_collection(self.alias).config.params.vectors, "size", None)
        return None if size is None else int(size)

    def search(self, queries: np.ndarray, k: int, model: str | None = None) -> tuple[list, list, list, list]:
        """The alias's k nearest points of each query: (ids, distances, models, sources) per query;
        ``model``: the model the queries were embedded with (points of another model match nothing)."""
        from qdrant_client import models as qm

        where = qm.Filter(must=[qm.FieldCondition(key="model", match=qm.MatchValue(value=model))]) if model else None
        params = None
        if not self.local:
            params = qm.SearchParams(hnsw_ef=max(int(self.settings.get("ef_search", 100)), k)) \
                if self.settings.get("ann", "hnsw") == "hnsw" else qm.SearchParams(exact=True)
        queries = np.asarray(queries, dtype=np.float32)
        nothing: tuple[list, list, list, list] = ([[] for _ in queries], [[] for _ in queries],
                                                  [set() for _ in queries], [[] for _ in queries])

        def other_space() -> bool:  # queries of another length than the alias's vectors: a query of another space
            size = self._size()
            if size is None or queries.ndim != 2 or queries.shape[1] == size:
                return False
            if model:
                return True  # like any query of another space's model, it matches nothing
            raise GalleryError(f"{self.where} holds {size}-d vectors; the queries are {queries.shape[1]}-d")

        if other_space():
            return nothing
        ids, distances, models, sources = [], [], [], []
        for query in queries:
            try:
                with self.calling(f"the alias {self.alias}") as client:
                    hits = client.query_points(self.alias, query=query.tolist(), limit=int(k), query_filter=where,
                                               search_params=params, with_payload=["id", "source", "model"]).points
            except QdrantError:
                # the alias moved to a collection of another length since the check (a switch, an
                # abort): Qdrant refuses the query's length
                if other_space():
                    return nothing
                raise
            ids.append([hit.payload["id"] for hit in hits])
            distances.append([float(hit.score) for hit in hits])
            models.append({hit.payload["model"] for hit in hits})
            sources.append([hit.payload["source"] for hit in hits])
        return ids, distances, models, sources


class QdrantGallery(StoredItems, FeaturesById, ServedGallery[Collections, str]):
    """A gallery whose vectors are Qdrant collections behind the alias queries are served from;
    the manifest, items and upgrade objects are in its store."""

    layout = QDRANT
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
        index.create(name, model)
        for part, features in parts:
            start, stop = self.part_bounds(part)
            index.write(name, model, ids[start:stop], features, EMBEDDED)

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
        """Qdrant holds vectors of up to 65,536 dimensions; a local-mode folder is one process's,
        so a backfill by Dask workers (processes of their own) cannot write it."""
        if int(model.dim or 0) > MAX_DIM:
            return (f"{model.uri} embeds into {int(model.dim or 0):,} dimensions; a Qdrant vector holds at most "
                    f"{MAX_DIM:,}. Keep this gallery in another layout (`fastfill gallery convert --layout lance`)")
        url = self.manifest()["index"].get("url", "")
        if task_runner == "dask" and is_local(url):
            return (f"gallery.upgrade.task_runner is dask, but this gallery's Qdrant is the local-mode folder {url}, "
                    "which one process at a time may open; the Dask workers could not write their chunks. Use "
                    "task_runner threads, or a Qdrant server (gallery.qdrant.url http://host:6333)")
        try:  # the new model's collection: free or this gallery's, as the alias
            self.index.check_names(self.index.collection(model))
        except NotOurs as refused:
            return str(refused).removesuffix(" Nothing was written.").rstrip(".")
        return None

    def _target(self, model: ModelRef) -> str:
        return self.index.collection(model)

    def _point(self, target: str, model: ModelRef, upgrade_id: str | None) -> None:
        """The alias moved to the collection ``target`` (one ``update_collection_aliases`` call)."""
        self.index.point(target)

    def _prepare_switch(self, plan: Plan, name: str) -> None:
        index = self.index
        ids = self.ids()
        index.create(name, plan.new)
        for part, features, backfilled in iter_mixed_parts(self, plan):
            start, stop = self.part_bounds(part)
            index.write(name, plan.new, ids[start:stop], features, [EMBEDDED if b else MAPPED for b in backfilled])

    def serve_chunk(self, plan, chunk: int, positions: np.ndarray, features: np.ndarray, embedded: np.ndarray) -> None:
        index = self.index
        index.write(index.collection(plan.new), plan.new, self.ids()[np.asarray(positions, dtype=np.int64)], features,
                    [EMBEDDED if e else MAPPED for e in embedded])

    @staticmethod
    def writer(store: Store, model: ModelRef, part_size: int, settings: dict | None = None) -> QdrantWriter:
        if settings is None:
            raise GalleryError("a Qdrant gallery is written with its settings (gallery.qdrant)")
        return QdrantWriter(store, model, part_size, settings)


class QdrantWriter:
    """Writes a new Qdrant gallery: the items as the parts layout's objects in the store, the
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
            self.index.create(self.name, self.model)
            self._created = True
        self.parts.write_items(start, items, images)
        self.index.write(self.name, self.model, ids, features, EMBEDDED)

    def close(self) -> None:
        self.index.point(self.name)
        self.index.close()

    def manifest_fields(self) -> dict:
        return {"index": self.settings}
