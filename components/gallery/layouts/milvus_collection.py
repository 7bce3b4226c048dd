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
manifest (its ``index`` names the server, the alias and the id type), the items table, the lock
and each upgrade's objects. The server: a Milvus server by ``http://host:19530`` (a token in
``MILVUS_TOKEN``), or Milvus Lite, a local ``.db`` file (one process at a time may open it).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable

import numpy as np

from fastfill.components.gallery.layouts.catalog import MILVUS, GalleryError, PartsWriter, check_features
from fastfill.components.gallery.layouts.item_ids import id_array, is_text
from fastfill.components.gallery.layouts.served import ServedGallery
from fastfill.components.gallery.store import DamagedObject, ObjectMissing, Store, StoreError
from fastfill.components.platform.registry import ModelRef

TOKEN_ENV = "MILVUS_TOKEN"
EMBEDDED, MAPPED = "embedded", "mapped"
METRICS = {"l2": "L2", "cosine": "COSINE"}
MAX_DIM = 32768  # Milvus's largest float vector
ROWS_PER_CALL = 5000


class MilvusError(StoreError):
    """The Milvus server cannot be reached or refused a call (retried as a store error)."""


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
    """The manifest's ``index`` of a new Milvus gallery from ``gallery.milvus`` (``config``)."""
    return {"kind": MILVUS, "uri": config.uri, "alias": _name(config.alias or default_alias(store_uri),
                                                               "gallery.milvus.alias"),
            "distance": distance, "ann": config.ann, "hnsw_m": config.hnsw_m,
            "hnsw_ef_construction": config.hnsw_ef_construction, "ef_search": config.ef_search, "collections": {}}


