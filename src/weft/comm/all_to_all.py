"""Differentiable all-to-all over a process group: linear (one call) or 2DH (two levels).

The backward of an all-to-all is the all-to-all of the output gradient with the split sizes
swapped, so gradients of tokens sent to an expert's owner flow back to the sender.

weft's collectives get detached aliases of their tensors (the same memory, no autograd history).
A process group's work keeps its tensors until its own thread lets it go (gloo's worker, NCCL's
watchdog), a moment after the call has returned; an output that autograd then gives its grad_fn
would keep the whole graph of the call alive that moment longer, gradient accumulators included,
and a CUDA graph capture refuses to start while an earlier call's graph holds those
(`weft.graphs.GraphedStep`): timed candidates came out infinite now and then.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from weft.comm.two_dim import all_to_all_2dh
from weft.distributed import HierarchicalGroups, group_size, hierarchical_groups

ALGOS = ("linear", "2dh")


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits, scheduler):
        ctx.group, ctx.out_splits, ctx.in_splits, ctx.scheduler = group, out_splits, in_splits, scheduler
        return _exchange(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.group, ctx.in_splits, ctx.out_splits, ctx.scheduler), None, None, None, None


def output_buffer(x: torch.Tensor, out_splits: list[int] | None) -> torch.Tensor:
    """The receive buffer of an all-to-all of x: like x (equal splits) or sum(out_splits) rows."""
    if out_splits is None:
        return torch.empty_like(x)
    return x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))


def _exchange(x: torch.Tensor, group, out_splits, in_splits, scheduler=None) -> torch.Tensor:
    x = x.contiguous()
    out = output_buffer(x, out_splits)
    # detached aliases: a process group's work must not hold the call's autograd graph (module docstring)
    if scheduler is None or not scheduler.active:
        dist.all_to_all_single(out.detach(), x.detach(), out_splits, in_splits, group=group)
        return out
    # Lancet's backward: deferred weight gradients run while the exchange is in flight.
    work = dist.all_to_all_single(out.detach(), x.detach(), out_splits, in_splits, group=group, async_op=True)
    nbytes = x.numel() * x.element_size()
    scheduler.communicate(("all_to_all", x.dtype, nbytes), nbytes, work, x.device)
    return out


def all_to_all(
    x: torch.Tensor,
    group: dist.ProcessGroup | None,
    output_splits: list[int] | None = None,
    input_splits: list[int] | None = None,
    algo: str = "linear",
    groups_2dh: HierarchicalGroups | None = None,
    scheduler=None,
) -> torch.Tensor:
    """All-to-all along dim 0, differentiable.

    With no splits, dim 0 is cut into W equal chunks and chunk i goes to rank i (fixed size).
    With splits (all-to-allv), `input_splits[i]` rows go to rank i and `output_splits[i]` rows
    arrive from rank i. A single-process group (or None) returns `x` unchanged.

    `algo="2dh"` computes the same fixed-size exchange hierarchically (Tutel appendix A) over
    `groups_2dh`, the `hierarchical_groups(group)` of this group. Building those is a collective
    over the whole world, so build them ahead of time (e.g. at layer construction) and pass
    them; left None, they are built (once, then cached) here, which every rank must reach.

    `scheduler` (a `weft.overlap.WGradScheduler`): in its backward, the reverse exchange runs
    asynchronously while the scheduler's deferred weight gradients that fit its time run.
    """
    if algo not in ALGOS:
        raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
    if algo == "2dh" and (output_splits is not None or input_splits is not None):
        raise ValueError("algo='2dh' needs equal splits: pass no output_splits/input_splits")
    world = group_size(group)
    if world == 1:
        return x
    if algo == "linear":
        return _AllToAll.apply(x, group, output_splits, input_splits, scheduler)
    groups_2dh = hierarchical_groups(group) if groups_2dh is None else groups_2dh
    if groups_2dh.size != world:
        raise ValueError(
            f"groups_2dh spans {groups_2dh.num_nodes} x {groups_2dh.local_size} ranks, "
            f"but the group has {world}"
        )
    return all_to_all_2dh(x, groups_2dh)


def all_to_all_counts(counts: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Exchange per-destination counts (W*n,) so each rank learns what it will receive (W*n,)."""
    if group_size(group) == 1:
        return counts
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


# torch 2.13 renamed these (the old names warn); the GPU image's torch 2.11 has only the old ones.
ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class _AllGather(torch.autograd.Function):
    """Concatenate every rank's tensor along dim 0; backward: reduce-scatter (sum) of the grad."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        out = x.new_empty((group_size(group) * x.shape[0],) + tuple(x.shape[1:]))
        ALL_GATHER(out.detach(), x.detach(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // group_size(ctx.group),) + tuple(grad.shape[1:]))
        REDUCE_SCATTER(out.detach(), grad.detach(), group=ctx.group)
        return out, None


def all_gather(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All ranks' `x` stacked along dim 0 in group-rank order, differentiable (the gradient of a
    rank's slice is the sum of every rank's gradient for it). One process: `x` itself."""
    if group_size(group) == 1:
        return x
    return _AllGather.apply(x, group)
