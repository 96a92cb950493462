"""Tensor-parallel attention and MLP (Megatron-LM sec. 3, fig. 3): the first linear of each is
split by output columns (attention: by heads, each rank holds n_head / tp whole heads of q, k
and v; MLP: hidden units), the second by input rows, so each rank computes a partial sum of the
output with no communication in between: `out_proj(inner(h))`. The all-reduce that completes it
belongs to the schedule (weft.tp.schedule), which is where Domino overlaps it (and may compute
`out_proj` in column slices). Given a `WeightGradQueue`, `inner` and `linear` hold the linears'
weight gradients back for the schedule to run under an all-reduce.

Shards are cut from the dense modules of `weft.models.gpt` (`from_dense`), with the same
parameter names, so rank r's tensors are slices of the dense ones: `shard_of` says which.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from weft.distributed import group_rank, group_size
from weft.kernels.rotary import qkv_heads


def check_divisible(what: str, size: int, tp: int) -> None:
    if size % tp:
        raise ValueError(f"tensor parallelism over {tp} ranks needs {what} divisible by {tp}, got {size}")


class TPAttention(nn.Module):
    """Causal self-attention with n_head / tp heads per rank; `qkv.weight` (3 * dim / tp, dim) holds
    this rank's rows of q, k and v, `out_proj.weight` (dim, dim / tp) its heads' columns."""

    def __init__(self, dim: int, n_head: int, group: dist.ProcessGroup | None, kernels: str = "auto",
                 device=None, dtype=None):
        super().__init__()
        tp = group_size(group)
        check_divisible("n_head", n_head, tp)
        self.group, self.kernels = group, kernels
        self.dim, self.n_head, self.local_heads, self.head_dim = dim, n_head, n_head // tp, dim // n_head
        local = self.local_heads * self.head_dim
        self.qkv = nn.Linear(dim, 3 * local, bias=False, device=device, dtype=dtype)
        self.out_proj = nn.Linear(local, dim, bias=False, device=device, dtype=dtype)

    def shard_of(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the dense parameter `name` ('qkv.weight' or 'out_proj.weight')."""
        first = group_rank(self.group) * self.local_heads
        heads = slice(first, first + self.local_heads)
        if name == "qkv.weight":  # rows: (3, n_head, head_dim) of the dense output
            return full.view(3, self.n_head, self.head_dim, self.dim)[:, heads].reshape(-1, self.dim)
        if name == "out_proj.weight":  # columns: (n_head, head_dim) of the dense input
            return full.view(self.dim, self.n_head, self.head_dim)[:, heads].reshape(self.dim, -1)
        raise KeyError(name)

    def unshard(self, name: str, shards: list[torch.Tensor]) -> torch.Tensor:
        """The dense tensor `name` from every rank's shard, in group-rank order (`shard_of`'s inverse)."""
        if name == "qkv.weight":
            return torch.cat([s.view(3, self.local_heads, self.head_dim, self.dim) for s in shards], 1).flatten(0, 2)
        if name == "out_proj.weight":
            return torch.cat([s.view(self.dim, self.local_heads, self.head_dim) for s in shards], 1).flatten(1)
        raise KeyError(name)

    def inner(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
              queue: WeightGradQueue | None = None) -> torch.Tensor:
        """Everything before `out_proj`: this rank's heads' attention output (batch, seq, dim / tp)."""
        batch, seq, _ = h.shape
        q, k, v = qkv_heads(linear(h, self.qkv, queue), self.local_heads, *rope, self.kernels)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(batch, seq, -1)