class Collections:
    """The server side of a Milvus gallery: its models' collections and the alias."""

    def __init__(self, settings: dict):
        self.settings = settings
        self.alias = settings["alias"]
        self.view = self.alias  # what the team's service searches
        self.metric = METRICS[settings.get("distance", "l2")]
        self._client = None

    @property
    def where(self) -> str:
        return f"Milvus {self.settings['uri']} alias {self.alias}"

    def client(self):
        if self._client is None:
            from pymilvus import MilvusClient

            try:
                self._client = MilvusClient(self.settings["uri"], token=os.environ.get(TOKEN_ENV, ""))
            except Exception as error:  # noqa: BLE001 - pymilvus raises its own kinds and grpc's
                raise MilvusError(f"cannot reach {self.where}: {' '.join(str(error).split())[:300]}") from None
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def collection(self, model: ModelRef) -> str:
        adopted = self.settings.get("collections", {}).get(model.key)
        return adopted or collection_of(self.alias, model)

    def exists(self, name: str) -> bool:
        return self.client().has_collection(name)

    def count(self, name: str) -> int:
        rows = self.client().query(name, filter="", output_fields=["count(*)"])
        return int(rows[0]["count(*)"])

    def serving(self) -> dict | None:
        """Which collection the alias points at and the model its rows are in (None before any)."""
        client = self.client()
        if self.alias not in client.list_aliases().get("aliases", []):
            return None
        collection = client.describe_alias(self.alias)["collection_name"]
        rows = client.query(collection, filter="", output_fields=["model"], limit=1)
        uri = rows[0]["model"] if rows else None
        found = re.fullmatch(r"models:/(.+)/([^/]+)", uri or "")
        dim = next((int(f["params"]["dim"]) for f in client.describe_collection(collection)["fields"]
                    if f["name"] == "embedding"), None)
        return {"model": uri, "vectors": collection, "upgrade": None, "dim": dim, "since": None,
                "model_name": found.group(1) if found else None, "model_version": found.group(2) if found else None}

    def create(self, name: str, model: ModelRef, text_ids: bool) -> None:
        """A new collection (dropped first: a switch or a write cut short, an aborted upgrade's)
        for ``model``'s vectors, with its ANN index."""
        from pymilvus import DataType

        client = self.client()
        if client.has_collection(name):
            client.drop_collection(name)
        schema = client.create_schema(auto_id=False)
        if text_ids:
            schema.add_field("id", DataType.VARCHAR, is_primary=True, max_length=1024)
        else:
            schema.add_field("id", DataType.INT64, is_primary=True)
        schema.add_field("embedding", DataType.FLOAT_VECTOR, dim=int(model.dim))
        schema.add_field("source", DataType.VARCHAR, max_length=16)
        schema.add_field("model", DataType.VARCHAR, max_length=512)
        index = client.prepare_index_params()
        if self.settings.get("ann", "hnsw") == "hnsw":
            index.add_index("embedding", index_type="HNSW", metric_type=self.metric,
                            params={"M": int(self.settings.get("hnsw_m", 16)),
                                    "efConstruction": int(self.settings.get("hnsw_ef_construction", 64))})
        else:
            index.add_index("embedding", index_type="FLAT", metric_type=self.metric)
        client.create_collection(name, schema=schema, index_params=index)

    def write(self, name: str, model: ModelRef, ids: np.ndarray, vectors: np.ndarray, sources, insert=False) -> None:
        sources = [sources] * len(ids) if isinstance(sources, str) else list(sources)
        rows = [{"id": item, "embedding": vector, "source": source, "model": model.uri}
                for item, vector, source in zip(ids.tolist(), np.asarray(vectors, dtype=np.float32), sources)]
        client = self.client()
        for start in range(0, len(rows), ROWS_PER_CALL):
            block = rows[start:start + ROWS_PER_CALL]
            (client.insert if insert else client.upsert)(name, block)

    def read(self, name: str, ids: np.ndarray, dim: int, vector_field: str = "embedding") -> np.ndarray:
        out = np.empty((len(ids), dim), dtype=np.float32)
        text = is_text(ids)
        for start in range(0, len(ids), ROWS_PER_CALL):
            block = [str(v) for v in ids[start:start + ROWS_PER_CALL]] if text else \
                [int(v) for v in ids[start:start + ROWS_PER_CALL]]
            found = {row["id"]: row[vector_field]
                     for row in self.client().get(name, ids=block, output_fields=[vector_field])}
            for k, item in enumerate(block):
                if item not in found:
                    raise DamagedObject(f"{self.where} collection {name}: item {item!r} has no row (deleted by another "
                                        "writer?); restore it, or adopt the collection again")
                out[start + k] = found[item]
        return out

    def point(self, name: str) -> None:
        """The alias moves to ``name`` (created the first time): one step for every reader."""
        client = self.client()
        client.load_collection(name)
        if self.serving() is None:
            client.create_alias(name, self.alias)
        else:
            client.alter_alias(name, self.alias)

    def drop(self, name: str) -> None:
        if self.client().has_collection(name):
            self.client().drop_collection(name)

    def product_distances(self, distances: list) -> np.ndarray:
        """Milvus's distances as the product gives them: squared L2 (Milvus's L2), or 1 - cosine."""
        values = np.asarray(distances, dtype=np.float64)
        return values if self.metric == "L2" else 1.0 - values

    def embedded_count(self) -> int:
        rows = self.client().query(self.alias, filter=f'source == "{EMBEDDED}"', output_fields=["count(*)"])
        return int(rows[0]["count(*)"])

    def model_collections(self) -> list[str]:
        return sorted(n for n in self.client().list_collections() if n.startswith(f"{self.alias}_emb_"))

    def search(self, queries: np.ndarray, k: int, model: str | None = None) -> tuple[list, list, list, list]:
        """The alias's k nearest rows of each query: (ids, distances, models, sources) per query;
        ``model``: the model the queries were embedded with (rows of another model match nothing)."""
        params = {"ef": max(int(self.settings.get("ef_search", 100)), k)} if self.settings.get("ann") == "hnsw" else {}
        found = self.client().search(self.alias, data=np.asarray(queries, dtype=np.float32).tolist(), limit=int(k),
                                     filter=f'model == "{model}"' if model else "", output_fields=["source", "model"],
                                     search_params={"params": params})
        ids, distances, models, sources = [], [], [], []
        for hits in found:
            ids.append([hit["id"] for hit in hits])
            distances.append([float(hit["distance"]) for hit in hits])
            models.append({hit["entity"]["model"] for hit in hits})
            sources.append([hit["entity"]["source"] for hit in hits])
        return ids, distances, models, sources


