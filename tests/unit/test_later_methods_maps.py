"""Two methods published after FastFill, on tiny data: the lambda-orthogonality affine map (Ricci et
al., 2025) and online backfilling with a reverse transformation merged by distance (Seo et al.,
WACV 2025). docs/methods.md describes both."""

import numpy as np
import pytest
import torch

from fastfill.components.evaluation import backfill_curve, retrieval_metrics
from fastfill.components.evaluation.dual_curve import dual_curve
from fastfill.components.evaluation.online_backfill import monotonicity, online_curve
from fastfill.components.experiment.adapters import fit_procrustes
from fastfill.components.experiment.dense import Dense
from fastfill.components.experiment.losses import orthogonality_penalty
from fastfill.components.experiment.map_training import train_alignment
from fastfill.components.experiment.models import AlignmentMap, build, describe, load_alignment, save_alignment
from fastfill.components.platform.config import AlignConfig, ConfigError, parse_params
from testkit.tiny_demo import tiny_params

CPU = torch.device("cpu")


# ---- lambda-orthogonality


def test_the_orthogonality_penalty_against_literal_values():
    d = 4
    assert orthogonality_penalty(2 * torch.eye(d)).item() == pytest.approx(d * 9)  # (4 - 1)^2 on the diagonal
    rotation = torch.tensor([[0.6, -0.8], [0.8, 0.6]])
    assert orthogonality_penalty(rotation).item() == pytest.approx(0.0, abs=1e-12)
    # an isometric embedding d_old = 2 -> d_new = 3 (torch's Linear stores W as (d_new, d_old))
    assert orthogonality_penalty(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])).item() == 0.0
    # W^T W = [[1, 1], [1, 2]]: off-diagonal 1 twice, diagonal 0 and 1
    assert orthogonality_penalty(torch.tensor([[1.0, 1.0], [0.0, 1.0]])).item() == pytest.approx(3.0)


def test_the_affine_map_is_configured_validated_and_rebuilt():
    config = AlignConfig(architecture="affine", orthogonality=0.5)
    assert config.orthogonality_weight == 0.5
    assert AlignConfig(architecture="affine").orthogonality_weight == 1.0  # null: the default lambda
    assert AlignConfig().orthogonality_weight == 0.0  # an MLP has no W
    with pytest.raises(ValueError, match="orthogonality is the affine map's penalty"):
        AlignConfig(architecture="mlp", orthogonality=1.0)
    with pytest.raises(ValueError):
        AlignConfig(architecture="affine", orthogonality=-1.0)
    # the configuration survives a dump and a reload (each seed of the comparison re-validates it)
    assert AlignConfig(**AlignConfig().model_dump()) == AlignConfig()
    h = AlignmentMap.from_config(config, 3, 5)
    assert isinstance(h.transform, torch.nn.Linear) and h.affine_weight.shape == (5, 3)
    assert type(build(describe(h)).transform) is Dense  # one linear layer, rebuilt as it was
    with pytest.raises(ValueError, match="only an affine map"):
        AlignmentMap.from_config(AlignConfig(hidden=[4]), 3, 5).affine_weight  # noqa: B018 - the access raises


def test_the_comparison_row_and_its_orders_are_valid():
    data = tiny_params("/tmp/images")
    data["compare"]["align"]["lambda_orth"] = {"architecture": "affine", "orthogonality": 1.0, "disc": True,
                                               "epochs": 3, "warmup_epochs": 1}
    data["compare"]["orders"]["lambda_orth"] = ["random"]
    seeded = parse_params(data).for_comparison(0)
    assert seeded.align["lambda_orth"].architecture == "affine"
    data["compare"]["orders"]["lambda_orth"] = ["sigma"]
    with pytest.raises(ConfigError, match="sigma order"):
        parse_params(data)


