"""Object storage for the gallery: one interface, a local folder or ``s3://bucket/prefix``.

Every object is written whole to a deterministic key with its SHA-256, and every read checks
it, so a torn or altered object is an error that names its key, never silently wrong data.
The checksum and the bytes are one unit, replaced together:

- S3: the object's user metadata ``sha256`` (S3 replaces an object and its metadata at once).
- A local folder: key ``a/b.npy`` is ``ROOT/a/b.npy``, a relative symlink to a hidden file
  ``ROOT/a/.b.npy.<sha256>.<nonce>`` that holds the bytes and carries the checksum in its name.
  A write makes a new such file and swaps the link with one rename, so a reader sees the old
  object or the new one, each with its own checksum, never one's bytes with the other's
  checksum. Folders written before this layout (a plain file with a ``<name>.sha256`` file
  beside it) are read as they are; the next write of a key moves it to the new layout.

Writes that must not lose a race (the upgrade lock) use ``swap``: replace an object only if it
is still the version that was read, or create it only if absent (S3's ``If-Match`` /
``If-None-Match: *``; in a folder, under an exclusive ``flock`` on a hidden file beside the key),
so of two writers exactly one wins. ``fence`` lets a lock holder refuse this process's further
writes to a store once its lease is gone.

``s3://`` stores: credentials and region from the AWS environment variables or config files,
the endpoint from ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` (MinIO or any S3-compatible
service), retries and timeouts from ``gallery.s3`` (``configure_s3`` for the process, or the
``s3`` argument of ``open_store``). Throttling (503 SlowDown), 5xx answers, dropped connections
and slow answers are retried with backoff; a request that fails every attempt ends in one
``StoreUnreachable`` naming the store and what to do. Credentials are never logged.
"""

from __future__ import annotations

from pathlib import Path

from fastfill.components.gallery.store.base import (
    AlreadyExists,
    ChecksumMismatch,
    Conflict,
    DamagedObject,
    ObjectMissing,
    Store,
    StoreError,
    StoreUnreachable,
    fence,
    json_bytes,
    parse_json,
    sha256,
    unfence,
)
from fastfill.components.gallery.store.local import CHECKSUM_SUFFIX, LocalStore
from fastfill.components.gallery.store.s3 import S3Store, configure_s3, s3_client, s3_endpoint, s3_settings

__all__ = [
    "CHECKSUM_SUFFIX", "AlreadyExists", "ChecksumMismatch", "Conflict", "DamagedObject", "LocalStore", "ObjectMissing",
    "S3Store", "Store", "StoreError", "StoreUnreachable", "configure_s3", "fence", "json_bytes", "open_store",
    "parse_json", "s3_client", "s3_endpoint", "s3_settings", "sha256", "unfence",
]


def open_store(uri: str | Path, s3=None) -> Store:
    """``s3://bucket[/prefix]`` or a local folder path (``file://`` accepted). ``s3``: the S3
    client's settings (``gallery.s3``); default, those of ``configure_s3`` or the defaults."""
    text = str(uri)
    if text.startswith("s3://"):
        rest = text[len("s3://"):]
        bucket, _, prefix = rest.partition("/")
        if len(bucket) < 3:
            raise StoreError(f"{text!r}: an S3 URI needs a bucket name, s3://BUCKET[/PREFIX]")
        return S3Store(bucket, prefix, settings=s3)
    if "://" in text and not text.startswith("file://"):
        raise StoreError(f"{text!r}: unsupported store URI; use a local folder or s3://bucket/prefix")
    return LocalStore(Path(text.removeprefix("file://")))
