"""Linear layers whose CPU matrix products give the same bytes on Intel and AMD at full speed.

torch computes ``nn.Linear`` on the CPU with MKL's sgemm. MKL picks its kernels by CPU maker: only
its COMPATIBLE branch (what ``compute.cpu_kernels: avx2`` sets) gives the same bytes on both, and
on the alignment maps' layers that branch ran 2.4x slower than MKL's own kernels
(``benchmarks/cpu_kernels.py``). oneDNN's matrix products are generated code for the instruction
set ``ONEDNN_MAX_CPU_ISA`` allows (AVX2 under the pin) and the same on every maker, as its
convolutions already are in the CNNs: ``Dense`` sends the forward product and both backward
products (input and weight gradients) through oneDNN, at MKL's native speed.

``Dense`` is an ``nn.Linear`` (the same parameters, state dict and initialisation); it computes as
``nn.Linear`` does wherever oneDNN does not apply: other devices or dtypes, an empty batch, under
autocast (bfloat16 training: torch's own casts), and while torch traces or exports the model
(ONNX sees a plain linear layer).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def _onednn_product():
    """oneDNN's linear product on dense CPU tensors (what torch's compiler itself calls), or None
    in a torch build without it."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


_PRODUCT = _onednn_product()


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` by oneDNN: x (N, K), weight (M, K), any strides."""
    return _PRODUCT(x, weight, bias, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _product(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = _product(grad, weight.t(), None) if ctx.needs_input_grad[0] else None  # grad @ W
        grad_weight = _product(grad.t(), x.t(), None) if ctx.needs_input_grad[1] else None  # grad^T @ x
        grad_bias = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``Dense`` computes this product through oneDNN."""
    if torch.jit.is_tracing() or torch.jit.is_scripting() or torch.onnx.is_in_onnx_export() \
            or torch.compiler.is_compiling():
        return False
    return (_PRODUCT is not None and x.device.type == "cpu" and weight.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.dim() >= 1
            and x.numel() > 0 and not torch.is_autocast_enabled("cpu"))


class Dense(nn.Linear):
    """``nn.Linear`` whose CPU float32 products run on oneDNN (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not uses_onednn(x, self.weight):
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        out = _OneDNNLinear.apply(rows, self.weight, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features) if x.dim() != 2 else out
