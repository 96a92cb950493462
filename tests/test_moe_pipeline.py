"""Tutel's pipelined exchange (overlap_degree d) computes exactly the layer of degree 1, and the
per-call overrides of top_k / capacity_factor equal a layer built with those settings."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from weft import MoE
from weft.moe import pipeline
from weft.moe.pipeline import chunk_bounds
from weft.testing import run_checks

DIM, HIDDEN, EXPERTS, TOKENS = 16, 24, 8, 24


def _run(moe: MoE, x: torch.Tensor, dy: torch.Tensor, **overrides):
    moe.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = moe(x, **overrides)
    (y.float() * dy).sum().backward()
    return y.detach().float(), x.grad.float(), {n: p.grad.float().clone() for n, p in moe.named_parameters()}


def mismatches(label: str, got: tuple, ref: tuple, dtype: torch.dtype) -> list[str]:
    """Relative errors of output, input gradient and every parameter gradient above tolerance."""
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    pairs = [("y", got[0], ref[0]), ("dx", got[1], ref[1])] + [(n, got[2][n], ref[2][n]) for n in ref[2]]
    errors = [(name, float((a - b).norm() / b.norm().clamp_min(1e-12))) for name, a, b in pairs]
    return [f"{label}: {name} rel err {err:.2e}" for name, err in errors if err > tol]


def pipeline_worker(dtypes=(torch.float32, torch.bfloat16), device: str = "cpu") -> list[str]:
    rank = dist.get_rank()
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    failures = []
    cases = [(gate, cap, degree, dtype, "swiglu")
             for gate, cap, degree, dtype in itertools.product(("topk", "expert_choice"), (1.0, 0, -1.0), (2, 4, 8),
                                                               dtypes)
             if gate == "topk" or cap > 0]
    # The pipelined experts run each activation's backward by hand: every one against degree 1.
    cases += [("topk", 1.0, degree, dtype, act)
              for act, degree, dtype in itertools.product(("relu", "gelu", "silu"), (2, 3), dtypes)]
    for gate, cap, degree, dtype, activation in cases:
        torch.manual_seed(0)
        moe = MoE(DIM, HIDDEN, EXPERTS, top_k=2, gate=gate, capacity_factor=cap, activation=activation, dtype=dtype,
                  device=device)
        gen = torch.Generator().manual_seed(10 + rank)
        x = (torch.randn(TOKENS, DIM, generator=gen) + torch.eye(DIM)[0]).to(device, dtype)
        dy = torch.randn(TOKENS, DIM, generator=gen).to(device)
        label = f"rank {rank} gate={gate} cf={cap} d={degree} {dtype} {activation}"
        failures += mismatches(label, _run(moe, x, dy, overlap_degree=degree), _run(moe, x, dy), dtype)
    return failures


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_overlap_degree_matches_degree_one(world_size):
    failures = run_checks(pipeline_worker, world_size, timeout=300)
    assert not failures, "\n".join(failures[:10])


def dropless_worker(dtypes=(torch.float32, torch.bfloat16), device: str = "cpu") -> list[str]:
    rank = dist.get_rank()
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    failures = []
    for degree, dtype, activation in itertools.product((2, 3, 8), dtypes, ("gelu", "swiglu")):
        torch.manual_seed(0)
        moe = MoE(DIM, HIDDEN, EXPERTS, top_k=2, capacity_factor=None, activation=activation, dtype=dtype,
                  device=device)
        gen = torch.Generator().manual_seed(10 + rank)
        tokens = 9 + 7 * rank  # uneven on purpose; some segments are shorter than the degree
        x = (torch.randn(tokens, DIM, generator=gen) + torch.eye(DIM)[0]).to(device, dtype)
        dy = torch.randn(tokens, DIM, generator=gen).to(device)
        label = f"rank {rank} dropless d={degree} {dtype} {activation}"
        failures += mismatches(label, _run(moe, x, dy, overlap_degree=degree), _run(moe, x, dy), dtype)
    return failures


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_dropless_pipelining_matches_degree_one(world_size):
    failures = run_checks(dropless_worker, world_size, timeout=300)
    assert not failures, "\n".join(failures[:10])


def no_fill_worker() -> list[str]:
    """One pipelined dropless exchange (degree 2, 2 ranks with 2 experts each, uneven segments)
    under the profiler: its output equals the experts on each destination's rows grouped by
    expert, and neither forward nor backward writes a row-sized zero tensor or index_copies into
    one (the rows go back by the inverse permutations)."""
    from torch.profiler import ProfilerActivity, profile

    from weft.moe.pipeline import dropless_pipelined_exchange

    rank = dist.get_rank()
    torch.manual_seed(0)
    moe = MoE(DIM, HIDDEN, 4, top_k=2, capacity_factor=None, activation="gelu", kernels="torch")
    sent_by_rank = ([[1, 2], [3, 0]], [[2, 1], [0, 4]])  # [source][destination rank][its local expert]
    sent, received = sent_by_rank[rank], [rows[rank] for rows in sent_by_rank]
    send = torch.randn(sum(map(sum, sent)), DIM, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    upstream = torch.randn(send.shape, generator=torch.Generator().manual_seed(5 + rank))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = dropless_pipelined_exchange(send, moe.experts, dist.group.WORLD, sent, received, 2)
        out.backward(upstream)
    reference = _run_reference_exchange(send.detach(), moe, sent, received)
    error = float((out - reference).abs().max())
    failures = [] if error <= 1e-6 else [f"rank {rank}: output differs by {error:.2e}"]
    writes = sorted({e.key for e in prof.events() if e.key in ("aten::zeros", "aten::zeros_like", "aten::index_copy_",
                                                                "aten::index_copy", "aten::index_add_")})
    return failures + ([f"rank {rank}: row writes {writes}"] if writes else [])


def _run_reference_exchange(send: torch.Tensor, moe: MoE, sent: list[list[int]], received: list[list[int]]):
    """The experts' outputs for the sent rows by one all-to-all each way (degree 1)."""
    from weft.moe.exchange.all_to_all import experts_on_received

    recv = torch.empty(sum(map(sum, received)), send.shape[1])
    dist.all_to_all_single(recv, send, [sum(row) for row in received], [sum(row) for row in sent])
    recv_counts = torch.tensor([n for row in received for n in row])
    back = experts_on_received(moe.experts, recv, recv_counts, received).detach()
    out = torch.empty_like(send)
    dist.all_to_all_single(out, back, [sum(row) for row in sent], [sum(row) for row in received])
    return out


