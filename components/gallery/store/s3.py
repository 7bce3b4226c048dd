"""``s3://bucket/prefix`` as a store, through boto3 (AWS, MinIO, any S3-compatible endpoint),
and the S3 client settings of this process (``configure_s3``).

Checksums: every object is written with S3's own SHA-256 (``ChecksumAlgorithm``, with the value
computed here, so S3 refuses a body that arrives altered) and, as before, the hex SHA-256 in the
user metadata ``sha256``. A read asks for S3's checksum (``ChecksumMode``), which boto3 checks
against the body it receives. The bytes read are then compared with the metadata's SHA-256 when
the object has it (every object this store wrote, before this release too: an object replaced by
another writer with its own checksum but the old metadata is caught here), else with S3's value:
the base64 of the 32-byte digest of the whole object, decoded to hex. A composite value
(``...-N``, an object uploaded in N parts by another tool) is no digest of the whole object and
is not used; an object with neither is refused as not written by this store."""

from __future__ import annotations

import os
import random
import time
from typing import Any

from fastfill.components.gallery.store.base import (
    AlreadyExists,
    Conflict,
    ObjectMissing,
    Store,
    StoreError,
    StoreUnreachable,
)
from fastfill.components.platform.config import S3Config

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
                what_object = self.describe(key) if key is not None else self.uri
                raise conflict(f"{what_object} " + ("already exists" if conflict is AlreadyExists else
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
        extra: dict[str, Any] = {"IfNoneMatch": "*"} if create_only else {}
        self._call("writing", key, self.client.put_object, Bucket=self.bucket, Key=self._key(key), Body=data,
                   **_checksums(digest), **extra)

    def _swap(self, key: str, data: bytes, digest: str, expected: str | None) -> str:
        condition: dict[str, Any] = {"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected}
        try:
            response = self._call("writing", key, self.client.put_object,
                                  conflict=AlreadyExists if expected is None else Conflict, Bucket=self.bucket,
                                  Key=self._key(key), Body=data, **_checksums(digest), **condition)
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
            response = self._call("reading", key, self.client.get_object, Bucket=self.bucket, Key=self._key(key),
                                  ChecksumMode="ENABLED")
            try:
                data = response["Body"].read()
            except (BotoCoreError, urllib3.exceptions.HTTPError, OSError) as error:
                if attempt == self.attempts:
                    raise StoreUnreachable(self._gave_up("reading", key, f"{type(error).__name__}: {error}",
                                                         self.attempts)) from None
                time.sleep(random.random() * min(2 ** (attempt - 1), 20))
                continue
            return data, recorded_sha256(response), response["ETag"]
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


def _checksums(digest: str) -> dict:
    """The put_object arguments that record ``digest`` (hex SHA-256): S3's own checksum (S3
    checks the body against it on arrival) and the user metadata of earlier releases."""
    import base64

    return {"ChecksumAlgorithm": "SHA256", "ChecksumSHA256": base64.b64encode(bytes.fromhex(digest)).decode(),
            "Metadata": {"sha256": digest}}


def recorded_sha256(response: dict) -> str | None:
    """The hex SHA-256 an object was written with: the user metadata ``sha256`` (what this store
    writes), else S3's whole-object checksum (base64 of the digest); None without either."""
    import base64
    import binascii

    metadata = response.get("Metadata", {}).get("sha256")
    if metadata:
        return metadata
    native = response.get("ChecksumSHA256")
    if native and "-" not in native and response.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT":
        try:
            raw = base64.b64decode(native, validate=True)
        except (binascii.Error, ValueError):
            raw = b""
        if len(raw) == 32:
            return raw.hex()
    return None
