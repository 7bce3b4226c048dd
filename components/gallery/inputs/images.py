"""Images where they already are: read by URI (``s3://bucket/key``, a local path, or a path
relative to the gallery's root), decoded and shaped for the model, with a bounded pool of
parallel reads. An image that cannot be read or decoded is a failure with its reason, never an
exception and never a silent gap: the caller decides what a failure means.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from fastfill.components.gallery.store import StoreError, s3_client, s3_endpoint
from fastfill.components.model_store.preprocessing import Preprocessing

DEFAULT_WORKERS = 16


@dataclass(frozen=True)
class ImageFailure:
    """An item whose image could not be used: its row in the request, and why."""

    row: int
    uri: str
    reason: str


def readable(count: int, failures: Sequence[ImageFailure]) -> np.ndarray:
    """The mask of the ``count`` rows of a request whose image was read (not in ``failures``)."""
    mask = np.ones(count, dtype=bool)
    mask[[failure.row for failure in failures]] = False
    return mask


def resolve(uri: str, root: str | None) -> str:
    """A full location: ``s3://`` and absolute paths as they are, others under ``root``."""
    if uri.startswith("s3://") or uri.startswith("/") or root is None:
        return uri.removeprefix("file://")
    root = root.removeprefix("file://")
    return f"{root.rstrip('/')}/{uri}" if root.startswith("s3://") else os.path.join(root, uri)


class _S3Reader:
    """One boto3 client per endpoint and process for ``s3://`` image reads (the endpoint from
    AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, as the store's)."""

    _lock = threading.Lock()
    _clients: dict = {}

    @classmethod
    def client(cls):

        endpoint = s3_endpoint()
        with cls._lock:
            if endpoint not in cls._clients:
                cls._clients[endpoint] = s3_client(endpoint, pool=64)
            return cls._clients[endpoint]

    @classmethod
    def read(cls, uri: str) -> bytes:
        bucket, _, key = uri[len("s3://"):].partition("/")
        return cls.client().get_object(Bucket=bucket, Key=key)["Body"].read()


def read_bytes(location: str) -> bytes:
    if location.startswith("s3://"):
        return _S3Reader.read(location)
    with open(location, "rb") as file:
        return file.read()


def as_preprocessing(shape: Sequence[int] | Preprocessing) -> Preprocessing:
    """A model's preprocessing as it is, or a bare (C, H, W) as a plain stretch to it."""
    return shape if isinstance(shape, Preprocessing) else Preprocessing.plain(shape)


def decode(data: bytes, shape: Sequence[int] | Preprocessing) -> np.ndarray:
    """Encoded image bytes (PNG, JPEG, WebP, anything Pillow reads; RGB, RGBA, grey, 16-bit)
    -> uint8 (C, H, W) as the model's preprocessing makes them (its colour mode and resize rule),
    or for a bare (C, H, W) grey or RGB stretched to that size (bilinear)."""
    return as_preprocessing(shape).decode(data)


# S3 answers about one object (the item's problem) as opposed to the store's (outage, throttling
# past the retries, a wrong bucket or credentials), which must stop the chunk, not fail its images
ITEM_S3_CODES = {"NoSuchKey", "404", "AccessDenied", "403", "InvalidObjectState"}


class ImageStoreError(StoreError):
    """The images' store itself failed (not one image): the chunk stops and is retried."""


def read_image(location: str, shape: Sequence[int] | Preprocessing) -> tuple[np.ndarray | None, str | None]:
    """(image, None), or (None, why) when this one image is missing, forbidden or undecodable.
    A failure of the store itself raises ImageStoreError: it says nothing about the image."""
    from PIL import Image

    try:
        data = read_bytes(location)
    except FileNotFoundError as error:
        return None, f"missing: no such file {error.filename}" if error.filename else "missing: no such file"
    except (IsADirectoryError, PermissionError) as error:
        return None, f"unreadable: {type(error).__name__}: {error}"[:300]
    except Exception as error:  # noqa: BLE001 - sorted below into the item's problem or the store's, then raised
        response = getattr(error, "response", None)  # botocore's ClientError carries the S3 error code
        code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
        if code in ("NoSuchKey", "404"):
            return None, "missing: no such object"
        if code in ITEM_S3_CODES:
            return None, f"unreadable: S3 {code}"
        raise ImageStoreError(f"cannot read {location}: {type(error).__name__}: {error}"[:500]
                              + " (the image store failed, not the image; check the endpoint and credentials, "
                              "then run the upgrade again: finished chunks are kept)") from error
    try:
        return decode(data, shape), None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
        from PIL import UnidentifiedImageError

        if isinstance(error, UnidentifiedImageError):
            return None, "undecodable: not an image Pillow can read"
        return None, f"undecodable: {type(error).__name__}: {error}"[:300]


def read_images(uris: Sequence[str], shape: Sequence[int] | Preprocessing, *, root: str | None = None,
                workers: int = DEFAULT_WORKERS) -> tuple[np.ndarray, list[ImageFailure]]:
    """The images at ``uris`` as uint8 (n, C, H, W) (``shape``: a model's preprocessing, or a bare
    (C, H, W), see ``decode``), read by ``workers`` threads, each taking a
    contiguous slice and decoding straight into the result (no per-image task: the overhead per
    image stays at the read and the decode); a failed row is zeros and listed in the failures,
    in row order. A failure of the store itself (not of one image) raises ImageStoreError."""
    shape = as_preprocessing(shape)
    out = np.zeros((len(uris), *shape.shape), dtype=np.uint8)
    count = len(uris)
    if not count:
        return out, []
    remote = str(root or "").startswith("s3://") or any(str(u).startswith("s3://") for u in uris[:64])
    # Local files: one thread (a read is a cheap system call and the decode holds the GIL, so more
    # threads only contend; chunks in flight run in parallel already). S3: ``workers`` requests in
    # flight, since each waits on the network.
    workers = max(1, min(workers if remote else 1, count))
    bounds = np.linspace(0, count, workers + 1).astype(int)

    def work(first: int, last: int) -> list[ImageFailure]:
        failed = []
        for row in range(first, last):
            image, why = read_image(resolve(str(uris[row]), root), shape)
            if image is not None:
                out[row] = image
            else:  # read_image gives an image or why there is none
                failed.append(ImageFailure(row, str(uris[row]), why or "unreadable"))
        return failed

    if workers == 1:
        return out, work(0, count)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="image-read") as pool:
        slices = [pool.submit(work, int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
        failures = [failure for part in slices for failure in part.result()]
    return out, failures
