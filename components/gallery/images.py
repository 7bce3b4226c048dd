"""Images where they already are: read by URI (``s3://bucket/key``, a local path, or a path
relative to the gallery's root), decoded and shaped for the model, with a bounded pool of
parallel reads. An image that cannot be read or decoded is a failure with its reason, never an
exception and never a silent gap: the caller decides what a failure means.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

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
        from components.gallery.store import s3_client, s3_endpoint

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
    response = getattr(error, "response", None)  # botocore's ClientError carries the S3 error code
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    if code in ("NoSuchKey", "404"):
        return "missing: no such object"
    if code:
        return f"unreadable: S3 {code}"
    return f"{'undecodable' if isinstance(error, (OSError, ValueError, SyntaxError)) else 'unreadable'}: " \
           f"{type(error).__name__}: {error}"[:300]


def read_images(uris: Sequence[str], shape: Sequence[int], *, root: str | None = None,
                workers: int = DEFAULT_WORKERS) -> tuple[np.ndarray, list[ImageFailure]]:
    """The images at ``uris`` as uint8 (n, C, H, W), read by ``workers`` threads, each taking a
    contiguous slice and decoding straight into the result (no per-image task: the overhead per
    image stays at the read and the decode); a failed row is zeros and listed in the failures,
    in row order."""
    out = np.zeros((len(uris), *shape), dtype=np.uint8)
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
            try:
                out[row] = decode(read_bytes(resolve(str(uris[row]), root)), shape)
            except Exception as error:  # noqa: BLE001 - every failure is recorded, never raised
                failed.append(ImageFailure(row, str(uris[row]), _why(error)))
        return failed

    if workers == 1:
        return out, work(0, count)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="image-read") as pool:
        slices = [pool.submit(work, int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
        failures = [failure for part in slices for failure in part.result()]
    return out, failures