class TPMLP(nn.Module):
    """gelu MLP with hidden / tp units per rank: `fc.weight` (hidden / tp, dim), `out_proj.weight`
    (dim, hidden / tp)."""

    def __init__(self, dim: int, hidden_dim: int, group: dist.ProcessGroup | None, device=None, dtype=None):
        super().__init__()
        tp = group_size(group)
        check_divisible("the MLP's hidden size", hidden_dim, tp)
        self.group, self.local_hidden = group, hidden_dim // tp
        self.fc = nn.Linear(dim, self.local_hidden, bias=False, device=device, dtype=dtype)
        self.out_proj = nn.Linear(self.local_hidden, dim, bias=False, device=device, dtype=dtype)

    def shard_of(self, name: str, full: torch.Tensor) -> torch.Tensor:
        units = slice(group_rank(self.group) * self.local_hidden, (group_rank(self.group) + 1) * self.local_hidden)
        if name == "fc.weight":
            return full[units]
        if name == "out_proj.weight":
            return full[:, units]
        raise KeyError(name)

    def unshard(self, name: str, shards: list[torch.Tensor]) -> torch.Tensor:
        """The dense tensor `name` from every rank's shard, in group-rank order (`shard_of`'s inverse)."""
        if name in ("fc.weight", "out_proj.weight"):
            return torch.cat(shards, 0 if name == "fc.weight" else 1)
        raise KeyError(name)

    def inner(self, h: torch.Tensor, rope=None, queue: WeightGradQueue | None = None) -> torch.Tensor:
        """Everything before `out_proj`: gelu(fc(h)) of this rank's hidden units."""
        return F.gelu(linear(h, self.fc, queue))


def load_shards(module: TPAttention | TPMLP, dense: nn.Module) -> None:
    """Copy this rank's slices of `dense`'s parameters (same names) into `module`."""
    dense_params = dict(dense.named_parameters())
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(module.shard_of(name, dense_params[name]))


class WeightGradQueue:
    """The weight gradients of `linear` calls made with this queue, held back in backward (only
    the input gradient is computed at once) until `run()`: Domino's backward computes a
    micro-batch's input gradient, starts its all-reduce, and runs the weight-gradient matmuls
    under it (sec. 4.1, fig. 8). `run()` accumulates each product into one buffer per weight
    (`addmm_`: no separate sum over micro-batches); `grads()` hands the buffers over by weight."""

    def __init__(self):
        # (weight, input, output gradient, the weight's rows the call used or None for all)
        self.items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, slice | None]] = []
        self.buffers: dict[int, torch.Tensor] = {}

    def run(self) -> None:
        for weight, x, dy, rows in self.items:
            x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
            buf = self.buffers.get(id(weight))
            if buf is None and rows is None:
                self.buffers[id(weight)] = dy2.t().mm(x2)
                continue
            if buf is None:  # in the matmul's dtype (bf16 under autocast, as autocast's linear sums it)
                buf = self.buffers[id(weight)] = torch.zeros_like(weight, dtype=dy2.dtype)
            (buf if rows is None else buf[rows]).addmm_(dy2.t(), x2)
        self.items.clear()

    def grads(self) -> dict[int, torch.Tensor]:
        self.run()
        return self.buffers


def autocast_operands(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` and `weight` as autocast hands them to a matmul where it is on for `x`'s device: both
    in its dtype. A custom autograd function's backward runs outside autocast, so it must keep
    these operands (the input gradient is `dy @ weight` in that dtype, as autocast's own linear
    computes it)."""
    kind = x.device.type
    if not torch.is_autocast_enabled(kind):
        return x, weight
    dtype = torch.get_autocast_dtype(kind)
    return x.to(dtype), weight.to(dtype)


class _QueuedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, queue: WeightGradQueue, rows: slice | None) -> torch.Tensor:
        x, operand = autocast_operands(x, weight)
        ctx.save_for_backward(x, operand)
        ctx.queue, ctx.rows, ctx.weight = queue, rows, weight
        return F.linear(x, operand if rows is None else operand[rows])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, operand = ctx.saved_tensors
        ctx.queue.items.append((ctx.weight, x, dy, ctx.rows))
        return dy.matmul(operand if ctx.rows is None else operand[ctx.rows]), None, None, None


def linear(x: torch.Tensor, layer: nn.Linear, queue: WeightGradQueue | None, rows: slice | None = None
           ) -> torch.Tensor:
    """`layer(x)` (no bias), or only the output features `rows` of it; with a queue the weight
    gradient waits in the queue instead of reaching `layer.weight` through autograd."""
    if queue is not None:
        return _QueuedLinear.apply(x, layer.weight, queue, rows)
    return layer(x) if rows is None else F.linear(x, layer.weight[rows])
