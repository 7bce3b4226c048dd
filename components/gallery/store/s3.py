"""``s3://bucket/prefix`` as a store, through boto3 (AWS, MinIO, any S3-compatible endpoint),
and the S3 client settings of this process (``configure_s3``)."""

from __future__ import annotations

import os
import random
import time

from components.gallery.store.base import (
    AlreadyExists, Conflict, ObjectMissing, Store, StoreError, StoreUnreachable,
)


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
