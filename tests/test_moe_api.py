"""Single-process use of weft.MoE: drop-in FFN, bad input, dtypes, routing cost O(T*k*dim)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moe_reference as ref
from weft import MoE
from weft.testing import run_distributed


def test_drop_in_ffn_without_process_group():
    torch.manual_seed(0)
    moe = MoE(16, 32, 4, top_k=2, capacity_factor=None)
    x = torch.randn(2, 5, 16, requires_grad=True)
    y = moe(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    y.square().sum().backward()
    assert x.grad is not None and moe.experts.w1.grad is not None and moe.router.weight.grad is not None
    params = {n: p.detach() for n, p in moe.named_parameters()}
    cfg = {"gate": "topk", "top_k": 2, "num_experts": 4, "activation": "gelu", "normalize_gates": True}
    y_ref = ref.moe_forward(x.detach().reshape(-1, 16), params, cfg, None)[0]
    torch.testing.assert_close(y.detach().reshape(-1, 16), y_ref, rtol=1e-5, atol=1e-6)
    assert moe.stats.capacity is None and int(moe.stats.dropped) == 0
    assert int(moe.stats.expert_counts.sum()) == 10 * 2


def test_router_stays_float32_when_model_is_cast():
    moe = MoE(16, 32, 4, gate="cosine").to(torch.bfloat16)
    assert moe.experts.w1.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in moe.router.parameters())
    assert moe(torch.randn(3, 16, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_parameter_names_and_shapes_follow_the_contract():
    shapes = {n: tuple(p.shape) for n, p in MoE(16, 24, 4, activation="swiglu").named_parameters()}
    assert shapes == {"router.weight": (4, 16), "experts.w1": (4, 16, 24), "experts.w2": (4, 24, 16),
                      "experts.w3": (4, 16, 24)}
    assert "experts.w3" not in dict(MoE(16, 24, 4, activation="relu").named_parameters())


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"gate": "switch"}, ValueError, "unknown gate"),
        ({"activation": "tanh"}, ValueError, "unknown activation"),
        ({"top_k": 5}, ValueError, r"top_k \(5\) must not exceed num_experts \(4\)"),
        ({"top_k": 0}, ValueError, "top_k must be a positive integer"),
        ({"capacity_factor": "1.0"}, TypeError, "capacity_factor"),
        ({"gate": "expert_choice", "capacity_factor": None}, ValueError, "expert_choice"),
        ({"gate": "expert_choice", "capacity_factor": 0}, ValueError, "expert_choice"),
    ],
)
def test_bad_configuration_raises(kwargs, error, match):
    with pytest.raises(error, match=match):
        MoE(16, 32, 4, **kwargs)


def test_bad_input_raises():
    moe = MoE(16, 32, 4)
    with pytest.raises(ValueError, match="last dimension must be dim=16"):
        moe(torch.randn(3, 15))
    with pytest.raises(TypeError, match="floating-point"):
        moe(torch.ones(3, 16, dtype=torch.long))
    with pytest.raises(TypeError, match="torch.Tensor"):
        moe([[0.0] * 16])


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("capacity_factor", [1.25, None])
def test_routing_never_materialises_tokens_by_experts_by_capacity(capacity_factor):
    """Tutel's fast encode/decode: no (T, E, C) tensor; the biggest is O(T*k*dim + E*C*dim + T*E)."""
    tokens, experts, k, dim = 2048, 64, 2, 8
    moe = MoE(dim, 8, experts, top_k=k, capacity_factor=capacity_factor)
    x = torch.randn(tokens, dim, requires_grad=True)
    with _LargestTensor() as mode:
        moe(x).sum().backward()
    cap = -(-int(k * 1.25 * tokens) // experts)
    dense_one_hot = tokens * experts * cap
    linear_bound = tokens * k * dim + experts * cap * dim + tokens * experts
    assert mode.largest <= linear_bound < dense_one_hot / 50


def test_capacity_is_the_exact_ceiling_of_the_decimal_factor():
    # 1 * 1.1 * 100 / 2 is 55.000000000000007 in floats; the capacity is 55.
    moe = MoE(8, 8, 2, top_k=1, capacity_factor=1.1)
    moe(torch.randn(100, 8))
    assert moe.stats.capacity == 55


def test_router_runs_in_float32_under_autocast():
    torch.manual_seed(0)
    moe = MoE(16, 32, 8, top_k=2, gate="topk", capacity_factor=None)
    x = torch.randn(256, 16)
    logits = moe.router(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto_logits = moe.router(x)
        moe(x)
    assert auto_logits.dtype == torch.float32 and torch.equal(auto_logits, logits)
    assert moe.z_loss.dtype == torch.float32


def test_an_inf_in_an_unused_expert_row_does_not_reach_dropped_tokens():
    torch.manual_seed(0)
    moe = MoE(8, 8, 2, top_k=1, capacity_factor=0.25)
    x = torch.randn(32, 8)
    with torch.no_grad():
        moe.experts.w2[1].fill_(float("inf"))  # every token routed to expert 1 turns inf...
        moe.router.weight[0] += 100.0 * x.mean(0)  # ...but almost all go to expert 0 and drop
    y = moe(x)
    assert int(moe.stats.dropped) > 0
    finite_rows = torch.isfinite(y).all(dim=1)
    assert finite_rows.sum() >= 32 - moe.stats.capacity  # only tokens kept by expert 1 may be inf


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_capacity_factor_is_refused(bad):
    with pytest.raises(ValueError, match="capacity_factor must be finite"):
        MoE(8, 8, 2, capacity_factor=bad)


def test_a_rank_without_tokens_gets_finite_losses():
    moe = MoE(8, 8, 4, capacity_factor=None)
    y = moe(torch.randn(0, 8))
    assert y.shape == (0, 8) and float(moe.aux_loss) == 0.0 and float(moe.z_loss) == 0.0


@pytest.mark.parametrize("gate", ["topk", "bpr", "cosine", "random", "expert_choice"])
def test_every_gate_handles_an_empty_batch(gate):
    moe = MoE(8, 16, 4, gate=gate, capacity_factor=1.0)
    x = torch.randn(0, 8, requires_grad=True)
    y = moe(x)
    y.sum().backward()
    assert y.shape == (0, 8) and x.grad.shape == (0, 8) and int(moe.stats.dropped) == 0


@pytest.mark.parametrize("capacity_factor", [1e6, 1e30, -1e30])
def test_capacity_never_exceeds_the_token_count(capacity_factor):
    """A token routes to an expert once, so capacity beyond T is never used: it is capped at T
    (1e6 on 16 tokens sized 8,000,000 slots; 1e30 overflowed) with the same output as no-drop."""
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, top_k=2, capacity_factor=capacity_factor)
    x = torch.randn(16, 8)
    y = moe(x)
    assert moe.stats.capacity <= 16 and int(moe.stats.dropped) == 0
    assert torch.equal(y, moe(x, capacity_factor=0))


def _mismatch_worker(case: str) -> str:
    import torch.distributed as dist
    rank = dist.get_rank()
    experts = 8 if case == "num_experts" and rank == 1 else 4
    settings = {"capacity_factor": None, "a2a_algo": "dedup-fixed"} if case == "tokens dedup-fixed" else \
        {"capacity_factor": 1.0}
    moe = MoE(8, 16, experts, top_k=2, **settings)
    tokens = 12 if case.startswith("tokens") and rank == 1 else 16
    kwargs = {"top_k": 1} if case == "top_k" and rank == 1 else {}
    try:
        moe(torch.randn(tokens, 8), **kwargs)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("case, field", [("num_experts", "num_experts is"), ("top_k", "top_k is"),
                                         ("tokens", "tokens per rank (fixed-size all-to-all) is"),
                                         ("tokens dedup-fixed", "tokens per rank (fixed-size all-to-all) is")])
def test_ranks_with_different_layers_or_calls_are_told_at_the_first_forward(case, field):
    messages = run_distributed(_mismatch_worker, 2, args=(case,), timeout=120)
    for rank, message in enumerate(messages):
        assert message.startswith(f"MoE layer differs across the expert-parallel group: {field}"), message
        assert f"(group rank {rank}) but not on group rank {1 - rank}" in message


def _uneven_dropless_worker() -> tuple[int, ...]:
    import torch.distributed as dist
    moe = MoE(8, 16, 4, top_k=2, capacity_factor=None)
    y = moe(torch.randn(10 + 3 * dist.get_rank(), 8))
    return tuple(y.shape)


def test_uneven_token_counts_stay_fine_where_sizes_are_agreed():
    assert run_distributed(_uneven_dropless_worker, 2, timeout=120) == [(10, 8), (13, 8)]


@pytest.mark.parametrize("capacity_factor", [1.0, None])
def test_an_expert_bias_routes_a_batch_in_parts_as_whole(capacity_factor):
    """Lancet's partitions (CarriedRouting) honour the selection bias: the same experts,
    positions and kept slots as the whole batch routed at once, and not those of no bias."""
    from weft.moe.routing import Router

    router = Router("topk", 8, True, None)
    logits = torch.randn(40, 8, generator=torch.Generator().manual_seed(0))
    logits[:, 0] += 2.0  # most tokens prefer expert 0, which the bias holds back
    bias = torch.tensor([-0.5, 0.1, 0.0, 0.05, -0.05, 0.2, 0.0, 0.1])
    whole = router.route(logits, 1, capacity_factor, bias)
    assert not torch.equal(whole.experts_S, router.route(logits, 1, capacity_factor).experts_S)
    parts = router.in_parts(40, 1, capacity_factor, bias)
    routed = [parts.route(chunk) for chunk in logits.split([13, 17, 10])]
    assert torch.equal(torch.cat([r.experts_S for r in routed]), whole.experts_S)
    assert torch.equal(torch.cat([r.positions_S for r in routed]), whole.positions_S)
    if capacity_factor is not None:
        assert torch.equal(torch.cat([r.kept_S for r in routed]), whole.kept_S)
    assert torch.equal(parts.finish().stats.expert_counts, whole.summary.stats.expert_counts)


def test_the_expert_bias_update_and_its_errors():
    """update_expert_bias: +rate below the mean load, -rate above, nothing at the mean; layers
    whose gate does not rank experts by probability refuse the bias."""
    moe = MoE(16, 32, 4, top_k=1, expert_bias=True)
    moe.update_expert_bias(torch.tensor([1.0, 5.0, 3.0, 3.0]), 0.01)
    assert moe.expert_bias.tolist() == pytest.approx([0.01, -0.01, 0.0, 0.0])
    assert "expert_bias" in moe.state_dict()
    with pytest.raises(ValueError, match="no expert bias"):
        MoE(16, 32, 4, top_k=1).update_expert_bias(torch.ones(4), 0.01)
    for gate in ("random", "expert_choice"):
        with pytest.raises(ValueError, match=f"token-choice gate .*not '{gate}'"):
            MoE(16, 32, 4, top_k=1, gate=gate, expert_bias=True)
