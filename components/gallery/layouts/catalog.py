"""The gallery's layout in a store, and reading/writing it.

Under one prefix::

    gallery.json                            manifest: items, parts, image shape, the gallery's model
    items/part-NNNNN.parquet                item id, image (key or URI), optional label and group,
                                            and weight where adopted with one (components.gallery.upgrade.usage)
    images/part-NNNNN.npy                   uint8 images (n, C, H, W) that a backfill re-embeds;
                                            an adopted gallery has none: its images stay where
                                            they are, read by the URI in the items table
    features/<name>-v<version>/part-NNNNN.npy   features of one model version, written once
    upgrades/lock.json                      held while an upgrade runs
    upgrades/<upgrade-id>/...               see components.gallery.upgrade.planning

Items are numbered by position 0..N-1 (part = position // part_size); item ids are the user's.
``gallery.json`` is written last by an ingest and rewritten only by the finish of an upgrade.

The layout above is the parts layout's (``PartsGallery``, ``layout: parts`` in the manifest).
``Gallery`` is the interface every layout implements; the layouts whose index serves the team's
queries (Lance, pgvector, Milvus: ``components.gallery.layouts.served.ServedGallery``) keep their
vectors (and Lance its items and images) in that index, and everything else (the manifest, the
lock, the upgrades' objects) as here. Such an index is a ``ServingIndex`` and says what it serves
in a ``Serving`` record. ``components.gallery.layouts.opening`` opens any layout from the
manifest; the upgrade, search, gate and advice read only these interfaces.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Protocol

import numpy as np

from fastfill.components.gallery.inputs.images import read_images
from fastfill.components.gallery.layouts.item_ids import id_array
from fastfill.components.gallery.layouts.part_caches import COLUMN_CACHE, IMAGE_CACHE, ColumnCache, ImageCache
from fastfill.components.gallery.store import DamagedObject, ObjectMissing, Store
from fastfill.components.platform.registry import ModelRef

MANIFEST = "gallery.json"
FORMAT = 1
PARTS, LANCE, PGVECTOR, MILVUS, QDRANT = "parts", "lance", "pgvector", "milvus", "qdrant"  # the layouts
# (gallery.layout; the manifest's ``layout``)


class GalleryError(ValueError):
    """Bad input for a gallery operation; the message says what is wrong and what to do."""


# ------------------------------------------------------------------------------------------------
# What an index that serves the team's queries says and does (the Lance, pgvector and Milvus layouts)

EMBEDDED, MAPPED = "embedded", "mapped"  # a served row's source: the model embedded its image; h(old)


@dataclass(frozen=True)
class Serving:
    """What an index serves now: the model whose space its rows are in (``model``: its URI, and
    its name, version and dimension), where the vectors are (``vectors``: a table.column, a
    collection, a dataset's column), the upgrade whose mixed gallery it serves (None: the model's
    own features) and since when; pgvector's record also names whose it is (``gallery``: the
    gallery's id, ``store``: its store), Lance's its table's version."""

    model: str | None
    model_name: str | None
    model_version: str | None
    dim: int | None
    vectors: str | None
    upgrade: str | None = None
    since: str | None = None
    gallery: str | None = None
    store: str | None = None
    version: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


class ServingIndex(Protocol):
    """The index a layout serves the team's queries from, as the product reads it: where it is
    (``where``, for messages; ``view``, the name readers query), what it serves (``serving``),
    the k nearest rows of queries embedded by a model (``search``: ids, distances, the model of
    each answer's rows, sources; rows of another model answer nothing), how many rows the serving
    model embedded (``embedded_count``), its distances as the product's (``product_distances``),
    the chunks of an upgrade whose rows it records (``chunk_done``; None where the store's
    markers are the only record), and ``close``."""

    @property
    def where(self) -> str: ...

    @property
    def view(self) -> str: ...

    def serving(self) -> Serving | None: ...

    def search(self, queries: np.ndarray, k: int, model: str | None = None) -> tuple[list, list, list, list]: ...

    def embedded_count(self) -> int: ...

    def product_distances(self, distances: list) -> np.ndarray: ...

    def chunk_done(self, upgrade_id: str) -> set[int] | None: ...

    def close(self) -> None: ...


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def dim_of(model: ModelRef) -> int:
    """``model``'s dimension, which a model whose vectors are written has (its features were read)."""
    if model.dim is None:
        raise GalleryError(f"{model.uri}: its dimension is not known; register it with its dim")
    return int(model.dim)


