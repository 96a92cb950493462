"""An all-to-all(v) split into start and wait, both differentiable (`weft.comm.split`), for
pipelines that run other work while the exchange is in flight (Lancet's partitioned forward,
sec. 5.3).

    out, pending = start_all_to_all(x, group, out_splits, in_splits)
    ...                                  # independent computation overlaps the exchange
    out = wait_all_to_all(out, pending)  # out is valid from here on

Backward mirrors it: the wait's backward launches the reverse exchange of the gradient and the
start's backward waits for it, so autograd's other backward work in between overlaps it too.
Between the launch and the wait, a `weft.overlap.WGradScheduler` (if given) runs deferred
weight-gradient items that fit the exchange's predicted time (Lancet sec. 4).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from weft.comm.all_to_all import output_buffer
from weft.comm.split import SplitCollective, start, wait
from weft.distributed import group_size


@dataclass
class Pending(SplitCollective):
    """The in-flight exchange shared by a start/wait pair (forward) and by their backward."""

    group: dist.ProcessGroup | None
    out_splits: list[int] | None
    in_splits: list[int] | None
    scheduler: object | None = None  # WGradScheduler: runs deferred dW while the exchange flies

    def launch(self, x: torch.Tensor) -> tuple[torch.Tensor, object | None]:
        return _launch(x, self.group, self.out_splits, self.in_splits)

    def launch_backward(self, grad: torch.Tensor) -> tuple[torch.Tensor, object | None]:
        return _launch(grad, self.group, self.in_splits, self.out_splits)

    def while_backward_flies(self, grad: torch.Tensor) -> None:
        scheduler = self.scheduler
        if scheduler is not None and scheduler.active and self.work is not None:
            nbytes = grad.numel() * grad.element_size()
            scheduler.run_under(("all_to_all", grad.dtype, nbytes), nbytes)


def _launch(x: torch.Tensor, group, out_splits, in_splits) -> tuple[torch.Tensor, object | None]:
    out = output_buffer(x, out_splits)
    if group_size(group) == 1:
        out.copy_(x)
        return out, None
    return out, dist.all_to_all_single(out.detach(), x.detach(), out_splits, in_splits, group=group, async_op=True)


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
    return start(x, pending), pending


def wait_all_to_all(out: torch.Tensor, pending: Pending) -> torch.Tensor:
    """Wait for the exchange started by `start_all_to_all`; returns its output."""
    return wait(out, pending)
