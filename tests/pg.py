"""A real PostgreSQL 16 with pgvector for the tests (``pgserver``: started from Python, in a
folder of its own, once per test process; it stops when the process ends), and the gallery
settings that put a test's gallery in a table of its own there."""

import atexit
import functools
import hashlib
import shutil
import tempfile
import warnings


@functools.cache
def pg_uri() -> str:
    """The server's ``postgresql://`` URI (a Unix socket in its folder)."""
    import pgserver

    folder = tempfile.mkdtemp(prefix="fastfill-pg-")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs: XDG_RUNTIME_DIR is not set
        server = pgserver.get_server(folder, cleanup_mode="stop")
    uri = server.get_uri()

    def stop() -> None:
        try:
            server.cleanup()
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    atexit.register(stop)
    return uri


def table_for(store_uri: str) -> str:
    """A table name of the test's own, from its store's URI."""
    return "g_" + hashlib.sha1(str(store_uri).encode()).hexdigest()[:12]


def pg_gallery_config(store_uri: str, **pgvector):
    """gallery settings (``GalleryConfig``) of a pgvector gallery in the test's own table."""
    from fastfill.components.platform.config import GalleryConfig

    return GalleryConfig(layout="pgvector", pgvector={"uri": pg_uri(), "table": table_for(store_uri), **pgvector})