class MilvusGallery(ServedGallery):
    """A gallery whose vectors are Milvus collections behind the alias queries are served from;
    the manifest, items and upgrade objects are in its store."""

    layout = MILVUS

    @property
    def index(self) -> Collections:
        settings = self.manifest()["index"]
        if self._index is None or self._index.settings != settings:
            self._index = Collections(settings)
        return self._index

    def _rows(self, model: ModelRef, ids: np.ndarray) -> np.ndarray:
        name = self.index.collection(model)
        if not self.index.exists(name):
            raise ObjectMissing(f"{self.index.where} holds no features of {model.uri} (no collection {name})")
        dim = model.dim or int(self.index.serving()["dim"])
        return check_features(self.index.read(name, ids, dim), model.dim, f"{self.index.where} collection {name}")

    def write_features(self, model: ModelRef, parts: Iterable[tuple[int, np.ndarray]]) -> None:
        index = self.index
        name = index.collection(model)
        serving = index.serving()
        if serving is not None and serving["vectors"] == name:  # the chunks filled it (the finish)
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
        keep = self.index.collection(self.model)
        drop = [n for n in self.index.model_collections() if n != keep]
        drop += [n for n in self.manifest()["index"].get("collections", {}).values()
                 if n != keep and self.index.exists(n)]
        for name in drop:
            self.index.drop(name)
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
            return (f"{model.uri} embeds into {int(model.dim):,} dimensions; a Milvus float vector holds at most "
                    f"{MAX_DIM:,}. Keep this gallery in another layout (`fastfill gallery convert --layout lance`)")
        uri = self.manifest()["index"].get("uri", "")
        if task_runner == "dask" and not uri.startswith(("http://", "https://", "tcp://", "unix:")):
            return (f"gallery.upgrade.task_runner is dask, but this gallery's Milvus is the Milvus Lite file {uri}, "
                    "which one process at a time may open; the Dask workers could not write their chunks. Use "
                    "task_runner threads, or a Milvus server (gallery.milvus.uri http://host:19530)")
        return None

    def sync_serving(self, manifest: dict | None = None) -> dict:
        from fastfill.components.gallery.upgrade.planning import load_plan

        manifest = manifest or self.manifest(refresh=True)
        index = self.index
        upgrade = manifest.get("upgrade")
        plan = load_plan(self.store, upgrade) if upgrade else None
        model = plan.new if plan is not None else ModelRef.from_dict(manifest["model"])
        name = index.collection(model)
        serving = index.serving()
        if serving is not None and serving["vectors"] == name:
            return serving
        if plan is not None:
            self._prepare_switch(plan, name)
        index.point(name)
        return index.serving()

    def _prepare_switch(self, plan, name: str) -> None:
        from fastfill.components.gallery.upgrade.backfill import iter_mixed_parts

        index = self.index
        ids = self.ids()
        index.create(name, plan.new, is_text(ids))
        for part, features, backfilled in iter_mixed_parts(self, plan):
            start, stop = self.part_bounds(part)
            index.write(name, plan.new, ids[start:stop], features, [EMBEDDED if b else MAPPED for b in backfilled],
                        insert=True)

    def serve_chunk(self, plan, chunk: int, positions: np.ndarray, features: np.ndarray, embedded: np.ndarray) -> None:
        index = self.index
        index.write(index.collection(plan.new), plan.new, self.ids()[np.asarray(positions, dtype=np.int64)], features,
                    [EMBEDDED if e else MAPPED for e in embedded])

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
        self.index = Collections(self.settings)
        self.name = self.index.collection(model)
        self._created = False

    def write(self, start: int, items, features: np.ndarray, images: np.ndarray | None = None) -> None:
        ids = id_array(items.column("id"))
        if not self._created:
            if self.index.serving() is not None:
                raise GalleryError(f"{self.index.where} exists already; name a new alias in gallery.milvus.alias")
            self.index.create(self.name, self.model, is_text(ids))
            self._created = True
        self.parts.write_items(start, items, images)
        self.index.write(self.name, self.model, ids, features, EMBEDDED, insert=True)

    def close(self) -> None:
        self.index.point(self.name)

    def manifest_fields(self) -> dict:
        return {"index": self.settings}
