"""A collective split into a differentiable start and wait, so that other work runs while it is
in flight; backward mirrors it (the wait's backward launches the reverse collective of the
gradient, the start's backward waits for it and delivers it).

    out = start(x, pending)   # launched; `out` is not valid yet
    ...                       # independent computation overlaps the collective
    out = wait(out, pending)  # valid from here on

A `SplitCollective` says which collective runs each way (`launch`, `launch_backward`); one
instance serves one start/wait pair and its backward. Autograd runs ready nodes in reverse order
of creation, so the start's backward (the wait for the reverse collective) comes where the start
was created in the forward.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class SplitCollective(ABC):
    """The in-flight state of one start/wait pair: the pending work and, in backward, the
    gradient being exchanged."""

    work: object | None = None
    grad_in: torch.Tensor | None = None

    @abstractmethod
    def launch(self, x: torch.Tensor) -> tuple[torch.Tensor, object | None]:
        """Launch the forward collective of x: (its output buffer, the work to wait for or None)."""

    @abstractmethod
    def launch_backward(self, grad: torch.Tensor) -> tuple[torch.Tensor, object | None]:
        """Launch the reverse collective of the output's gradient: (the input's gradient buffer, work)."""

    def while_backward_flies(self, grad: torch.Tensor) -> None:
        """Called right after `launch_backward` (e.g. Lancet's deferred weight gradients); none by default."""
        del grad


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pending):
        ctx.pending = pending
        out, pending.work = pending.launch(x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        pending = ctx.pending
        if pending.work is not None:
            pending.work.wait()
        grad_in, pending.work, pending.grad_in = pending.grad_in, None, None
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
        pending.grad_in, pending.work = pending.launch_backward(grad.contiguous())
        pending.while_backward_flies(grad)
        # The start's backward ignores what it receives here and delivers the exchanged gradient.
        return grad, None


def start(x: torch.Tensor, pending: SplitCollective) -> torch.Tensor:
    """Launch `pending`'s collective of x; the returned buffer is valid after `wait`."""
    return _Start.apply(x, pending)


def wait(out: torch.Tensor, pending: SplitCollective) -> torch.Tensor:
    """Wait for the collective `start` launched; returns its output."""
    return _Wait.apply(out, pending)