def test_the_pipelined_dropless_exchange_regroups_rows_without_a_fill():
    failures = run_checks(no_fill_worker, 2, timeout=120)
    assert not failures, "\n".join(failures)


def two_dim_worker() -> list[str]:
    rank = dist.get_rank()
    failures = []
    dtypes = (torch.float32, torch.bfloat16)
    for gate, cap, dtype in itertools.product(("topk", "bpr", "expert_choice"), (1.0, 0, -1.0), dtypes):
        if gate == "expert_choice" and cap <= 0:
            continue
        torch.manual_seed(0)
        linear = MoE(DIM, HIDDEN, EXPERTS, top_k=2, gate=gate, capacity_factor=cap, dtype=dtype)
        torch.manual_seed(0)
        two_dim = MoE(DIM, HIDDEN, EXPERTS, top_k=2, gate=gate, capacity_factor=cap, dtype=dtype, a2a_algo="2dh")
        gen = torch.Generator().manual_seed(10 + rank)
        x = (torch.randn(TOKENS, DIM, generator=gen) + torch.eye(DIM)[0]).to(dtype)
        dy = torch.randn(TOKENS, DIM, generator=gen)
        ref, got = _run(linear, x, dy), _run(two_dim, x, dy)
        pairs = [("y", got[0], ref[0]), ("dx", got[1], ref[1])] + [(n, got[2][n], ref[2][n]) for n in ref[2]]
        for name, a, b in pairs:
            if not torch.equal(a, b):
                failures.append(f"rank {rank} gate={gate} cf={cap} {dtype}: {name} differs by "
                                f"{float((a - b).abs().max()):.2e}")
    groups = two_dim.groups_2dh
    if groups is not None and groups.num_nodes * groups.local_size != dist.get_world_size():
        failures.append("bad groups")
    return failures


@pytest.mark.parametrize("world_size, local_size", [(2, 1), (4, 2)])
def test_two_dim_all_to_all_layer_equals_linear(world_size, local_size):
    failures = run_checks(two_dim_worker, world_size, env={"LOCAL_WORLD_SIZE": local_size}, timeout=300)
    assert not failures, "\n".join(failures[:10])


