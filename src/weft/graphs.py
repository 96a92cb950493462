"""Whole-step CUDA graphs: one forward and backward replayed as a single CUDA graph.

A training step of an MoE model in eager PyTorch launches thousands of small kernels, and the
host work of launching them (Python, the dispatcher, autograd) is slower than the GPU running
them: `weft bench layer --breakdown` shows the GPU idle half of a qwen2-like layer step. Captured
once, the same kernels replay from one host call (NVIDIA's CUDA graphs; PyTorch's
`torch.cuda.graph`, its "whole-network capture" recipe). This is how Megatron-Core and vLLM remove
launch overhead too.

`GraphedStep(fn, args)` captures `fn(*args)`: every shape static, no host synchronisation inside
(`.item()`, `.tolist()`, data-dependent sizes such as the dropless all-to-allv), NCCL collectives
allowed (they are captured like kernels). Calling it copies new inputs into the captured input
tensors and replays. Invariants the caller relies on:

- Outputs are the captured output tensors: the next call overwrites them (copy what you keep).
- Gradients (`fn` may call `backward`), two ways:
  - `accumulate=False` (a step that starts from no gradients, e.g. one micro-batch per optimizer
    step): the captured backward creates the `.grad` tensors, in the graph's memory, and each
    replay overwrites them with that step's gradients (an eager backward into `.grad = None`).
    After every replay each `.grad` of `grads_of` (and of the inputs) is that tensor: no zeroing
    between steps, which would cost a write of every gradient, nor an accumulating add, which
    would cost two reads and a write (together ~13 ms per step for gpt2-l-moe's 3.4 B
    parameters on an H200).
  - `accumulate=True`: autograd accumulates into the `.grad` tensors that exist at capture time,
    in place (`GraphedStep` checks this: the same tensors before and after the capture), so a
    replay adds its gradients to them like an eager backward would. Zero them in place
    (`zero_grad(set_to_none=False)`), never set them to None, between steps.
- The warm-up calls (on a side stream, as CUDA requires before a capture) run `fn` for real:
  construction leaves every `.grad` in `grads_of` zeroed (`accumulate=True`) or replaced by the
  graph's own (`accumulate=False`), so it has no effect on gradients.
- No autograd graph from an earlier eager call may still be alive (a tensor that requires grad
  kept from it): its gradient accumulators are bound to the stream it ran on, and the capture,
  which runs on its own stream, would have to synchronise with that one, which CUDA refuses
  ("operation would make the legacy stream depend on a capturing blocking stream").
  `GraphedStep` checks this first (`live_gradient_accumulators`) and names it.
- Python-side effects of `fn` (attributes it assigns) happen at capture only; return what a
  caller reads after each step instead of reading module attributes.
"""
from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from weft.profiling import slowest_rank, wall_seconds


class CaptureError(RuntimeError):
    """`fn` cannot be captured as a CUDA graph (the message says why, e.g. a host synchronisation)."""


def live_gradient_accumulators(tensors: Iterable[torch.Tensor]) -> list[int]:
    """Indices of the leaf tensors whose gradient accumulator (autograd's AccumulateGrad node) is
    alive: held by the graph of a call whose outputs someone still keeps. Probed by tagging each
    accumulator and looking it up again after dropping our own reference: only a kept one still
    carries the tag."""
    leaves = [(i, t) for i, t in enumerate(tensors) if t.requires_grad and t.is_leaf]
    tag = "weft.graphs.probe"
    for _, t in leaves:
        torch.autograd.graph.get_gradient_edge(t).node.metadata[tag] = True
    held = []
    for i, t in leaves:
        if torch.autograd.graph.get_gradient_edge(t).node.metadata.pop(tag, False):
            held.append(i)
    return held


def warm_up(fn: Callable[..., Any], args: Sequence[torch.Tensor], tensors: Iterable[torch.Tensor], calls: int,
            accumulate: bool) -> None:
    """`calls` eager calls of `fn(*args)`, each starting from the gradients the captured step
    starts from: `tensors`' `.grad` zeroed (`accumulate`: the step adds into them) or dropped (the
    step's backward makes its own; zeroed ones kept would make every call after the first add into
    a whole set of gradients the captured step never holds, memory it would need at no other time)."""
    tensors = list(tensors)
    for _ in range(calls):
        for t in tensors:
            if t.grad is not None:
                if accumulate:
                    t.grad.zero_()
                else:
                    t.grad = None
        fn(*args)


