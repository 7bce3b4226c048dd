"""The Lance serving table's ANN index (tests/gallery_cases.py covers the table through whole
upgrades on galleries too small to index): built at the switch, a chunk's rows searched exactly
beside it, rebuilt over one compacted fragment at the finish."""

import os

import numpy as np
import pytest

from fastfill.components.gallery.layouts.lance_serving import EMBEDDED, MAPPED, ServingTable
from fastfill.components.gallery.store import DamagedObject
from fastfill.components.platform.registry import ModelRef

N, DIM = 3000, 16
MODEL = ModelRef("m", "2", DIM)


def _exact(vectors, queries, k):
    distances = ((queries[:, None, :] - vectors[None]) ** 2).sum(-1)
    return np.argsort(distances, axis=1, kind="stable")[:, :k]


def test_the_index_is_built_at_the_switch_and_a_chunk_is_searched_beside_it(tmp_path):
    rng = np.random.default_rng(3)
    centres = rng.normal(size=(30, DIM)).astype(np.float32)
    vectors = (centres[rng.integers(0, 30, N)] + 0.3 * rng.normal(size=(N, DIM))).astype(np.float32)
    table = ServingTable(str(tmp_path), {"ann": "ivf_flat", "ann_min_rows": 1000, "nprobes": 20})
    ids = np.arange(N) + 7
    parts = ((np.arange(s, s + 1000), vectors[s:s + 1000], [MAPPED] * 1000, np.full(1000, -1)) for s in range(0, N, 1000))
    table.write(MODEL, "up-1", ids, parts)
    assert [i["fields"] for i in table.dataset().list_indices()] == [["embedding"]]
    queries = vectors[:50] + 0.05
    got, _, models, sources = table.search(queries, 10, MODEL.uri)
    exact = ids[_exact(vectors, queries, 10)]
    recall = np.mean([len(set(g) & set(e)) / 10 for g, e in zip(got, exact)])
    assert recall >= 0.9 and all(m == {MODEL.uri} for m in models)

    chunk = np.arange(0, N, 3)  # a third of the rows, everywhere in the table
    moved = vectors.copy()
    moved[chunk] = rng.normal(size=(len(chunk), DIM)).astype(np.float32)
    table.serve_chunk("up-1", 0, chunk, ids[chunk], moved[chunk], [EMBEDDED] * len(chunk))
    assert table.dataset().count_rows() == N and table.embedded_count() == len(chunk)
    assert table.chunk_done("up-1") == {0} and table.chunk_done("up-2") == set()
    queries = moved[chunk[:40]]
    got, _, _, sources = table.search(queries, 1, MODEL.uri)
    assert [g[0] for g in got] == list(ids[chunk[:40]]) and all(s == [EMBEDDED] for s in sources)
    assert table.search(queries, 1, "models:/m/1")[0] == [[]] * 40  # another space: no rows

    table.retag(MODEL, None)  # the finish: compacted, indexed again, same answers
    assert table.serving()["upgrade"] is None and len(table.dataset().get_fragments()) == 1
    assert table.dataset().has_index
    again, _, _, _ = table.search(queries, 1, MODEL.uri)
    assert again == got


def test_a_damaged_serving_table_is_named_in_one_line(tmp_path):
    rng = np.random.default_rng(4)
    table = ServingTable(str(tmp_path), {"ann": "none"})
    vectors = rng.normal(size=(500, DIM)).astype(np.float32)
    table.write(MODEL, None, np.arange(500), [(np.arange(500), vectors, [EMBEDDED] * 500, np.full(500, -1))])
    data = tmp_path / "serving.lance" / "data"
    (victim,) = list(data.iterdir())
    with open(victim, "r+b") as handle:
        handle.truncate(os.path.getsize(victim) // 2)
    with pytest.raises(DamagedObject, match=r"serving.lance: the serving table cannot be read \(.*\); restore it") as raised:
        table.search(vectors[:2], 3, MODEL.uri)
    assert "\n" not in str(raised.value)
