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

import torch
import torch.distributed as dist
import torch.nn.functional as F

from weft.comm.two_dim import start_exchange_2dh
from weft.distributed import group_size
from weft.kernels.grouped_mm import EXCHANGE_SM_MARGIN, leave_sms
from weft.moe.exchange.all_to_all import inverse_permutation
from weft.moe.experts import activate


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
    return out, dist.all_to_all_single(out.detach(), x.detach(), group=group, async_op=True)  # weft.comm.all_to_all


def _wait(handle) -> None:
    if handle is not None:
        handle.wait()


def _wait_running_dw(handle, received: torch.Tensor, scheduler, chunk: int) -> None:
    """Wait for backward chunk `chunk`'s exchange; under a Lancet `WGradScheduler` in its backward,
    for the first chunk first run the deferred weight gradients its plan gives this exchange
    (`communicate`), while it flies. Only the first: nothing else can run beside its exchange,
    while every later chunk's exchange flies beside the chunk before it computing its backward,
    where items would delay that computation instead of filling an idle link (and take from the
    pool the items the next layer's first exchange could hide)."""
    if handle is None or scheduler is None or not scheduler.active or chunk > 0:
        _wait(handle)
        return
    nbytes = received.numel() * received.element_size()
    scheduler.communicate(("all_to_all", received.dtype, nbytes), nbytes, handle, received.device)


class _ChunkedFFN:
    """The expert FFN act(x @ w1) @ w2 (swiglu: (silu(x @ w1) * (x @ w3)) @ w2) over row chunks
    that arrive one at a time, written by hand so that each weight gradient is ONE batched matmul
    over all chunks at the end of backward. Autograd per chunk would compute d partial weight
    gradients and add them up: d - 1 extra weight-sized writes and reads per weight, which on
    large experts cost more than the pipelining hides.

    Saved rows live in full (G, R, .) buffers, chunk c in rows [ep * a, ep * b) of every expert:
    a permutation of the plain layer's rows, which a weight gradient does not see. Only kernels
    that write strided views correctly are used on them (bmm out=, in-place activations, silu
    and threshold backward; CPU gelu's out= variants are not among them).
    """

    def __init__(self, activation: str, weights: tuple, x_like: torch.Tensor, groups: int, rows: int, track: bool):
        self.activation, self.track = activation, track
        self.w1, self.w2, self.w3 = weights
        dim, hidden = self.w1.shape[1], self.w1.shape[2]
        self.x = x_like.new_empty(groups, rows, dim)
        # What backward needs besides x: relu keeps its output (its own derivative mask), gelu and
        # silu their input (the output is recomputed for dW2), swiglu both inputs of its product.
        self.h1 = x_like.new_empty(groups, rows, hidden) if track else None
        self.h3 = x_like.new_empty(groups, rows, hidden) if track and activation == "swiglu" else None

    def forward(self, rows: slice) -> torch.Tensor:
        """Expert outputs (G, M, dim) of the input rows already written to `self.x[:, rows]`."""
        x, w1, w3 = self.x[:, rows], self.w1, self.w3
        if not self.track:
            return torch.bmm(activate(self.activation, torch.bmm(x, w1), torch.bmm(x, w3) if w3 is not None else None),
                             self.w2)
        h1 = torch.bmm(x, w1, out=self.h1[:, rows])
        if self.activation == "relu":
            hidden = h1.relu_()
        else:
            h3 = torch.bmm(x, w3, out=self.h3[:, rows]) if w3 is not None else None
            hidden = activate(self.activation, h1, h3)
        return torch.bmm(hidden, self.w2)

    def backward(self, rows: slice) -> torch.Tensor:
        """Input gradient (G, M, dim) of the chunk whose output gradient is in `self.dy[:, rows]`;
        its hidden gradients go to `self.dh1` (`self.dh3`) for the weight gradients."""
        dy, h1, dh1 = self.dy[:, rows], self.h1[:, rows], self.dh1[:, rows]
        w2t = self.w2.transpose(1, 2)
        if self.activation in ("relu", "silu"):
            torch.bmm(dy, w2t, out=dh1)
            if self.activation == "relu":
                torch.ops.aten.threshold_backward.grad_input(dh1, h1, 0, grad_input=dh1)
            else:
                torch.ops.aten.silu_backward.grad_input(dh1, h1, grad_input=dh1)
        elif self.activation == "gelu":
            dh1.copy_(torch.ops.aten.gelu_backward(torch.bmm(dy, w2t), h1))
        else:  # swiglu: a = silu(h1) * h3
            h3, dh3 = self.h3[:, rows], self.dh3[:, rows]
            da = torch.bmm(dy, w2t)
            torch.mul(da, F.silu(h1), out=dh3)
            torch.ops.aten.silu_backward.grad_input(da.mul_(h3), h1, grad_input=dh1)
            return torch.bmm(dh1, self.w1.transpose(1, 2)).baddbmm_(dh3, self.w3.transpose(1, 2))
        return torch.bmm(dh1, self.w1.transpose(1, 2))

    def start_backward(self) -> None:
        self.dy = torch.empty_like(self.x)
        self.dh1 = torch.empty_like(self.h1)
        self.dh3 = torch.empty_like(self.h3) if self.h3 is not None else None

    def weight_grads(self) -> tuple:
        """(dw1, dw2, dw3): one batched matmul each over every chunk's rows."""
        hidden = self.h1 if self.activation == "relu" else activate(self.activation, self.h1, self.h3)
        x_t = self.x.transpose(1, 2)
        dw3 = torch.bmm(x_t, self.dh3) if self.h3 is not None else None
        return torch.bmm(x_t, self.dh1), torch.bmm(hidden.transpose(1, 2), self.dy), dw3


