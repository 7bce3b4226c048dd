import numpy as np
import pytest
import torch

from fastfill.components.experiment.data import Split
from fastfill.components.experiment.inference import apply_alignment, embed
from fastfill.components.experiment.map_training import train_alignment, true_alignment_loss
from fastfill.components.experiment.models import (
    AlignmentMap,
    Embedder,
    load_alignment,
    load_embedder,
    save_alignment,
    save_embedder,
)
from fastfill.components.experiment.training import TrainingRun, train_embedder
from fastfill.components.platform.config import AlignConfig, TrainConfig
from testkit.tiny_demo import class_image

CPU = torch.device("cpu")


@pytest.mark.parametrize("backbone", ["cnn_small", "cnn", "resnet18"])
def test_backbones_give_embeddings_and_logits(backbone):
    model = Embedder(TrainConfig(backbone=backbone, width=4, embedding_dim=8), 1, [0, 1, 2]).eval()
    features = model(torch.rand(2, 1, 16, 16))
    assert features.shape == (2, 8)
    assert model.classify(features).shape == (2, 3)


def test_class_index_maps_global_labels_to_rows():
    model = Embedder(TrainConfig(backbone="cnn_small", width=2), 1, [1, 3, 4])
    assert model.class_index(torch.tensor([3, 1, 4, 0, 7])).tolist() == [1, 0, 2, -1, -1]


def _split(n_per_class=24, classes=(0, 1, 2, 3), seed=0) -> Split:
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.array(classes), n_per_class)
    images = np.stack([class_image(int(c), rng, 16, 6) for c in labels])[:, None]
    return Split(images, labels.astype(np.int64))


def test_embedder_training_lowers_its_loss_and_resumes(tmp_path):
    config = TrainConfig(backbone="cnn_small", width=4, embedding_dim=8, epochs=4, batch_size=16, lr=5e-3)
    checkpoint = tmp_path / "ckpt.pt"
    progress = []
    run = TrainingRun(CPU, checkpoint, lambda m: None, lambda done, total: progress.append((done, total)))
    model, history = train_embedder(config, _split(), [0, 1, 2, 3], (0.3, 0.3), run=run)
    assert history[-1]["loss"] < history[0]["loss"]
    assert progress == [(1, 4), (2, 4), (3, 4), (4, 4)]
    # Re-running the same config resumes from the final checkpoint: no epoch is trained again.
    messages, resumed = [], []
    again, history2 = train_embedder(config, _split(), [0, 1, 2, 3], (0.3, 0.3),
                                     run=TrainingRun(CPU, checkpoint, messages.append,
                                                     lambda done, total: resumed.append((done, total))))
    assert history2 == history and any("resuming" in m for m in messages)
    assert resumed == [(4, 4)]  # no epoch trained, and the progress still ends at 100%
    for a, b in zip(model.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)


def test_training_is_seeded():
    config = TrainConfig(backbone="cnn_small", width=4, embedding_dim=8, epochs=1, batch_size=16)
    a, _ = train_embedder(config, _split(), [0, 1, 2, 3], (0.3, 0.3), run=TrainingRun(CPU, log=lambda m: None))
    b, _ = train_embedder(config, _split(), [0, 1, 2, 3], (0.3, 0.3), run=TrainingRun(CPU, log=lambda m: None))
    images = _split(4).images
    assert np.allclose(embed(a, images, device=CPU), embed(b, images, device=CPU))


def test_labels_outside_the_model_classes_are_refused():
    config = TrainConfig(backbone="cnn_small", width=4, epochs=1)
    with pytest.raises(ValueError, match="outside the model's classes"):
        train_embedder(config, _split(), [0, 1], (0.3, 0.3), run=TrainingRun(CPU, log=lambda m: None))