def _rotation_problem(n=600, d=6, seed=0):
    rng = np.random.default_rng(seed)
    rotation, _ = np.linalg.qr(rng.normal(size=(d, d)))
    labels = rng.integers(0, 4, n)
    old = (rng.normal(scale=0.5, size=(4, d))[labels] + rng.normal(size=(n, d))).astype(np.float32)
    shift = rng.normal(size=d)
    new = (old @ rotation.T + shift).astype(np.float32)  # phi_new = R phi_old + t exactly
    return old, new, labels, rotation, shift


def test_the_affine_map_recovers_a_rotation(tmp_path):
    old, new, labels, rotation, shift = _rotation_problem()
    config = AlignConfig(architecture="affine", orthogonality=1.0, epochs=10, warmup_epochs=1, batch_size=32,
                         min_steps=1000, lr=0.02, validation_fraction=0.0)  # the last epoch is kept
    lines = []
    h, history = train_alignment(config, old, new, labels, torch.nn.Linear(6, 4, bias=False), device=CPU,
                                 log=lines.append)
    weight = h.affine_weight.detach().double().numpy()
    assert np.abs(weight - rotation).max() < 0.05
    assert np.abs(h.transform.bias.detach().numpy() - shift).max() < 0.05
    assert np.abs(weight.T @ weight - np.eye(6)).max() < 0.05  # W close to orthogonal
    assert all("orthogonality" in record for record in history)
    assert history[-1]["orthogonality"] < 0.01
    assert any("||W^T W - I||_F^2" in line for line in lines)
    save_alignment(h, config, tmp_path / "map.pt")
    again = load_alignment(tmp_path / "map.pt")
    torch.testing.assert_close(again.affine_weight, h.affine_weight)


def test_the_penalty_pulls_a_scaled_map_towards_orthogonality():
    """phi_new = 2 phi_old: lambda = 0 learns W = 2 I; a large lambda keeps W nearer orthogonal."""
    old, _, labels, _, _ = _rotation_problem(seed=1)
    new = 2 * old
    settings = dict(architecture="affine", epochs=10, warmup_epochs=1, batch_size=32, min_steps=1000, lr=0.02,
                    validation_fraction=0.0)
    penalties = {}
    for lam in (0.0, 100.0):
        h, _ = train_alignment(AlignConfig(orthogonality=lam, **settings), old, new, labels,
                               torch.nn.Linear(6, 4, bias=False), device=CPU, log=lambda m: None)
        penalties[lam] = orthogonality_penalty(h.affine_weight).item()
    assert penalties[0.0] == pytest.approx(6 * 9, rel=0.05)  # W = 2 I: the penalty's literal value
    assert penalties[100.0] < penalties[0.0] / 2


# ---- online backfilling: the distance merge


def _two_sides():
    """Queries 0..3, items 0..3 (each query's own item left out); labels [0, 0, 1, 1]."""
    labels = np.array([0, 0, 1, 1])
    new = np.array([[0.0], [1.0], [3.0], [3.5]], np.float32)          # new features of queries and items
    reverse = np.array([[0.0], [5.0], [10.0], [20.0]], np.float32)   # queries mapped into the old space
    old = np.array([[0.0], [4.0], [12.0], [21.0]], np.float32)        # the items' stored old features
    return reverse, new, old, labels


def test_the_distance_merge_on_a_hand_made_example():
    """Order [2, 0, 1, 3], half backfilled (items 2 and 0 re-embedded). Query 1: the new list holds
    items 2 (d = (3 - 1)^2 = 4) and 0 (d = 1); the old list item 3 (d = (21 - 5)^2 = 256). Merged by
    distance: 0 (1), 2 (4), 3 (256): the positive (item 0) first. Query 3: new list 2 (0.25), 0
    (12.25); old list 1 ((4 - 20)^2 = 256): 2, 0, 1, the positive first. Query 0: new list 0 is its
    own item, so 2 (9); old list 1 (16), 3 (441): 2, 1, 3: the positive (1) second. Query 2: new
    list 0 (9); old list 1 (36), 3 (121): 0, 1, 3, the positive (3) third."""
    reverse, new, old, labels = _two_sides()
    order = np.array([2, 0, 1, 3])
    curve = online_curve(reverse, new, old, new, labels, order, num_intermediate=1)
    assert list(curve.alphas) == pytest.approx([0, 0.5, 1])
    assert curve.top1[1] == pytest.approx(0.5)  # queries 1 and 3 right at top-1
    assert curve.map[1] == pytest.approx((1 + 1 + 1 / 2 + 1 / 3) / 4)
    # the merge compares raw distances: z-scoring each list ranks query 1's old item elsewhere
    assert curve.top1.tolist() == dual_curve(reverse, new, old, new, labels, order, merge="distance",
                                             num_intermediate=1).top1.tolist()


