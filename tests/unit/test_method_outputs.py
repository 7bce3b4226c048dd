"""Evaluation of the methods that are not a plain map: RACT's orders from the new classifier on
old features, a unified space whose queries are not the new features, and the unified map's
checkpoint."""

import numpy as np
import torch

from fastfill.components.evaluation import backfill_curve
from fastfill.components.evaluation.assessment import MethodOutputs, build_order, method_curves
from fastfill.components.evaluation.ordering import entropy_uncertainty, least_confidence, margin_uncertainty
from fastfill.components.experiment.models import UnifiedMaps, load_alignment, save_alignment
from fastfill.components.platform.config import AlignConfig


def test_uncertainty_orders_put_the_least_certain_old_feature_first():
    logits = np.array([[5.0, 0.0, 0.0],    # confident
                       [1.0, 1.0, 0.0],    # two classes tie: small margin
                       [0.3, 0.2, 0.25],   # nearly uniform: the least certain by every measure
                       [3.0, 1.0, 0.0]])
    outputs = MethodOutputs(gallery_old=np.zeros((4, 2), np.float32), logits=logits)
    # the nearly uniform row is least certain by confidence and entropy; the exact tie of the
    # top two classes has the smallest margin
    for name, score, first in (("least_confidence", least_confidence, 2), ("margin", margin_uncertainty, 1),
                               ("entropy", entropy_uncertainty, 2)):
        order = build_order(name, outputs, np.zeros((4, 2)), seed=0)
        np.testing.assert_array_equal(order, np.argsort(-score(logits), kind="stable"))
        assert order[0] == first and order[-1] == 0, name


def test_orders_that_need_what_a_method_lacks_say_so():
    outputs = MethodOutputs(gallery_old=np.zeros((3, 2), np.float32))
    for name, needs in (("entropy", "logits"), ("sigma", "uncertainty"), ("oracle", "true per-item loss")):
        try:
            build_order(name, outputs, np.zeros((3, 2)), 0)
        except ValueError as error:
            assert needs in str(error)
        else:
            raise AssertionError(f"{name} built without {needs}")


def test_a_fallback_map_without_a_helpful_head_is_measured_in_random_order():
    from fastfill.components.evaluation.ordering import random_order

    outputs = MethodOutputs(gallery_old=np.zeros((50, 2)), sigma_is_random=True)
    np.testing.assert_array_equal(build_order("sigma", outputs, np.zeros((50, 2)), 3), random_order(50, 3))


def test_a_unified_method_is_evaluated_in_its_shared_space():
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(4), 10)
    new = rng.normal(size=(40, 6)).astype(np.float32)
    shared_query = (np.eye(4)[labels] * 3 + rng.normal(scale=0.3, size=(40, 4))).astype(np.float32)
    shared_old = shared_query + rng.normal(scale=1.0, size=(40, 4)).astype(np.float32)
    outputs = MethodOutputs(gallery_old=shared_old, query=shared_query)
    curves, tau = method_curves(outputs, new, labels, ["random"], distance="l2", curve_points=3, seed=1)
    order = build_order("random", outputs, shared_query, 1)
    expected = backfill_curve(shared_query, shared_query, shared_old, labels, order, distance="l2",
                              num_intermediate=3).to_dict()
    assert curves["random"]["top1"] == expected["top1"] and tau is None
    assert curves["random"]["top1"][-1] > 0.9  # the shared space, not the unrelated new features


def test_a_unified_map_is_saved_and_restored(tmp_path):
    torch.manual_seed(0)
    maps = UnifiedMaps(6, 8, num_classes=3, blocks=1).eval()
    config = AlignConfig(architecture="unified", rbt_blocks=1)
    save_alignment(maps, config, tmp_path / "map.pt")
    restored = load_alignment(tmp_path / "map.pt")
    x_old, x_new = torch.randn(5, 6), torch.randn(5, 8)
    assert isinstance(restored, UnifiedMaps)
    torch.testing.assert_close(restored(x_old), maps(x_old))
    torch.testing.assert_close(restored.embed_new(x_new), maps.embed_new(x_new))