def part_key(kind: str, part: int, suffix: str = "npy") -> str:
    return f"{kind}/part-{part:05d}.{suffix}"


def features_key(model: ModelRef, part: int) -> str:
    return f"features/{model.key}/part-{part:05d}.npy"


def check_features(features: np.ndarray, dim: int | None, what: str) -> np.ndarray:
    """2-D, finite, float32, of the model's dimension; else a GalleryError naming ``what``."""
    features = np.asarray(features)
    if features.ndim != 2:
        raise GalleryError(f"{what}: expected a 2-D array (items, dimension), got shape {features.shape}")
    if dim is not None and features.shape[1] != dim:
        raise GalleryError(f"{what}: features have dimension {features.shape[1]}, but the model's is {dim}; "
                           "compute them with the same model")
    if not np.issubdtype(features.dtype, np.floating) and not np.issubdtype(features.dtype, np.integer):
        raise GalleryError(f"{what}: features must be numbers, got dtype {features.dtype}")
    features = features.astype(np.float32, copy=False)
    bad = ~np.isfinite(features).all(axis=1)
    if bad.any():
        rows = np.flatnonzero(bad)
        raise GalleryError(f"{what}: {len(rows)} rows contain NaN or infinite values (first: row {rows[0]}); "
                           "nothing was written")
    return features


