"""Fixtures shared by all tiers: a real S3 HTTP endpoint (moto's server on a free local port)."""

import os
import uuid

import pytest

from tests.environment import restored_environ

AWS_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL_S3",
            "AWS_ENDPOINT_URL", "AWS_PROFILE")


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on 127.0.0.1 (a free port), with fake credentials in the environment,
    so boto3 in this process and in CLI subprocesses speaks HTTP to it."""
    from moto.server import ThreadedMotoServer

    with restored_environ(*AWS_KEYS):
        for key in AWS_KEYS:
            os.environ.pop(key, None)
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        os.environ["AWS_ENDPOINT_URL_S3"] = url
        try:
            yield url
        finally:
            server.stop()


def new_bucket(endpoint: str) -> str:
    import boto3

    name = f"gallery-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture(params=["local", "s3"])
def store_uri(request, tmp_path) -> str:
    """A fresh, empty store of each backend."""
    if request.param == "local":
        return str(tmp_path / "store")
    endpoint = request.getfixturevalue("s3_endpoint")
    return f"s3://{new_bucket(endpoint)}/galleries/main"
