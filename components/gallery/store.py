"""Object storage for the gallery: one interface, a local folder or ``s3://bucket/prefix``.

Every object is written whole to a deterministic key with its SHA-256, and every read checks
it, so a torn or altered object is an error that names its key, never silently wrong data.
The checksum travels with the object: S3 user metadata ``sha256``; in a local folder, a
``<key>.sha256`` file beside it (written first, so a crash between the two leaves a mismatch
that the next write of the same key repairs).

``s3://`` stores use boto3's standard configuration: credentials and region from the AWS
environment variables or config files, the endpoint from ``AWS_ENDPOINT_URL_S3`` /
``AWS_ENDPOINT_URL`` (MinIO or any S3-compatible service). Credentials are never logged.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np

CHECKSUM_SUFFIX = ".sha256"


class StoreError(RuntimeError):
    """A store operation failed; the message names the object and what to do."""


class ObjectMissing(StoreError):
    pass


class ChecksumMismatch(StoreError):
    pass


class StoreUnreachable(StoreError):
    pass


class AlreadyExists(StoreError):
    """A create-only write found the key taken (used for locks)."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Store(ABC):
    """Bytes under string keys ("a/b/c.npy"), checksummed."""

    uri: str

    @abstractmethod
    def _put(self, key: str, data: bytes, digest: str, *, create_only: bool) -> None: ...

    @abstractmethod
    def _get(self, key: str) -> tuple[bytes, str | None]: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` (a folder-like prefix, "a/b/"), sorted."""

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def check(self) -> None:
        """Raise StoreUnreachable when the store can't be reached or doesn't exist."""

    # ---- bytes with checksums

    def put(self, key: str, data: bytes, *, create_only: bool = False) -> str:
        digest = sha256(data)
        self._put(key, data, digest, create_only=create_only)
        return digest

    def get(self, key: str) -> bytes:
        # A local object and its checksum file are replaced one after the other, so a reader can
        # meet one new and one old while a mutable object (gallery.json) is rewritten: a
        # mismatch is read again a few times before it counts as corruption.
        for attempt in range(4):
            data, recorded = self._get(key)
            actual = sha256(data)
            if actual == recorded:
                return data
            time.sleep(0.05 * (attempt + 1))
        if recorded is None:
            raise ChecksumMismatch(f"{self.describe(key)} has no recorded checksum; it was not written by "
                                   "this store. Remove it, or re-run the command that writes it")
        raise ChecksumMismatch(f"{self.describe(key)} is corrupt: its SHA-256 is {actual[:12]}..., "
                               f"the recorded one {recorded[:12]}...; re-run the command that writes it")

    def describe(self, key: str) -> str:
        return f"{self.uri.rstrip('/')}/{key}"

    # ---- typed helpers

    def put_json(self, key: str, value: object, *, create_only: bool = False) -> str:
        return self.put(key, (json.dumps(value, indent=1, sort_keys=True) + "\n").encode(), create_only=create_only)

    def get_json(self, key: str) -> dict:
        data = self.get(key)
        try:
            return json.loads(data)
        except ValueError as error:
            raise StoreError(f"{self.describe(key)} is not valid JSON: {error}") from None

    def put_array(self, key: str, array: np.ndarray) -> str:
        buffer = io.BytesIO()
        np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
        return self.put(key, buffer.getvalue())

    def get_array(self, key: str) -> np.ndarray:
        data = self.get(key)
        try:
            return np.load(io.BytesIO(data), allow_pickle=False)
        except ValueError as error:
            raise StoreError(f"{self.describe(key)} is not a readable array: {error}") from None

    def put_parquet(self, key: str, table) -> str:
        import pyarrow.parquet as pq

        buffer = io.BytesIO()
        pq.write_table(table, buffer)
        return self.put(key, buffer.getvalue())

    def get_parquet(self, key: str):
        import pyarrow as pa
        import pyarrow.parquet as pq

        data = self.get(key)
        try:
            return pq.read_table(io.BytesIO(data))
        except (pa.ArrowInvalid, OSError) as error:
            raise StoreError(f"{self.describe(key)} is not a readable parquet table: {error}") from None

    def delete_prefix(self, prefix: str) -> int:
        keys = self.list(prefix)
        for key in keys:
            self.delete(key)
        return len(keys)


# ------------------------------------------------------------------------------------------------


class LocalStore(Store):
    """A folder with the object store's layout: key "a/b.npy" is the file ROOT/a/b.npy."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.uri = str(self.root)

    def _path(self, key: str) -> Path:
        if key.startswith("/") or ".." in key.split("/"):
            raise StoreError(f"invalid key {key!r}")
        return self.root / key

    def check(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise StoreUnreachable(f"{self.root} exists and is not a folder; give a folder or an s3:// URI")

    def _put(self, key: str, data: bytes, digest: str, *, create_only: bool) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        if create_only:
            try:
                descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                raise AlreadyExists(f"{self.describe(key)} already exists") from None
            # the checksum first: a reader never sees the object without one
            _write_file(path.with_name(path.name + CHECKSUM_SUFFIX), digest.encode())
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            return
        _write_file(path.with_name(path.name + CHECKSUM_SUFFIX), digest.encode())
        _write_file(path, data)

    def _get(self, key: str) -> tuple[bytes, str | None]:
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise ObjectMissing(f"{self.describe(key)} does not exist") from None
        except OSError as error:
            raise StoreError(f"{self.describe(key)} cannot be read: {error.strerror}") from None
        try:
            recorded = path.with_name(path.name + CHECKSUM_SUFFIX).read_text().strip()
        except FileNotFoundError:
            recorded = None
        return data, recorded

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str) -> list[str]:
        base = self._path(prefix.rstrip("/")) if prefix.strip("/") else self.root
        if not base.is_dir():
            return []
        keys = []
        for path in base.rglob("*"):
            if path.is_file() and not path.name.endswith((CHECKSUM_SUFFIX, ".part")):
                keys.append(path.relative_to(self.root).as_posix())
        return sorted(keys)

    def delete(self, key: str) -> None:
        path = self._path(key)
        path.unlink(missing_ok=True)
        path.with_name(path.name + CHECKSUM_SUFFIX).unlink(missing_ok=True)


def _write_file(path: Path, data: bytes) -> None:
    """Whole or not at all: a side file renamed over the target."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.part")
    with open(partial, "wb") as handle:
        handle.write(data)
    partial.replace(path)


# ------------------------------------------------------------------------------------------------


def s3_endpoint() -> str | None:
    """The S3 endpoint from the environment (AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL); None: AWS."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def s3_client(endpoint_url: str | None, *, attempts: int = 5, connect_timeout: float = 5, read_timeout: float = 60,
              pool: int = 32):
    """A boto3 S3 client with the product's retry and timeout settings (credentials and region
    from boto3's standard configuration)."""
    import boto3
    from botocore.config import Config

    config = Config(retries={"max_attempts": attempts, "mode": "standard"}, connect_timeout=connect_timeout,
                    read_timeout=read_timeout, max_pool_connections=pool)
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)


class S3Store(Store):
    """``s3://bucket/prefix`` through boto3 (AWS, MinIO, any S3-compatible endpoint)."""

    def __init__(self, bucket: str, prefix: str, *, endpoint_url: str | None = None):
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        endpoint_url = endpoint_url or s3_endpoint()
        self.endpoint = endpoint_url or "AWS"
        self.client = s3_client(endpoint_url)
        # reachability is asked once, up front: fail fast instead of retrying with backoff
        self._probe = s3_client(endpoint_url, attempts=1, connect_timeout=3, read_timeout=10)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, key: str | None, function, **kwargs):
        from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError, NoCredentialsError

        try:
            return function(**kwargs)
        except ClientError as error:
            code = error.response.get("Error", {}).get("Code", "")
            status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("NoSuchKey", "404") and key is not None:
                raise ObjectMissing(f"{self.describe(key)} does not exist") from None
            if code == "NoSuchBucket" or (code == "404" and key is None):
                raise StoreUnreachable(f"bucket {self.bucket!r} does not exist at {self.endpoint}; create it "
                                       "or check the URI") from None
            if code in ("PreconditionFailed", "412") or status == 412:
                raise AlreadyExists(f"{self.describe(key)} already exists") from None
            if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                raise StoreUnreachable(f"{what} {self.uri}: access denied ({code}); check the AWS credentials "
                                       "in the environment or config") from None
            raise StoreError(f"{what} {self.describe(key) if key else self.uri}: {code or error}") from None
        except NoCredentialsError:
            raise StoreUnreachable(f"{self.uri}: no AWS credentials; set AWS_ACCESS_KEY_ID and "
                                   "AWS_SECRET_ACCESS_KEY or an AWS profile") from None
        except EndpointConnectionError:
            raise StoreUnreachable(f"{self.uri}: cannot connect to the S3 endpoint {self.endpoint}; is it running, "
                                   "and is AWS_ENDPOINT_URL right?") from None
        except BotoCoreError as error:
            raise StoreUnreachable(f"{self.uri} at {self.endpoint}: {type(error).__name__}: {error}") from None

    def check(self) -> None:
        self._call("reaching", None, self._probe.head_bucket, Bucket=self.bucket)

    def _put(self, key: str, data: bytes, digest: str, *, create_only: bool) -> None:
        extra = {"IfNoneMatch": "*"} if create_only else {}
        self._call("writing", key, self.client.put_object, Bucket=self.bucket, Key=self._key(key), Body=data,
                   Metadata={"sha256": digest}, **extra)

    def _get(self, key: str) -> tuple[bytes, str | None]:
        response = self._call("reading", key, self.client.get_object, Bucket=self.bucket, Key=self._key(key))
        return response["Body"].read(), response.get("Metadata", {}).get("sha256")

    def exists(self, key: str) -> bool:
        try:
            self._call("checking", key, self.client.head_object, Bucket=self.bucket, Key=self._key(key))
        except ObjectMissing:
            return False
        return True

    def list(self, prefix: str) -> list[str]:
        full = self._key(prefix)
        keys: list[str] = []
        token: dict = {}
        while True:
            page = self._call("listing", None, self.client.list_objects_v2, Bucket=self.bucket, Prefix=full, **token)
            strip = len(self.prefix) + 1 if self.prefix else 0
            keys += [item["Key"][strip:] for item in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return sorted(keys)
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def delete(self, key: str) -> None:
        self._call("deleting", key, self.client.delete_object, Bucket=self.bucket, Key=self._key(key))


def open_store(uri: str | Path) -> Store:
    """``s3://bucket[/prefix]`` or a local folder path (``file://`` accepted)."""
    text = str(uri)
    if text.startswith("s3://"):
        rest = text[len("s3://"):]
        bucket, _, prefix = rest.partition("/")
        if len(bucket) < 3:
            raise StoreError(f"{text!r}: an S3 URI needs a bucket name, s3://BUCKET[/PREFIX]")
        return S3Store(bucket, prefix)
    if "://" in text and not text.startswith("file://"):
        raise StoreError(f"{text!r}: unsupported store URI; use a local folder or s3://bucket/prefix")
    return LocalStore(Path(text.removeprefix("file://")))

