"""`Experts.forward_by_source`: the padded experts on the rows where an all-to-all leaves them (by
source rank, then expert) compute what Tutel's Flexible layout (expert, then source) computes,
with no copy of the rows."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from weft.moe.experts import Experts, by_source_pays

SOURCES, LOCAL, SLOTS, DIM, HIDDEN = 3, 4, 5, 8, 12


def _flexible(experts: Experts, x_WGCD: torch.Tensor) -> torch.Tensor:
    W, G, C, D = x_WGCD.shape
    out = experts(x_WGCD.transpose(0, 1).reshape(G, W * C, D))
    return out.view(G, W, C, D).transpose(0, 1)


def _grads(experts: Experts, fn, x: torch.Tensor, dy: torch.Tensor):
    x = x.detach().clone().requires_grad_()
    y = fn(experts, x)
    params = [p for p in experts.parameters()]
    return (y, *torch.autograd.grad(y, [x, *params], dy))


@pytest.mark.parametrize("activation", ["relu", "gelu", "swiglu"])
@pytest.mark.parametrize("sources", [1, 2, SOURCES])
def test_by_source_computes_the_flexible_layout(activation, sources):
    torch.manual_seed(0)
    experts = Experts(DIM, HIDDEN, LOCAL, activation=activation, dtype=torch.float64)
    x = torch.randn(sources, LOCAL, SLOTS, DIM, dtype=torch.float64)
    dy = torch.randn_like(x)
    got = _grads(experts, Experts.forward_by_source, x, dy)
    want = _grads(experts, _flexible, x, dy)
    assert got[0].is_contiguous() and got[0].shape == x.shape
    assert len(got) == len(want) == 2 + (3 if activation == "swiglu" else 2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_by_source_under_autocast_casts_as_the_flexible_layout_does():
    """float32 weights under bf16 autocast: bf16 products, float32 weight gradients."""
    torch.manual_seed(1)
    experts = Experts(DIM, HIDDEN, LOCAL, activation="relu")
    x = torch.randn(SOURCES, LOCAL, SLOTS, DIM)
    dy = torch.randn(SOURCES, LOCAL, SLOTS, DIM, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _grads(experts, Experts.forward_by_source, x, dy)
        want = _grads(experts, _flexible, x, dy)
    assert got[0].dtype == want[0].dtype == torch.bfloat16
    assert [g.dtype for g in got[2:]] == [torch.float32, torch.float32]
    for a, b in zip(got, want):  # the weight gradients sum the sources in pieces: bf16 rounding apart
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


class _Copies(TorchDispatchMode):
    """The names of the copying ops run under it."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if "copy" in name or "clone" in name or name == "contiguous":
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def test_by_source_pays_where_the_rows_outweigh_the_weight_gradients():
    # qwen2-moe-2l's training batch (2 ranks, 2,560 slots, swiglu 1,408 wide) and the layer benchmark's
    # shapes at 4,096 tokens (relu; measured 1-5% slower per source on 2 x H100)
    assert by_source_pays(2, 2560, 1408, 3)
    assert not any(by_source_pays(2, slots, hidden, 2) for slots, hidden in ((256, 1408), (512, 6400), (1024, 14336)))


def test_by_source_copies_the_rows_where_that_pays_less():
    experts = Experts(DIM, 4 * SOURCES * SLOTS, LOCAL, activation="relu", dtype=torch.float64)
    assert not by_source_pays(SOURCES, SLOTS, experts.hidden_dim, 2)
    x = torch.randn(SOURCES, LOCAL, SLOTS, DIM, dtype=torch.float64, requires_grad=True)
    copies = _Copies()
    with copies:
        experts.forward_by_source(x).backward(torch.randn_like(x))
    assert copies.names  # the Flexible layout, chosen


def test_by_source_copies_no_rows():
    experts = Experts(DIM, HIDDEN, LOCAL, activation="relu", dtype=torch.float64)
    assert by_source_pays(SOURCES, SLOTS, HIDDEN, 2)
    x = torch.randn(SOURCES, LOCAL, SLOTS, DIM, dtype=torch.float64, requires_grad=True)
    dy = torch.randn_like(x)  # contiguous, as the all-to-all's backward hands it over
    copies = _Copies()
    with copies:
        experts.forward_by_source(x).backward(dy)
    assert copies.names == [], copies.names
    flexible = _Copies()
    with flexible:
        _flexible(experts, x).backward(dy)
    assert flexible.names  # the layout the rows are copied into (the check above can fail)


def _layer_path_worker(hidden: int) -> tuple[int, list[str]]:
    """One forward + backward of a padded expert-parallel layer: how many per-source matmuls it
    ran, and where its outputs and gradients differ from the same call with the rows copied into
    the Flexible layout (the rule forced off)."""
    import torch.distributed as dist

    import weft.moe.experts as experts_module
    from weft import MoE

    calls = []
    real_bmm, real_rule = experts_module.source_major_bmm, experts_module.by_source_pays
    experts_module.source_major_bmm = lambda *args: calls.append(1) or real_bmm(*args)
    torch.manual_seed(0)
    moe = MoE(DIM, hidden, 4, top_k=1, capacity_factor=1.0, activation="relu")
    x = torch.randn(64, DIM, generator=torch.Generator().manual_seed(dist.get_rank()))

    def run():
        moe.zero_grad(set_to_none=True)
        x_in = x.clone().requires_grad_()
        out = moe(x_in)
        out.backward(torch.ones_like(out))
        return [out.detach(), x_in.grad] + [p.grad.clone() for p in moe.parameters() if p.grad is not None]

    got = run()
    made = len(calls)
    experts_module.by_source_pays = lambda *args: False
    try:
        want = run()
    finally:
        experts_module.by_source_pays = real_rule
    differ = [f"rank {dist.get_rank()} tensor {i}" for i, (a, b) in enumerate(zip(got, want))
              if not torch.allclose(a, b, rtol=1e-5, atol=1e-6)]
    return made, differ + ([] if len(got) == len(want) else ["a different set of gradients"])


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("hidden", [HIDDEN, 4096])
def test_the_padded_exchange_computes_per_source_where_it_pays(world, hidden):
    """World sizes 1, 2 and 4 (gloo), 4 experts, 64 tokens per rank, top-1 at cf 1.0: 64 / 4 = 16
    slots per expert and source. With 12 hidden the rows outweigh the weight gradients and every
    rank of 2 or 4 computes per source (the two matmuls' calls; one rank has a single source, its
    rows already by expert); with 4,096 they do not (the Flexible layout: none). Either way the
    outputs and every gradient are those of the Flexible layout."""
    from weft.testing import run_distributed

    per_source = world > 1 and by_source_pays(world, 16, hidden, 2)
    assert per_source == (world > 1 and hidden == HIDDEN)
    results = run_distributed(_layer_path_worker, world, args=(hidden,), timeout=180)
    assert [made for made, _ in results] == [2 if per_source else 0] * world
    assert not [d for _, differ in results for d in differ], results
