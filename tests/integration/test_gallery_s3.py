"""The gallery components on a real S3 HTTP endpoint (moto's server): every store case of
tests/gallery_cases.py, and the errors of stores that cannot be reached."""

import socket

import pytest

from components.gallery.store import StoreError, StoreUnreachable, open_store
from tests.environment import new_bucket
from tests.gallery_cases import STORE_CASES, make_data, make_models


@pytest.mark.parametrize("case", STORE_CASES, ids=lambda case: case.__name__)
def test_on_s3(case, s3_endpoint):
    case(f"s3://{new_bucket(s3_endpoint)}/galleries/main", make_models(), make_data())


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
