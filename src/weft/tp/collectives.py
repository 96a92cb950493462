"""The two collectives of Megatron-style tensor parallelism as autograd functions (Megatron-LM,
sec. 3: `f` and `g`), over the tensor-parallel group:

- `copy_to_tp` (f): identity forward; the input gradient, a partial sum on each rank after a
  column-parallel linear, is all-reduced in backward.
- `reduce_from_tp` (g): the partial outputs of a row-parallel linear all-reduced in forward;
  identity backward.

A group of size 1 (or None with no process group) makes both the identity.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from weft.distributed import group_size


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
