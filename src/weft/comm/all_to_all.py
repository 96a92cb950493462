"""Differentiable all-to-all over a process group.

The backward of an all-to-all is the all-to-all of the output gradient with the split sizes
swapped, so gradients of tokens sent to an expert's owner flow back to the sender.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from weft.distributed import group_size


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return _exchange(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.group, ctx.in_splits, ctx.out_splits), None, None, None


def _exchange(x: torch.Tensor, group, out_splits, in_splits) -> torch.Tensor:
    x = x.contiguous()
    if out_splits is None:
        out = torch.empty_like(x)
    else:
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


def all_to_all(
    x: torch.Tensor,
    group: dist.ProcessGroup | None,
    output_splits: list[int] | None = None,
    input_splits: list[int] | None = None,
) -> torch.Tensor:
    """All-to-all along dim 0, differentiable.

    With no splits, dim 0 is cut into W equal chunks and chunk i goes to rank i (fixed size).
    With splits (all-to-allv), `input_splits[i]` rows go to rank i and `output_splits[i]` rows
    arrive from rank i. A single-process group returns `x` unchanged.
    """
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, output_splits, input_splits)


def all_to_all_counts(counts: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Exchange per-destination counts (W*n,) so each rank learns what it will receive (W*n,)."""
    if group_size(group) == 1:
        return counts
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out
