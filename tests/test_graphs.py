"""`weft.graphs` where no GPU is: what the CPU can check of the graph helpers (their captures and
replays are tested on GPUs in tests/test_gpu.py)."""
from __future__ import annotations

import math

import pytest
import torch

from weft.graphs import CaptureError, GraphedStep, time_graphed


def test_cpu_steps_cannot_be_captured_and_time_as_infinite():
    """A step of CPU tensors is refused with CaptureError; `time_graphed` times such candidates as
    infinite (never chosen) and leaves no gradient behind."""
    weight = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3)

    def step_of(depth: int):
        def step(x_in: torch.Tensor) -> None:
            h = x_in
            for _ in range(depth):
                h = h @ weight
            h.sum().backward()
        return step

    with pytest.raises(CaptureError, match="CUDA tensor"):
        GraphedStep(step_of(1), [x], grads_of=[weight])
    for accumulate in (True, False):
        seconds = time_graphed(step_of, (1, 2), (x,), [weight], trials=1, accumulate=accumulate)
        assert seconds == [math.inf, math.inf]
        assert weight.grad is None
