"""Judged queries: loading and checking the file, the gate's numbers on the whole gallery, and
the label-free agreement."""

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from fastfill.components.evaluation import backfill_curve, retrieval_metrics
from fastfill.components.gallery.gate.judged_gate import agreement_at, measure_judged_gate
from fastfill.components.gallery.gate.promotion import measure_gate
from fastfill.components.gallery.inputs.judgments import Judgments, load_judgments
from fastfill.components.gallery.layouts.catalog import GalleryError

IDS = np.array([10, 20, 30, 40, 50])
ROWS = {"query": ["10", "10", "s3://b/q.png", "30", "10", "40", "50", "50"],
        "relevant": ["20", "30", "40", "10", "20", "40", "40", "50"]}


def _csv(path, columns: dict) -> str:
    pacsv.write_csv(pa.table({name: pa.array(values, pa.string()) for name, values in columns.items()}), path)
    return str(path)


def _check_resolved(judged: Judgments) -> None:
    # distinct queries in file order; 40's only pair is with itself, so 40 is left out
    np.testing.assert_array_equal(judged.query_positions, [0, -1, 2, 4])
    assert judged.query_uris == [None, "s3://b/q.png", None, None]
    assert [r.tolist() for r in judged.relevant] == [[1, 2], [3], [0], [3]]
    assert (judged.duplicates, judged.self_pairs, judged.dropped_queries) == (1, 2, 1)
    assert judged.pairs == 5 and len(judged) == 4
    np.testing.assert_array_equal(judged.image_queries, [1])
    line = judged.describe()
    assert "4 queries (3 gallery items, 1 images), 5 relevant pairs" in line and "1 repeated pairs" in line


def test_load_csv_resolves_ids_images_and_repeats(tmp_path):
    _check_resolved(load_judgments(_csv(tmp_path / "judged.csv", ROWS), IDS))


def test_load_parquet_with_integer_relevant_ids(tmp_path):
    path = tmp_path / "judged.parquet"
    pq.write_table(pa.table({"query": pa.array(ROWS["query"]),
                             "relevant": pa.array([int(v) for v in ROWS["relevant"]], pa.int64())}), path)
    _check_resolved(load_judgments(str(path), IDS.tolist()))


def test_text_ids_resolve_as_the_team_wrote_them(tmp_path):
    """A gallery of text ids (SKUs with their zeros): the same file with those ids resolves to the
    same positions; a query that is no item's id is an image URI; an unknown relevant id is named."""
    text = np.array(["SKU-010", "SKU-020", "0030", "SKU-040", "SKU-050"])
    as_text = {"10": "SKU-010", "20": "SKU-020", "30": "0030", "40": "SKU-040", "50": "SKU-050"}
    rows = {name: [as_text.get(v, v) for v in values] for name, values in ROWS.items()}
    _check_resolved(load_judgments(_csv(tmp_path / "judged.csv", rows), text))
    path = _csv(tmp_path / "unknown.csv", {"query": ["SKU-010"], "relevant": ["30"]})  # "30" is not "0030"
    with pytest.raises(GalleryError, match=r"1 relevant ids are not in the gallery \(30; 1 rows\)"):
        load_judgments(path, text)


def test_a_missing_column_is_named(tmp_path):
    path = _csv(tmp_path / "judged.csv", {"query": ["10"], "relevant_id": ["20"]})
    with pytest.raises(GalleryError, match=r"judged\.csv lacks the column relevant \(it has: query, relevant_id\)"):
        load_judgments(path, IDS)


def test_unknown_relevant_ids_are_counted_and_named(tmp_path):
    path = _csv(tmp_path / "judged.csv", {"query": ["10", "10", "20", "30"], "relevant": ["99", "20", "98", "99"]})
    with pytest.raises(GalleryError) as error:
        load_judgments(path, IDS)
    message = str(error.value)
    assert path in message and "2 relevant ids are not in the gallery (99, 98; 3 rows)" in message
    assert "remove those rows or ingest the items first" in message and "\n" not in message


@pytest.mark.parametrize("content, why", [(b"", "is empty"), (b"query,relevant\n", "has no rows")])
def test_an_empty_file_is_refused(tmp_path, content, why):
    path = tmp_path / "judged.csv"
    path.write_bytes(content)
    with pytest.raises(GalleryError, match=why):
        load_judgments(str(path), IDS)


def test_other_bad_files(tmp_path):
    with pytest.raises(GalleryError, match="does not exist"):
        load_judgments(str(tmp_path / "nowhere.csv"), IDS)
    path = _csv(tmp_path / "judged.csv", {"query": ["10"], "relevant": ["an-image.png"]})
    with pytest.raises(GalleryError, match="relevant values are not item ids"):
        load_judgments(path, IDS)
    path = _csv(tmp_path / "stray.csv", {"query": ["77"], "relevant": ["20"]})
    with pytest.raises(GalleryError, match=r"queries look like item ids but are not in the gallery \(77"):
        load_judgments(path, IDS)


# ------------------------------------------------------------------------------------------------


