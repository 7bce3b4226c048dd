"""The pgvector index's build memory (gallery.pgvector.index_memory) on the tests' PostgreSQL:
an IVFFlat build that needs more than PostgreSQL's 64 MB default is given what the setting says
for its own statement, and one that needs more than the setting is refused in one line that
names the setting."""

import numpy as np
import pytest

from fastfill.components.gallery.layouts.catalog import GalleryError
from fastfill.components.gallery.layouts.pg_index import Index, Place, index_settings
from fastfill.components.platform.registry import ModelRef
from tests.pg import pg_gallery_config

ROWS, DIM = 3000, 256


def _index(tmp_path, **pgvector) -> tuple[Index, Place]:
    config = pg_gallery_config(str(tmp_path), ann="ivfflat", **pgvector)
    index = Index(index_settings(config.pgvector, "l2"))
    model = ModelRef("embedder", "9", DIM)
    place = index.place(model)
    index.drop(place)
    vectors = np.random.default_rng(0).normal(size=(ROWS, DIM)).astype(np.float32)
    index.new_vectors(place, DIM, iter([(np.arange(ROWS), vectors, ["embedded"] * ROWS)]))
    return index, place


def test_the_index_build_gets_the_memory_it_is_given_and_names_the_setting_when_short(tmp_path):
    index, place = _index(tmp_path / "short", ivfflat_lists=2000, index_memory="1MB")
    with pytest.raises(GalleryError, match=r"memory required is \d+ MB, maintenance_work_mem is 1 MB; raise "
                                          r"gallery.pgvector.index_memory \(now 1MB\)"):
        index.ann_index(place)
    assert not index.ann_indexed(place)
    assert index.execute("SHOW maintenance_work_mem").fetchone()[0] == "64MB"  # the session's own, untouched
    index.close()

    index, place = _index(tmp_path / "enough", ivfflat_lists=2000)  # the default: 1GB for the build
    index.ann_index(place)
    assert index.ann_indexed(place)
    index.close()
