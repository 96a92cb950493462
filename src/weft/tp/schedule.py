"""How a stack of tensor-parallel sub-layers runs: each `Stage` is a residual sub-layer
x -> x + all_reduce(compute(norm(x))), whose `compute` (a column- then a row-parallel linear)
leaves a partial sum on each rank. The schedules compute the same function and differ in when
the all-reduces run:

- `Sequential`: Megatron-LM (sec. 3): each all-reduce in forward (`g`) and each input-gradient
  all-reduce in backward (`f`) waits where it is issued; the GPU idles through every one.
- `Domino(p1)`: Domino's row split of the input (sec. 3.2, 4.1, fig. 5, 7, 8): the batch is cut into p1
  micro-batches that run through the stages one after the other; each micro-batch's all-reduce
  is issued asynchronously and waited only when that micro-batch enters the next stage, so it
  runs while the other micro-batches compute. Backward mirrors it: a micro-batch's input
  gradient is computed first, its all-reduce started, and its weight-gradient matmuls run under
  it (sec. 4.1, fig. 8), then the next micro-batch's. Every row of the batch sees the same operations as
  in `Sequential`, so outputs and gradients are equal (the weight gradients summed over the
  micro-batches instead of one matmul over the batch: equal up to rounding).
- `NoComm`: the all-reduces left out. Not the same function (each rank sums only its own part):
  the time with no communication at all, the ceiling an overlap can reach (`weft bench`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from weft.tp.collectives import all_reduce_, copy_to_tp, reduce_from_tp
from weft.tp.layers import WeightGradQueue


@dataclass(frozen=True)
class Stage:
    """x -> x + all_reduce(compute(norm(x))): `norm` replicated on every rank of the group,
    `compute(h, queue=None)` the partial sum of this rank's shards (with a
    `weft.tp.layers.WeightGradQueue`: its linears' weight gradients go to the queue); `params`
    every parameter of both."""

    norm: nn.Module
    compute: Callable[..., torch.Tensor]
    params: tuple[nn.Parameter, ...]


class Sequential:
    """Megatron-style tensor parallelism: the all-reduces wait where they are issued."""

    name = "none"

    def run(self, stages: Sequence[Stage], x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        for stage in stages:
            x = x + reduce_from_tp(stage.compute(copy_to_tp(stage.norm(x), group)), group)
        return x


class NoComm:
    """The stages without their all-reduces (timing only: not the function of the model)."""

    name = "no-comm"

    def run(self, stages: Sequence[Stage], x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        for stage in stages:
            x = x + stage.compute(stage.norm(x))
        return x


class Domino:
    """Domino's row split into `p1` micro-batches along dim 0 (see the module docstring)."""

    name = "domino"

    def __init__(self, p1: int = 2):
        if isinstance(p1, bool) or not isinstance(p1, int) or p1 < 1:
            raise ValueError(f"domino's p1 (micro-batches) must be a positive integer, got {p1!r}")
        self.p1 = p1

    def run(self, stages: Sequence[Stage], x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        if not torch.is_grad_enabled():  # evaluation, sampling: no graphs to keep (and no overlap)
            return Sequential().run(stages, x, group)
        if x.shape[0] < self.p1:
            raise ValueError(f"domino splits the batch into p1 = {self.p1} micro-batches; the batch has only "
                             f"{x.shape[0]} rows")
        params = [p for stage in stages for p in stage.params]
        return _DominoStack.apply(tuple(stages), group, self.p1, x, *params)


@dataclass
class _Record:
    """One micro-batch through one stage: its input (a leaf), the norm's output (in the graph of
    the input), the compute's input (a leaf) and its partial output (in the graph of that leaf)."""

    x_in: torch.Tensor
    normed: torch.Tensor
    h: torch.Tensor
    partial: torch.Tensor


class _DominoStack(torch.autograd.Function):
    """The stack of stages over p1 micro-batches with the schedule spelled out in both passes.
    Each micro-batch's work in each stage is a small autograd graph kept from the forward; the
    backward walks them in the order that overlaps, with `torch.autograd.grad`, and returns the
    summed parameter gradients."""

    @staticmethod
    def forward(ctx, stages, group, p1, x, *params):
        micro = [c.detach() for c in x.chunk(p1)]
        pending: list[tuple[torch.Tensor, object] | None] = [None] * len(micro)
        records: list[list[_Record]] = []
        queue = WeightGradQueue()
        for stage in stages:
            row = []
            for i in range(len(micro)):
                if pending[i] is not None:  # the previous stage's all-reduce of this micro-batch
                    reduced, work = pending[i]
                    if work is not None:
                        work.wait()
                    micro[i] = micro[i] + reduced
                with torch.enable_grad():
                    x_in = micro[i].detach().requires_grad_()
                    normed = stage.norm(x_in)
                    h = normed.detach().requires_grad_()
                    partial = stage.compute(h, queue=queue)
                reduced = partial.detach().clone()
                pending[i] = (reduced, all_reduce_(reduced, group, async_op=True))
                row.append(_Record(x_in, normed, h, partial))
            records.append(row)
        for i, (reduced, work) in enumerate(pending):
            if work is not None:
                work.wait()
            micro[i] = micro[i] + reduced
        ctx.stages, ctx.group, ctx.records, ctx.queue = stages, group, records, queue
        return torch.cat(micro)

    @staticmethod
    def backward(ctx, grad_out):
        stages, group, records = ctx.stages, ctx.group, ctx.records
        count = len(records[0])
        grads = [g.contiguous() for g in grad_out.chunk(count)]  # d loss / d (stage output), per micro-batch
        param_grads: dict[int, torch.Tensor] = {}

        def accumulate(params, found):
            for p, g in zip(params, found):
                if g is not None:
                    param_grads[id(p)] = g if id(p) not in param_grads else param_grads[id(p)] + g

        def finish(stage: Stage, rec: _Record, pending_grad) -> torch.Tensor:
            """Wait for a micro-batch's input-gradient all-reduce, then the norm's backward."""
            dh, work = pending_grad
            if work is not None:
                work.wait()
            norm_params = [p for p in stage.norm.parameters() if p.requires_grad]
            found = torch.autograd.grad(rec.normed, [rec.x_in, *norm_params], dh, allow_unused=True)
            accumulate(norm_params, found[1:])
            return found[0]

        pending: list = [None] * count
        for s in range(len(stages) - 1, -1, -1):
            stage = stages[s]
            compute_params = [p for p in stage.params if p.requires_grad
                              and all(p is not q for q in stage.norm.parameters())]
            for i in range(count):
                if pending[i] is not None:  # the later stage's all-reduce of this micro-batch
                    grads[i] = grads[i] + finish(stages[s + 1], records[s + 1][i], pending[i])
                rec = records[s][i]
                # the input gradient (the linears' weight gradients wait in the queue) ...
                found = torch.autograd.grad(rec.partial, [rec.h, *compute_params], grads[i], allow_unused=True)
                accumulate(compute_params, found[1:])
                dh = found[0].contiguous()
                pending[i] = (dh, all_reduce_(dh, group, async_op=True))
                ctx.queue.run()  # ... and the weight-gradient matmuls under its all-reduce
        for i in range(count):
            grads[i] = grads[i] + finish(stages[0], records[0][i], pending[i])
        accumulate_all = ctx.queue.grads()
        for key, g in accumulate_all.items():
            param_grads[key] = g if key not in param_grads else param_grads[key] + g
        all_params = [p for stage in stages for p in stage.params]
        del ctx.records, ctx.queue
        return (None, None, None, torch.cat(grads), *(param_grads.get(id(p)) for p in all_params))