class GraphedStep:
    """`fn(*args)` (a forward and backward of static shapes on CUDA) replayed as one CUDA graph.

    Args:
        fn: the step; returns a pytree of tensors (or None).
        args: example tensors of the shapes and dtypes every later call passes (copied into the
            graph's static inputs; a tensor that requires grad keeps doing so).
        grads_of: the tensors (parameters) whose `.grad` the step writes.
        accumulate: whether a replay adds to the existing `.grad` tensors (True) or sets them to
            its own gradients (False); see the module docstring.
        warmup: eager calls before the capture (CUDA needs a few for lazy initialisation: cuBLAS
            workspaces, NCCL communicators, autotuned kernels).
        stream: the side stream of the warm-up and the capture (default: a new one). Pass the same
            stream to every capture of a series: cuBLAS keeps a workspace (~64 MiB per stream
            on an H100, counted in `torch.cuda.memory_allocated`) for every stream it has run on, for
            the life of the process, so each new stream costs that much memory for good.
        pool: the memory pool of an earlier `GraphedStep` (its `pool`) whose memory this graph's
            capture may reuse: the two hold one set of activations, not two. Then replay them
            one after the other on one stream, never both at once; each one's outputs may be
            overwritten by the other's replay, so read them before it (torch.cuda.graph's `pool`).
    """

    def __init__(self, fn: Callable[..., Any], args: Sequence[torch.Tensor], grads_of: Iterable[torch.Tensor] = (),
                 accumulate: bool = True, warmup: int = 3, stream: torch.cuda.Stream | None = None,
                 pool: Any = None):
        if not args or any(not isinstance(a, torch.Tensor) or not a.is_cuda for a in args):
            raise CaptureError("a CUDA graph step needs CUDA tensor arguments")
        self.fn = fn
        self.grads_of = list(grads_of)
        held = live_gradient_accumulators(self.grads_of)
        if held:
            raise CaptureError(f"an earlier call's autograd graph is still alive (a loss or output that requires grad "
                               f"is kept): it holds the gradient accumulators of {len(held)} of the "
                               f"{len(self.grads_of)} tensors, bound to its CUDA stream; drop it before capturing")
        self.static_args = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
        side = self.stream = stream if stream is not None else torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            warm_up(fn, self.static_args, [*self.grads_of, *self.static_args], warmup, accumulate)
        torch.cuda.current_stream().wait_stream(side)
        self._clear_grads()
        written = [*self.grads_of, *(a for a in self.static_args if a.requires_grad)]
        for t in written:
            if not accumulate:  # the captured backward creates them
                t.grad = None
            elif t.grad is None:  # the gradients the graph accumulates into must exist before it
                t.grad = torch.zeros_like(t)
        before = [t.grad for t in written]
        self.graph = torch.cuda.CUDAGraph()
        try:
            # on the warm-up's stream, where the gradient accumulators were created (another stream
            # makes autograd warn of a stream mismatch at every capture)
            with torch.cuda.graph(self.graph, pool=pool, stream=side):
                self.static_out = fn(*self.static_args)
        except RuntimeError as e:  # e.g. "operation not permitted when stream is capturing"
            raise CaptureError(f"the step cannot be captured as a CUDA graph: {str(e).splitlines()[0]}") from e
        moved = [i for i, t in enumerate(written) if t.grad is not before[i]]
        if accumulate and moved:
            raise CaptureError(f"the captured backward replaced {len(moved)} .grad tensors instead of accumulating "
                               "into them in place")
        # accumulate=False: the graph's gradient tensors, put back on `.grad` after each replay; the
        # tensors its backward gives no gradient keep none after a replay, as after an eager step's
        # (a `.grad` set between replays, e.g. the zeros `reduce_gradients` sums for a rank without
        # one, would otherwise carry over into the next step)
        self._owned = [] if accumulate else [(t, t.grad) for t in written if t.grad is not None]
        self._unwritten = [] if accumulate else [t for t in written if t.grad is None]

    def _clear_grads(self) -> None:
        for t in [*self.grads_of, *self.static_args]:
            if t.grad is not None:
                t.grad.zero_()

    @property
    def pool(self) -> Any:
        """The graph's memory pool, for a later capture to share (`pool`)."""
        return self.graph.pool()

    @property
    def inputs(self) -> list[torch.Tensor]:
        """The captured input tensors (e.g. to read an input's `.grad` after a replay)."""
        return self.static_args

    def __call__(self, *args: torch.Tensor) -> Any:
        """Copy `args` into the captured inputs and replay; returns the captured outputs."""
        if len(args) != len(self.static_args):
            raise TypeError(f"the graphed step takes {len(self.static_args)} tensors, got {len(args)}")
        for static, new in zip(self.static_args, args):
            if new.shape != static.shape or new.dtype != static.dtype:
                raise ValueError(f"a CUDA graph replays fixed shapes: got {tuple(new.shape)} {new.dtype}, captured "
                                 f"{tuple(static.shape)} {static.dtype}")
            if new.data_ptr() != static.data_ptr():
                static.detach().copy_(new)
        self.graph.replay()
        for t, grad in self._owned:
            if t.grad is not grad:  # set to None or replaced since: this replay's gradients are in `grad`
                t.grad = grad
        for t in self._unwritten:
            t.grad = None
        return self.static_out