def _literal_online_curve(reverse, new, old, labels, order, points):
    """Every query's merged list built item by item: (distance, 0 = new first, rank, positive)."""
    from fastfill.components.evaluation import pairwise_distances

    n = len(labels)
    d_new, d_old = pairwise_distances(new, new, "l2"), pairwise_distances(reverse, old, "l2")
    top1, ap = [], []
    for m in [(i * n) // (points + 1) for i in range(points + 2)]:
        hits_at, aps = [], []
        for q in range(n):
            entries = []
            for source, items, dist in ((0, order[:m], d_new), (1, order[m:], d_old)):
                ranked = sorted((float(dist[q, j]), labels[j] == labels[q]) for j in items if j != q)
                entries += [(d, source, r, positive) for r, (d, positive) in enumerate(ranked)]
            hits = [positive for *_, positive in sorted(entries)]
            hits_at.append(hits[0])
            ranks = [r + 1 for r, hit in enumerate(hits) if hit]
            if ranks:
                aps.append(np.mean([(i + 1) / r for i, r in enumerate(ranks)]))
        top1.append(np.mean(hits_at))
        ap.append(np.mean(aps))
    return np.array(top1), np.array(ap)


def test_the_distance_merge_matches_the_literal_merge_at_every_point():
    rng = np.random.default_rng(7)
    labels = rng.integers(0, 3, 36)
    old = (rng.normal(size=(3, 4))[labels] + rng.normal(size=(36, 4))).astype(np.float32)
    new = (rng.normal(size=(3, 5))[labels] + rng.normal(scale=0.7, size=(36, 5))).astype(np.float32)
    reverse = (old + rng.normal(scale=0.5, size=old.shape)).astype(np.float32)
    order = rng.permutation(36)
    curve = online_curve(reverse, new, old, new, labels, order, num_intermediate=5)
    top1, ap = _literal_online_curve(reverse, new, old, labels, order, 5)
    assert curve.top1 == pytest.approx(top1) and curve.map == pytest.approx(ap)


def test_the_distance_merge_puts_the_new_item_first_at_an_equal_distance():
    labels = np.array([0, 1, 0])
    new = np.array([[0.0], [1.0], [5.0]], np.float32)
    old = np.array([[0.0], [9.0], [1.0]], np.float32)
    reverse = np.array([[0.0], [0.0], [0.0]], np.float32)
    # item 1 re-embedded. Query 0: item 1 (new, d = 1, a negative) and item 2 (old, d = 1, a
    # positive) tie: the new one first, so query 0 is wrong. Query 1: its own item is the new list,
    # the old list holds only negatives. Query 2: item 1 (new, d = 16) after item 0 (old, d = 0,
    # a positive): right. Had the tie gone the other way, 2 of 3 would be right.
    curve = online_curve(reverse, new, old, new, labels, np.array([1, 2, 0]), num_intermediate=1)
    assert curve.top1[1] == pytest.approx(1 / 3)


def test_the_reverse_transformation_path_ends_at_old_old_and_new_new():
    """phi_new = R phi_old (R orthogonal): Procrustes recovers the reverse map, so at 0% the ranking
    is old/old, and at 100% new/new."""
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 3, 60)
    old = (rng.normal(size=(3, 5))[labels] + rng.normal(scale=0.7, size=(60, 5))).astype(np.float32)
    rotation, _ = np.linalg.qr(rng.normal(size=(5, 5)))
    new = (old @ rotation).astype(np.float32)
    noisy_new = new + rng.normal(scale=0.01, size=new.shape).astype(np.float32)  # new differs a little
    reverse = fit_procrustes(new, old)(noisy_new)
    curve = online_curve(reverse, noisy_new, old, noisy_new, labels, rng.permutation(60), num_intermediate=4)
    old_old, new_new = retrieval_metrics(old, old, labels), retrieval_metrics(noisy_new, noisy_new, labels)
    reverse_old = retrieval_metrics(reverse, old, labels)
    assert curve.top1[0] == pytest.approx(reverse_old["top1"]) and curve.map[0] == pytest.approx(reverse_old["map"])
    assert curve.top1[0] == pytest.approx(old_old["top1"], abs=1 / 60)
    assert curve.map[0] == pytest.approx(old_old["map"], abs=0.02)
    assert curve.top1[-1] == pytest.approx(new_new["top1"]) and curve.map[-1] == pytest.approx(new_new["map"])
    # with identical spaces the merge is the whole gallery in one space: every point is the same ranking
    flat = online_curve(old, old, old, old, labels, rng.permutation(60), num_intermediate=4)
    assert np.allclose(flat.top1, old_old["top1"]) and np.allclose(flat.map, old_old["map"])
    plain = backfill_curve(old, old, old, labels, num_intermediate=4)
    assert flat.top1.tolist() == pytest.approx(plain.top1.tolist())


