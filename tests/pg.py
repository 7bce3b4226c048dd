"""A real PostgreSQL 16 with pgvector (and Milvus Lite files, Qdrant local-mode folders) for the tests
(``pgserver``: started from Python, in a folder of its own, once per test process; it stops when the process ends), and the
gallery settings that put a test's gallery in a table of its own there."""

import functools
import hashlib


@functools.cache
def pg_uri() -> str:
    """The server's ``postgresql://`` URI (a Unix socket in its folder); it stops with this
    process, killed or not (testkit/local_postgres.py)."""
    from testkit.local_postgres import start_postgres

    return start_postgres()


def table_for(store_uri: str) -> str:
    """A table name of the test's own, from its store's URI."""
    return "g_" + hashlib.sha1(str(store_uri).encode()).hexdigest()[:12]


def pg_gallery_config(store_uri: str, **pgvector):
    """gallery settings (``GalleryConfig``) of a pgvector gallery in the test's own table."""
    from fastfill.components.platform.config import GalleryConfig

    return GalleryConfig(layout="pgvector", pgvector={"uri": pg_uri(), "table": table_for(store_uri), **pgvector})


# where an S3-store test's local index goes: the tests' own temporary folder, which pytest removes
# on later runs (tests/conftest.py sets it), so a killed run leaves nothing in /tmp
LOCAL_BASE: str | None = None


def local_folder(store_uri: str, prefix: str) -> str:
    """Where a test keeps a local index beside its store: the store's own folder, or, for an S3
    store, a temporary folder under ``LOCAL_BASE`` removed at exit."""
    import atexit
    import os
    import shutil
    import tempfile

    if str(store_uri).startswith("s3://"):
        folder = tempfile.mkdtemp(prefix=prefix, dir=LOCAL_BASE)
        atexit.register(shutil.rmtree, folder, True)
        return folder
    return os.path.dirname(str(store_uri).rstrip("/"))


def milvus_gallery_config(store_uri: str):
    """gallery settings of a Milvus gallery: a Milvus Lite file of the test's own (``local_folder``),
    its alias named after the store."""
    import importlib.util
    import os

    import pytest

    from fastfill.components.platform.config import GalleryConfig

    if importlib.util.find_spec("milvus_lite") is None:  # the gpu install: Milvus Lite requires faiss-cpu
        pytest.skip("Milvus Lite is not installed (it comes with the cpu extra); a Milvus server is not started here")
    name = table_for(store_uri)
    folder = local_folder(store_uri, "fastfill-milvus-")
    return GalleryConfig(layout="milvus", milvus={"uri": os.path.join(folder, f"milvus-{name}.db"), "alias": name})


def qdrant_gallery_config(store_uri: str):
    """gallery settings of a Qdrant gallery: a local-mode folder of the test's own (``local_folder``),
    its alias named after the store."""
    import os

    from fastfill.components.platform.config import GalleryConfig

    name = table_for(store_uri)
    folder = local_folder(store_uri, "fastfill-qdrant-")
    return GalleryConfig(layout="qdrant", qdrant={"url": os.path.join(folder, f"qdrant-{name}"), "alias": name})
