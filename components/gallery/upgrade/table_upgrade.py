"""The upgrade's work on the Lance table (gallery.layout lance), free of Prefect and MLflow: the
items' images, the map applied to the stored features and the backfill order, a chunk
re-embedded, and the promotion gate's sample. ``flows/lance_upgrade.py`` sequences them.

An item's image is its ``pixels`` (an ingested gallery) or read by its URI (an adopted one, under
the table's image root, in the image shape the table records). A chunk's unreadable images keep
their h(old) as their features in the new space, as in the parts layout, and are listed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from components.gallery.layouts.catalog import GalleryError, check_features
from components.gallery.layouts.item_ids import id_array
from components.gallery.layouts.lance_format import _metadata
from components.gallery.layouts.lance_table import LanceGallery


@dataclass(frozen=True)
class Failure:
    position: int
    uri: str
    reason: str
    id: object = None  # the item's id


def images_at(table: LanceGallery, positions: np.ndarray, workers: int = 16,
              preprocessing=None) -> tuple[np.ndarray, list[Failure]]:
    """The uint8 images (n, C, H, W) of the items at ``positions``, in that order, and the ones that
    could not be read (their rows are zeros): stored pixels as stored (``inference.embed`` brings
    them to the model's shape), URIs decoded by ``preprocessing`` (the embedding model's)."""
    from components.gallery.inputs.images import read_images

    positions = np.asarray(positions, dtype=np.int64)
    dataset = table.dataset()
    shape, root = _image_source(table, dataset)
    names = dataset.schema.names
    column = "pixels" if "pixels" in names else "image" if "image" in names else None
    if column is None:
        raise GalleryError(f"{table.uri} has neither images (pixels) nor their URIs (image): nothing to re-embed")
    wanted = ", ".join(str(int(p)) for p in positions)
    rows = table._read(dataset, ["position", "id", column], filter=f"position IN ({wanted})") if len(positions) else None
    if rows is None:
        return np.zeros((0, *shape), dtype=np.uint8), []
    where = dict(zip(rows.column("position").to_pylist(), range(rows.num_rows), strict=True))
    picked = [where[int(p)] for p in positions]
    values = rows.column(column).take(picked).to_pylist()
    if column == "pixels":
        return np.frombuffer(b"".join(values), dtype=np.uint8).reshape(len(positions), *shape).copy(), []
    images, failures = read_images(values, preprocessing or shape, root=root, workers=workers)
    ids = rows.column("id").take(picked).to_pylist()
    return images, [Failure(int(positions[f.row]), f.uri, f.reason, ids[f.row]) for f in failures]


def _image_source(table: LanceGallery, dataset) -> tuple[list[int], str | None]:
    """(the images' shape, the root their relative URIs are under) that the table records."""
    metadata = _metadata(dataset.schema)
    shape = json.loads(metadata.get("fastfill.image_shape") or "null")
    if not shape:
        raise GalleryError(f"{table.uri} does not record its images' shape (fastfill.image_shape); convert or adopt "
                           "it again")
    return shape, metadata.get("fastfill.image_root") or None


def order_of(table: LanceGallery) -> np.ndarray:
    """The backfill order (positions, first first) from the table's ``rank`` column."""
    data = table._read(table.dataset(), ["position", "rank"])
    order = np.empty(data.num_rows, dtype=np.int64)
    order[data.column("rank").to_numpy()] = data.column("position").to_numpy()
    return order


def usage_weights(table: LanceGallery, usage_log: str | None):
    """The table's usage weights (``usage.weights_of``): counted from the query log ``usage_log``
    when one is given, else the table's ``weight`` column."""
    from components.gallery.upgrade import usage

    def stored():
        if usage.WEIGHT not in table.dataset().schema.names:
            return None
        return np.asarray(table.items([usage.WEIGHT]).column(usage.WEIGHT).to_pylist(), dtype=np.float64)

    return usage.weights_of(usage_log, lambda: id_array(table.items(["id"]).column("id")), stored,
                            f"the table {table.uri}", "the table's")


def plan(table: LanceGallery, upgrade: str, new, alignment_map, order_kind: str, seed: int,
         token: str | None = None, weights: np.ndarray | None = None) -> tuple[str, np.ndarray]:
    """h(old) and log sigma^2 of every stored feature, the backfill order (``usage.backfill_order``;
    the usage orders take ``weights``, from ``usage_weights``), and the upgrade's columns written
    (``LanceGallery.begin_upgrade``). Returns (the plan's token, the order)."""
    from components.experiment.inference import apply_alignment
    from components.gallery.upgrade import usage

    old = table.features()
    transformed, log_sigma2 = apply_alignment(alignment_map, old)
    transformed = check_features(transformed, None, "the transformed features h(old)")
    order = usage.backfill_order(order_kind, len(old), seed, log_sigma2, weights)
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    token = table.begin_upgrade(upgrade, new, transformed, rank, log_sigma2, token=token)
    return token, order


def backfill_chunk(table: LanceGallery, upgrade: str, token: str, chunk: int, positions: np.ndarray, model, *,
                   batch_size: int = 512, read_workers: int = 16, precision: str = "auto") -> dict:
    """Re-embed one chunk's images with the new model and commit them (one append); an unreadable
    image keeps its h(old). Committing a chunk again is harmless (readers keep one commit)."""
    from components.experiment.inference import embed

    positions = np.asarray(positions, dtype=np.int64)
    images, failures = images_at(table, positions, read_workers, getattr(model, "preprocessing", None))
    dim = table.upgrade().new.dim
    features = np.empty((len(positions), dim), dtype=np.float32)
    failed = np.isin(positions, [f.position for f in failures])
    if (~failed).any():
        features[~failed] = check_features(embed(model, images[~failed], batch_size=batch_size, precision=precision),
                                           dim, f"new-model features of chunk {chunk}")
    if failed.any():
        features[failed] = table.features_at(positions[failed], "mapped")
    record = table.commit_chunk(upgrade, chunk, positions, features, token)
    return {**record, "count": len(positions),
            "failed": [{"id": f.id, "position": f.position, "uri": f.uri, "reason": f.reason} for f in failures]}


def gate_sample(table: LanceGallery, size: int | str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions, labels) of the promotion gate's sample: seeded, class-balanced where labels are
    (``planning.eval_sample``). Refused without labels (judged queries gate such a table)."""
    from components.gallery.upgrade.planning import eval_sample

    if "label" not in table.dataset().schema.names:
        from components.gallery.upgrade.lifecycle import no_truth_refusal

        raise GalleryError(no_truth_refusal(table.uri))
    labels = np.asarray(table.items(["label"]).column("label").to_pylist(), dtype=np.int64)
    positions = eval_sample(labels, None if size == "all" else int(size), seed, len(labels))
    return positions, labels[positions]


def gate_numbers(table: LanceGallery, positions: np.ndarray, labels: np.ndarray, queries: np.ndarray,
                 order: np.ndarray, *, distance: str, curve_points: int) -> dict:
    """The promotion gate's numbers (``promotion.measure_gate``) on the sample at ``positions``:
    the champion's stored features of the sample against the challenger's queries on the sample's
    gallery as it fills, from h(old) to the new features, in the backfill's order."""
    from components.gallery.gate.promotion import measure_gate

    champion = table.features_at(positions, "features")
    transformed = table.features_at(positions, "mapped")
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    local_order = np.argsort(rank[positions], kind="stable")
    return measure_gate(champion, queries, queries, transformed, labels, local_order, distance=distance,
                        curve_points=curve_points)


def judged_queries(table: LanceGallery, judged, embed_new, embed_champion, *, workers: int = 16, source: str = "",
                   preprocessing=None, champion_preprocessing=None):
    """The judged queries' features on both sides of the gate (``judgments.load_judgments``'s
    ``judged``, resolved against the table's ids), on the table (``samples.judged_features``).
    Returns (judged, new queries, champion queries)."""
    from components.gallery.inputs.images import read_images
    from components.gallery.upgrade.samples import judged_features

    def uri_images(uris: list[str], side: str):
        shape, root = _image_source(table, table.dataset())
        wanted = preprocessing if side == "new" else champion_preprocessing
        return read_images(uris, wanted or shape, root=root, workers=workers)

    return judged_features(judged, embed_new, embed_champion, source,
                           item_images=lambda positions: images_at(table, positions, workers, preprocessing),
                           item_features=table.features_at, uri_images=uri_images)


def judged_gate_numbers(table: LanceGallery, judged, new_queries: np.ndarray, champion_queries: np.ndarray,
                        order: np.ndarray, *, distance: str, curve_points: int) -> dict:
    """The promotion gate's numbers on judged queries against the whole table
    (``judged_gate.measure_judged_gate``): the champion's stored features, h(old), and the new
    features every chunk committed (after the fold), along the backfill's order."""
    from components.gallery.gate.judged_gate import measure_judged_gate

    return measure_judged_gate(champion_queries, table.features("features"), new_queries, table.features("new"),
                               table.features("mapped"), judged, order, distance=distance, curve_points=curve_points)