def time_graphed(step_of: Callable[[Any], Callable[..., Any]], candidates: Sequence, args: Sequence[torch.Tensor],
                 grads_of: Iterable[torch.Tensor], trials: int = 3, warmup: int = 1,
                 accumulate: bool = True, rounds: int = 1) -> list[float]:
    """Median wall seconds of one replay of each candidate's step (`step_of(candidate)`, a forward
    and backward on `args`) captured as a CUDA graph: what a graphed training step with that
    candidate costs, host launches gone. One candidate at a time, its graph freed before the next
    is captured (each holds a memory pool of its activations: all of them at once may not fit).
    `accumulate` as the step that will run (`GraphedStep`): True, the gradients accumulate into
    the same `.grad` tensors, zeroed; False, each graph writes its own, as a step with one
    micro-batch does (no add into earlier gradients: for gpt2-l-moe's ~1.8 B float32 parameters
    per rank the add alone is several ms). Every `.grad` of `grads_of` is None at the end. A
    candidate that cannot be captured is timed as infinite (with a warning saying why, once). The slowest rank's
    medians (`weft.profiling.slowest_rank`), so every rank picks the same. All candidates are captured on
    one side stream (see `GraphedStep`'s `stream`).

    `rounds` > 1: the candidates are timed in order, then in the reverse order, and so on
    (recaptured each round), and each one's time is the mean of its rounds' medians: a drift of
    the GPU's speed over the timing (clocks, power, a link through host memory) then weighs on
    every candidate alike, where one round favours the candidates timed while it was fast."""
    if trials < 1 or warmup < 0 or rounds < 1:
        raise ValueError(f"trials and rounds must be >= 1 and warmup >= 0, got {trials}, {rounds} and {warmup}")
    grads_of = list(grads_of)
    device = args[0].device
    side = torch.cuda.Stream(device) if device.type == "cuda" else None  # GraphedStep refuses CPU tensors
    medians: list[list[float]] = [[] for _ in candidates]
    for r in range(rounds):
        order = range(len(candidates)) if r % 2 == 0 else reversed(range(len(candidates)))
        for i in order:
            if medians[i] and math.isinf(medians[i][0]):
                continue  # could not be captured: not tried again
            try:
                graph = GraphedStep(step_of(candidates[i]), args, grads_of=grads_of, accumulate=accumulate,
                                    stream=side)
            except CaptureError as e:
                name = getattr(candidates[i], "name", candidates[i])
                warnings.warn(f"weft: {name} timed as infinite: {e}", stacklevel=2)
                medians[i].append(math.inf)
            else:
                medians[i].append(statistics.median(_replay_seconds(graph, args, device, warmup + trials)[warmup:]))
                del graph  # its memory pool, before the next candidate's capture
            for t in grads_of:  # this candidate's gradients (accumulate=False: in that pool) go with it
                t.grad = None
    return slowest_rank([statistics.fmean(m) for m in medians], device)


def _replay_seconds(graph: GraphedStep, args: Sequence[torch.Tensor], device: torch.device, times: int) -> list[float]:
    """Wall seconds of `times` replays, each after a barrier of the default group (where there is
    one): a graph that holds collectives waits in them for the rank the host launched last, so
    without it each rank's time carries the ranks' host skew, as `weft bench layer`'s timing
    (a barrier before each step) does not (docs/balance.md, "The fit on the planned input")."""
    seconds = []
    for _ in range(times):
        if dist.is_initialized():
            dist.barrier()
        seconds.append(wall_seconds(lambda: graph(*args), device))
    return seconds
