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

import errno
import hashlib
import io
import json
import os
import random
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import numpy as np

CHECKSUM_SUFFIX = ".sha256"  # the checksum file of the older local layout


class StoreError(RuntimeError):
    """A store operation failed; the message names the object and what to do."""


class ObjectMissing(StoreError):
    pass


class ChecksumMismatch(StoreError):
    pass


class StoreUnreachable(StoreError):
    pass


class Conflict(StoreError):
    """A conditional write found the object other than expected: another writer was first."""


class AlreadyExists(Conflict):
    """A create-only write found the key taken (used for locks)."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------------------------------------------
# Fences: a lock holder's veto on this process's writes to one store


_FENCES: dict[str, tuple[str, Callable[[str], None]]] = {}
_FENCES_LOCK = threading.Lock()


def fence(store: Store, owner: str, check: Callable[[str], None]) -> None:
    """From now on every ``put`` and ``delete`` of ``store``'s objects in this process first calls
    ``check(key)``, which raises to refuse the write. One fence per store: a later one (a newer
    lock of the same gallery) replaces an earlier one. ``swap`` and ``delete_if`` are not fenced:
    they are the lock's own writes, and their condition guards them."""
    with _FENCES_LOCK:
        _FENCES[store.identity] = (owner, check)


def unfence(store: Store, owner: str) -> None:
    """Remove ``owner``'s fence of ``store`` (a fence that another owner replaced stays)."""
    with _FENCES_LOCK:
        if _FENCES.get(store.identity, (None,))[0] == owner:
            del _FENCES[store.identity]


