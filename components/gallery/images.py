"""Images where they already are: read by URI (``s3://bucket/key``, a local path, or a path
relative to the gallery's root), decoded and shaped for the model, with a bounded pool of
parallel reads. An image that cannot be read or decoded is a failure with its reason, never an
exception and never a silent gap: the caller decides what a failure means.
"""

from __future__ import annotations

import io
import os
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_WORKERS = 16


@dataclass(frozen=True)
class ImageFailure:
    """An item whose image could not be used: its row in the request, and why."""

    row: int
    uri: str
    reason: str


def resolve(uri: str, root: str | None) -> str:
    """A full location: ``s3://`` and absolute paths as they are, others under ``root``."""
    if uri.startswith("s3://") or uri.startswith("/") or root is None:
        return uri.removeprefix("file://")
    root = root.removeprefix("file://")
    return f"{root.rstrip('/')}/{uri}" if root.startswith("s3://") else str(Path(root) / uri)


class _S3Reader:
    """One boto3 client per process for ``s3://`` image reads (the endpoint from
    AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, as the store's)."""

    _lock = threading.Lock()
    _client = None

    @classmethod
    def client(cls):
        with cls._lock:
            if cls._client is None:
                import boto3
                from botocore.config import Config

                endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
                config = Config(retries={"max_attempts": 5, "mode": "standard"}, connect_timeout=5,
                                read_timeout=60, max_pool_connections=64)
                cls._client = boto3.session.Session().client("s3", endpoint_url=endpoint, config=config)
            return cls._client

    @classmethod
    def read(cls, uri: str) -> bytes:
        bucket, _, key = uri[len("s3://"):].partition("/")
        return cls.client().get_object(Bucket=bucket, Key=key)["Body"].read()


def read_bytes(location: str) -> bytes:
    if location.startswith("s3://"):
        return _S3Reader.read(location)
    return Path(location).read_bytes()


def decode(data: bytes, shape: Sequence[int]) -> np.ndarray:
    """Encoded image bytes (PNG, JPEG, anything Pillow reads) -> uint8 (C, H, W) of ``shape``:
    grey for one channel, RGB for three, resized (bilinear) when the size differs."""
    from PIL import Image

    channels, height, width = shape
    with Image.open(io.BytesIO(data)) as image:
        image = image.convert("L" if channels == 1 else "RGB")
        if image.size != (width, height):
            image = image.resize((width, height), Image.Resampling.BILINEAR)
        array = np.asarray(image, dtype=np.uint8)
    return array[None] if channels == 1 else array.transpose(2, 0, 1)


def _why(error: BaseException) -> str:
    """A short reason for the failure list: missing, unreadable or undecodable."""
    from PIL import UnidentifiedImageError

    if isinstance(error, FileNotFoundError):
        return f"missing: no such file {error.filename}" if error.filename else "missing: no such file"
    if isinstance(error, UnidentifiedImageError):
        return "undecodable: not an image Pillow can read"
    code = getattr(error, "response", {}).get("Error", {}).get("Code") if hasattr(error, "response") else None
    if code in ("NoSuchKey", "404"):
        return "missing: no such object"
    if code:
        return f"unreadable: S3 {code}"
    return f"{'undecodable' if isinstance(error, (OSError, ValueError, SyntaxError)) else 'unreadable'}: " \
           f"{type(error).__name__}: {error}"[:300]


def _load(location: str, shape: Sequence[int]) -> np.ndarray:
    return decode(read_bytes(location), shape)


def read_images(uris: Sequence[str], shape: Sequence[int], *, root: str | None = None,
                workers: int = DEFAULT_WORKERS) -> tuple[np.ndarray, list[ImageFailure]]:
    """The images at ``uris`` as uint8 (n, C, H, W), read ``workers`` at a time; a failed row is
    zeros and listed in the failures."""
    out = np.zeros((len(uris), *shape), dtype=np.uint8)
    failures: list[ImageFailure] = []
    for row, result in enumerate(iter_images(uris, shape, root=root, workers=workers)):
        if isinstance(result, ImageFailure):
            failures.append(ImageFailure(row, result.uri, result.reason))
        else:
            out[row] = result
    return out, failures


def iter_images(uris: Sequence[str], shape: Sequence[int], *, root: str | None = None,
                workers: int = DEFAULT_WORKERS) -> Iterator[np.ndarray | ImageFailure]:
    """The images at ``uris`` in order, each an array or an ``ImageFailure``; at most
    ``workers`` reads in flight and ``2 * workers`` decoded images waiting, so a consumer that
    embeds as they come overlaps its work with the next reads."""
    if not len(uris):
        return
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="image-read") as pool:
        ahead = max(2, 2 * workers)
        pending: deque = deque()
        position = 0
        for row in range(len(uris)):
            while position < len(uris) and position - row < ahead:
                pending.append(pool.submit(_load, resolve(str(uris[position]), root), shape))
                position += 1
            future = pending.popleft()
            try:
                yield future.result()
            except Exception as error:  # noqa: BLE001 - every failure is recorded, never raised
                yield ImageFailure(row, str(uris[row]), _why(error))
