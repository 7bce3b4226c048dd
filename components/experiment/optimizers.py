"""Adam and AdamW whose square root is correctly rounded on every CPU.

torch.optim.Adam divides each step by the square root of its second moment, and on the CPU
torch computes that root through MKL's vector maths, whose last bits follow the CPU maker's
approximate reciprocal square root: an Intel and an AMD CPU train other weights from the same
seed, and every stage after training gives other bytes (reports/cpu_kernels.md). numpy's
``sqrt`` is the IEEE square root instruction, correctly rounded on every x86-64 CPU; these
optimisers take the root from it and do everything else as torch's single-tensor Adam does
(same state names, same order of operations), so a pinned run gives the same bytes on Intel
and AMD. On a GPU the root is torch's, which CUDA rounds correctly too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch


def exact_sqrt(values: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of ``values``, in a new tensor (numpy's on the CPU)."""
    if values.device.type != "cpu":
        return values.sqrt()
    out = torch.empty_like(values, memory_format=torch.contiguous_format)
    np.sqrt(values.contiguous().numpy(), out=out.numpy())
    return out


class ExactAdam(torch.optim.Optimizer):
    """Adam (``decoupled=False``: weight decay added to the gradient, as torch.optim.Adam) or
    AdamW (``decoupled=True``: weight decay applied to the weights, as torch.optim.AdamW), with
    the square root of :func:`exact_sqrt`. Works with torch's learning-rate schedulers and its
    state_dict, like any ``torch.optim.Optimizer``."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, decoupled: bool = False):
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"ExactAdam needs lr, eps and weight_decay >= 0 and betas in [0, 1), "
                             f"got lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                                  "decoupled": decoupled})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("ExactAdam does not take sparse gradients")
                grad = param.grad
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["step"] = step = int(state["step"]) + 1
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                if decay:
                    if group["decoupled"]:
                        param.mul_(1 - lr * decay)
                    else:
                        grad = grad.add(param, alpha=decay)
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step_size = lr / (1 - beta1 ** step)
                denom = exact_sqrt(exp_avg_sq).div_(math.sqrt(1 - beta2 ** step)).add_(eps)
                param.addcdiv_(exp_avg, denom, value=-step_size)
        return loss
