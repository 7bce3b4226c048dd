"""Judgments read from an S3 endpoint over HTTP (moto's server), through the store's client."""

import io

import boto3
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fastfill.components.gallery.inputs.judgments import load_judgments
from fastfill.components.gallery.layouts.catalog import GalleryError
from tests.environment import new_bucket


def test_judgments_are_read_from_s3(s3_endpoint):
    bucket = new_bucket(s3_endpoint)
    buffer = io.BytesIO()
    pq.write_table(pa.table({"query": ["7", "7", "s3://images/q.png"], "relevant": [5, 9, 7]}), buffer)
    # no endpoint passed: the loader finds it in AWS_ENDPOINT_URL_S3, as the store does
    boto3.client("s3", endpoint_url=s3_endpoint).put_object(Bucket=bucket, Key="golden/judged.parquet",
                                                            Body=buffer.getvalue())
    judged = load_judgments(f"s3://{bucket}/golden/judged.parquet", np.array([9, 7, 5]))
    np.testing.assert_array_equal(judged.query_positions, [1, -1])
    assert judged.query_uris == [None, "s3://images/q.png"]
    assert [r.tolist() for r in judged.relevant] == [[0, 2], [1]]
    with pytest.raises(GalleryError, match=rf"judgments file s3://{bucket}/golden/missing.csv does not exist"):
        load_judgments(f"s3://{bucket}/golden/missing.csv", np.array([9, 7, 5]))