def test_saved_models_load_back(tmp_path):
    config = TrainConfig(backbone="cnn", width=4, embedding_dim=8)
    model = Embedder(config, 1, [0, 2], 0.4, 0.2).eval()
    save_embedder(model, config, tmp_path / "m.pt")
    loaded = load_embedder(tmp_path / "m.pt")
    x = torch.rand(3, 1, 16, 16)
    assert torch.allclose(model(x), loaded(x))
    assert loaded.classes.tolist() == [0, 2] and float(loaded.pixel_std) == pytest.approx(0.2)
    h = AlignmentMap(8, 6, [5], uncertainty=True).eval()
    save_alignment(h, AlignConfig(hidden=[5], uncertainty=True, disc=True), tmp_path / "h.pt")
    assert torch.allclose(h(x[:, 0, 0, :8]), load_alignment(tmp_path / "h.pt")(x[:, 0, 0, :8]))


def _feature_pairs(n=256, d_old=6, d_new=5, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    centers = rng.normal(size=(classes, d_new)).astype(np.float32) * 3
    new = centers[labels] + rng.normal(scale=0.3, size=(n, d_new)).astype(np.float32)
    mixing = rng.normal(size=(d_new, d_old)).astype(np.float32)
    old = np.tanh(new @ mixing) + rng.normal(scale=0.05, size=(n, d_old)).astype(np.float32)
    classifier = torch.nn.Linear(d_new, classes, bias=False)
    with torch.no_grad():
        classifier.weight.copy_(torch.from_numpy(centers))
    return old.astype(np.float32), new.astype(np.float32), labels, classifier


@pytest.mark.parametrize("terms", [dict(l2=True), dict(l2=True, disc=True, uncertainty=True), dict(disc=True, l2=False)])
def test_alignment_training_lowers_its_loss(terms):
    old, new, labels, classifier = _feature_pairs()
    config = AlignConfig(hidden=[32, 32], epochs=12, warmup_epochs=1, batch_size=32, lr=3e-3, min_steps=0, **terms)
    h, history = train_alignment(config, old, new, labels, classifier, device=CPU, log=lambda m: None)
    assert history[-1]["loss"] < history[0]["loss"]
    transformed, log_sigma2 = apply_alignment(h, old, device=CPU)
    assert transformed.shape == new.shape
    assert (log_sigma2 is not None) == config.uncertainty
    loss = true_alignment_loss(config, transformed, new, labels, classifier)
    assert loss.shape == (len(old),) and np.isfinite(loss).all()


def test_sigma_tracks_the_true_loss():
    """psi learns log sigma^2 ~ log of the per-sample loss: items it is unsure of have larger losses."""
    old, new, labels, classifier = _feature_pairs(n=512)
    config = AlignConfig(hidden=[32, 32], epochs=25, warmup_epochs=2, batch_size=32, lr=3e-3, min_steps=0, disc=True,
                         uncertainty=True)
    h, _ = train_alignment(config, old, new, labels, classifier, device=CPU, log=lambda m: None)
    transformed, log_sigma2 = apply_alignment(h, old, device=CPU)
    loss = true_alignment_loss(config, transformed, new, labels, classifier)
    from fastfill.components.evaluation.ordering import kendall_tau

    assert kendall_tau(log_sigma2, loss) > 0.2


def test_alignment_inputs_must_describe_the_same_images():
    old, new, labels, classifier = _feature_pairs()
    with pytest.raises(ValueError, match="same images"):
        train_alignment(AlignConfig(hidden=[4], epochs=2, warmup_epochs=1), old[:-1], new, labels, classifier,
                        device=CPU, log=lambda m: None)


def test_a_checkpoint_of_other_data_is_not_resumed(tmp_path):
    config = TrainConfig(backbone="cnn_small", width=4, embedding_dim=8, epochs=1, batch_size=16)
    checkpoint = tmp_path / "ckpt.pt"
    train_embedder(config, _split(seed=0), [0, 1, 2, 3], (0.3, 0.3),
                   run=TrainingRun(CPU, checkpoint, lambda m: None))
    messages = []
    train_embedder(config, _split(seed=1), [0, 1, 2, 3], (0.3, 0.3),
                   run=TrainingRun(CPU, checkpoint, messages.append))
    assert not any("resuming" in m for m in messages)


def test_training_precision_resolves_per_device(monkeypatch):
    from fastfill.components.experiment import training

    assert training.training_dtype(CPU, "fp32") is None
    assert training.training_dtype(CPU, "bf16") is torch.bfloat16
    monkeypatch.setattr(training, "cpu_has_fast_bf16", lambda: True)
    assert training.training_dtype(CPU, "auto") is torch.bfloat16
    monkeypatch.setattr(training, "cpu_has_fast_bf16", lambda: False)  # emulated bfloat16 is slower: float32
    assert training.training_dtype(CPU, "auto") is None
    with pytest.raises(ValueError, match="fp32, bf16 or auto"):
        training.training_dtype(CPU, "half")


def test_bf16_training_runs_its_forward_passes_in_bfloat16_and_learns_as_float32_does():
    """bf16: the matrix products of the forward pass run in bfloat16 (a hook sees it), the
    weights stay float32, and the map reaches the loss the float32 map reaches (within 10%)."""
    old, new, labels, classifier = _feature_pairs(n=512)
    seen = []
    hook = torch.nn.modules.module.register_module_forward_hook(
        lambda module, inputs, output: seen.append(output.dtype) if isinstance(module, torch.nn.Linear) else None)
    try:
        results = {}
        for precision in ("fp32", "bf16"):
            seen.clear()
            config = AlignConfig(hidden=[32, 32], epochs=12, warmup_epochs=1, batch_size=32, lr=3e-3, min_steps=0,
                                 validation_fraction=0, precision=precision)
            h, history = train_alignment(config, old, new, labels, classifier, device=CPU, log=lambda m: None)
            results[precision] = (history[-1]["loss"], history[0]["loss"], set(seen))
            assert all(p.dtype == torch.float32 for p in h.parameters())
    finally:
        hook.remove()
    assert results["fp32"][2] == {torch.float32} and torch.bfloat16 in results["bf16"][2]
    (fp32_end, fp32_start, _), (bf16_end, bf16_start, _) = results["fp32"], results["bf16"]
    assert bf16_end < 0.5 * bf16_start and fp32_end < 0.5 * fp32_start
    assert bf16_end == pytest.approx(fp32_end, rel=0.1) and bf16_end != fp32_end
    # the embedder too: bfloat16 convolutions, float32 weights, and it learns
    ends = {}
    for precision in ("fp32", "bf16"):
        config = TrainConfig(backbone="cnn_small", width=4, embedding_dim=8, epochs=4, batch_size=16, lr=5e-3,
                             precision=precision)
        model, history = train_embedder(config, _split(), [0, 1, 2, 3], (0.3, 0.3),
                                        run=TrainingRun(CPU, log=lambda m: None))
        assert history[-1]["loss"] < history[0]["loss"]
        assert all(p.dtype == torch.float32 for p in model.parameters())
        ends[precision] = history[-1]["loss"]
    assert ends["bf16"] == pytest.approx(ends["fp32"], rel=0.1) and ends["bf16"] != ends["fp32"]


def test_embedder_training_shows_its_progress_with_rate_and_time_left(monkeypatch):
    """Logs (no terminal): a line with the steps done, the rate and the time left, at most every
    FASTFILL_PROGRESS_SECONDS, and one at the end; the training itself is the same."""
    monkeypatch.setenv("FASTFILL_PROGRESS", "log")
    monkeypatch.setenv("FASTFILL_PROGRESS_SECONDS", "0")
    config = TrainConfig(backbone="cnn_small", width=4, embedding_dim=8, epochs=2, batch_size=16)
    lines = []
    shown, history = train_embedder(config, _split(), [0, 1, 2, 3], (0.3, 0.3), run=TrainingRun(CPU, log=lines.append))
    steps = [line for line in lines if line.startswith("training the cnn_small model:")]
    assert steps and "step/s" in steps[0] and "left" in steps[0], lines
    assert steps[-1].startswith(f"training the cnn_small model: done, {history[-1]['step']}/{history[-1]['step']} "
                                "steps (100%)"), steps[-1]
    monkeypatch.setenv("FASTFILL_PROGRESS", "off")
    quiet, _ = train_embedder(config, _split(), [0, 1, 2, 3], (0.3, 0.3), run=TrainingRun(CPU, log=lambda m: None))
    for a, b in zip(shown.state_dict().values(), quiet.state_dict().values()):
        assert torch.equal(a, b)
