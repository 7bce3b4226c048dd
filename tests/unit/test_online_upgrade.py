"""What the upgrade offers of the methods since FastFill: online backfilling as a search merge (the
upgrade's stored reverse transformation, `search --merge online`) and as a way of the budget
advisor, beside the lambda-orthogonal affine map; each against a literal reference on tiny data."""

import io
from dataclasses import replace

import numpy as np
import pytest

from fastfill.cli.command_support import INPUT, outcome
from fastfill.components.evaluation.fusion import distance_merge
from fastfill.components.evaluation.online_backfill import online_curve
from fastfill.components.experiment.adapters import (
    AffineAdapter,
    adapter_arrays,
    adapter_from_arrays,
    fit_metric_compatible,
    fit_procrustes,
)
from fastfill.components.experiment.inference import apply_alignment, embed
from fastfill.components.gallery.advice.advisor import ranks_of
from fastfill.components.gallery.advice.target_advice import online_top1, shadow_top1_judged, ways_to_target
from fastfill.components.gallery.layouts.catalog import GalleryError
from fastfill.components.gallery.search.dual import DualSearch
from fastfill.components.gallery.store import DamagedObject, LocalStore, ObjectMissing
from fastfill.components.gallery.upgrade import backfill, planning
from fastfill.components.platform.config import parse_params
from testkit.tiny_demo import tiny_params
from tests.gallery_cases import NEW, NEW_DIM, OLD, OLD_DIM, N, _gallery, make_data, make_models

# ---- the merge by distance


def test_the_distance_merge_on_a_hand_made_example():
    """Old list: 7 (1.0), 3 (4.0); new list: 5 (0.5), 9 (2.5), scaled by 2: 5 (1.0), 9 (5.0).
    Ascending: 5 and 7 tie at 1.0, the new list's first; then 3 (4.0), 9 (5.0)."""
    ids, distances, sources = distance_merge([np.array([7, 3]), np.array([5, 9])],
                                             [np.array([1.0, 4.0]), np.array([0.5, 2.5])], scales=[1.0, 2.0])
    assert ids.tolist() == [5, 7, 3, 9] and sources.tolist() == [1, 0, 0, 1]
    assert distances.tolist() == [1.0, 1.0, 4.0, 5.0]
    ids, _, _ = distance_merge([np.array([7, 3, -1]), np.array([5, 9, -1])],
                               [np.array([1.0, 4.0, 0.0]), np.array([0.5, 2.5, 0.0])], limit=3)
    assert ids.tolist() == [5, 7, 9]  # unscaled; faiss's padding (-1) dropped
    with pytest.raises(ValueError, match="positive finite scale"):
        distance_merge([np.array([1])], [np.array([1.0])], scales=[0.0])
    with pytest.raises(ValueError, match="not ascending"):
        distance_merge([np.array([1, 2])], [np.array([2.0, 1.0])])


# ---- the stored reverse transformation


def _pairs(n=80, seed=0):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 4, n)
    old = (rng.normal(size=(4, OLD_DIM))[labels] + 0.5 * rng.normal(size=(n, OLD_DIM))).astype(np.float32)
    new = (rng.normal(size=(4, NEW_DIM))[labels] + 0.5 * rng.normal(size=(n, NEW_DIM))).astype(np.float32)
    return new, old, labels


def test_a_reverse_transformation_is_stored_as_arrays_and_read_back_equal(tmp_path):
    new, old, labels = _pairs()
    fitted = fit_metric_compatible(new, old, labels, rank=4, hidden=16, epochs=2, min_steps=20)
    arrays = adapter_arrays(fitted)
    assert all(isinstance(v, np.ndarray) and v.dtype != object for v in arrays.values())
    store = LocalStore(str(tmp_path / "s"))
    assert planning.load_reverse(store, "u") is None  # planned without one
    planning.write_reverse(store, "u", fitted)
    back = planning.load_reverse(store, "u")
    assert back.kind == "metric_compatible" and back.new_scale == pytest.approx(fitted.new_scale)
    np.testing.assert_array_equal(back(new), fitted(new))
    affine = fit_procrustes(new, old)
    again = adapter_from_arrays(adapter_arrays(affine))
    assert isinstance(again, AffineAdapter) and again.kind == "procrustes"
    np.testing.assert_array_equal(again(new), affine(new))


def _hand_made_reverse(scale=1.5, seed=1):
    """A residual-MLP reverse transformation with arbitrary weights and a gain of ``scale ** 2``."""
    rng = np.random.default_rng(seed)
    hidden = 6
    return adapter_from_arrays({
        "kind": np.array("metric_compatible"), "weight": rng.normal(size=(NEW_DIM, OLD_DIM)) * 0.3,
        "bias": rng.normal(size=OLD_DIM), "mean": rng.normal(size=NEW_DIM), "std": np.ones(NEW_DIM) * 2,
        "new_scale": np.array(scale), "mlp.0.weight": rng.normal(size=(hidden, NEW_DIM)).astype(np.float32),
        "mlp.0.bias": np.zeros(hidden, np.float32), "mlp.2.weight": rng.normal(size=(OLD_DIM, hidden)).astype(np.float32),
        "mlp.2.bias": np.zeros(OLD_DIM, np.float32)})


