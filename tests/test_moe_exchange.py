"""Every exchange strategy (weft.moe.exchange) against the expert function written out here.

Each strategy takes a rank's dispatched rows, padded (E * C rows, slot c of expert e at row
e * C + c) or grouped (sorted by expert, `counts[e]` rows each, uneven across ranks), and must
return expert_e(row) for every row, with the input gradients of those rows and, on each expert's
owner, the weight gradients summed over every rank's rows. The oracle gathers the whole experts
with plain torch.distributed and runs the FFN per row."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from weft import MoE
from weft.moe.exchange import (
    AllToAll,
    DataParallelExperts,
    ExchangeContext,
    Grouped,
    Padded,
    Pipelined,
    ReplicatedExperts,
    SlicedExperts,
    Transfer,
)
from weft.testing import run_checks

DIM, HIDDEN, CAPACITY = 8, 12, 5


def _gather(w: torch.Tensor, shards: int) -> torch.Tensor:
    """Every rank's (El, a, b) weight, joined into the whole experts (shards along the hidden dim)."""
    parts = [torch.empty_like(w) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, w.detach())
    hidden_axis = 1 if w.shape[1] != DIM else 2  # w2 is (., hidden, dim); w1 and w3 (., dim, hidden)
    experts = []
    for i in range(0, len(parts), shards):
        experts.append(torch.cat(parts[i:i + shards], dim=hidden_axis) if shards > 1 else parts[i])
    return torch.cat(experts)


def _ffn(activation: str, x: torch.Tensor, w1, w2, w3) -> torch.Tensor:
    h = x @ w1
    if activation == "swiglu":
        h = F.silu(h) * (x @ w3)
    else:
        h = {"relu": F.relu, "gelu": F.gelu}[activation](h)
    return h @ w2


def _oracle(moe: MoE, rows: torch.Tensor, expert_of_row: torch.Tensor, dy: torch.Tensor):
    """Outputs, input gradients and this rank's share of the whole experts' weight gradients."""
    shards = moe.expert_shards
    weights = [None if w is None else _gather(w, shards).requires_grad_() for w in moe.experts.weights()]
    x = rows.detach().requires_grad_()
    outs = [_ffn(moe.experts.activation, x[i], *[None if w is None else w[int(e)] for w in weights])
            for i, e in enumerate(expert_of_row)]
    out = torch.stack(outs) if outs else rows.new_zeros(0, DIM)
    if outs:
        (out * dy).sum().backward()
    grads = [None if w is None else (w.grad if w.grad is not None else torch.zeros_like(w)).clone() for w in weights]
    dx = x.grad if x.grad is not None else torch.zeros_like(x)
    for g in grads:
        if g is not None:
            dist.all_reduce(g)  # the expert gradient holds every rank's rows
    return out.detach(), dx, grads


def _owned(moe: MoE, full_grad: torch.Tensor, index: int) -> torch.Tensor:
    """The part of a whole-expert gradient that this rank's parameter holds."""
    rank, shards, local = dist.get_rank(), moe.expert_shards, moe.num_local_experts
    if shards == 1:
        return full_grad[rank * local:(rank + 1) * local]
    expert, shard = rank // shards, rank % shards
    width = HIDDEN // shards
    hidden_axis = 1 if index == 1 else 2
    return full_grad[expert:expert + 1].narrow(hidden_axis, shard * width, width)


def _compare(moe, strategy, rows, layout, expert_of_row, dy, label) -> list[str]:
    moe.zero_grad(set_to_none=True)
    x = rows.detach().requires_grad_()
    out = strategy(x, layout)
    (out * dy).sum().backward()
    want_out, want_dx, want_grads = _oracle(moe, rows, expert_of_row, dy)
    pairs = [("out", out.detach(), want_out), ("dx", x.grad, want_dx)]
    for i, (w, g) in enumerate(zip(moe.experts.weights(), want_grads)):
        if w is not None:
            pairs.append((f"dw{i + 1}", w.grad, _owned(moe, g, i)))
    failures = []
    for name, got, want in pairs:
        if got is None or got.shape != want.shape or not torch.allclose(got, want, atol=1e-5, rtol=1e-4):
            err = None if got is None or got.shape != want.shape else float((got - want).abs().max())
            failures.append(f"rank {dist.get_rank()} {label}: {name} differs (max abs error {err})")
    return failures


