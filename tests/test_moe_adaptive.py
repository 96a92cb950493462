"""Tutel's switchable parallelism (parallel="adaptive"): r = 0 (data parallel for experts: gather
the weights, keep the tokens) computes exactly what r = 1 (expert parallel) does, outputs and
every gradient, with the same sharded parameters and no parameter movement between calls. With
fewer experts than ranks, every r (0 and each divisor of W / E) equals a one-rank layer holding
the whole experts, whose expert gradients are summed over the ranks' tokens."""
from __future__ import annotations

import itertools
import re

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


def adaptive_worker(dtypes=(torch.float32, torch.bfloat16), device: str = "cpu") -> list[str]:
    rank = dist.get_rank()
    failures = []
    for gate, cap, dtype in itertools.product(("topk", "bpr", "expert_choice"), (1.0, 0, None), dtypes):
        if gate == "expert_choice" and not cap:
            continue
        torch.manual_seed(0)
        moe = MoE(DIM, HIDDEN, EXPERTS, top_k=2, gate=gate, capacity_factor=cap, activation="swiglu",
                  parallel="adaptive", dtype=dtype, device=device)
        before = {n: p.detach().clone() for n, p in moe.named_parameters()}
        gen = torch.Generator().manual_seed(rank)
        tokens = 20 + 4 * rank if cap is None else 24
        x = (torch.randn(tokens, DIM, generator=gen) + torch.eye(DIM)[0]).to(device, dtype)
        dy = torch.randn(tokens, DIM, generator=gen).to(device)
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
    assert adaptive.parallel_choices() == [0, 1]
    with pytest.raises(ValueError, match=r"parallel \(r\) must be one of \[0, 1\]"):
        adaptive(torch.randn(4, DIM), parallel=2)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def check_parallel_case(solo: dist.ProcessGroup, experts: int, gate: str, cap, activation: str, dtype: torch.dtype,
                        top_k: int = 2, normalize: bool = True, a2a_algo: str = "linear", kernels: str = "auto",
                        device: str = "cpu") -> tuple[list[str], list[str], int]:
    """parallel="adaptive" at every r it offers (0, and each divisor of the ranks per expert; padded
    modes also pipelined at degrees 2 and 4 for r > 0, Tutel 3.2) and at its own choice, against a
    layer on the one-rank group `solo` holding the whole experts (the same seed, so the same
    weights): outputs, input and router gradients, drops, and each expert gradient summed over the
    ranks' tokens, sliced as this rank holds it (whole experts when E >= W, a 1/m slice of the
    hidden dimension when m = W / E > 1 ranks share one). Switching r moves no parameter.
    (failures, refusals, calls checked): a call this layer refuses with its one-line ValueError
    (e.g. a dedup exchange at r = 0) is named among the refusals, not the failures."""
    rank, world = dist.get_rank(), dist.get_world_size()
    shards, local = max(1, world // experts), max(1, experts // world)
    first = rank // shards * local  # this rank's first expert
    failures, refusals = [], []
    torch.manual_seed(0)
    moe = MoE(DIM, HIDDEN, experts, top_k=top_k, gate=gate, capacity_factor=cap, activation=activation,
              normalize_gates=normalize, a2a_algo=a2a_algo, kernels=kernels, parallel="adaptive", dtype=dtype,
              device=device)
    torch.manual_seed(0)
    whole = MoE(DIM, HIDDEN, experts, top_k=top_k, gate=gate, capacity_factor=cap, activation=activation,
                normalize_gates=normalize, group=solo, dtype=dtype, device=device)
    before = {n: p.detach().clone() for n, p in moe.named_parameters()}
    gen = torch.Generator().manual_seed(rank)
    # dropless allows uneven token counts (not in fixed-size exchanges, nor Comet's buffers sized by them)
    fixed_size = a2a_algo in ("dedup-fixed", "dedup-fixed-own") or kernels == "comet"
    tokens = 20 + 4 * rank if cap is None and not fixed_size else 24
    x = (torch.randn(tokens, DIM, generator=gen) + torch.eye(DIM)[0] * rank).to(device, dtype)
    dy = torch.randn(tokens, DIM, generator=gen).to(device)
    torch.manual_seed(1000 + rank)  # the random gate draws from torch's RNG
    ref = _run(whole, x, dy)
    expect = {}
    for name, grad in ref[2].items():
        if name.startswith("experts."):  # each expert's gradient sums every rank's tokens
            dist.all_reduce(grad)
            part = grad[first : first + local]
            width = HIDDEN // shards
            grad = part.narrow(1 if name == "experts.w2" else 2, (rank % shards) * width, width)
        expect[name] = grad
    degrees = (1, 2, 4) if cap is not None else (1,)
    runs = [(r, d) for r in moe.parallel_choices() for d in degrees if d == 1 or r > 0] + [(None, 1)]
    tol, checked = (1e-5 if dtype == torch.float32 else 3e-2), 0
    for r, d in runs:
        label = (f"rank {rank} E={experts} W={world} gate={gate} cf={cap} k={top_k} {activation} {dtype} "
                 f"norm={normalize} {a2a_algo} {kernels} r={r} d={d}")
        torch.manual_seed(1000 + rank)
        try:
            got = _run(moe, x, dy) if r is None else _run(moe, x, dy, parallel=r, overlap_degree=d)
        except ValueError as e:
            refusals.append(str(e))
            continue
        checked += 1
        pairs = [("y", got[0], ref[0]), ("dx", got[1], ref[1])] + [(n, got[2][n], expect[n]) for n in expect]
        for name, a, b in pairs:
            if a.shape != b.shape:
                failures.append(f"{label}: {name} shape {tuple(a.shape)} != {tuple(b.shape)}")
            elif _relative(a, b) > tol:
                failures.append(f"{label}: {name} rel err {_relative(a, b):.2e}")
        if moe.stats.dropped.item() != whole.stats.dropped.item():
            failures.append(f"{label}: dropped {moe.stats.dropped.item()} != {whole.stats.dropped.item()}")
    if any(not torch.equal(p, before[n]) for n, p in moe.named_parameters()):
        failures.append(f"rank {rank} E={experts} gate={gate} cf={cap}: parameters changed")
    if any(p.shape[-1 if n != "experts.w2" else -2] != HIDDEN // shards
           for n, p in moe.named_parameters() if n.startswith("experts.")):
        failures.append(f"expert shards are not 1/{shards} of the hidden dimension")
    return failures, refusals, checked


def sliced_worker(experts: int, dtypes=(torch.float32, torch.bfloat16), device: str = "cpu") -> list[str]:
    """Fewer experts than ranks: every r against a one-rank layer with the whole experts."""
    solo = dist.new_subgroups(group_size=1)[0]  # a one-rank group per rank: the oracle's
    failures = []
    cases = [("topk", 1.0, "swiglu", torch.float32), ("bpr", 0.5, "relu", torch.float32),
             ("topk", 0, "gelu", torch.float32),
             ("topk", None, "swiglu", torch.float32), ("expert_choice", 1.0, "relu", torch.float32),
             ("topk", 1.0, "swiglu", torch.bfloat16), ("topk", None, "relu", torch.bfloat16)]
    for gate, cap, activation, dtype in cases:
        if dtype in dtypes:
            found, refused, checked = check_parallel_case(solo, experts, gate, cap, activation, dtype,
                                                          min(2, experts), device=device)
            failures += found + [f"refused: {message}" for message in refused]
            if checked < 2 + (cap is not None) * 2:  # r = 0, r = 1 (degrees 1, 2, 4 when padded), its own choice
                failures.append(f"E={experts} gate={gate} cf={cap}: only {checked} calls checked")
    return failures


@pytest.mark.parametrize("world_size, experts", [(2, 1), (4, 1), (4, 2)])
def test_fewer_experts_than_ranks_every_r_equals_whole_experts(world_size, experts):
    failures = run_checks(sliced_worker, world_size, args=(experts,), timeout=300)
    assert not failures, "\n".join(failures[:10])


def fewer_experts_errors_worker() -> list[str]:
    failures = []
    for kwargs, message in [({}, "needs parallel='adaptive'"),
                            ({"parallel": "adaptive", "overlap_degree": 2, "capacity_factor": None},
                             "needs a padded capacity mode"),
                            ({"parallel": "adaptive", "hidden_dim": 10}, "hidden_dim \\(10\\) must be divisible")]:
        args = {"dim": DIM, "hidden_dim": HIDDEN, "num_experts": 1, "top_k": 1, **kwargs}
        try:
            MoE(**args)
            failures.append(f"{kwargs}: accepted")
        except ValueError as e:
            if not re.search(message, str(e)):
                failures.append(f"{kwargs}: wrong message {e}")
    moe = MoE(DIM, 12, 1, top_k=1, parallel="adaptive")  # 4 ranks per expert: r in 0, 1, 2, 4
    if moe.parallel_choices() != [0, 1, 2, 4]:
        failures.append(f"choices {moe.parallel_choices()}")
    try:
        moe(torch.randn(4, DIM), parallel=3)
        failures.append("r = 3 accepted")
    except ValueError as e:
        if "must be one of [0, 1, 2, 4]" not in str(e):
            failures.append(f"wrong message {e}")
    return failures


def test_fewer_experts_than_ranks_is_checked():
    failures = run_checks(fewer_experts_errors_worker, 4, timeout=120)
    assert not failures, "\n".join(failures)