def _judged(positions, relevant) -> Judgments:
    return Judgments("test", np.asarray(positions, dtype=np.int64), [None if p >= 0 else f"q{i}.png"
                                                                     for i, p in enumerate(positions)],
                     [np.asarray(r, dtype=np.int64) for r in relevant])


def test_the_challenger_reaches_every_relevant_item_as_it_is_backfilled():
    """New features put each query exactly on its relevant item; transformed ones are far from
    everything and farthest at the relevant items: a query hits exactly once its relevant item
    is backfilled. The champion hits for queries 0 and 1 only."""
    rng = np.random.default_rng(0)
    n, d = 40, 8
    relevant = np.array([3, 11, 17, 25, 38])
    new = rng.normal(size=(n, d)).astype(np.float32)
    transformed = (rng.normal(size=(n, d)) + 100).astype(np.float32)
    transformed[relevant] = new[relevant] + 1000
    champion = rng.normal(size=(n, d)).astype(np.float32)
    champion_queries = champion[[3, 11, 0, 1, 2]]  # on the relevant item for queries 0 and 1, elsewhere after
    order = rng.permutation(n)
    judged = _judged([-1] * 5, [[r] for r in relevant])
    numbers = measure_judged_gate(champion_queries, champion, new[relevant], new, transformed, judged, order,
                                  curve_points=3)
    assert numbers["alpha"] == [0.0, 0.25, 0.5, 0.75, 1.0] and numbers["queries"] == 5
    assert numbers["champion_top1"] == 0.4

    def rank(query, item):  # 1 + the items nearer to the query than ``item``
        distances = ((champion.astype(np.float64) - query) ** 2).sum(1)
        return 1 + int((distances < distances[item]).sum())

    ranks = [rank(q, r) for q, r in zip(champion_queries, relevant)]
    assert ranks[:2] == [1, 1] and min(ranks[2:]) > 1
    assert numbers["champion_map"] == pytest.approx(np.mean([1 / r for r in ranks]))
    backfilled = [np.isin(relevant, order[: (i * n) // 4]) for i in range(5)]
    assert numbers["top1"] == [float(b.mean()) for b in backfilled]
    assert numbers["top1"][0] == 0.0 and numbers["top1"][-1] == 1.0
    # one relevant item: AP = 1 / its rank, by brute force in the mixed gallery of each point
    for b, count, measured in zip(backfilled, [(i * n) // 4 for i in range(5)], numbers["map"]):
        mixed = transformed.astype(np.float64)
        mixed[order[:count]] = new[order[:count]]
        distances = ((mixed[None] - new[relevant][:, None]) ** 2).sum(2)
        ranks = 1 + (distances < distances[np.arange(5), relevant][:, None]).sum(1)
        assert (ranks[b] == 1).all() and (ranks[~b] > 30).all()
        assert measured == pytest.approx(np.mean(1 / ranks))
    assert numbers["map"][-1] == 1.0
    assert numbers["nfr1"] == [float((~b[:2]).sum() / 2) for b in backfilled]
    assert numbers["nfr1_end"] == 0.0
    assert numbers["top1_auc"] == pytest.approx(np.mean(numbers["top1"]))
    expected = next(a for a, t in zip(numbers["alpha"], numbers["top1"]) if t > 0.4)
    assert numbers["fraction_to_gain"] == expected


def test_average_precision_with_two_relevant_items_at_known_ranks():
    """1-D features. Query 0 (at 0): the gallery at squared distances 1, 4, 9, 16, 25, 121, its
    relevant items at ranks 2 and 4, so AP = (1/2 + 2/4) / 2. Query 1 (at 8): its nearest
    relevant item (5.0) is exactly as far as an irrelevant one (11.0), which the tie rule ranks
    first; its other relevant item (4.0) comes third: AP = (1/2 + 2/3) / 2."""
    gallery = np.array([[1.0], [2.0], [3.0], [4.0], [5.0], [11.0]], np.float32)
    queries = np.array([[0.0], [8.0]], np.float32)
    judged = _judged([-1, -1], [[1, 3], [4, 3]])
    numbers = measure_judged_gate(queries, gallery, queries, gallery, gallery, judged, np.arange(6), curve_points=2)
    ap0, ap1 = 0.5 * (1 / 2 + 2 / 4), 0.5 * (1 / 2 + 2 / 3)
    assert numbers["map"] == pytest.approx([(ap0 + ap1) / 2] * 4)
    assert numbers["champion_map"] == pytest.approx((ap0 + ap1) / 2)
    assert numbers["top1"] == [0.0] * 4 and numbers["champion_top1"] == 0.0
    assert numbers["fraction_to_gain"] is None


def test_a_query_that_is_a_gallery_item_does_not_retrieve_itself():
    gallery = np.array([[0.0], [1.0], [3.0], [6.0]], np.float32)
    judged = _judged([0, -1], [[1], [2]])  # query 0 is item 0; query 1 an image at 0.0 whose relevant item is 2
    queries = np.array([[0.0], [0.0]], np.float32)
    numbers = measure_judged_gate(queries, gallery, queries, gallery, gallery, judged, np.arange(4), curve_points=0)
    # query 0: item 1 first (itself left out), AP 1; query 1: items 0 and 1 before item 2, AP 1/3
    assert numbers["top1"] == [0.5, 0.5] and numbers["champion_top1"] == 0.5
    assert numbers["map"] == pytest.approx([(1 + 1 / 3) / 2] * 2)
    with pytest.raises(ValueError, match="other than its own"):
        measure_judged_gate(queries, gallery, queries, gallery, gallery, _judged([0, -1], [[0], [2]]),
                            np.arange(4), curve_points=0)


@pytest.mark.parametrize("distance", ["l2", "cosine"])
def test_judgments_from_labels_give_the_label_gates_numbers(distance):
    """Judgments "same label" on a labelled sample that is its own gallery: top-1 and NFR@1 are
    promotion.measure_gate's, mAP is components.evaluation's; small blocks so that the gallery is
    walked in many pieces across the curve's cuts."""
    rng = np.random.default_rng(1)
    n, d, classes = 600, 6, 5
    labels = rng.integers(0, classes, n)
    centres = rng.normal(size=(classes, d)) * 2
    new = (centres[labels] + rng.normal(size=(n, d))).astype(np.float32)
    queries = (new + 0.3 * rng.normal(size=(n, d))).astype(np.float32)
    transformed = (new + 1.5 * rng.normal(size=(n, d))).astype(np.float32)
    champion = (centres[labels] + 1.6 * rng.normal(size=(n, d))).astype(np.float32)
    order = rng.permutation(n)
    everyone = np.arange(n)
    judged = _judged(everyone, [everyone[(labels == labels[i]) & (everyone != i)] for i in everyone])
    numbers = measure_judged_gate(champion, champion, queries, new, transformed, judged, order, distance=distance,
                                  curve_points=5, block_bytes=1)
    expected = measure_gate(champion, queries, new, transformed, labels, order, distance=distance, curve_points=5)
    for key in ("queries", "alpha", "top1", "nfr1", "champion_top1", "fraction_to_gain"):
        assert numbers[key] == expected[key], key
    for key in ("top1_auc", "top1_auc_gain", "nfr1_mean", "nfr1_end"):
        assert numbers[key] == pytest.approx(expected[key]), key
    curve = backfill_curve(queries, new, transformed, labels, order, distance=distance, num_intermediate=5)
    np.testing.assert_allclose(numbers["map"], curve.map, rtol=1e-6)
    assert numbers["champion_map"] == pytest.approx(retrieval_metrics(champion, champion, labels,
                                                                      distance=distance)["map"], rel=1e-6)
    assert len(set(numbers["top1"])) > 2  # the curve moves: the comparison means something


def test_blocks_do_not_change_the_numbers():
    rng = np.random.default_rng(3)
    n = 700
    gallery, transformed = rng.normal(size=(2, n, 4)).astype(np.float32)
    queries = rng.normal(size=(30, 4)).astype(np.float32)
    judged = _judged(np.r_[rng.choice(n, 20, replace=False), [-1] * 10],
                     [rng.choice(n, 3, replace=False) for _ in range(30)])
    judged.relevant = [r[r != p] for r, p in zip(judged.relevant, judged.query_positions)]
    order = rng.permutation(n)
    args = (queries, gallery, queries, gallery, transformed, judged, order)
    assert measure_judged_gate(*args, block_bytes=1) == measure_judged_gate(*args)


# ------------------------------------------------------------------------------------------------


def test_agreement_is_full_when_the_mixed_gallery_is_the_final_one():
    rng = np.random.default_rng(4)
    final = rng.normal(size=(200, 8)).astype(np.float32)
    positions = rng.choice(200, 25, replace=False)
    assert agreement_at(final[positions], final, final, positions, k=10) == 100.0
    mixed = final.copy()
    mixed[::2] += rng.normal(scale=1.0, size=(100, 8)).astype(np.float32)
    partly = agreement_at(final[positions], mixed, final, positions, k=10)
    mixed[1::2] += rng.normal(scale=1.0, size=(100, 8)).astype(np.float32)
    assert 0 <= agreement_at(final[positions], mixed, final, positions, k=10) < partly < 100.0


def test_agreement_read_in_gallery_blocks_is_the_brute_force_one(monkeypatch):
    from fastfill.components.gallery.gate import judged_gate

    rng = np.random.default_rng(5)
    final = rng.normal(size=(300, 6)).astype(np.float32)
    mixed = final + rng.normal(scale=0.7, size=final.shape).astype(np.float32)
    positions = rng.choice(300, 20, replace=False)
    queries = final[positions]

    def top(gallery):  # the 5 nearest, each query's own item left out
        distances = ((gallery[None].astype(np.float64) - queries[:, None]) ** 2).sum(2)
        distances[np.arange(20), positions] = np.inf
        return np.argsort(distances, axis=1)[:, :5]

    expected = 100 * np.mean([len(np.intersect1d(a, b)) / 5 for a, b in zip(top(mixed), top(final))])
    monkeypatch.setattr(judged_gate, "BLOCK_BYTES", 4 * 20 * 7)  # blocks of 7 items
    assert agreement_at(queries, mixed, final, positions, k=5) == pytest.approx(expected)
    assert 0 < expected < 100
