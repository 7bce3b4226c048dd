"""What the Lance gallery's modules share (components/gallery/layouts/lance_table.py describes the layout):
the table's names and metadata keys, the digest of a row, Arrow columns of vectors, the upgrade
the table holds, and the error for a damaged table."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from components.gallery.layouts.catalog import GalleryError
from components.platform.registry import ModelRef

TABLE = "gallery"
BACKFILL = "gallery_backfill"
MODEL_KEY = "fastfill.model"
UPGRADE_KEY = "fastfill.upgrade"
FINISHED_KEY = "fastfill.finished"
FORMAT_KEY = "fastfill.format"
FORMAT = "1"
SERVING = "serving-"
VECTOR_COLUMNS = ("features", "mapped", "new")
UPGRADE_COLUMNS = ("mapped", "mapped_digest", "log_sigma2", "rank", "new", "new_digest", "new_chunk")
DIGEST_BYTES = 16


class TableCorrupt(GalleryError):
    """A data file of the table is unreadable, or a vector's digest does not match."""


def table_uri(uri: str | Path) -> str:
    """Where the table of the store ``uri`` lives: ``<uri>/gallery.lance``."""
    text = str(uri).removeprefix("file://")
    if text.startswith("s3://"):
        return text.rstrip("/") + f"/{TABLE}.lance"
    return str(Path(text).resolve() / f"{TABLE}.lance")


def storage_options(uri: str | Path) -> dict | None:
    """Lance's object-store settings for an ``s3://`` URI: the endpoint of ``AWS_ENDPOINT_URL_S3``
    / ``AWS_ENDPOINT_URL`` (as the product's other S3 clients), credentials and region from
    boto3's standard configuration; None for a local folder."""
    if not str(uri).startswith("s3://"):
        return None
    import boto3

    from components.gallery.store import s3_endpoint

    session = boto3.session.Session()
    options = {"aws_region": session.region_name or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"}
    credentials = session.get_credentials()
    if credentials is not None:
        frozen = credentials.get_frozen_credentials()
        options.update(aws_access_key_id=frozen.access_key, aws_secret_access_key=frozen.secret_key)
        if frozen.token:
            options["aws_session_token"] = frozen.token
    endpoint = s3_endpoint()
    if endpoint:
        options["aws_endpoint"] = endpoint
        if endpoint.startswith("http://"):
            options["allow_http"] = "true"
    return options


def digests(positions: np.ndarray, vectors: np.ndarray) -> list[bytes]:
    """BLAKE2b-128 of each row's position (int64, little-endian) and float32 bytes."""
    positions = np.ascontiguousarray(positions, dtype="<i8")
    vectors = np.ascontiguousarray(vectors, dtype="<f4")
    return [hashlib.blake2b(p.tobytes() + v.tobytes(), digest_size=DIGEST_BYTES).digest()
            for p, v in zip(positions, vectors, strict=True)]


def _model_meta(model: ModelRef) -> dict[str, str]:
    return {MODEL_KEY: json.dumps(model.to_dict(), sort_keys=True)}


def _metadata(source) -> dict[str, str]:
    """A schema's or field's metadata with text keys and values (Arrow gives bytes)."""
    return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in (source.metadata or {}).items()}


def _vector_fields(name: str, dim: int, model: ModelRef | None):
    import pyarrow as pa

    metadata = _model_meta(model) if model is not None else None
    return [pa.field(name, pa.list_(pa.float32(), dim), metadata=metadata),
            pa.field(f"{name}_digest", pa.binary(DIGEST_BYTES))]


def _vector_arrays(positions: np.ndarray, vectors: np.ndarray) -> list:
    import pyarrow as pa

    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    dim = vectors.shape[1]
    values = pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1), pa.float32()), dim)
    return [values, pa.array(digests(positions, vectors), pa.binary(DIGEST_BYTES))]


def _as_numpy(column, dim: int) -> np.ndarray:
    """A fixed-size-list column (chunked) as an (n, dim) float32 array; nulls as NaN rows."""
    import pyarrow as pa

    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if len(column) == 0:
        return np.empty((0, dim), dtype=np.float32)
    if column.null_count:
        out = np.full((len(column), dim), np.nan, dtype=np.float32)
        valid = column.is_valid().to_numpy(zero_copy_only=False)
        out[valid] = column.drop_null().flatten().to_numpy(zero_copy_only=False).reshape(-1, dim)
        return out
    return np.array(column.flatten().to_numpy(zero_copy_only=False).reshape(-1, dim), dtype=np.float32)  # writable


@dataclass(frozen=True)
class Upgrade:
    """The upgrade whose columns the table holds."""

    id: str
    new: ModelRef
    token: str = ""


def _backfill_fields(dim: int, model: ModelRef) -> list:
    import pyarrow as pa

    return [pa.field("position", pa.int64()), pa.field("chunk", pa.int32()), pa.field("token", pa.string()),
            pa.field("commit", pa.string()), *_vector_fields("new", dim, model)]


def _field_model(field) -> ModelRef:
    raw = _metadata(field).get(MODEL_KEY)
    if not raw:
        raise GalleryError(f"column {field.name!r} does not say which model it holds (no {MODEL_KEY} metadata)")
    return ModelRef.from_dict(json.loads(raw))


def _vector_and_digest_names() -> set[str]:
    names = {"pixels"}
    for column in VECTOR_COLUMNS:
        names |= {column, f"{column}_digest"}
    return names


def _where(dataset) -> str:
    """A dataset's location as the messages name it (Lance drops a local path's leading slash)."""
    uri = str(dataset.uri)
    return uri if "://" in uri or uri.startswith("/") else "/" + uri


def _one_line(error: object) -> str:
    text = " ".join(str(error).split())
    return text if len(text) < 400 else text[:400] + "..."