def test_monotonicity_of_a_curve():
    rising = {"top1": [0.1, 0.2, 0.2, 0.5], "map": [0.1, 0.1, 0.3, 0.4]}
    assert monotonicity(rising) == {"top1_max_drop": 0.0, "map_max_drop": 0.0, "monotone": True}
    dipping = {"top1": [0.3, 0.2, 0.5, 0.45], "map": [0.1, 0.2, 0.3, 0.4]}
    result = monotonicity(dipping)
    assert result["top1_max_drop"] == pytest.approx(0.1) and result["map_max_drop"] == 0.0
    assert result["monotone"] is False


def test_the_evaluation_stage_measures_online_backfilling_in_each_order(tmp_path):
    """fastfill.tasks.method_curves.online_curves_of on a stage layout: the adapter fitted on new_train's
    pairs reverse-maps the new test features; each dual order, with monotonicity in the metrics."""
    from fastfill.components.evaluation.ordering import random_order
    from fastfill.components.evaluation.reports import build_metrics
    from fastfill.components.experiment.adapters import fit_adapter
    from fastfill.components.platform.config import EvaluateConfig
    from fastfill.tasks.method_curves import online_curves_of
    from tests.stage_layouts import evaluation_layout

    rng = np.random.default_rng(5)
    labels = rng.integers(0, 3, 30)
    old = (rng.normal(size=(3, 4))[labels] + rng.normal(scale=0.5, size=(30, 4))).astype(np.float32)
    new = (rng.normal(size=(3, 6))[labels] + rng.normal(scale=0.5, size=(30, 6))).astype(np.float32)
    train_old, train_new = rng.normal(size=(50, 4)).astype(np.float32), rng.normal(size=(50, 6)).astype(np.float32)
    layout = evaluation_layout(tmp_path, labels, old, new, train=(train_old, train_new))

    config = EvaluateConfig(online=["low_rank"], dual_orders=["random"], curve_points=3, seed=4, adapter_rank=2)
    curves = online_curves_of(config, layout)
    assert set(curves) == {"online_low_rank"} and set(curves["online_low_rank"]) == {"random"}
    reverse = fit_adapter("low_rank", train_new, train_old, rank=2)(new)
    expected = online_curve(reverse, new, old, new, labels, random_order(30, 4), num_intermediate=3)
    curve = curves["online_low_rank"]["random"]
    assert curve["top1"] == pytest.approx(expected.top1.tolist()) and "monotone" in curve
    assert config.headlines["online_low_rank"] == "random"
    metrics = build_metrics({}, curves, config.headlines, {})
    assert metrics["online_low_rank"]["monotone"] == curve["monotone"]
    assert metrics["online_low_rank"]["by_order"]["random"]["top1_max_drop"] == curve["top1_max_drop"]


