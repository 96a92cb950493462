"""An all-gather split into start and wait, both differentiable (`weft.comm.split`), for a
transfer launched ahead of the computation that needs it (Pro-Prophet's Trans under the
preceding block, Alg. 2):

    out, pending = start_all_gather(x, group)   # launched; other work runs meanwhile
    ...
    out = wait_all_gather(out, pending)         # every rank's x stacked along dim 0

In backward the wait launches the reduce-scatter (sum) of the gradient as soon as it is complete
and the start waits for it where the start was created in the forward (Agg): a transfer started
one layer early is summed back under that layer's backward.

Run it on a group of its own (`weft.distributed.side_group`) to let it fly beside the group's
other collectives instead of queueing behind them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from weft.comm.all_to_all import ALL_GATHER, REDUCE_SCATTER
from weft.comm.split import SplitCollective, start, wait
from weft.distributed import group_size


@dataclass
class PendingGather(SplitCollective):
    """An all-gather over `group` in flight, and its reduce-scatter in backward."""

    group: dist.ProcessGroup | None

    def launch(self, x: torch.Tensor) -> tuple[torch.Tensor, object | None]:
        world = group_size(self.group)
        out = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))
        if world == 1:
            return out.copy_(x), None
        return out, ALL_GATHER(out.detach(), x.detach(), group=self.group, async_op=True)  # weft.comm.all_to_all

    def launch_backward(self, grad: torch.Tensor) -> tuple[torch.Tensor, object | None]:
        world = group_size(self.group)
        grad_in = grad.new_empty((grad.shape[0] // world,) + tuple(grad.shape[1:]))
        if world == 1:
            return grad_in.copy_(grad), None
        return grad_in, REDUCE_SCATTER(grad_in.detach(), grad.detach(), group=self.group, async_op=True)


def start_all_gather(x: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, PendingGather]:
    """Launch the all-gather of `x` along dim 0 over `group`; returns the output buffer (not
    valid until `wait_all_gather`) and the handle."""
    pending = PendingGather(group)
    return start(x, pending), pending


def wait_all_gather(out: torch.Tensor, pending: PendingGather) -> torch.Tensor:
    """Wait for the all-gather started by `start_all_gather`; returns every rank's tensor stacked
    along dim 0 in group-rank order (the gradient of a rank's part is the sum of every rank's)."""
    return wait(out, pending)
