"""The two collectives of Megatron-style tensor parallelism as autograd functions (Megatron-LM,
sec. 3: `f` and `g`), over the tensor-parallel group:

- `copy_to_tp` (f): identity forward; the input gradient, a partial sum on each rank after a
  column-parallel linear, is all-reduced in backward.
- `reduce_from_tp` (g): the partial outputs of a row-parallel linear all-reduced in forward;
  identity backward.

And the pair that hands a token-wise sub-layer (an MoE layer) a different share of the tokens on
each rank of the group (Megatron-Core's sequence-parallel split around its MoE layer):

- `split_to_tp`: the rows of a tensor that is the same on every rank, this rank's 1 / tp of them
  in forward; the rows' gradients all-gathered in backward (each rank computed its own rows'
  gradient, every rank needs them all);
- `gather_from_tp`: every rank's rows all-gathered in forward; this rank's rows of the gradient
  in backward (the gradient of the gathered tensor is the same on every rank).

A group of size 1 (or None with no process group) makes both the identity.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from weft.comm.all_to_all import ALL_GATHER
from weft.distributed import group_rank, group_size


def all_reduce_(x: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False):
    """Sum `x` in place over `group`; the work handle when `async_op` (None for one rank)."""
    if group_size(group) == 1:
        return None
    return dist.all_reduce(x, group=group, async_op=async_op)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()  # the incoming gradient may be shared (a residual's)
        all_reduce_(grad, ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        out = x.contiguous().clone()
        all_reduce_(out, group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """f: identity forward, gradient all-reduced over `group` in backward."""
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """g: `x` summed over `group` in forward, identity backward."""
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def _gather_rows(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((group_size(group) * x.shape[0],) + tuple(x.shape[1:]))
    ALL_GATHER(out, x, group=group)
    return out


def _own_rows(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x.chunk(group_size(group))[group_rank(group)].contiguous()


class _Rows(torch.autograd.Function):
    """This rank's rows (`gather` False) or every rank's (`gather` True) in forward; the other
    one of the two in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None, gather: bool) -> torch.Tensor:
        ctx.group, ctx.gather = group, gather
        return _gather_rows(x, group) if gather else _own_rows(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (_own_rows(grad, ctx.group) if ctx.gather else _gather_rows(grad, ctx.group)), None, None


def split_to_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's 1 / tp of the rows (dim 0) of `x`, the same tensor on every rank of `group`;
    backward all-gathers the rows' gradients. The rows must divide evenly."""
    world = group_size(group)
    if x.shape[0] % world:
        raise ValueError(f"{x.shape[0]} rows cannot be split evenly over {world} tensor-parallel ranks")
    return x if world == 1 else _Rows.apply(x, group, False)


def gather_from_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's rows (dim 0) of `x` in rank order; backward keeps this rank's rows of the
    gradient (which must be the same on every rank)."""
    return x if group_size(group) == 1 else _Rows.apply(x, group, True)