class PipelinedExchange(torch.autograd.Function):
    """buffer (W*El*C, dim) in source layout -> expert outputs in the same layout."""

    @staticmethod
    def forward(ctx, buffer, activation, group, ep, local, cap, degree, track, algo, groups_2dh, scheduler,
                w1, w2, w3):
        ctx.comm = comm = (group, algo, groups_2dh)
        ctx.scheduler = scheduler
        dim = buffer.shape[-1]
        bounds = chunk_bounds(cap, degree)
        grid = buffer.view(ep, local, cap, dim)
        launched = [_launch(grid[:, :, a:b].contiguous(), *comm) for a, b in bounds]
        # The experts' compute runs with the weights and buffer as given (already in the compute dtype).
        with torch.autocast(buffer.device.type, enabled=False):
            ffn = _ChunkedFFN(activation, (w1, w2, w3), buffer, local, ep * cap, track)
            results = []
            for (a, b), (recv, handle) in zip(bounds, launched):
                _wait(handle)
                width, rows = b - a, slice(ep * a, ep * b)
                ffn.x[:, rows].view(local, ep, width, dim).copy_(recv.view(ep, local, width, dim).transpose(0, 1))
                out = ffn.forward(rows)
                back = out.view(local, ep, width, dim).transpose(0, 1).contiguous()
                results.append(_launch(back, *comm))
        for _, handle in results:
            _wait(handle)
        ctx.meta = (ep, local, cap, dim, bounds)
        ctx.ffn = ffn if track else None
        return torch.cat([r.view(ep, local, b - a, dim) for r, (a, b) in zip((r for r, _ in results), bounds)],
                         dim=2).view(ep * local * cap, dim)

    @staticmethod
    def backward(ctx, grad):
        ep, local, cap, dim, bounds = ctx.meta
        ffn, ctx.ffn = ctx.ffn, None  # free the saved rows with this backward
        grid = grad.contiguous().view(ep, local, cap, dim)
        launched = [_launch(grid[:, :, a:b].contiguous(), *ctx.comm) for a, b in bounds]
        sent = []
        with torch.autocast(grad.device.type, enabled=False):
            ffn.start_backward()
            for chunk, ((a, b), (recv, handle)) in enumerate(zip(bounds, launched)):
                _wait_running_dw(handle, recv, ctx.scheduler, chunk)
                width, rows = b - a, slice(ep * a, ep * b)
                ffn.dy[:, rows].view(local, ep, width, dim).copy_(recv.view(ep, local, width, dim).transpose(0, 1))
                back = ffn.backward(rows).view(local, ep, width, dim).transpose(0, 1).contiguous()
                sent.append(_launch(back, *ctx.comm))
            # The weight gradients run while the last input gradients are still in flight, leaving
            # that exchange its SMs (without: 0.55 ms of phi35's step, P2P disabled).
            with leave_sms(EXCHANGE_SM_MARGIN if sent[-1][1] is not None and grad.is_cuda else 0):
                dw1, dw2, dw3 = ffn.weight_grads()
        for _, handle in sent:
            _wait(handle)
        grad_buffer = torch.cat([r.view(ep, local, b - a, dim) for (r, _), (a, b) in zip(sent, bounds)], dim=2)
        return (grad_buffer.view(ep * local * cap, dim), *[None] * 10, dw1, dw2, dw3)


