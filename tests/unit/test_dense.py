"""Dense: nn.Linear whose CPU products run on oneDNN (the same bytes on Intel and AMD under the
AVX2 pin, at MKL's native speed). It must compute what nn.Linear computes, forward and backward,
and step aside wherever oneDNN does not apply."""

import io

import pytest
import torch
from torch.nn import functional as F

from fastfill.components.experiment import dense
from fastfill.components.experiment.dense import Dense, uses_onednn


@pytest.mark.parametrize("shape", [(256, 128), (1, 128), (7, 3, 128), (128,)])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_both_gradients_match_torch_linear(shape, bias):
    torch.manual_seed(0)
    layer = Dense(128, 64, bias=bias)
    x = torch.randn(*shape, requires_grad=True)
    out = layer(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    assert uses_onednn(x, layer.weight)
    x2 = x.detach().clone().requires_grad_()
    weight = layer.weight.detach().clone().requires_grad_()
    b = layer.bias.detach().clone().requires_grad_() if bias else None
    reference = F.linear(x2, weight, b)
    reference.backward(grad)
    assert out.shape == reference.shape
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.weight.grad, weight.grad, rtol=1e-5, atol=1e-4)
    if bias:
        torch.testing.assert_close(layer.bias.grad, b.grad, rtol=1e-5, atol=1e-5)


def test_the_products_run_on_onednn_not_on_torch_linear(monkeypatch):
    """Forward and backward go through oneDNN's product (three calls a step), never F.linear."""
    calls = []
    product = dense._PRODUCT
    monkeypatch.setattr(dense, "_PRODUCT", lambda *args: calls.append(args[0].shape) or product(*args))
    monkeypatch.setattr(dense.F, "linear", lambda *args: pytest.fail("F.linear was called"))
    layer = Dense(16, 8)
    layer(torch.randn(32, 16, requires_grad=True)).sum().backward()
    assert calls == [(32, 16), (32, 8), (8, 32)]  # x W^T, grad W, grad^T x


def test_a_frozen_layer_computes_no_weight_gradient(monkeypatch):
    calls = []
    product = dense._PRODUCT
    monkeypatch.setattr(dense, "_PRODUCT", lambda *args: calls.append(args[0].shape) or product(*args))
    layer = Dense(16, 8).requires_grad_(False)
    x = torch.randn(32, 16, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is None
    assert calls == [(32, 16), (32, 8)]


def test_it_steps_aside_where_onednn_does_not_apply():
    layer = Dense(16, 8)
    assert not uses_onednn(torch.randn(0, 16), layer.weight)
    assert not uses_onednn(torch.randn(4, 16, dtype=torch.float64), layer.weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not uses_onednn(torch.randn(4, 16), layer.weight)
        assert layer(torch.randn(4, 16)).dtype == torch.bfloat16  # autocast's own cast, as nn.Linear
    assert layer(torch.randn(0, 16)).shape == (0, 8)
    assert layer.double()(torch.randn(4, 16, dtype=torch.float64)).dtype == torch.float64


def test_it_is_an_nn_linear_to_state_dicts_and_exporters():
    """The same parameters and state dict as nn.Linear, and a traced or exported model sees a
    plain linear layer (no Python function in the graph)."""
    torch.manual_seed(0)
    layer = Dense(16, 8)
    plain = torch.nn.Linear(16, 8)
    plain.load_state_dict(layer.state_dict())
    assert layer.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(4, 16)
    traced = torch.jit.trace(layer, x)
    assert "linear" in str(traced.graph) and "PythonOp" not in str(traced.graph)
    torch.testing.assert_close(traced(x), plain(x))
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    plain.load_state_dict(torch.load(buffer, weights_only=True))
