"""A file a command takes (a manifest, feature shards, model weights) from a local path or an
``s3://bucket/key`` URI alike: an S3 object is copied into a scratch folder first, with the
same name, so the readers that want a path (pyarrow, numpy's memory map, torch) read it as a
local file. Problems are one-line GalleryErrors naming the option (table_files.s3_bytes: a
missing object or bucket, credentials, the endpoint)."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from fastfill.components.gallery.inputs.table_files import s3_bytes


def is_s3(uri: str | Path) -> bool:
    return str(uri).startswith("s3://")


def input_path(uri: str | Path, option: str, scratch: Path) -> Path:
    """The local path of ``uri`` (``file://`` accepted), or for ``s3://`` a copy of the object
    in ``scratch`` under its own name; ``option`` names the input in messages (--manifest)."""
    text = str(uri)
    if not is_s3(text):
        return Path(text.removeprefix("file://"))
    name = PurePosixPath(text[len("s3://"):].partition("/")[2]).name or "object"
    data = s3_bytes(text, option, option)
    scratch.mkdir(parents=True, exist_ok=True)
    target = scratch / name
    suffix = 1
    while target.exists():  # two shards of one name from different prefixes
        target = scratch / f"{suffix}-{name}"
        suffix += 1
    target.write_bytes(data)
    return target


def s3_folder(uri: str) -> str:
    """The ``s3://bucket/prefix`` an object lives under (relative URIs in a manifest on S3 are
    read beside it)."""
    return uri.rsplit("/", 1)[0]