class Gallery(ABC):
    """A gallery in a store, the interface every layout implements: its manifest and the
    upgrade's per-part objects (in the store on every layout: this class), and the layout's own
    readers and writers of items, images and features (abstract here). The layouts are siblings:
    ``PartsGallery`` (below), ``TableGallery`` (Lance), ``PgGallery`` and ``MilvusGallery``; none
    inherits another's, and those that keep items and images as store objects share
    ``StoredItems``."""

    layout: str
    serves_queries = False  # True where a reader's index is the gallery (lance, pgvector, milvus): `search` asks it

    @property
    def index(self) -> ServingIndex:
        """The index the team's queries are served from (the layouts that serve queries:
        ``serves_queries``); a GalleryError on the others."""
        raise GalleryError(f"a gallery of the {self.layout} layout serves no queries from an index; `fastfill search` "
                           "reads its features")

    def __init__(self, store: Store, manifest: dict | None = None):
        self.store = store
        self._manifest = manifest
        self._ids: np.ndarray | None = None

    # ---- manifest

    def exists(self) -> bool:
        return self.store.exists(MANIFEST)

    def manifest(self, refresh: bool = False) -> dict:
        if self._manifest is None or refresh:
            try:
                manifest = self.store.get_json(MANIFEST)
            except ObjectMissing:
                raise GalleryError(f"no gallery at {self.store.uri}: {MANIFEST} is missing; run "
                                   "`fastfill gallery ingest --store ...` first") from None
            self._manifest = check_manifest(manifest, self.store.describe(MANIFEST))
        return self._manifest

    def write_manifest(self, manifest: dict) -> None:
        self.store.put_json(MANIFEST, manifest)
        self._manifest = manifest

    @property
    def model(self) -> ModelRef:
        return ModelRef.from_dict(self.manifest()["model"])

    @property
    def num_items(self) -> int:
        return int(self.manifest()["num_items"])

    @property
    def adopted(self) -> bool:
        """Images read by URI where they are (``fastfill gallery adopt``), not packed parts."""
        return self.manifest().get("images", {}).get("source") == "uri"

    @property
    def image_root(self) -> str | None:
        return self.manifest().get("images", {}).get("root")

    @property
    def part_size(self) -> int:
        return int(self.manifest()["part_size"])

    @property
    def num_parts(self) -> int:
        return int(self.manifest()["num_parts"])

    def part_bounds(self, part: int) -> tuple[int, int]:
        start = part * self.part_size
        return start, min(start + self.part_size, self.num_items)

    # ---- items

    @abstractmethod
    def items(self):
        """The items table (pyarrow): id, image, label, group (and weight); in position order."""

    @abstractmethod
    def items_part(self, part: int):
        """The items table's rows of ``part``."""

    def column(self, name: str) -> np.ndarray:
        """One numeric column of the items table for every item, read part by part (the other
        columns, image URIs among them, are not kept)."""
        return np.concatenate([self.items_part(p).column(name).to_numpy().astype(np.int64)
                               for p in range(self.num_parts)])

    def ids(self) -> np.ndarray:
        """The items' ids in position order: int64, or str for a gallery of text ids. Read once per
        gallery object: every chunk and read of an index goes by id, and a gallery's items never
        change after it is made."""
        if self._ids is None:
            self._ids = np.concatenate([id_array(self.items_part(p).column("id")) for p in range(self.num_parts)])
        return self._ids

    def labels(self) -> np.ndarray | None:
        if not self.manifest().get("has_labels"):
            return None
        return self.column("label")

    # ---- arrays

    @abstractmethod
    def images(self, part: int) -> np.ndarray:
        """An ingested gallery's images of ``part``, uint8 (n, C, H, W)."""

    @abstractmethod
    def features(self, model: ModelRef, part: int) -> np.ndarray:
        """``model``'s features of the items of ``part``, checked (float32, finite, its dim)."""

    def part_rows(self, key: str, part: int) -> np.ndarray:
        """The per-part array at ``key`` (one row per item of ``part``), checked against the
        manifest's item count; a damaged one is refused naming it (DamagedObject: not retried)."""
        start, stop = self.part_bounds(part)
        array = self.store.get_array(key)
        if array.ndim == 0 or array.shape[0] != stop - start:
            rows = array.shape[0] if array.ndim else 0
            raise DamagedObject(f"{self.store.describe(key)}: {rows} rows, but part {part} has {stop - start} items "
                                "in the gallery's manifest; restore the object from a copy (or `fastfill upgrade "
                                "abort` when it belongs to an unfinished upgrade)")
        return array

    def all_features(self, model: ModelRef) -> np.ndarray:
        return np.concatenate([self.features(model, p) for p in range(self.num_parts)])

    @abstractmethod
    def features_at(self, model: ModelRef, positions: np.ndarray) -> np.ndarray:
        """``model``'s features of the items at ``positions`` (any order), reading only what holds them."""

    # ---- writing (a new gallery; the finish of an upgrade) and removing features (gc)

    @staticmethod
    @abstractmethod
    def writer(store: Store, model: ModelRef, part_size: int, settings: dict | None = None):
        """What writes a new gallery of this layout, part by part (ingest, adopt, convert): an
        object with ``write(start, items, features, images=None)`` and ``close()``. ``settings``:
        an index layout's (``opening.layout_of`` binds them from the configuration)."""

    @abstractmethod
    def write_features(self, model: ModelRef, parts) -> None:
        """``model``'s features of every part, from ``parts`` ((part, features) in part order);
        they serve once the manifest names ``model``."""

    @abstractmethod
    def missing_features(self, model: ModelRef) -> list[str]:
        """Where ``model``'s features of the gallery's parts are missing (empty: all there)."""

    @abstractmethod
    def collect_features(self) -> int:
        """Delete the features of every model but the gallery's own; returns how many were."""

    def kept_columns(self) -> list[str]:
        """Vectors of the team's that no model serves any more and that gc leaves where they are
        (a column of an adopted table: the team's to drop); none on most layouts."""
        return []

    def release(self) -> list[str]:
        """Remove from the team's database every object this gallery made there (after which
        another gallery may take the names); the objects removed."""
        raise GalleryError(f"a gallery of the {self.layout} layout has no objects in a team's database to release")

    def unserved_rows(self) -> dict | None:
        """Rows another writer added to the team's table since the gallery was made, which its
        index does not serve (seen at an upgrade's finish): {table, count, first}; None."""
        return None

    @abstractmethod
    def check_sources(self, sequential: bool = False) -> None:
        """Refuse, before planning writes anything, a gallery whose sources are not all there or
        do not fit its manifest (a GalleryError ending "Nothing was written.")."""

    def serve_chunk(self, plan, chunk: int, positions: np.ndarray, features: np.ndarray,  # noqa: B027 - a no-op by default
                    embedded: np.ndarray) -> None:
        """A layout that serves queries from an index writes a landed chunk's rows there (before
        its marker); a layout that serves only ``fastfill search`` has nothing to write: it reads
        the chunk's object."""

    def sync_serving(self, manifest: dict | None = None) -> Serving | None:
        """A layout that serves queries from an index makes it serve what the manifest says;
        nothing to do on one that does not."""
        return None

    def cannot_serve(self, model: ModelRef, task_runner: str = "threads") -> str | None:
        """Why this gallery, in its layout, cannot be upgraded to ``model`` (its dim known) with the
        backfill's ``task_runner``; None when it can. Asked before any work (the decider)."""
        return None


