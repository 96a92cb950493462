"""Tutel's pipelined expert exchange (Tutel 3.2): the capacity dimension is cut into d chunks;
the dispatch all-to-all of chunk i+1 runs while the experts compute chunk i, and the combine
all-to-all of chunk i while the experts compute chunk i+1. Backward overlaps the same way.

All dispatch all-to-alls are launched before any expert work so the communication stream never
waits behind computation it does not need; `work.wait()` only makes the compute stream wait for
the chunk it is about to use (NCCL), so the CPU never blocks until the end. Every chunk is an
independent slice of the (El, W*C, dim) Flexible layout, so the result equals overlap degree 1.
Each chunk's exchange may also be Tutel's 2DH all-to-all, queued on a side CUDA stream so it
overlaps the same way (`weft.comm.two_dim.start_exchange_2dh`).
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

from weft.comm.two_dim import start_exchange_2dh
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


def _launch(x: torch.Tensor, group, algo: str = "linear", groups_2dh=None) -> tuple[torch.Tensor, object | None]:
    """Start an equal-split all-to-all of x, linear or 2DH; returns (output, handle or None)."""
    if group_size(group) == 1:
        return x, None
    if algo == "2dh":
        return start_exchange_2dh(x, groups_2dh)
    out = torch.empty_like(x)
    return out, dist.all_to_all_single(out, x, group=group, async_op=True)


def _wait(handle) -> None:
    if handle is not None:
        handle.wait()


class PipelinedExchange(torch.autograd.Function):
    """buffer (W*El*C, dim) in source layout -> expert outputs in the same layout."""

    @staticmethod
    def forward(ctx, buffer, experts, group, ep, local, cap, degree, track, algo, groups_2dh, *params):
        ctx.track = track
        ctx.comm = comm = (group, algo, groups_2dh)
        dim = buffer.shape[-1]
        bounds = chunk_bounds(cap, degree)
        grid = buffer.view(ep, local, cap, dim)
        launched = [_launch(grid[:, :, a:b].contiguous(), *comm) for a, b in bounds]
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
            results.append(_launch(back, *comm))
        for _, handle in results:
            _wait(handle)
        ctx.meta = (ep, local, cap, dim, bounds)
        ctx.params = params
        return torch.cat([r.view(ep, local, b - a, dim) for r, (a, b) in zip((r for r, _ in results), bounds)],
                         dim=2).view(ep * local * cap, dim)

    @staticmethod
    def backward(ctx, grad):
        ep, local, cap, dim, bounds = ctx.meta
        grid = grad.contiguous().view(ep, local, cap, dim)
        launched = [_launch(grid[:, :, a:b].contiguous(), *ctx.comm) for a, b in bounds]
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
            sent.append(_launch(back, *ctx.comm))
        for _, handle in sent:
            _wait(handle)
        grad_buffer = torch.cat([r.view(ep, local, b - a, dim) for (r, _), (a, b) in zip(sent, bounds)], dim=2)
        ctx.inputs = ctx.outputs = None  # free the saved graphs
        return (grad_buffer.view(ep * local * cap, dim), *[None] * 9, *param_grads)


def pipelined_exchange(buffer: torch.Tensor, experts, group, ep: int, local: int, cap: int, degree: int,
                       algo: str = "linear", groups_2dh=None, weights: tuple | None = None) -> torch.Tensor:
    """Tutel's pipelining of the padded exchange; each chunk's all-to-all is `algo` ("linear" or
    "2dh" over `groups_2dh`, the hierarchical groups of `group`). Same function as degree 1.
    `weights` (w1, w2, w3) replace the experts' own (e.g. a slice gathered from several ranks;
    their gradients flow back through whatever produced them)."""
    if weights is None:
        params = list(experts.parameters())
    else:
        params = [w for w in weights if w is not None]
        experts = functools.partial(experts, weights=weights)
    track = torch.is_grad_enabled() and (buffer.requires_grad or any(p.requires_grad for p in params))
    return PipelinedExchange.apply(buffer, experts, group, ep, local, cap, degree, track, algo, groups_2dh, *params)


# -- dropless: every (destination rank, local expert) segment is cut into d parts -----------------
def _part(n: int, i: int, degree: int) -> tuple[int, int]:
    """Rows [a, b) of a segment of n rows that belong to chunk i of `degree` (parts may be empty)."""
    return n * i // degree, n * (i + 1) // degree


def dropless_plan(sent: list[list[int]], received: list[list[int]], degree: int, device) -> list[dict]:
    """Per chunk: which sent rows go (`index`), the split sizes both ways, the permutation that
    groups received rows by local expert (`by_expert`) and the rows per local expert. Sender and
    receiver cut each (source, expert) segment the same way, so both sides agree without talking."""
    ep, local = len(sent), len(sent[0])
    offsets, start = [], 0
    for r in range(ep):
        row = []
        for e in range(local):
            row.append(start)
            start += sent[r][e]
        offsets.append(row)
    plans = []
    for i in range(degree):
        index, send_splits = [], []
        for r in range(ep):
            total = 0
            for e in range(local):
                a, b = _part(sent[r][e], i, degree)
                index.append(torch.arange(offsets[r][e] + a, offsets[r][e] + b))
                total += b - a
            send_splits.append(total)
        sizes = [[_part(received[s][e], i, degree)[1] - _part(received[s][e], i, degree)[0] for e in range(local)]
                 for s in range(ep)]
        expert_of_row = torch.tensor([e for s in range(ep) for e in range(local) for _ in range(sizes[s][e])],
                                     dtype=torch.long)
        plans.append({
            "index": torch.cat(index).to(device),
            "send_splits": send_splits,
            "recv_splits": [sum(row) for row in sizes],
            "by_expert": torch.sort(expert_of_row, stable=True).indices.to(device),
            "per_expert": [sum(sizes[s][e] for s in range(ep)) for e in range(local)],
        })
    return plans


def _launch_v(x: torch.Tensor, group, out_splits: list[int], in_splits: list[int]):
    """Start an all-to-allv of x: in_splits[r] rows to rank r, out_splits[r] rows from rank r."""
    if group_size(group) == 1:
        return x, None
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    return out, dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group, async_op=True)


class DroplessPipelinedExchange(torch.autograd.Function):
    """send (N, dim) rows grouped by destination expert -> expert outputs in the same order."""

    @staticmethod
    def forward(ctx, send, experts, group, plans, track, *params):
        ctx.track, ctx.group, ctx.plans, ctx.params = track, group, plans, params
        launched = [_launch_v(send.index_select(0, p["index"]), group, p["recv_splits"], p["send_splits"])
                    for p in plans]
        ctx.inputs, ctx.outputs, results = [], [], []
        for plan, (recv, handle) in zip(plans, launched):
            _wait(handle)
            with torch.enable_grad() if track else contextlib.nullcontext():
                inp = recv.index_select(0, plan["by_expert"]).detach().requires_grad_(track)
                out = experts.forward_grouped(inp, plan["per_expert"])
            ctx.inputs.append(inp)
            ctx.outputs.append(out)
            back = torch.zeros_like(out).index_copy_(0, plan["by_expert"], out.detach())
            results.append(_launch_v(back, group, plan["send_splits"], plan["recv_splits"]))
        for _, handle in results:
            _wait(handle)
        index = torch.cat([p["index"] for p in plans])
        rows = torch.cat([r for r, _ in results])
        return torch.zeros(send.shape[0], rows.shape[1], dtype=rows.dtype, device=rows.device).index_copy_(0, index, rows)

    @staticmethod
    def backward(ctx, grad):
        group, plans = ctx.group, ctx.plans
        launched = [_launch_v(grad.index_select(0, p["index"]), group, p["recv_splits"], p["send_splits"])
                    for p in plans]
        param_grads = [None] * len(ctx.params)
        sent = []
        for plan, (recv, handle), inp, out in zip(plans, launched, ctx.inputs, ctx.outputs):
            _wait(handle)
            grad_out = recv.index_select(0, plan["by_expert"])
            grads = torch.autograd.grad(out, [inp, *ctx.params], grad_out, allow_unused=True)
            for i, g in enumerate(grads[1:]):
                if g is not None:
                    param_grads[i] = g if param_grads[i] is None else param_grads[i] + g
            back = torch.zeros_like(grads[0]).index_copy_(0, plan["by_expert"], grads[0])
            sent.append(_launch_v(back, group, plan["send_splits"], plan["recv_splits"]))
        for _, handle in sent:
            _wait(handle)
        index = torch.cat([p["index"] for p in plans])
        rows = torch.cat([r for r, _ in sent])
        grad_send = torch.zeros(grad.shape[0], rows.shape[1], dtype=rows.dtype, device=rows.device)
        ctx.inputs = ctx.outputs = None
        return (grad_send.index_copy_(0, index, rows), None, None, None, None, *param_grads)


def dropless_pipelined_exchange(send: torch.Tensor, experts, group, sent: list[list[int]],
                                received: list[list[int]], degree: int) -> torch.Tensor:
    """Tutel's pipelining for the dropless all-to-allv: the same function as one exchange."""
    params = list(experts.parameters())
    track = torch.is_grad_enabled() and (send.requires_grad or any(p.requires_grad for p in params))
    plans = dropless_plan(sent, received, degree, send.device)
    return DroplessPipelinedExchange.apply(send, experts, group, plans, track, *params)