def test_the_online_merge_searches_the_old_part_with_the_reverse_transform(mid_upgrade):
    gallery, plan, (old, new, _), (images, _) = mid_upgrade
    with pytest.raises(GalleryError, match="has no reverse transformation for online backfilling .*reverse.npz does "
                       "not exist: it was planned with gallery.upgrade.online false, or the object was deleted"):
        DualSearch(gallery, merge="online")  # a plan that does not say whether it kept one
    planning.write_plan(gallery.store, replace(plan, online=False))
    with pytest.raises(GalleryError, match=r"planned without online backfilling's reverse transformation "
                       r"\(gallery.upgrade.online was false\)"):
        DualSearch(gallery, merge="online")
    queries = embed(new, images[:6])
    mixed, on_new = backfill.mixed_features(gallery, plan)
    stored_old = gallery.all_features(OLD)
    # a gain that puts the two sides' distances on one scale, so that the merge mixes them
    typical_old = np.median(((_hand_made_reverse(1.0)(queries)[:, None] - stored_old[None]) ** 2).sum(-1))
    typical_new = np.median(((queries[:, None] - mixed[on_new][None]) ** 2).sum(-1))
    scale = float(np.sqrt(typical_old / typical_new))
    reverse = _hand_made_reverse(scale)
    planning.write_reverse(gallery.store, plan.upgrade_id, reverse)
    searcher = DualSearch(gallery, merge="online")
    k = 9
    got_ids, got_distances, sources = searcher.search_online(queries, k=k)
    # the literal merge: every item, its distance from the side it is on, the new side's times the gain
    twins = reverse(queries)
    ids = gallery.ids()
    both = 0
    for q in range(6):
        entries = [(float(((queries[q] - mixed[j]) ** 2).sum()) * scale ** 2, 0, int(ids[j]))
                   for j in np.flatnonzero(on_new)]
        entries += [(float(((twins[q] - stored_old[j]) ** 2).sum()), 1, int(ids[j])) for j in np.flatnonzero(~on_new)]
        entries.sort()
        assert got_ids[q].tolist() == [i for _, _, i in entries[:k]]
        np.testing.assert_allclose(got_distances[q], [d for d, _, _ in entries[:k]], rtol=1e-4, atol=1e-4)
        assert sources[q] == [NEW.uri if s == 0 else OLD.uri for _, s, _ in entries[:k]]
        both += len(set(sources[q])) == 2
    assert both > 0  # the merge does mix the two parts
    with pytest.raises(GalleryError, match="new model's query alone"):
        searcher.search(embed(old, images[:2]), queries[:2])
    with pytest.raises(GalleryError, match="merge='online'"):
        DualSearch(gallery, merge="rrf").search_online(queries)
    # images: only the new model embeds them
    from_images = searcher.search_images(images[:6], None, new, k=k)
    assert from_images[0].tolist() == got_ids.tolist()


def test_a_missing_or_garbage_reverse_transformation_is_one_line_naming_it(mid_upgrade):
    """A plan made with gallery.upgrade.online: true whose reverse.npz was deleted says it is
    missing (not that online was false); one whose bytes are not a reverse transformation, its
    checksum matching (written so), is a DamagedObject, not zipfile's BadZipFile."""
    gallery, plan, _, _ = mid_upgrade
    planning.write_plan(gallery.store, replace(plan, online=True))
    assert planning.load_plan(gallery.store, plan.upgrade_id).online is True
    key = gallery.store.describe(planning.reverse_key(plan.upgrade_id))
    with pytest.raises(ObjectMissing) as missing:
        DualSearch(gallery, merge="online")
    assert str(missing.value).startswith(f"{key} is missing: upgrade {plan.upgrade_id} was planned with online backfilling")
    assert "gallery.upgrade.online was false" not in str(missing.value)
    assert "`fastfill upgrade abort`" in str(missing.value) and "--merge rrf" in str(missing.value)
    assert outcome(missing.value) == (INPUT, str(missing.value))

    for garbage in (b"not a zip file at all", b"PK\x03\x04" + bytes(40), _npz(kind=np.array("metric_compatible")),
                    _npy()):
        gallery.store.put(planning.reverse_key(plan.upgrade_id), garbage)  # the checksum matches: it was written so
        with pytest.raises(DamagedObject) as damaged:
            DualSearch(gallery, merge="online")
        message = str(damaged.value)
        assert message.startswith(f"{key} is not a reverse transformation (") and "\n" not in message, message
        assert "`fastfill upgrade abort`" in message and outcome(damaged.value)[0] == INPUT


def _npz(**arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _npy() -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.zeros(3))
    return buffer.getvalue()


# ---- the budget advisor's ways