class StoredItems:
    """Items tables and an ingested gallery's images kept as objects in the store, one per part
    (``items/part-NNNNN.parquet``, ``images/part-NNNNN.npy``): the parts, pgvector and Milvus
    layouts keep them so."""

    if TYPE_CHECKING:  # what the gallery it is mixed into gives (``Gallery``'s)
        store: Store
        num_parts: int

        def manifest(self, refresh: bool = False) -> dict: ...

        def part_bounds(self, part: int) -> tuple[int, int]: ...

    def items(self):
        import pyarrow as pa

        return pa.concat_tables([self.store.get_parquet(part_key("items", p, "parquet"))
                                 for p in range(self.num_parts)])

    def items_part(self, part: int):
        return self.store.get_parquet(part_key("items", part, "parquet"))

    def images(self, part: int) -> np.ndarray:
        images = self.store.get_array(part_key("images", part))
        expected = (self.part_bounds(part)[1] - self.part_bounds(part)[0], *self.manifest()["image_shape"])
        if images.shape != tuple(expected) or images.dtype != np.uint8:
            raise DamagedObject(f"{self.store.describe(part_key('images', part))}: expected uint8 images of shape "
                                f"{tuple(expected)}, found {images.dtype} {images.shape}")
        return images


class PartsGallery(StoredItems, Gallery):
    """The parts layout: every model's features as ``.npy`` parts beside the items and images
    (``features/<model>/part-NNNNN.npy``), each object with its SHA-256; only ``fastfill`` reads it."""

    layout = PARTS

    def features(self, model: ModelRef, part: int) -> np.ndarray:
        key = features_key(model, part)
        return check_features(self.part_rows(key, part), model.dim, self.store.describe(key))

    def features_at(self, model: ModelRef, positions: np.ndarray) -> np.ndarray:
        return rows_at(self, positions, lambda part: features_key(model, part))

    @staticmethod
    def writer(store: Store, model: ModelRef, part_size: int, settings: dict | None = None) -> PartsWriter:
        return PartsWriter(store, model, part_size)

    def write_features(self, model: ModelRef, parts) -> None:
        for part, features in parts:
            self.store.put_array(features_key(model, part), features)

    def missing_features(self, model: ModelRef) -> list[str]:
        wanted = [features_key(model, part) for part in range(self.num_parts)]
        present = set(self.store.list(f"features/{model.key}/"))
        return [self.store.describe(key) for key in wanted if key not in present]

    def collect_features(self) -> int:
        current, deleted = self.model.key, 0
        for key in self.store.list("features/"):
            if key.split("/")[1] != current:
                self.store.delete(key)
                deleted += 1
        return deleted

    def check_sources(self, sequential: bool = False) -> None:
        """Every part's features (of the gallery's model; a sequential upgrade reads its source
        parts instead), items and, for an ingested gallery, images, by one listing per kind; and
        each items part's row count. Content (a NaN, a torn part) is checked as each part is read."""
        store, model = self.store, self.model
        wanted = {"items": [part_key("items", p, "parquet") for p in range(self.num_parts)]}
        if not sequential:
            wanted["features"] = [features_key(model, p) for p in range(self.num_parts)]
        if not self.adopted:
            wanted["images"] = [part_key("images", p) for p in range(self.num_parts)]
        for kind, keys in wanted.items():
            present = set(store.list(keys[0].rsplit("/", 1)[0] + "/")) if keys else set()
            missing = [key for key in keys if key not in present]
            if missing:
                raise GalleryError(f"{store.uri}: {len(missing)} of {len(keys)} {kind} parts are missing (first: "
                                   f"{missing[0]}); restore them, or re-create the gallery with `fastfill gallery "
                                   "ingest` / `adopt`. Nothing was written.")
        for part in range(self.num_parts):
            start, stop = self.part_bounds(part)
            rows = self.items_part(part).num_rows
            if rows != stop - start:
                raise GalleryError(f"{store.describe(wanted['items'][part])} has {rows} rows, but the manifest's "
                                   f"part {part} has {stop - start} items: the part belongs to another gallery. "
                                   "Nothing was written.")