def two_dim_pipeline_worker(dtypes=(torch.float32, torch.bfloat16), device: str = "cpu") -> list[str]:
    """2DH inside the pipelined exchange equals the linear layer of degree 1 (output, input and
    parameter gradients), and every chunk, both ways, really goes through 2DH."""
    rank = dist.get_rank()
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    calls = []
    real = pipeline.start_exchange_2dh
    pipeline.start_exchange_2dh = lambda x, groups: calls.append(x.shape) or real(x, groups)
    failures = []
    try:
        for cap, degree, dtype in itertools.product((1.0, 0), (2, 4), dtypes):
            def layer(cap=cap, dtype=dtype, **kwargs) -> MoE:
                torch.manual_seed(0)
                return MoE(DIM, HIDDEN, EXPERTS, top_k=2, capacity_factor=cap, activation="swiglu", dtype=dtype,
                           device=device, **kwargs)

            gen = torch.Generator().manual_seed(10 + rank)
            x = (torch.randn(TOKENS, DIM, generator=gen) + torch.eye(DIM)[0]).to(device, dtype)
            dy = torch.randn(TOKENS, DIM, generator=gen).to(device)
            label = f"rank {rank} 2dh cf={cap} d={degree} {dtype}"
            ref = _run(layer(), x, dy)
            two_dim = layer(a2a_algo="2dh", overlap_degree=degree)
            calls.clear()
            got = _run(two_dim, x, dy)
            failures += mismatches(label, got, ref, dtype)
            chunks = len(chunk_bounds(two_dim.stats.capacity, degree))
            if len(calls) != 4 * chunks:  # dispatch and combine, forward and backward
                failures.append(f"{label}: {len(calls)} 2DH chunk exchanges, expected {4 * chunks}")
            if device == "cpu":  # the exchange only moves data: bit-equal to linear at the same d
                same = _run(layer(overlap_degree=degree), x, dy)
                pairs = [("y", got[0], same[0]), ("dx", got[1], same[1])]
                pairs += [(n, got[2][n], same[2][n]) for n in same[2]]
                failures += [f"{label}: {name} differs from linear d={degree}" for name, a, b in pairs
                             if not torch.equal(a, b)]
    finally:
        pipeline.start_exchange_2dh = real
    if two_dim.groups_2dh.num_nodes < 2:
        failures.append(f"rank {rank}: 2DH groups span {two_dim.groups_2dh.num_nodes} node(s), expected several")
    return failures


@pytest.mark.parametrize("world_size, local_size", [(2, 1), (4, 2)])
def test_pipelined_two_dim_exchange_equals_linear_degree_one(world_size, local_size):
    failures = run_checks(two_dim_pipeline_worker, world_size, env={"LOCAL_WORLD_SIZE": local_size}, timeout=300)
    assert not failures, "\n".join(failures[:10])


def test_chunk_bounds_cover_the_capacity():
    assert chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert chunk_bounds(3, 8) == [(0, 1), (1, 2), (2, 3)]
    assert chunk_bounds(5, 1) == [(0, 5)]


@pytest.mark.parametrize("top_k, cap", [(1, 2.0), (4, 0), (2, None), (3, -0.5)])
def test_per_call_overrides_equal_a_layer_built_with_them(top_k, cap):
    torch.manual_seed(0)
    base = MoE(DIM, HIDDEN, EXPERTS, top_k=2, capacity_factor=1.25)
    built = MoE(DIM, HIDDEN, EXPERTS, top_k=top_k, capacity_factor=cap)
    built.load_state_dict(base.state_dict())
    x, dy = torch.randn(TOKENS, DIM), torch.randn(TOKENS, DIM)
    y_over, gx_over, g_over = _run(base, x, dy, top_k=top_k, capacity_factor=cap)
    assert (base.top_k, base.capacity_factor) == (2, 1.25)  # the override lasted one call
    over_stats = base.stats
    y_built, gx_built, g_built = _run(built, x, dy)
    torch.testing.assert_close(y_over, y_built)
    torch.testing.assert_close(gx_over, gx_built)
    for name in g_built:
        torch.testing.assert_close(g_over[name], g_built[name])
    assert over_stats.capacity == built.stats.capacity and int(over_stats.dropped) == int(built.stats.dropped)


def test_bad_overrides_and_degrees_are_refused():
    moe = MoE(DIM, HIDDEN, EXPERTS, top_k=2)
    x = torch.randn(4, DIM)
    with pytest.raises(ValueError, match=r"top_k \(9\) must not exceed num_experts \(8\)"):
        moe(x, top_k=9)
    with pytest.raises(ValueError, match="overlap_degree must be a positive integer"):
        moe(x, overlap_degree=0)
    with pytest.raises(ValueError, match="unknown a2a_algo 'ring'"):
        MoE(DIM, HIDDEN, EXPERTS, a2a_algo="ring")
    with pytest.raises(ValueError, match="a2a_algo='2dh' needs a padded capacity mode"):
        MoE(DIM, HIDDEN, EXPERTS, capacity_factor=None, a2a_algo="2dh")
    with pytest.raises(ValueError, match="a2a_algo='2dh' needs a padded capacity mode"):
        MoE(DIM, HIDDEN, EXPERTS, capacity_factor=None, a2a_algo="2dh", overlap_degree=2)
    two_dim = MoE(DIM, HIDDEN, EXPERTS, a2a_algo="2dh", overlap_degree=4)  # 2DH pipelines: accepted
    assert two_dim(x, overlap_degree=2).shape == x.shape and two_dim.overlap_degree == 4
    assert moe.top_k == 2 and moe.overlap_degree == 1  # a refused call changes nothing