def pipelined_exchange(buffer: torch.Tensor, experts, group, ep: int, local: int, cap: int, degree: int,
                       algo: str = "linear", groups_2dh=None, weights: tuple | None = None,
                       scheduler=None) -> torch.Tensor:
    """Tutel's pipelining of the padded exchange; each chunk's all-to-all is `algo` ("linear" or
    "2dh" over `groups_2dh`, the hierarchical groups of `group`). Same function as degree 1.
    `weights` (w1, w2, w3) replace the experts' own (e.g. a slice gathered from several ranks;
    their gradients flow back through whatever produced them). The expert weight gradients are
    computed here, at once (not deferred by a Lancet `WGradScheduler`); `scheduler` (Lancet's, in
    its backward) runs the model's other deferred weight gradients under the backward's first
    chunk's exchange, as the unpipelined exchange runs them under its one (Lancet sec. 4; why
    only the first: `_wait_running_dw`)."""
    w1, w2, w3 = experts.weights() if weights is None else weights
    dtype = experts.compute_dtype(buffer)
    buffer = buffer.to(dtype)
    w1, w2, w3 = (None if w is None else w.to(dtype) for w in (w1, w2, w3))
    track = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (buffer, w1, w2, w3))
    return PipelinedExchange.apply(buffer, experts.activation, group, ep, local, cap, degree, track, algo, groups_2dh,
                                   scheduler, w1, w2, w3)


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
        by_expert = torch.sort(expert_of_row, stable=True).indices.to(device)
        plans.append({
            "index": torch.cat(index).to(device),
            "send_splits": send_splits,
            "recv_splits": [sum(row) for row in sizes],
            "by_expert": by_expert,
            "to_received": inverse_permutation(by_expert),  # expert order -> the received rows' order
            "per_expert": [sum(sizes[s][e] for s in range(ep)) for e in range(local)],
        })
    return plans


def _launch_v(x: torch.Tensor, group, out_splits: list[int], in_splits: list[int]):
    """Start an all-to-allv of x: in_splits[r] rows to rank r, out_splits[r] rows from rank r."""
    if group_size(group) == 1:
        return x, None
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    return out, dist.all_to_all_single(out.detach(), x.detach().contiguous(), out_splits, in_splits, group=group,
                                     async_op=True)


class DroplessPipelinedExchange(torch.autograd.Function):
    """send (N, dim) rows grouped by destination expert -> expert outputs in the same order. The
    outputs go back to the received rows' order and then to the sent rows' order by gathers
    with the inverse permutations (each chunk's `to_received`, the chunks' joined rows'
    `to_sent`), forward and backward, with no row-sized zero tensor to index_copy into."""

    @staticmethod
    def forward(ctx, send, experts, group, plans, track, scheduler, *params):
        ctx.track, ctx.group, ctx.plans, ctx.params, ctx.scheduler = track, group, plans, params, scheduler
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
            back = out.detach().index_select(0, plan["to_received"])
            results.append(_launch_v(back, group, plan["send_splits"], plan["recv_splits"]))
        for _, handle in results:
            _wait(handle)
        # the chunks' rows, joined, are a permutation of the sent rows (each in exactly one chunk)
        ctx.to_sent = inverse_permutation(torch.cat([p["index"] for p in plans]))
        return torch.cat([r for r, _ in results]).index_select(0, ctx.to_sent)

    @staticmethod
    def backward(ctx, grad):
        group, plans = ctx.group, ctx.plans
        launched = [_launch_v(grad.index_select(0, p["index"]), group, p["recv_splits"], p["send_splits"])
                    for p in plans]
        param_grads = [None] * len(ctx.params)
        sent = []
        for chunk, (plan, (recv, handle), inp, out) in enumerate(zip(plans, launched, ctx.inputs, ctx.outputs)):
            _wait_running_dw(handle, recv, ctx.scheduler, chunk)
            grad_out = recv.index_select(0, plan["by_expert"])
            grads = torch.autograd.grad(out, [inp, *ctx.params], grad_out, allow_unused=True)
            for i, g in enumerate(grads[1:]):
                if g is not None:
                    param_grads[i] = g if param_grads[i] is None else param_grads[i] + g
            back = grads[0].index_select(0, plan["to_received"])
            sent.append(_launch_v(back, group, plan["send_splits"], plan["recv_splits"]))
        for _, handle in sent:
            _wait(handle)
        grad_send = torch.cat([r for r, _ in sent]).index_select(0, ctx.to_sent)
        ctx.inputs = ctx.outputs = None
        return (grad_send, None, None, None, None, None, *param_grads)


def dropless_pipelined_exchange(send: torch.Tensor, experts, group, sent: list[list[int]],
                                received: list[list[int]], degree: int, scheduler=None) -> torch.Tensor:
    """Tutel's pipelining for the dropless all-to-allv: the same function as one exchange. Under a
    Lancet `WGradScheduler` (`scheduler`) the deferred weight gradients its plan gives the
    backward's first chunk's exchange run while that exchange flies, as in `pipelined_exchange`."""
    params = list(experts.parameters())
    track = torch.is_grad_enabled() and (send.requires_grad or any(p.requires_grad for p in params))
    plans = dropless_plan(sent, received, degree, send.device)
    return DroplessPipelinedExchange.apply(send, experts, group, plans, track, scheduler, *params)