class PartsWriter:
    """Writes a new gallery of the parts layout: each part's items, features and images (an
    ingested gallery's) as objects; the manifest comes after ``close``."""

    def __init__(self, store: Store, model: ModelRef, part_size: int):
        self.store, self.model, self.part_size = store, model, part_size

    def write(self, start: int, items, features: np.ndarray, images: np.ndarray | None = None) -> None:
        self.store.put_array(features_key(self.model, start // self.part_size), features)
        self.write_items(start, items, images)

    def write_items(self, start: int, items, images: np.ndarray | None = None) -> None:
        """A part's items table (and an ingested gallery's images), without features."""
        part = start // self.part_size
        if images is not None:
            self.store.put_array(part_key("images", part), images)
        self.store.put_parquet(part_key("items", part, "parquet"), items)

    def close(self) -> None:
        pass


def by_part(gallery: Gallery, positions: np.ndarray):
    """(part, rows, offsets) for item ``positions`` (any order): the rows of the request that
    fall in each part, and their offsets within it; each part once, in order."""
    parts = positions // gallery.part_size
    for part in np.unique(parts):
        rows = np.flatnonzero(parts == part)
        yield int(part), rows, positions[rows] - int(part) * gallery.part_size


def fetch_images(gallery: Gallery, positions: np.ndarray, cache: ImageCache = IMAGE_CACHE, *,
                 workers: int = 16, preprocessing=None) -> tuple[np.ndarray, list]:
    """The images of items at ``positions`` (any order) and the failures
    (``images.ImageFailure``, ``row`` indexing ``positions``): packed parts, those not in
    ``cache`` read ``workers`` at a time (as stored: ``inference.embed`` brings them to the model's
    shape), or an adopted gallery's images read by URI, ``workers`` at a time, decoded by ``preprocessing`` (the model's that
    embeds them; default a plain stretch to the gallery's image shape)."""
    shape = tuple(gallery.manifest()["image_shape"])
    positions = np.asarray(positions, dtype=np.int64)
    if gallery.adopted:
        return read_images(item_column(gallery, positions, "image"), preprocessing or shape, root=gallery.image_root,
                           workers=workers)
    out = np.empty((len(positions), *shape), dtype=np.uint8)
    spans = list(by_part(gallery, positions))
    if len(spans) > 1 and workers > 1:  # the parts not cached yet, read ``workers`` at a time
        with ThreadPoolExecutor(min(workers, len(spans))) as pool:
            list(pool.map(lambda span: cache.get(gallery, span[0]), spans))
    for part, rows, offsets in spans:
        out[rows] = cache.get(gallery, part)[offsets]
    return out, []


def rows_at(gallery: Gallery, positions: np.ndarray, key_of_part) -> np.ndarray:
    """Rows at ``positions`` of a per-part array (``key_of_part(part)`` is its key), reading only
    the parts they fall in, one at a time: memory grows with the rows asked for, not the gallery."""
    out = None
    for part, rows, offsets in by_part(gallery, np.asarray(positions, dtype=np.int64)):
        array = gallery.part_rows(key_of_part(part), part)
        if out is None:
            out = np.empty((len(positions), *array.shape[1:]), dtype=array.dtype)
        out[rows] = array[offsets]
    return out if out is not None else np.zeros((0,), dtype=np.float32)


def item_column(gallery: Gallery, positions: np.ndarray, name: str, cache: ColumnCache = COLUMN_CACHE) -> list:
    """One column of the items table (id, image, label, group) at ``positions``, part by part
    (parts read recently come from ``cache``)."""
    out: list = [None] * len(positions)
    for part, rows, offsets in by_part(gallery, np.asarray(positions, dtype=np.int64)):
        for row, value in zip(rows, cache.get(gallery, part, name).take(offsets).to_pylist()):
            out[row] = value
    return out


def check_empty(store: Store, verb: str) -> None:
    """The store is reachable and holds no gallery yet; else a GalleryError saying what to do."""
    store.check()
    if store.exists(MANIFEST):
        raise GalleryError(f"{store.uri} already holds a gallery; {verb} into a new prefix or folder")


REQUIRED = ("num_items", "part_size", "num_parts", "image_shape", "model")


def check_registry(manifest: dict, where: str, registry: str) -> None:
    """Refuse to work on a gallery whose model versions belong to another registry than
    ``registry`` (``models:/embedder/3`` names a different model there). A gallery that records
    none (written before galleries recorded it) is accepted."""
    recorded = manifest.get("registry")
    if recorded and recorded != registry:
        raise GalleryError(f"{where} belongs to the model registry at {recorded}, but this command uses {registry}; "
                           "point MLFLOW_TRACKING_URI (or mlflow.tracking_uri) at the gallery's registry")


def check_manifest(manifest: object, where: str) -> dict:
    """A gallery manifest with every key the product reads, or a GalleryError naming what is
    missing (a hand-edited or foreign ``gallery.json``)."""
    if not isinstance(manifest, dict):
        raise GalleryError(f"{where} is not a gallery manifest (a JSON object); restore it from the store's history "
                           "or re-create the gallery with `fastfill gallery ingest` / `adopt`")
    missing = [key for key in REQUIRED if key not in manifest]
    model = manifest.get("model")
    if not missing and not (isinstance(model, dict) and {"name", "version"} <= set(model)):
        missing = ["model.name and model.version"]
    if missing:
        raise GalleryError(f"{where} lacks {', '.join(missing)}: it is not a manifest this product wrote; restore "
                           "it, or re-create the gallery with `fastfill gallery ingest` / `adopt`")
    return manifest


def commit_manifest(store: Store, model: ModelRef, *, num_items: int, part_size: int, image_shape, has_labels: bool,
                    has_groups: bool, by: str, images: dict | None = None, registry: str | None = None,
                    layout: str = PARTS, extra: dict | None = None) -> dict:
    """Write a new gallery's manifest, the last object of an ingest or an adopt: from here on
    the gallery exists."""
    manifest = {
        "format": FORMAT, "layout": layout, "created": now(), "num_items": num_items, "part_size": part_size,
        "num_parts": -(-num_items // part_size), "image_shape": [int(x) for x in image_shape],
        "has_labels": has_labels, "has_groups": has_groups, **({"images": images} if images else {}),
        **({"registry": registry} if registry else {}),  # the model registry its model versions belong to
        "model": model.to_dict(), "history": [{"model": model.to_dict(), "since": now(), "by": by}],
        "upgrade": None, **(extra or {}),  # a layout's own (pgvector: the index)
    }
    store.put_json(MANIFEST, manifest)
    return manifest


def check_ingest(images, labels, groups, ids) -> tuple[np.ndarray, np.ndarray]:
    """An ingest's images as uint8 (N, C, H, W) (one channel added to (N, H, W)) and its ids
    (0..N-1 by default), every column checked against N; a GalleryError naming what is wrong."""
    images = np.asarray(images)
    if images.ndim == 3:
        images = images[:, None]
    if images.ndim != 4 or images.dtype != np.uint8:
        raise GalleryError(f"images must be uint8 of shape (N, C, H, W) or (N, H, W), got {images.dtype} {images.shape}")
    n = len(images)
    if n < 2:
        raise GalleryError(f"a gallery needs at least 2 items, got {n}")
    for name, column in (("labels", labels), ("groups", groups), ("ids", ids)):
        if column is not None and len(column) != n:
            raise GalleryError(f"{name}: {len(column)} values for {n} images")
    ids = np.arange(n, dtype=np.int64) if ids is None else id_array(ids)  # integers or text, as given
    if len(np.unique(ids)) != n:
        raise GalleryError("item ids must be unique")
    return images, ids


def ingest(store: Store, images: np.ndarray, features: np.ndarray, model: ModelRef, *,
           labels: np.ndarray | None = None, groups: np.ndarray | None = None, ids: np.ndarray | None = None,
           part_size: int = 1000, on_part=None, registry: str | None = None, layout: type[Gallery] | None = None) -> dict:
    """Write a new gallery: items, images and the model's features, part by part, in ``layout``
    (a Gallery class; default the parts layout); the manifest last, so a crashed ingest leaves no
    gallery (re-run it: the parts are overwritten)."""
    import pyarrow as pa

    check_empty(store, "ingest")
    layout = layout or PartsGallery
    images, ids = check_ingest(images, labels, groups, ids)
    n = len(images)
    features = check_features(features, model.dim, "gallery features")
    if len(features) != n:
        raise GalleryError(f"{len(features)} feature rows for {n} images")
    if part_size < 1:
        raise GalleryError(f"part_size must be >= 1, got {part_size}")

    num_parts = -(-n // part_size)
    writer = layout.writer(store, model, part_size)
    for part in range(num_parts):
        start, stop = part * part_size, min((part + 1) * part_size, n)
        columns = {
            "id": pa.array(ids[start:stop]),
            "image": pa.array([f"{part_key('images', part)}#{row}" for row in range(stop - start)]),
            "label": (pa.array(np.asarray(labels[start:stop], dtype=np.int64)) if labels is not None
                      else pa.nulls(stop - start, pa.int64())),
            "group": (pa.array([str(g) for g in groups[start:stop]], type=pa.string()) if groups is not None
                      else pa.nulls(stop - start, pa.string())),
        }
        writer.write(start, pa.table(columns), features[start:stop], images[start:stop])
        if on_part is not None:
            on_part(part + 1, num_parts)
    writer.close()
    return commit_manifest(store, model, num_items=n, part_size=part_size, image_shape=images.shape[1:],
                           has_labels=labels is not None, has_groups=groups is not None, by="ingest",
                           registry=registry, layout=layout.layout, extra=written_fields(writer))


def written_fields(writer) -> dict:
    """What a layout's writer adds to the new gallery's manifest (pgvector: its index)."""
    fields = getattr(writer, "manifest_fields", None)
    return fields() if fields is not None else {}
