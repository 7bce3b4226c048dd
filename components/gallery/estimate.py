"""What an upgrade would do, before it does it (``fastfill upgrade --dry-run``): items, chunks,
bytes to read, object-store requests, and a duration estimated from reading and embedding a
small random sample of the gallery's own images. Nothing is written.
"""

from __future__ import annotations

import math
import time

import numpy as np

from components.gallery.catalog import Gallery, fetch_images, item_column


def _mean_encoded_size(gallery: Gallery, positions: np.ndarray) -> float:
    """Mean bytes of an adopted gallery's encoded images (the sample's, read once more)."""
    from components.gallery.images import ITEM_S3_CODES, read_bytes, resolve

    sizes = []
    for uri in item_column(gallery, positions, "image"):
        try:
            sizes.append(len(read_bytes(resolve(str(uri), gallery.image_root))))
        except OSError:  # a missing or unreadable file is counted by the sample's failures
            continue
        except Exception as error:  # noqa: BLE001 - S3: only an object's own problem is skipped
            response = getattr(error, "response", None)
            if not (isinstance(response, dict) and response.get("Error", {}).get("Code") in ITEM_S3_CODES):
                raise
            continue
    return float(np.mean(sizes)) if sizes else 0.0


def dry_run(gallery: Gallery, config, new_model, *, sample: int = 64, seed: int = 0) -> dict:
    """The plan of an upgrade of ``gallery`` to ``new_model`` under ``config``
    (gallery.upgrade), with measured per-item read and embedding times."""
    from components.experiment.inference import embed
    from components.gallery.images import readable

    n, parts = gallery.num_items, gallery.num_parts
    chunks = math.ceil(n / config.chunk_size)
    shape = tuple(gallery.manifest()["image_shape"])
    old_dim, new_dim = gallery.model.dim or 0, new_model.embedding_dim
    positions = np.sort(np.random.default_rng(seed).choice(n, size=min(sample, n), replace=False))
    started = time.perf_counter()
    images, failures = fetch_images(gallery, positions, workers=config.read_workers)
    read_seconds = time.perf_counter() - started
    ok = readable(len(positions), failures)
    embed(new_model, images[ok][:2], batch_size=config.batch_size, precision=config.precision)  # warm-up: first-call costs are not per item
    started = time.perf_counter()
    embed(new_model, images[ok], batch_size=config.batch_size, precision=config.precision)
    embed_seconds = time.perf_counter() - started
    per_read, per_embed = read_seconds / len(positions), embed_seconds / max(1, int(ok.sum()))

    image_bytes = _mean_encoded_size(gallery, positions) if gallery.adopted else float(np.prod(shape))
    feature_bytes, new_bytes = n * old_dim * 4, n * new_dim * 4
    image_reads = n if gallery.adopted else parts  # packed parts are cached per process
    requests = {
        "plan": 3 * parts + 5,  # features in, transformed and sigma out; order, eval sample, plan, manifest
        # the images, each part's item URIs once (cached per process), a chunk's features and its marker
        "backfill": image_reads + (parts if gallery.adopted else 0) + 2 * chunks,
        "finish": 2 * chunks + 2 * parts + 2,  # markers and chunks in; transformed in, features out
    }
    backfill_seconds = n * (per_read + per_embed) / max(1, config.max_concurrency)
    if config.max_items_per_second:
        backfill_seconds = max(backfill_seconds, n / config.max_items_per_second)
    return {
        "store": gallery.store.uri, "items": n, "parts": parts, "chunks": chunks, "chunk_size": config.chunk_size,
        "images": "read by URI where they are" if gallery.adopted else "packed parts in the store",
        "bytes_to_read": {"features": feature_bytes, "images": int(n * image_bytes), "finish": 2 * new_bytes,
                          "total": int(feature_bytes + n * image_bytes + 2 * new_bytes)},
        "bytes_to_write": {"plan": int(n * (new_dim * 4 + 4 + 8)), "backfill": new_bytes, "finish": new_bytes},
        "requests": {**requests, "total": sum(requests.values())},
        "sample": {"items": len(positions), "failed": len(failures), "read_seconds_per_item": per_read,
                   "embed_seconds_per_item": per_embed},
        "estimated_backfill_seconds": backfill_seconds,
        "note": "the estimate covers reading and embedding at max_concurrency chunks in flight; training a map "
                "(when the registry has none for the two versions) and the store's latency under load are not in it",
    }