def _clustered(n=120, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    old = rng.normal(size=(classes, 6))[labels] + 1.3 * rng.normal(size=(n, 6))
    new = rng.normal(size=(classes, 9))[labels] + 0.5 * rng.normal(size=(n, 9))
    return old.astype(np.float32), new.astype(np.float32), labels


@pytest.mark.parametrize("distance, gain", [("l2", 1.7), ("l2", 0.4), ("cosine", 1.0)])
def test_the_online_top1_is_the_evaluations_online_curve_when_the_sample_is_the_gallery(distance, gain):
    old, new, labels = _clustered()
    twins = fit_procrustes(new, old)(new)
    order = np.random.default_rng(1).permutation(len(labels))
    predicted = online_top1(old, new, twins, labels, ranks_of(order, np.arange(len(labels))), len(labels),
                            gain=gain, distance=distance)
    side = new * np.float32(np.sqrt(gain))
    measured = online_curve(twins, side, old, side, labels, order, distance=distance, num_intermediate=19)
    np.testing.assert_allclose(predicted["top1"], measured.top1, atol=1e-12)
    assert predicted["way"] == "online backfilling" and predicted["error_scale"] == 1.0


def test_the_judged_online_top1_is_the_labelled_one_when_the_judgments_say_what_the_labels_say():
    from fastfill.components.gallery.inputs.judgments import Judgments

    old, new, labels = _clustered(n=60)
    twins = fit_procrustes(new, old)(new)
    positions, ranks = np.arange(60), ranks_of(np.random.default_rng(2).permutation(60), np.arange(60))
    relevant = [np.flatnonzero((labels == labels[p]) & (positions != p)) for p in positions]
    judged = Judgments("by label", positions, [None] * 60, relevant)
    by_judgments = shadow_top1_judged(twins, new, judged, positions, old, new, ranks, 60, np.ones(60, bool), gain=2.0)
    by_labels = online_top1(old, new, twins, labels, ranks, 60, gain=2.0)
    np.testing.assert_allclose(by_judgments["sample_top1"], by_labels["sample_top1"], atol=1e-12)


def test_the_ways_include_online_backfilling_and_the_other_maps(tmp_path):
    models, data = make_models(), make_data()
    old, new, h = models
    gallery = _gallery(str(tmp_path / "store"), models, data)
    positions = np.arange(0, N, 2)
    stored = gallery.all_features(gallery.model)
    queries = embed(new, data[0][positions])
    transformed, log_sigma2 = apply_alignment(h, stored)
    reverse = _hand_made_reverse()
    other = transformed[::-1].copy()  # any map's output will do: the way is predicted from it
    result = ways_to_target(0.5, gallery, positions=positions, prefilled=positions, queries=queries,
                            old_side=stored[positions], sample_transformed=transformed[positions],
                            transformed_parts=lambda: iter([(0, transformed)]), log_sigma2=log_sigma2, weights=None,
                            seed=0, reverse=reverse, other_maps={"lambda-orthogonal map (affine)": (
                                other[positions], lambda: iter([(0, other)]))})
    names = [w["way"] for w in result["ways"]]
    assert names == ["map, sigma order", "map, random order", "lambda-orthogonal map (affine), random order",
                     "shadow index (rrf), random order", "online backfilling (metric-compatible), random order",
                     "candidate reranking (K=50), random order",
                     "shadow index (rrf), sigma order", "online backfilling (metric-compatible), sigma order",
                     "candidate reranking (K=50), sigma order"]
    by = {w["way"]: w for w in result["ways"]}
    # at 0% online backfilling is the reverse-transformed queries against the old gallery, whatever the order
    assert by["online backfilling (metric-compatible), random order"]["top1_at_0"] == \
        by["online backfilling (metric-compatible), sigma order"]["top1_at_0"]
    # the other map's way is the map's way computed on its own transform
    alone = ways_to_target(0.5, gallery, positions=positions, prefilled=positions, queries=queries,
                           old_side=stored[positions], sample_transformed=other[positions],
                           transformed_parts=lambda: iter([(0, other)]), log_sigma2=None, weights=None, seed=0)
    assert by["lambda-orthogonal map (affine), random order"]["top1_full"] == \
        alone["ways"][0]["top1_full"]


# ---- the lambda-orthogonal map as the upgrade's method


def test_the_upgrade_may_train_a_map_of_the_comparison():
    data = tiny_params("/tmp/images")
    data["compare"]["align"]["lambda_orth"] = {"architecture": "affine", "orthogonality": 1.0, "epochs": 3,
                                               "warmup_epochs": 1}
    data["compare"]["orders"]["lambda_orth"] = ["random"]
    data["gallery"] = {"upgrade": {"method": "lambda_orth", "order": "random", "online": True}}
    params = parse_params(data)
    assert params.upgrade_map.architecture == "affine" and params.gallery.upgrade.online
    data["gallery"]["upgrade"]["method"] = "unknown"
    with pytest.raises(ValueError, match="not under align or compare.align"):
        parse_params(data)
    data["gallery"]["upgrade"]["method"] = "unified"
    with pytest.raises(ValueError, match="unified map"):
        parse_params(data)
