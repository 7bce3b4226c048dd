"""The product's optimiser: torch's Adam and AdamW with a correctly rounded square root, so that
training gives the same bytes on Intel and AMD CPUs (benchmarks/cpu_kernels.py)."""

import numpy as np
import pytest
import torch
from torch import nn

from fastfill.components.experiment.optimizers import ExactAdam


def test_exact_adam_is_adam_and_adamw_with_a_correctly_rounded_root():
    """The product's optimiser takes torch's Adam and AdamW steps (same state names) to within a
    float32 rounding of the square root, and its root is numpy's exactly."""
    from fastfill.components.experiment.optimizers import exact_sqrt

    values = torch.from_numpy(np.random.default_rng(0).random(10_000, dtype=np.float32) * 1e3)
    assert exact_sqrt(values).numpy().tobytes() == np.sqrt(values.numpy()).tobytes()
    for decoupled, reference in ((False, torch.optim.Adam), (True, torch.optim.AdamW)):
        torch.manual_seed(0)
        ours, theirs = nn.Linear(16, 8), nn.Linear(16, 8)
        theirs.load_state_dict(ours.state_dict())
        mine = ExactAdam(ours.parameters(), lr=1e-2, weight_decay=0.1, decoupled=decoupled)
        other = reference(theirs.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
        x, y = torch.randn(64, 16), torch.randn(64, 8)
        for _ in range(20):
            for model, optimiser in ((ours, mine), (theirs, other)):
                optimiser.zero_grad()
                ((model(x) - y) ** 2).mean().backward()
                optimiser.step()
        for a, b in zip(ours.parameters(), theirs.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert set(mine.state[ours.weight]) == {"step", "exp_avg", "exp_avg_sq"}
        assert mine.state[ours.weight]["step"] == 20
    with pytest.raises(ValueError, match="betas"):
        ExactAdam(nn.Linear(2, 2).parameters(), betas=(0.9, 1.0))
