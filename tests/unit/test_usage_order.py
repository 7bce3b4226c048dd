"""The usage backfill orders: weights counted from a query log (CSV, Parquet) or the items
table's weight column, unknown ids refused, the orders themselves, and the plan of a small
gallery in usage_sigma order."""

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from fastfill.components.evaluation.ordering import check_permutation, expected_gain_order, sigma_order, usage_order
from fastfill.components.experiment.inference import apply_alignment
from fastfill.components.experiment.models import AlignmentMap
from fastfill.components.gallery.inputs.adopt import adopt, read_manifest
from fastfill.components.gallery.layouts.catalog import Gallery, GalleryError, PartsGallery
from fastfill.components.gallery.store import open_store
from fastfill.components.gallery.upgrade import planning
from fastfill.components.gallery.upgrade.usage import (
    backfill_order,
    load_usage_log,
    map_order,
    order_after_map,
    stored_weights,
    usage_weights,
)
from tests.gallery_cases import NEW, NEW_DIM, OLD, OLD_DIM, N, _gallery, make_data, make_models

IDS = np.array([10, 20, 30, 40, 50, 60])
# query q1 hit 20 and 30; q2 hit 20 (twice in the log: counted once) and 50; q3 hit 20
LOG = {"query": ["q1", "q1", "q2", "q2", "q2", "q3"], "hit": ["20", "30", "20", "50", "20", "20"]}
EXPECTED = [0, 3, 1, 0, 1, 0]


def _csv(path, columns: dict) -> str:
    pacsv.write_csv(pa.table({name: pa.array(values, pa.string()) for name, values in columns.items()}), path)
    return str(path)


def test_weights_are_counted_from_a_csv_log(tmp_path):
    usage = load_usage_log(_csv(tmp_path / "log.csv", LOG), IDS)
    assert usage.weights.tolist() == EXPECTED and usage.queries == 3 and usage.repeats == 1
    assert "3 queries; 3 of 6 items hit (50.0%), total weight 5; 1 repeated rows counted once" in usage.describe()


def test_weights_are_counted_from_a_parquet_log_with_integer_ids(tmp_path):
    path = tmp_path / "log.parquet"
    pq.write_table(pa.table({"query": pa.array([7, 7, 8, 8, 8, 9]),
                             "hit": pa.array([int(h) for h in LOG["hit"]], pa.int64())}), path)
    assert load_usage_log(str(path), IDS.tolist()).weights.tolist() == EXPECTED


def test_weights_are_counted_against_text_ids(tmp_path):
    text = np.array(["a/10.jpg", "a/20.jpg", "a/30.jpg", "a/40.jpg", "a/50.jpg", "a/60.jpg"])
    log = {"query": LOG["query"], "hit": [f"a/{h}.jpg" for h in LOG["hit"]]}
    assert load_usage_log(_csv(tmp_path / "log.csv", log), text).weights.tolist() == EXPECTED


def test_unknown_ids_are_counted_and_named(tmp_path):
    path = _csv(tmp_path / "log.csv", {"query": ["a", "a", "b", "c"], "hit": ["99", "20", "98", "99"]})
    with pytest.raises(GalleryError) as error:
        load_usage_log(path, IDS)
    message = str(error.value)
    assert path in message and "2 hit ids are not in the gallery (99, 98; 3 rows)" in message and "\n" not in message


@pytest.mark.parametrize("columns, message", [
    ({"query": ["a"], "item": ["20"]}, r"lacks the column hit \(it has: query, item\); name the columns query and hit"),
    ({"query": ["a", "b"], "hit": ["20", "x.png"]}, r"1 hit values are not item ids \(rows 2: x.png\)"),
    ({"query": ["a", ""], "hit": ["20", "30"]}, r"1 rows have no query \(rows 2\)"),
])
def test_bad_logs_are_refused_naming_what_is_wrong(tmp_path, columns, message):
    with pytest.raises(GalleryError, match=message):
        load_usage_log(_csv(tmp_path / "log.csv", columns), IDS)
    with pytest.raises(GalleryError, match="usage log .* does not exist; fix gallery.upgrade.usage_log"):
        load_usage_log(str(tmp_path / "nowhere.csv"), IDS)


def test_usage_order_puts_the_most_asked_first_and_breaks_ties_by_sigma_else_position():
    weights = np.array([0.0, 3.0, 1.0, 0.0, 1.0, 0.0])
    log_sigma2 = np.array([0.5, -1.0, 0.1, 2.0, 0.3, -0.2])
    assert usage_order(weights).tolist() == [1, 2, 4, 0, 3, 5]
    assert usage_order(weights, log_sigma2).tolist() == [1, 4, 2, 3, 0, 5]
    with pytest.raises(ValueError, match="finite and >= 0; 1 are not"):
        usage_order(np.array([1.0, -2.0]))


def test_expected_gain_order_is_a_permutation_with_the_gain_first_and_sigma_after():
    rng = np.random.default_rng(0)
    n = 200
    log_sigma2 = rng.normal(size=n)
    weights = np.zeros(n)
    hit = rng.choice(n, size=30, replace=False)
    weights[hit] = rng.integers(1, 20, size=30)
    order = check_permutation(expected_gain_order(weights, log_sigma2), n)
    gain = weights * np.exp(log_sigma2)
    np.testing.assert_array_equal(order[:30], hit[np.argsort(-gain[hit], kind="stable")])
    never = np.setdiff1d(np.arange(n), hit)
    np.testing.assert_array_equal(order[30:], [i for i in sigma_order(log_sigma2) if i in set(never)])
    # huge weights and sigmas do not overflow: the product is ranked in log space
    assert expected_gain_order(np.array([1e300, 1.0, 0.0]), np.array([0.0, 800.0, 900.0])).tolist() == [1, 0, 2]
    # no weights at all: FastFill's order
    np.testing.assert_array_equal(expected_gain_order(np.zeros(n), log_sigma2), sigma_order(log_sigma2))


