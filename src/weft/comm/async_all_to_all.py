"""An all-to-all(v) split into start and wait, both differentiable, for pipelines that run other
work while the exchange is in flight (Lancet's partitioned forward, sec. 5.3).

    out, pending = start_all_to_all(x, group, out_splits, in_splits)
    ...                                  # independent computation overlaps the exchange
    out = wait_all_to_all(out, pending)  # out is valid from here on

Backward mirrors it: the wait's backward launches the reverse exchange of the gradient and the
start's backward waits for it, so autograd's other backward work in between overlaps it too.
Between the launch and the wait, a `weft.overlap.WGradScheduler` (if given) runs deferred
weight-gradient items that fit the exchange's predicted time (Lancet sec. 4).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from weft.comm.all_to_all import output_buffer
from weft.distributed import group_size


@dataclass
class Pending:
    """The in-flight exchange shared by a start/wait pair (forward) and by their backward."""

    group: dist.ProcessGroup | None
    out_splits: list[int] | None
    in_splits: list[int] | None
    scheduler: object | None = None  # WGradScheduler: runs deferred dW while the exchange flies
    work: object | None = None
    grad_out: torch.Tensor | None = field(default=None, repr=False)


def _launch(x: torch.Tensor, group, out_splits, in_splits) -> tuple[torch.Tensor, object | None]:
    x = x.contiguous()
    out = output_buffer(x, out_splits)
    if group_size(group) == 1:
        out.copy_(x)
        return out, None
    return out, dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=True)


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pending):
        ctx.pending = pending
        out, pending.work = _launch(x, pending.group, pending.out_splits, pending.in_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        pending = ctx.pending
        if pending.work is not None:
            pending.work.wait()
        pending.work, grad_in, pending.grad_out = None, pending.grad_out, None
        return grad_in, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, pending):
        ctx.pending = pending
        if pending.work is not None:
            pending.work.wait()
            pending.work = None
        return out

    @staticmethod
    def backward(ctx, grad):
        pending = ctx.pending
        pending.grad_out, pending.work = _launch(grad, pending.group, pending.in_splits, pending.out_splits)
        scheduler = pending.scheduler
        if scheduler is not None and scheduler.active and pending.work is not None:
            nbytes = grad.numel() * grad.element_size()
            scheduler.run_for(scheduler.predict_comm(("all_to_all", grad.dtype, nbytes), nbytes))
        # The start's backward ignores what it receives here and delivers the exchanged gradient.
        return grad, None


def start_all_to_all(
    x: torch.Tensor,
    group: dist.ProcessGroup | None,
    output_splits: list[int] | None = None,
    input_splits: list[int] | None = None,
    scheduler: object | None = None,
) -> tuple[torch.Tensor, Pending]:
    """Launch an all-to-all(v) of `x` along dim 0; returns the output buffer (not valid until
    `wait_all_to_all`) and the handle. Splits as in `weft.comm.all_to_all`."""
    pending = Pending(group, output_splits, input_splits, scheduler)
    return _Start.apply(x, pending), pending


def wait_all_to_all(out: torch.Tensor, pending: Pending) -> torch.Tensor:
    """Wait for the exchange started by `start_all_to_all`; returns its output."""
    return _Wait.apply(out, pending)
