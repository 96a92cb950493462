"""`Experts.forward_part` with `WeightGradParts`: several calls of the experts on different rows
in one backward give the gradients of one call on all the rows, the weight gradients summed
inside the matmuls (no full-size gradient added to another)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from weft.moe.experts import Experts, WeightGradParts

LOCAL, DIM, HIDDEN = 3, 8, 12
ROWS = (5, 7)


def _two_calls(experts: Experts, x_a, x_b, parts: WeightGradParts | None, reverse: bool):
    """(experts(x_a), experts(x_b)), computed in that order, or with `reverse` b first (autograd
    then runs a's backward first: the other call is the last and sums the weight gradients)."""
    call = experts if parts is None else (lambda x: experts.forward_part(x, parts))
    if reverse:
        y_b = call(x_b)
        return call(x_a), y_b
    y_a = call(x_a)
    return y_a, call(x_b)


@pytest.mark.parametrize("activation", ["relu", "gelu", "swiglu"])
@pytest.mark.parametrize("reverse", [False, True])
def test_parts_give_the_gradients_of_one_call_on_all_rows(activation, reverse):
    torch.manual_seed(0)
    experts = Experts(DIM, HIDDEN, LOCAL, activation=activation, dtype=torch.float64)
    x = torch.randn(LOCAL, sum(ROWS), DIM, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(LOCAL, sum(ROWS), DIM, dtype=torch.float64)
    params = list(experts.parameters())
    want = torch.autograd.grad(experts(x), [x, *params], dy)
    x_a, x_b = x.split(ROWS, dim=1)
    parts = WeightGradParts(experts, 2, torch.float64)
    y_a, y_b = _two_calls(experts, x_a, x_b, parts, reverse)
    dy_a, dy_b = dy.split(ROWS, dim=1)
    loss = (y_a * dy_a).sum() + (y_b * dy_b).sum()
    got = torch.autograd.grad(loss, [x, *params])
    assert len(got) == 1 + (3 if activation == "swiglu" else 2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


class _Adds(TorchDispatchMode):
    """The shapes of the out-of-place adds run under it."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "add":
            self.shapes.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("with_parts", [False, True])
def test_parts_add_no_weight_sized_gradients(with_parts):
    """Autograd sums a weight's two gradients with an add of the weight's size; the parts do not
    (the add this avoids is what the test sees without them)."""
    torch.manual_seed(1)
    experts = Experts(DIM, HIDDEN, LOCAL, activation="relu")
    x_a, x_b = (torch.randn(LOCAL, n, DIM, requires_grad=True) for n in ROWS)
    parts = WeightGradParts(experts, 2, torch.float32) if with_parts else None
    y_a, y_b = _two_calls(experts, x_a, x_b, parts, reverse=False)
    with _Adds() as adds:
        (y_a.square().sum() + y_b.square().sum()).backward()
    weight_sized = [s for s in adds.shapes if s in {tuple(p.shape) for p in experts.parameters()}]
    assert bool(weight_sized) != with_parts, adds.shapes
    assert all(p.grad is not None for p in experts.parameters())


def test_parts_under_autocast_keep_float32_weight_gradients():
    """float32 weights, bf16 compute: the weights cast once, bf16 products, float32 gradients equal
    to one bf16 call's to bf16 rounding."""
    torch.manual_seed(2)
    experts = Experts(DIM, HIDDEN, LOCAL, activation="swiglu")
    x = torch.randn(LOCAL, sum(ROWS), DIM)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.autograd.grad(experts(x).float().square().sum(), list(experts.parameters()))
        parts = WeightGradParts(experts, 2, experts.compute_dtype(x))
        outs = [experts.forward_part(rows, parts) for rows in x.split(ROWS, dim=1)]
    assert all(y.dtype == torch.bfloat16 for y in outs)
    got = torch.autograd.grad(sum(y.float().square().sum() for y in outs), list(experts.parameters()))
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
