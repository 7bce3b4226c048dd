"""The gallery components on a real S3 HTTP endpoint (moto's server): every store case of
tests/gallery_cases.py, and the errors of stores that cannot be reached."""

import socket

import pytest

from fastfill.components.gallery.store import StoreError, StoreUnreachable, open_store
from tests.environment import new_bucket
from tests.gallery_cases import CASES, GALLERY_CASES, INDEX_CASES, case_id, make_data, make_models


def _on_s3(pair):
    """Every case runs on the local store in the unit tier, on each layout. On S3 the default run
    takes the layouts whose files S3 holds (parts, and Lance's table); the cases every layout
    shares, on pgvector and Milvus (whose index lives in their own server, beside the same S3
    files), are ``slow``."""
    case, layout = pair
    if layout in ("pgvector", "milvus") and (case in GALLERY_CASES or case in INDEX_CASES):
        return pytest.param(pair, marks=pytest.mark.slow, id=case_id(pair))
    return pytest.param(pair, id=case_id(pair))


@pytest.mark.parametrize("pair", [_on_s3(pair) for pair in CASES])
def test_on_s3(pair, s3_endpoint):
    case, layout = pair
    case(f"s3://{new_bucket(s3_endpoint)}/galleries/main", make_models(), make_data(), layout)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_stores_say_so(s3_endpoint, monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{_closed_port()}")
    with pytest.raises(StoreUnreachable, match="cannot connect to the S3 endpoint"):
        open_store("s3://some-bucket/x").check()
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)
    with pytest.raises(StoreUnreachable, match="bucket 'no-such-bucket' does not exist"):
        open_store("s3://no-such-bucket/x").check()
    with pytest.raises(StoreError, match="unsupported store URI"):
        open_store("gs://bucket/x")
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreUnreachable, match="not a folder"):
        open_store(tmp_path / "file").check()


def test_objects_carry_s3_s_own_sha256_and_today_s_metadata_still_reads(s3_endpoint):
    """What the store writes has S3's native SHA-256 (checked by S3 on arrival) beside the
    metadata of earlier releases; an object with only the metadata (written before) still reads,
    and one whose bytes do not match what is recorded is refused, whichever records it."""
    import base64
    import hashlib

    import boto3

    from fastfill.components.gallery.store import ChecksumMismatch

    bucket = new_bucket(s3_endpoint)
    store = open_store(f"s3://{bucket}/g")
    data = b"features" * 1000
    digest = store.put("a.bin", data)
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    head = client.head_object(Bucket=bucket, Key="g/a.bin", ChecksumMode="ENABLED")
    assert head["ChecksumSHA256"] == base64.b64encode(hashlib.sha256(data).digest()).decode()
    assert head["Metadata"]["sha256"] == digest
    assert store.get("a.bin") == data

    # an earlier release's object: the metadata only (no native SHA-256), still read and checked
    client.put_object(Bucket=bucket, Key="g/old.bin", Body=data, Metadata={"sha256": digest})
    assert store.get("old.bin") == data
    client.put_object(Bucket=bucket, Key="g/old.bin", Body=data[:-1], Metadata={"sha256": digest})
    with pytest.raises(ChecksumMismatch, match="is corrupt"):
        store.get("old.bin")
    # replaced by another writer with S3's checksum of other bytes and the old metadata
    client.put_object(Bucket=bucket, Key="g/a.bin", Body=b"other", Metadata={"sha256": digest},
                      ChecksumAlgorithm="SHA256")
    with pytest.raises(ChecksumMismatch, match="is corrupt"):
        store.get("a.bin")
    # an object another tool wrote with S3's SHA-256 only: checked against it
    client.put_object(Bucket=bucket, Key="g/native.bin", Body=data, ChecksumAlgorithm="SHA256")
    assert store.get("native.bin") == data
