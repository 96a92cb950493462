"""Tutel's switchable parallelism (parallel="adaptive"): r = 0 (data parallel for experts: gather
the weights, keep the tokens) computes exactly what r = 1 (expert parallel) does, outputs and
every gradient, with the same sharded parameters and no parameter movement between calls."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from weft import MoE
from weft.testing import run_checks

DIM, HIDDEN, EXPERTS = 16, 24, 8


def _run(moe, x, dy, **kw):
    moe.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = moe(x, **kw)
    (y.float() * dy).sum().backward()
    return y.detach().float(), x.grad.float(), {n: p.grad.float().clone() for n, p in moe.named_parameters()}


def adaptive_worker() -> list[str]:
    rank = dist.get_rank()
    failures = []
    for gate, cap, dtype in itertools.product(("topk", "bpr", "expert_choice"), (1.0, 0, None),
                                              (torch.float32, torch.bfloat16)):
        if gate == "expert_choice" and not cap:
            continue
        torch.manual_seed(0)
        moe = MoE(DIM, HIDDEN, EXPERTS, top_k=2, gate=gate, capacity_factor=cap, activation="swiglu",
                  parallel="adaptive", dtype=dtype)
        before = {n: p.detach().clone() for n, p in moe.named_parameters()}
        gen = torch.Generator().manual_seed(rank)
        tokens = 20 + 4 * rank if cap is None else 24
        x = (torch.randn(tokens, DIM, generator=gen) + torch.eye(DIM)[0]).to(dtype)
        dy = torch.randn(tokens, DIM, generator=gen)
        ep, dp = _run(moe, x, dy, parallel=1), _run(moe, x, dy, parallel=0)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        pairs = [("y", dp[0], ep[0]), ("dx", dp[1], ep[1])] + [(n, dp[2][n], ep[2][n]) for n in ep[2]]
        for name, a, b in pairs:
            err = float((a - b).norm() / b.norm().clamp_min(1e-12))
            if err > tol:
                failures.append(f"rank {rank} gate={gate} cf={cap} {dtype}: {name} rel err {err:.2e}")
        if any(not torch.equal(p, before[n]) for n, p in moe.named_parameters()):
            failures.append("parameters changed")  # switching r moves no parameters
    return failures


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_data_parallel_experts_equal_expert_parallel(world_size):
    failures = run_checks(adaptive_worker, world_size, timeout=300)
    assert not failures, "\n".join(failures[:10])


def test_parallel_arguments_are_checked():
    with pytest.raises(ValueError, match="unknown parallel 'zero'"):
        MoE(DIM, HIDDEN, EXPERTS, parallel="zero")
    moe = MoE(DIM, HIDDEN, EXPERTS)
    with pytest.raises(ValueError, match="needs MoE\\(..., parallel='adaptive'\\)"):
        moe(torch.randn(4, DIM), parallel=0)
    adaptive = MoE(DIM, HIDDEN, EXPERTS, parallel="adaptive")
    with pytest.raises(ValueError, match="r > 1 .* is not implemented yet"):
        adaptive(torch.randn(4, DIM), parallel=2)