def _padded_rows(moe: MoE, gen: torch.Generator, device: str):
    rows = torch.randn(moe.num_experts * CAPACITY, DIM, generator=gen).to(device)
    return rows, torch.arange(moe.num_experts).repeat_interleave(CAPACITY), Padded(CAPACITY)


def _grouped_rows(moe: MoE, gen: torch.Generator, device: str):
    counts = torch.randint(0, 5, (moe.num_experts,), generator=gen)  # uneven, zeros included
    rows = torch.randn(int(counts.sum()), DIM, generator=gen).to(device)
    return rows, torch.arange(moe.num_experts).repeat_interleave(counts), Grouped(counts.to(device))


def exchange_worker(num_experts: int, activation: str, device: str = "cpu") -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    moe = MoE(DIM, HIDDEN, num_experts, top_k=1, activation=activation, parallel="adaptive", a2a_algo="auto",
              device=device)
    ctx = ExchangeContext(moe.experts, moe.placement)
    if moe.expert_shards == 1:
        strategies = {
            "all-to-all": (AllToAll(ctx), "padded grouped"),
            "2dh": (AllToAll(ctx, "2dh"), "padded"),
            "pipelined d2": (Pipelined(ctx, 2), "padded grouped"),
            "pipelined d3 2dh": (Pipelined(ctx, 3, "2dh"), "padded"),
            "data-parallel": (DataParallelExperts(ctx), "padded grouped"),
        }
    else:
        strategies = {f"sliced r{r}": (SlicedExperts(ctx, r), "padded grouped")
                      for r in moe.parallel_choices() if r > 0}
        strategies.update({f"sliced r{r} d2": (SlicedExperts(ctx, r, 2), "padded")
                           for r in moe.parallel_choices() if r > 0})
        strategies["data-parallel"] = (DataParallelExperts(ctx), "padded grouped")
    gen = torch.Generator().manual_seed(100 + rank)
    failures = []
    if world == 4 and moe.groups_2dh.num_nodes != 2:
        failures.append(f"2DH spans {moe.groups_2dh.num_nodes} node(s); the test expects 2")
    for (name, (strategy, layouts)), layout_name in itertools.product(strategies.items(), ("padded", "grouped")):
        if layout_name not in layouts:
            continue
        rows, expert_of_row, layout = (_padded_rows if layout_name == "padded" else _grouped_rows)(moe, gen, device)
        dy = torch.randn(rows.shape, generator=gen).to(device)
        failures += _compare(moe, strategy, rows, layout, expert_of_row, dy, f"{name} {layout_name}")
    if moe.expert_shards == 1 and world > 1:  # Pro-Prophet's copies (dropless only), built where used
        others = lambda e: frozenset(range(world)) - {e // moe.num_local_experts}  # noqa: E731
        every = {e: others(e) for e in range(num_experts)}
        for name, copies in (("replicated, expert 1 copied", {1: others(1)}),
                             ("replicated, every expert copied (no row sent)", every)):
            rows, expert_of_row, layout = _grouped_rows(moe, gen, device)
            dy = torch.randn(rows.shape, generator=gen).to(device)
            strategy = ReplicatedExperts(ctx, Transfer(moe.experts, moe.placement, copies, moe.group))
            failures += _compare(moe, strategy, rows, layout, expert_of_row, dy, f"{name} grouped")
    return failures


@pytest.mark.parametrize("world_size, num_experts", [(1, 4), (2, 4), (4, 8), (2, 1), (4, 2), (4, 1)])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_every_exchange_computes_the_expert_function(world_size, num_experts, activation):
    failures = run_checks(exchange_worker, world_size, args=(num_experts, activation), timeout=300,
                          env={"LOCAL_WORLD_SIZE": 2})
    assert not failures, "\n".join(failures[:10])
