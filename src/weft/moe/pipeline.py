"""Tutel's pipelined expert exchange (Tutel 3.2): the capacity dimension is cut into d chunks;
the dispatch all-to-all of chunk i+1 runs while the experts compute chunk i, and the combine
all-to-all of chunk i while the experts compute chunk i+1. Backward overlaps the same way.

All dispatch all-to-alls are launched before any expert work so the communication stream never
waits behind computation it does not need; `work.wait()` only makes the compute stream wait for
the chunk it is about to use (NCCL), so the CPU never blocks until the end. Every chunk is an
independent slice of the (El, W*C, dim) Flexible layout, so the result equals overlap degree 1.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from weft.distributed import group_size


def chunk_bounds(capacity: int, degree: int) -> list[tuple[int, int]]:
    """Split [0, capacity) into min(degree, capacity) contiguous, near-equal chunks."""
    degree = max(1, min(degree, capacity))
    base, extra = divmod(capacity, degree)
    bounds, start = [], 0
    for i in range(degree):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _launch(x: torch.Tensor, group) -> tuple[torch.Tensor, object | None]:
    """Start an equal-split all-to-all of x; returns (output, handle or None)."""
    if group_size(group) == 1:
        return x, None
    out = torch.empty_like(x)
    return out, dist.all_to_all_single(out, x, group=group, async_op=True)


def _wait(handle) -> None:
    if handle is not None:
        handle.wait()


class PipelinedExchange(torch.autograd.Function):
    """buffer (W*El*C, dim) in source layout -> expert outputs in the same layout."""

    @staticmethod
    def forward(ctx, buffer, experts, group, ep, local, cap, degree, track, *params):
        ctx.track = track
        dim = buffer.shape[-1]
        bounds = chunk_bounds(cap, degree)
        grid = buffer.view(ep, local, cap, dim)
        launched = [_launch(grid[:, :, a:b].contiguous(), group) for a, b in bounds]
        ctx.inputs, ctx.outputs, results = [], [], []
        for (a, b), (recv, handle) in zip(bounds, launched):
            _wait(handle)
            width = b - a
            flexible = recv.view(ep, local, width, dim).transpose(0, 1).reshape(local, ep * width, dim)
            # Keep each chunk's expert graph for backward, unless nothing needs gradients (eval).
            with torch.enable_grad() if ctx.track else contextlib.nullcontext():
                inp = flexible.detach().requires_grad_(ctx.track)
                out = experts(inp)
            ctx.inputs.append(inp)
            ctx.outputs.append(out)
            back = out.detach().view(local, ep, width, dim).transpose(0, 1).contiguous()
            results.append(_launch(back, group))
        for _, handle in results:
            _wait(handle)
        ctx.meta = (group, ep, local, cap, dim, bounds)
        ctx.params = params
        return torch.cat([r.view(ep, local, b - a, dim) for r, (a, b) in zip((r for r, _ in results), bounds)],
                         dim=2).view(ep * local * cap, dim)

    @staticmethod
    def backward(ctx, grad):
        group, ep, local, cap, dim, bounds = ctx.meta
        grid = grad.contiguous().view(ep, local, cap, dim)
        launched = [_launch(grid[:, :, a:b].contiguous(), group) for a, b in bounds]
        param_grads = [None] * len(ctx.params)
        sent = []
        for (a, b), (recv, handle), inp, out in zip(bounds, launched, ctx.inputs, ctx.outputs):
            _wait(handle)
            width = b - a
            grad_out = recv.view(ep, local, width, dim).transpose(0, 1).reshape(local, ep * width, dim)
            grads = torch.autograd.grad(out, [inp, *ctx.params], grad_out, allow_unused=True)
            for i, g in enumerate(grads[1:]):
                if g is not None:
                    param_grads[i] = g if param_grads[i] is None else param_grads[i] + g
            back = grads[0].view(local, ep, width, dim).transpose(0, 1).contiguous()
            sent.append(_launch(back, group))
        for _, handle in sent:
            _wait(handle)
        grad_buffer = torch.cat([r.view(ep, local, b - a, dim) for (r, _), (a, b) in zip(sent, bounds)], dim=2)
        ctx.inputs = ctx.outputs = None  # free the saved graphs
        return (grad_buffer.view(ep * local * cap, dim), None, None, None, None, None, None, None, *param_grads)


def pipelined_exchange(buffer: torch.Tensor, experts, group, ep: int, local: int, cap: int, degree: int) -> torch.Tensor:
    params = list(experts.parameters())
    track = torch.is_grad_enabled() and (buffer.requires_grad or any(p.requires_grad for p in params))
    return PipelinedExchange.apply(buffer, experts, group, ep, local, cap, degree, track, *params)