def test_backfill_order_names_what_an_order_needs():
    with pytest.raises(GalleryError, match="usage_sigma order needs an alignment map with an uncertainty head.*"
                                           "use order random or usage"):
        backfill_order("usage_sigma", 3, 0, None, np.ones(3))
    with pytest.raises(GalleryError, match="3 usage weights for 4 items"):
        backfill_order("usage", 4, 0, None, np.ones(3))
    with pytest.raises(GalleryError, match="unknown backfill order 'popular'"):
        backfill_order("popular", 3, 0)
    assert backfill_order("usage", 3, 0, None, np.array([0.0, 0.0, 2.0])).tolist() == [2, 0, 1]


def test_the_usage_orders_want_a_map_with_sigma_and_go_by_usage_when_its_sigma_does_not_help():
    assert [map_order(o) for o in ("sigma", "random", "usage", "usage_sigma")] == ["sigma", "random", "sigma", "sigma"]
    assert order_after_map("usage_sigma", "sigma") == "usage_sigma" and order_after_map("usage", "sigma") == "usage"
    assert order_after_map("usage_sigma", "random") == "usage" and order_after_map("usage", "random") == "usage"
    assert order_after_map("sigma", "random") == "random" and order_after_map("random", "random") == "random"


def test_adopt_keeps_a_weight_column_and_refuses_bad_weights(tmp_path):
    (tmp_path / "m.csv").write_text("id,uri,weight\n1,a.png,2.5\n2,b.png,0\n3,c.png,7\n")
    table = read_manifest(tmp_path / "m.csv")
    adopt(open_store(tmp_path / "g"), table, OLD, (1, 8, 8), features=iter([np.ones((3, OLD_DIM))]), part_size=2)
    gallery = PartsGallery(open_store(tmp_path / "g"))
    assert stored_weights(gallery).tolist() == [2.5, 0.0, 7.0]
    assert usage_weights(gallery, None).weights.tolist() == [2.5, 0.0, 7.0]
    (tmp_path / "bad.csv").write_text("id,uri,weight\n1,a.png,2\n2,b.png,-1\n")
    with pytest.raises(GalleryError, match=r"column weight must hold numbers >= 0 .*1 are not \(first: row 1, -1.0\)"):
        read_manifest(tmp_path / "bad.csv")
    (tmp_path / "text.csv").write_text("id,uri,weight\n1,a.png,often\n2,b.png,1\n")
    with pytest.raises(GalleryError, match="column weight must hold numbers"):
        read_manifest(tmp_path / "text.csv")


def _transformed(gallery: Gallery, h) -> str:
    uid = planning.upgrade_id(OLD, NEW)
    for part in range(gallery.num_parts):
        planning.transform_part(gallery, uid, h, part)
    return uid


def test_a_small_gallery_is_planned_in_usage_sigma_order(tmp_path):
    models, data = make_models(), make_data()
    gallery = _gallery(str(tmp_path / "store"), models, data)
    uid = _transformed(gallery, models[2])
    with pytest.raises(GalleryError, match="need per-item usage weights.*--usage-log FILE or "
                                           "gallery.upgrade.usage_log.*weight column"):
        planning.make_order(gallery, uid, "usage_sigma", 0)

    assert gallery.ids()[[3, 40, 17]].tolist() == [1003, 1040, 1017]  # five queries hit 1003, two 1040, one 1017
    log = _csv(tmp_path / "log.csv", {"query": [f"q{i}" for i in range(5)] + ["q0", "q1", "q9"],
                                      "hit": ["1003"] * 5 + ["1040", "1040", "1017"]})
    usage = usage_weights(gallery, log)
    assert usage.weights[[3, 40, 17]].tolist() == [5, 2, 1] and usage.weights.sum() == 8
    order = planning.make_order(gallery, uid, "usage_sigma", 0, usage.weights)
    _, log_sigma2 = apply_alignment(models[2], gallery.all_features(OLD))
    gain = usage.weights * np.exp(log_sigma2.astype(np.float64))
    assert order[:3].tolist() == sorted([3, 40, 17], key=lambda i: -gain[i])
    np.testing.assert_array_equal(order[3:], [i for i in sigma_order(log_sigma2) if i not in (3, 40, 17)])

    plan = planning.Plan(uid, OLD, NEW, "models:/embedder-alignment/1", "usage_sigma", 7, N, 0, "l2")
    planning.commit_plan(gallery, plan, order)
    stored = planning.order_of(gallery.store, uid)
    np.testing.assert_array_equal(check_permutation(stored, N), order)
    assert planning.load_plan(gallery.store, uid).order_kind == "usage_sigma"
    assert gallery.manifest(refresh=True)["upgrade"] == uid


def test_without_an_uncertainty_head_usage_ties_go_by_position(tmp_path):
    models, data = make_models(), make_data()
    gallery = _gallery(str(tmp_path / "store"), models, data)
    uid = _transformed(gallery, AlignmentMap(OLD_DIM, NEW_DIM, [16], uncertainty=False).eval())
    weights = np.zeros(N)
    weights[[9, 2]] = [1, 4]
    assert planning.make_order(gallery, uid, "usage", 0, weights).tolist() == [2, 9, *[i for i in range(N)
                                                                                        if i not in (2, 9)]]
    with pytest.raises(GalleryError, match="usage_sigma order needs an alignment map with an uncertainty head"):
        planning.make_order(gallery, uid, "usage_sigma", 0, weights)
