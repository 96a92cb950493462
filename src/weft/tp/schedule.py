"""How a stack of tensor-parallel sub-layers runs: each `Stage` is a residual sub-layer
x -> x + all_reduce(out(inner(norm(x)))), whose `inner` (after a column-parallel linear) and `out`
(a row-parallel linear) leave a partial sum on each rank. The schedules compute the same function and differ in when
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
- `Domino(p1, p2)`, p2 > 1: Domino's column split of the last weight (sec. 3.3, 4.2, fig. 6)
  too: `out` computes its output features in p2 slices, each slice's all-reduce starting as soon
  as it is computed, under the next slice's matmul (and the next micro-batch's work); with p1 = 1
  the column split alone, with both the hybrid (sec. 3.4). The slices are joined before the next
  stage (the residual and the norm need every feature).
- `Domino(p1, p2, reduce="copy")`: the same schedule with its asynchronous all-reduces done by
  copies into the peers' memory (`weft.tp.collectives.copy_all_reduce_`) instead of NCCL's
  kernels, which slow the GEMMs they run beside (2 H100s with NVLink: Domino's GEMMs 6.9 ms of
  kernel time against 5.4 without the all-reduces). Ranks that reach each other's memory only.
- `NoComm`: the all-reduces left out. Not the same function (each rank sums only its own part):
  the time with no communication at all, the ceiling an overlap can reach (`weft bench`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from weft.tp.collectives import all_reduce_, copy_all_reduce_, copy_to_tp, reduce_from_tp
from weft.tp.layers import WeightGradQueue, linear


@dataclass(frozen=True)
class Stage:
    """x -> x + all_reduce(out(inner(norm(x)))): `norm` replicated on every rank of the group,
    `inner(h, queue=None)` this rank's part up to the row-parallel linear `out` (with a
    `weft.tp.layers.WeightGradQueue`, its linears' weight gradients go to the queue); `params`
    every parameter of the three."""

    norm: nn.Module
    inner: Callable[..., torch.Tensor]
    out: nn.Linear
    params: tuple[nn.Parameter, ...]

    def partial(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(h))


class Sequential:
    """Megatron-style tensor parallelism: the all-reduces wait where they are issued."""

    name = "none"

    def run(self, stages: Sequence[Stage], x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        for stage in stages:
            x = x + reduce_from_tp(stage.partial(copy_to_tp(stage.norm(x), group)), group)
        return x


class NoComm:
    """The stages without their all-reduces (timing only: not the function of the model)."""

    name = "no-comm"

    def run(self, stages: Sequence[Stage], x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        for stage in stages:
            x = x + stage.partial(stage.norm(x))
        return x


# how Domino's asynchronous all-reduces are done: the group's collective, or copies into peer memory
REDUCES = {"group": all_reduce_, "copy": copy_all_reduce_}
# Domino's schedule names (`weft.tp.make_schedule`, `--tp-overlap`) and the reduce each runs
DOMINO_SCHEDULES = {"domino": "group", "domino-copy": "copy"}


class Domino:
    """Domino's row split into `p1` micro-batches along dim 0, and its column split of each
    stage's last weight into `p2` slices, its all-reduces done by `reduce` (see the module
    docstring)."""

    def __init__(self, p1: int = 2, p2: int = 1, reduce: str = "group"):
        for name, value in (("p1", p1), ("p2", p2)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"domino's {name} must be a positive integer, got {value!r}")
        if reduce not in REDUCES:
            raise ValueError(f"domino's reduce must be one of {', '.join(REDUCES)}, got {reduce!r}")
        self.p1, self.p2, self.reduce = p1, p2, reduce

    @property
    def name(self) -> str:
        return next(name for name, reduce in DOMINO_SCHEDULES.items() if reduce == self.reduce)

    def run(self, stages: Sequence[Stage], x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        if not torch.is_grad_enabled():  # evaluation, sampling: no graphs to keep (and no overlap)
            return Sequential().run(stages, x, group)
        if x.shape[0] < self.p1:
            raise ValueError(f"domino splits the batch into p1 = {self.p1} micro-batches; the batch has only "
                             f"{x.shape[0]} rows")
        if x.shape[-1] < self.p2:
            raise ValueError(f"domino splits each output into p2 = {self.p2} column slices; it has only "
                             f"{x.shape[-1]} features")
        params = [p for stage in stages for p in stage.params]
        return _DominoStack.apply(tuple(stages), group, (self.p1, self.p2), REDUCES[self.reduce], x, *params)


@dataclass
class _Record:
    """One micro-batch through one stage: its input (a leaf), the norm's output (in the graph of
    the input), the partial's input (a leaf) and the p2 column slices of its partial output (in
    the graph of that leaf)."""

    x_in: torch.Tensor
    normed: torch.Tensor
    h: torch.Tensor
    parts: list[torch.Tensor]


class _DominoStack(torch.autograd.Function):
    """The stack of stages over p1 micro-batches with the schedule spelled out in both passes.
    Each micro-batch's work in each stage is a small autograd graph kept from the forward; the
    backward walks them in the order that overlaps, with `torch.autograd.grad`, and returns the
    summed parameter gradients."""

    @staticmethod
    def forward(ctx, stages, group, splits, reduce, x, *params):
        p1, p2 = splits
        micro = [c.detach() for c in x.chunk(p1)]
        columns = _slices(x.shape[-1], p2)
        pending: list[list | None] = [None] * len(micro)  # per micro-batch: (reduced slice, work) per slice
        records: list[list[_Record]] = []
        queue = WeightGradQueue()

        def join(i: int) -> None:
            """Wait for micro-batch i's slices and add them to its residual stream."""
            for _, work in pending[i]:
                if work is not None:
                    work.wait()
            reduced = [r for r, _ in pending[i]]
            micro[i] = micro[i] + (reduced[0] if len(reduced) == 1 else torch.cat(reduced, -1))

        for stage in stages:
            row = []
            for i in range(len(micro)):
                if pending[i] is not None:  # the previous stage's all-reduces of this micro-batch
                    join(i)
                with torch.enable_grad():
                    x_in = micro[i].detach().requires_grad_()
                    normed = stage.norm(x_in)
                    h = normed.detach().requires_grad_()
                    inner = stage.inner(h, queue=queue)
                parts, pending[i] = [], []
                for cols in columns:  # each slice's all-reduce under the next slice's matmul
                    with torch.enable_grad():
                        part = linear(inner, stage.out, queue, None if p2 == 1 else cols)
                    # reduced in place: no backward reads a linear's output (the queue keeps its input)
                    reduced = part.detach()
                    pending[i].append((reduced, reduce(reduced, group, async_op=True)))
                    parts.append(part)
                row.append(_Record(x_in, normed, h, parts))
            records.append(row)
        for i in range(len(micro)):
            join(i)
        ctx.stages, ctx.group, ctx.records, ctx.queue, ctx.columns = stages, group, records, queue, columns
        ctx.reduce = reduce
        return torch.cat(micro)

    @staticmethod
    def backward(ctx, grad_out):
        stages, group, records = ctx.stages, ctx.group, ctx.records
        count = len(records[0])
        grads = [g.contiguous() for g in grad_out.chunk(count)]  # d loss / d (stage output), per micro-batch
        param_grads: dict[int, torch.Tensor] = {}  # by id of the parameter

        def add(key: int, g: torch.Tensor | None) -> None:
            if g is not None:
                param_grads[key] = g if key not in param_grads else param_grads[key] + g

        def accumulate(params, found):
            for p, g in zip(params, found):
                add(id(p), g)

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
            norm_ids = {id(p) for p in stage.norm.parameters()}
            compute_params = [p for p in stage.params if p.requires_grad and id(p) not in norm_ids]
            for i in range(count):
                if pending[i] is not None:  # the later stage's all-reduce of this micro-batch
                    grads[i] = grads[i] + finish(stages[s + 1], records[s + 1][i], pending[i])
                rec = records[s][i]
                # the input gradient (the linears' weight gradients wait in the queue) ...
                slices = [grads[i][..., cols] for cols in ctx.columns]
                found = torch.autograd.grad(rec.parts, [rec.h, *compute_params], slices, allow_unused=True)
                accumulate(compute_params, found[1:])
                dh = found[0].contiguous()
                pending[i] = (dh, ctx.reduce(dh, group, async_op=True))
                ctx.queue.run()  # ... and the weight-gradient matmuls under its all-reduce
        for i in range(count):
            grads[i] = grads[i] + finish(stages[0], records[0][i], pending[i])
        for key, g in ctx.queue.grads().items():
            add(key, g)
        all_params = [p for stage in stages for p in stage.params]
        del ctx.records, ctx.queue
        return (None, None, None, None, torch.cat(grads), *(param_grads.get(id(p)) for p in all_params))


def _slices(size: int, count: int) -> list[slice]:
    """`count` contiguous slices covering range(size), as even as possible (the first ones larger)."""
    bounds = [size * k // count for k in range(count + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]