def test_the_metric_compatible_term_against_a_literal_computation():
    """Two anchors of classes 0 and 1 in 1-D: the candidates of anchor 0 are the other new item
    (distance 4) and the two old items through the reverse transformation (distances 0.25 and
    6.25); its positive is the old item of its own class."""
    from fastfill.components.experiment.adapters import metric_compatible_loss

    new = torch.tensor([[0.0], [2.0]])
    reverse = torch.tensor([[0.5], [2.0]])
    old = torch.tensor([[0.0], [3.0]])
    labels = torch.tensor([0, 1])
    loss = metric_compatible_loss(reverse, new, old, labels, scale=1.0, temperature=1.0)
    logits0 = torch.tensor([-4.0, -0.25, -6.25])  # new item 1, old items 0 and 1
    logits1 = torch.tensor([-4.0, -4.0, -1.0])  # new item 0, old items 0 and 1
    expected = torch.stack([-(logits0[1] - torch.logsumexp(logits0, 0)), -(logits1[2] - torch.logsumexp(logits1, 0))])
    assert torch.allclose(loss, expected)
    # a same-class new item is a positive too: the loss is the mean over the positives
    both = metric_compatible_loss(reverse, new, old, torch.tensor([0, 0]), scale=2.0, temperature=0.5)
    scaled0 = logits0  # temperature * scale = 1
    assert both[0] == pytest.approx(float(-(scaled0 - torch.logsumexp(scaled0, 0)).mean()))


def test_the_metric_compatible_reverse_transformation_makes_the_merge_rise():
    """An old space at another scale than the new one: a reverse transformation fitted by least
    squares lands on the old features, but its distances do not rank with the new ones, and the
    merge falls below its start; the metric-compatible one rises along the backfill."""
    from fastfill.components.experiment.adapters import fit_adapter, fit_metric_compatible

    rng = np.random.default_rng(7)
    centres_old, centres_new = rng.normal(size=(4, 6)), rng.normal(size=(4, 8))

    def draw(n):
        y = rng.integers(0, 4, n)
        old = 3.0 * (centres_old[y] + rng.normal(scale=0.9, size=(n, 6)))  # wide, noisy old space
        new = centres_new[y] + rng.normal(scale=0.3, size=(n, 8))
        return y, old.astype(np.float32), new.astype(np.float32)

    train_y, train_old, train_new = draw(600)
    y, old, new = draw(200)
    order = rng.permutation(200)
    curves = {}
    fitted = {"low_rank": fit_adapter("low_rank", train_new, train_old, rank=6),
              "metric_compatible": fit_metric_compatible(train_new, train_old, train_y, rank=6, min_steps=300)}
    for kind, adapter in fitted.items():
        scaled = new * np.float32(getattr(adapter, "new_scale", 1.0))
        curves[kind] = online_curve(adapter(new), scaled, old, scaled, y, order, num_intermediate=8)
    plain, compatible = curves["low_rank"], curves["metric_compatible"]
    assert monotonicity(plain.to_dict())["map_max_drop"] > 0.1  # least squares: the merge falls at first
    assert monotonicity(compatible.to_dict())["monotone"]  # metric-compatible: it never falls
    assert compatible.map.mean() > plain.map.mean() + 0.05
    assert fitted["metric_compatible"].new_scale > 1.5  # the new space's distances raised to the old scale
    with pytest.raises(ValueError, match="class labels"):
        fit_adapter("metric_compatible", train_new, train_old)