class Store(ABC):
    """Bytes under string keys ("a/b/c.npy"), checksummed."""

    uri: str

    @property
    @abstractmethod
    def identity(self) -> str:
        """The same string for every Store object of one place (fences are keyed by it)."""

    @abstractmethod
    def _put(self, key: str, data: bytes, digest: str, *, create_only: bool) -> None: ...

    @abstractmethod
    def _get_versioned(self, key: str) -> tuple[bytes, str | None, str]:
        """(bytes, the recorded checksum or None, the object's version)."""

    def _get(self, key: str) -> tuple[bytes, str | None]:
        """(bytes, the recorded checksum or None): what ``get`` reads."""
        return self._get_versioned(key)[:2]

    @abstractmethod
    def _swap(self, key: str, data: bytes, digest: str, expected: str | None) -> str: ...

    @abstractmethod
    def _delete_if(self, key: str, expected: str) -> None: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` (a folder-like prefix, "a/b/"), sorted."""

    @abstractmethod
    def _delete(self, key: str) -> None: ...

    @abstractmethod
    def check(self) -> None:
        """Raise StoreUnreachable when the store can't be reached or doesn't exist."""

    # ---- bytes with checksums

    def _fenced(self, key: str) -> None:
        entry = _FENCES.get(self.identity)
        if entry is not None:
            entry[1](key)

    def put(self, key: str, data: bytes, *, create_only: bool = False) -> str:
        self._fenced(key)
        digest = sha256(data)
        self._put(key, data, digest, create_only=create_only)
        return digest

    def delete(self, key: str) -> None:
        self._fenced(key)
        self._delete(key)

    def get(self, key: str) -> bytes:
        data, recorded = self._get(key)
        self._verify(key, data, recorded)
        return data

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        """The object's bytes (checked) and its version, for a later ``swap`` or ``delete_if``."""
        data, recorded, version = self._get_versioned(key)
        self._verify(key, data, recorded)
        return data, version

    def _verify(self, key: str, data: bytes, recorded: str | None) -> None:
        actual = sha256(data)
        if recorded is None:
            raise ChecksumMismatch(f"{self.describe(key)} has no recorded checksum; it was not written by "
                                   "this store. Remove it, or re-run the command that writes it")
        if actual != recorded:
            raise ChecksumMismatch(f"{self.describe(key)} is corrupt: its SHA-256 is {actual[:12]}..., "
                                   f"the recorded one {recorded[:12]}...; re-run the command that writes it")

    def swap(self, key: str, data: bytes, *, expected: str | None) -> str:
        """Write ``data`` to ``key`` only if the object is still version ``expected`` (from
        ``get_versioned`` or an earlier ``swap``), or, with ``expected=None``, only if there is
        none; atomically, so of two writers exactly one wins. Returns the new version; raises
        AlreadyExists (``expected=None``) or Conflict when the object is not as expected."""
        return self._swap(key, data, sha256(data), expected)

    def delete_if(self, key: str, *, expected: str) -> None:
        """Delete ``key`` only if it is still version ``expected`` (Conflict otherwise); an
        object already gone is no error."""
        self._delete_if(key, expected)

    def describe(self, key: str) -> str:
        return f"{self.uri.rstrip('/')}/{key}"

    # ---- typed helpers

    def put_json(self, key: str, value: object, *, create_only: bool = False) -> str:
        return self.put(key, json_bytes(value), create_only=create_only)

    def get_json(self, key: str) -> dict:
        return parse_json(self, key, self.get(key))

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


def json_bytes(value: object) -> bytes:
    return (json.dumps(value, indent=1, sort_keys=True) + "\n").encode()


def parse_json(store: Store, key: str, data: bytes) -> dict:
    try:
        return json.loads(data)
    except ValueError as error:
        raise StoreError(f"{store.describe(key)} is not valid JSON: {error}") from None


# ------------------------------------------------------------------------------------------------


_READS = 50  # a local read that keeps losing its object to rewrites gives up after this many tries


class LocalStore(Store):
    """A folder with the object store's layout: key "a/b.npy" is ROOT/a/b.npy, a relative symlink
    to the hidden file that holds its bytes and names its checksum (see the module's doc). Names
    starting with a dot are the store's own (object files, guards) and are not keys."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.uri = str(self.root)
        self._identity = str(self.root.resolve())

    @property
    def identity(self) -> str:
        return self._identity

    def _path(self, key: str) -> Path:
        parts = key.split("/")
        if key.startswith("/") or ".." in parts or parts[-1].startswith("."):
            raise StoreError(f"invalid key {key!r}")
        return self.root / key

    def check(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise StoreUnreachable(f"{self.root} exists and is not a folder; give a folder or an s3:// URI")

    # ---- layout

    @staticmethod
    def _digest_of(path: Path, target: str) -> str | None:
        """The checksum in the name of an object file of ``path`` (None: not one of ours)."""
        head, _, rest = target.rpartition(".")  # ".NAME.DIGEST", "NONCE"
        stem, _, digest = head.rpartition(".")
        if stem == f".{path.name}" and len(digest) == 64 and "/" not in target and rest:
            return digest
        return None

    def _publish(self, path: Path, data: bytes, digest: str, *, sync: bool = False) -> str:
        """Write a new object file and point the key's link at it; returns its name (the version)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        target = f".{path.name}.{digest}.{uuid.uuid4().hex[:12]}"
        with open(path.parent / target, "xb") as handle:
            handle.write(data)
            if sync:
                handle.flush()
                os.fsync(handle.fileno())
        previous = _link_target(path)
        link = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.link")
        os.symlink(target, link)
        os.replace(link, path)  # the one step that changes what readers see
        if previous is not None and self._digest_of(path, previous) is not None:
            (path.parent / previous).unlink(missing_ok=True)
        path.with_name(path.name + CHECKSUM_SUFFIX).unlink(missing_ok=True)  # the older layout's
        return target

    @contextmanager
    def _guard(self, path: Path):
        """An exclusive flock on the key's hidden guard file: conditional writes of one key, by
        any process or thread, run one at a time. The guard file is never removed (removing a
        locked file would let a second writer lock a new one)."""
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(path.with_name(f".{path.name}.guard"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            yield
        finally:
            os.close(descriptor)  # closing releases the flock

    def _version(self, path: Path) -> str | None:
        """What names the key's current object (its file's name; the older layout: its checksum
        file's content); None if there is none."""
        target = _link_target(path)
        if target is not None:
            return target
        if not path.is_file():
            return None
        try:
            return "sha256:" + path.with_name(path.name + CHECKSUM_SUFFIX).read_text().strip()
        except FileNotFoundError:
            return "unchecked"

    # ---- operations

    def _put(self, key: str, data: bytes, digest: str, *, create_only: bool) -> None:
        path = self._path(key)
        if create_only:
            self._swap(key, data, digest, None)
        else:
            self._publish(path, data, digest)

    def _swap(self, key: str, data: bytes, digest: str, expected: str | None) -> str:
        path = self._path(key)
        with self._guard(path):
            current = self._version(path)
            if expected is None and current is not None:
                raise AlreadyExists(f"{self.describe(key)} already exists")
            if expected is not None and current != expected:
                raise Conflict(f"{self.describe(key)} " + ("no longer exists" if current is None else
                                                             "changed since it was read"))
            return self._publish(path, data, digest, sync=True)

    def _delete_if(self, key: str, expected: str) -> None:
        path = self._path(key)
        with self._guard(path):
            current = self._version(path)
            if current is None:
                return
            if current != expected:
                raise Conflict(f"{self.describe(key)} changed since it was read")
            self._delete(key)

    def _get_versioned(self, key: str) -> tuple[bytes, str | None, str]:
        path = self._path(key)
        for attempt in range(_READS):
            try:
                target = os.readlink(path)
            except FileNotFoundError:
                raise ObjectMissing(f"{self.describe(key)} does not exist") from None
            except OSError as error:
                if error.errno != errno.EINVAL:
                    raise StoreError(f"{self.describe(key)} cannot be read: {error.strerror}") from None
                data, recorded = self._read_older_layout(key, path)
                if recorded is not None and sha256(data) != recorded and attempt < 3:
                    time.sleep(0.02 * (attempt + 1))  # that layout's two files are replaced one by one
                    continue
                return data, recorded, "sha256:" + (recorded or "")
            try:
                data = (path.parent / target).read_bytes()
            except FileNotFoundError:
                continue  # rewritten between the link and the file: read the new one
            except OSError as error:
                raise StoreError(f"{self.describe(key)} cannot be read: {error.strerror}") from None
            return data, self._digest_of(path, target), target
        raise StoreError(f"{self.describe(key)} was replaced {_READS} times while being read; is something "
                         "rewriting it in a loop?")

    def _read_older_layout(self, key: str, path: Path) -> tuple[bytes, str | None]:
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
            if (path.name.startswith(".") or path.name.endswith((CHECKSUM_SUFFIX, ".part"))
                    or any(part.startswith(".") for part in path.relative_to(self.root).parts)):
                continue
            if path.is_file():
                keys.append(path.relative_to(self.root).as_posix())
        return sorted(keys)

    def _delete(self, key: str) -> None:
        path = self._path(key)
        target = _link_target(path)
        path.unlink(missing_ok=True)
        path.with_name(path.name + CHECKSUM_SUFFIX).unlink(missing_ok=True)
        if target is not None and self._digest_of(path, target) is not None:
            (path.parent / target).unlink(missing_ok=True)


def _link_target(path: Path) -> str | None:
    """Where the key's link points, or None (no link: absent, or a file of the older layout)."""
    try:
        return os.readlink(path)
    except (FileNotFoundError, OSError):
        return None


# ------------------------------------------------------------------------------------------------


_S3_SETTINGS = None


def configure_s3(settings) -> None:
    """Make ``settings`` (``gallery.s3``: retry_mode, max_attempts, connect_timeout, read_timeout)
    what every S3 client of this process uses unless given its own; None: the defaults again.
    An entry point calls it once with its params."""
    global _S3_SETTINGS
    _S3_SETTINGS = settings


def s3_settings():
    """The S3 client settings in force: those of ``configure_s3``, else ``gallery.s3``'s defaults."""
    if _S3_SETTINGS is not None:
        return _S3_SETTINGS
    from components.platform.config import S3Config

    return S3Config()


def s3_endpoint() -> str | None:
    """The S3 endpoint from the environment (AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL); None: AWS."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def s3_client(endpoint_url: str | None, *, settings=None, attempts: int | None = None,
              connect_timeout: float | None = None, read_timeout: float | None = None, pool: int = 32):
    """A boto3 S3 client with the product's retries and timeouts (``settings``, default
    ``s3_settings()``; ``attempts`` and the timeouts override them), credentials and region from
    boto3's standard configuration."""
    import boto3
    from botocore.config import Config

    settings = settings or s3_settings()
    config = Config(retries={"total_max_attempts": attempts or settings.max_attempts, "mode": settings.retry_mode},
                    connect_timeout=connect_timeout or settings.connect_timeout,
                    read_timeout=read_timeout or settings.read_timeout, max_pool_connections=pool)
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)


_THROTTLED = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "BandwidthLimitExceeded",
              "TooManyRequestsException", "RequestThrottled", "RequestTimeout", "InternalError",
              "ServiceUnavailable"}


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


class S3Store(Store):
    """``s3://bucket/prefix`` through boto3 (AWS, MinIO, any S3-compatible endpoint)."""

    def __init__(self, bucket: str, prefix: str, *, endpoint_url: str | None = None, settings=None):
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        endpoint_url = endpoint_url or s3_endpoint()
        self.endpoint = endpoint_url or "AWS"
        self.settings = settings or s3_settings()
        self.attempts = self.settings.max_attempts
        self.client = s3_client(endpoint_url, settings=self.settings)
        # reachability is asked once, up front, with few attempts and short timeouts: a wrong
        # endpoint fails in seconds, a lone throttled answer does not
        self._probe_attempts = min(3, self.attempts)
        self._probe = s3_client(endpoint_url, settings=self.settings, attempts=self._probe_attempts,
                                connect_timeout=min(3, self.settings.connect_timeout),
                                read_timeout=min(10, self.settings.read_timeout))

    @property
    def identity(self) -> str:
        return f"{self.uri}@{self.endpoint}"

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _gave_up(self, what: str, key: str | None, detail: str, attempts: int) -> str:
        return (f"{self.uri}: {what} {self.describe(key) if key else 'the bucket'} failed {attempts} time"
                f"{'s' if attempts > 1 else ''} at the S3 endpoint {self.endpoint} ({_one_line(detail)}): the store "
                "is unreachable or overloaded. Check that the endpoint is up and reachable, then run the same command "
                "again: finished work is kept (gallery.s3.max_attempts sets how often a request is tried)")

    def _call(self, what: str, key: str | None, function, *, conflict: type[Conflict] = AlreadyExists,
              attempts: int | None = None, **kwargs):
        from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError, NoCredentialsError

        attempts = attempts or self.attempts
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
            if code in ("PreconditionFailed", "412", "ConditionalRequestConflict") or status in (409, 412):
                raise conflict(f"{self.describe(key)} " + ("already exists" if conflict is AlreadyExists else
                                                           "changed since it was read")) from None
            if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                raise StoreUnreachable(f"{what} {self.uri}: access denied ({code}); check the AWS credentials "
                                       "in the environment or config") from None
            if code in _THROTTLED or (status or 0) >= 500:
                raise StoreUnreachable(self._gave_up(what, key, f"{code or 'HTTP error'}, HTTP {status}",
                                                     attempts)) from None
            raise StoreError(f"{what} {self.describe(key) if key else self.uri}: {code or error}") from None
        except NoCredentialsError:
            raise StoreUnreachable(f"{self.uri}: no AWS credentials; set AWS_ACCESS_KEY_ID and "
                                   "AWS_SECRET_ACCESS_KEY or an AWS profile") from None
        except EndpointConnectionError:
            raise StoreUnreachable(f"{self.uri}: cannot connect to the S3 endpoint {self.endpoint} ({what} "
                                   f"{self.describe(key) if key else 'the bucket'}, {attempts} attempt"
                                   f"{'s' if attempts > 1 else ''}); is it running, and is AWS_ENDPOINT_URL right? "
                                   "Then run the same command again: finished work is kept") from None
        except BotoCoreError as error:
            raise StoreUnreachable(self._gave_up(what, key, f"{type(error).__name__}: {error}", attempts)) from None

    def check(self) -> None:
        self._call("reaching", None, self._probe.head_bucket, attempts=self._probe_attempts, Bucket=self.bucket)

    def _put(self, key: str, data: bytes, digest: str, *, create_only: bool) -> None:
        extra = {"IfNoneMatch": "*"} if create_only else {}
        self._call("writing", key, self.client.put_object, Bucket=self.bucket, Key=self._key(key), Body=data,
                   Metadata={"sha256": digest}, **extra)

    def _swap(self, key: str, data: bytes, digest: str, expected: str | None) -> str:
        condition = {"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected}
        try:
            response = self._call("writing", key, self.client.put_object,
                                  conflict=AlreadyExists if expected is None else Conflict, Bucket=self.bucket,
                                  Key=self._key(key), Body=data, Metadata={"sha256": digest}, **condition)
        except ObjectMissing:  # If-Match on an object that is gone
            raise Conflict(f"{self.describe(key)} no longer exists") from None
        return response["ETag"]

    def _delete_if(self, key: str, expected: str) -> None:
        try:
            self._call("deleting", key, self.client.delete_object, conflict=Conflict, Bucket=self.bucket,
                       Key=self._key(key), IfMatch=expected)
        except ObjectMissing:
            pass

    def _get_versioned(self, key: str) -> tuple[bytes, str | None, str]:
        """The body is read outside boto3's retries: a connection dropped while it streams is
        retried here, with the same backoff and number of attempts."""
        import urllib3
        from botocore.exceptions import BotoCoreError

        for attempt in range(1, self.attempts + 1):
            response = self._call("reading", key, self.client.get_object, Bucket=self.bucket, Key=self._key(key))
            try:
                data = response["Body"].read()
            except (BotoCoreError, urllib3.exceptions.HTTPError, OSError) as error:
                if attempt == self.attempts:
                    raise StoreUnreachable(self._gave_up("reading", key, f"{type(error).__name__}: {error}",
                                                         self.attempts)) from None
                time.sleep(random.random() * min(2 ** (attempt - 1), 20))
                continue
            return data, response.get("Metadata", {}).get("sha256"), response["ETag"]
        raise AssertionError("unreachable")

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

    def _delete(self, key: str) -> None:
        self._call("deleting", key, self.client.delete_object, Bucket=self.bucket, Key=self._key(key))


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
