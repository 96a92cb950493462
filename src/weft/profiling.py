"""Named stages for the torch profiler: `with stage("dispatch"): ...` marks a region as a
`weft.dispatch` range while a profiler is recording, and costs one C call otherwise;
`seconds(fn, device)`, the one timer of a call that measuring code shares (`seconds_per_call` for
kernels timed back to back); and
`time_candidates` / `interleaved_samples`, the interleaved timing of equivalent settings that
measured choices share.

`weft.bench.breakdown` attributes every GPU kernel to the innermost stage that launched it,
forward and backward (a backward op inherits the stage of the forward op it differentiates).
"""
from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

PREFIX = "weft."


def stage(name: str) -> contextlib.AbstractContextManager:
    """A profiler range `weft.<name>` while the profiler records; nothing otherwise."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(PREFIX + name)
    return contextlib.nullcontext()


def seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one fn() call: between two CUDA events on GPUs (no host sync inside), else wall."""
    if device.type != "cuda":
        begin = time.perf_counter()
        fn()
        return time.perf_counter() - begin
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e-3


def seconds_per_call(fn: Callable[[], object], device: torch.device, calls: int = 4) -> float:
    """Seconds per call of fn() on the device: on GPUs one call queued first, then `calls` more
    between two events, so that each call's host work (argument binding, descriptors, small
    allocations) runs while earlier kernels do, as in a step the host keeps ahead of or a CUDA
    graph; events around a single call would count that host work as the kernel's time (it made
    a 0.2 ms Comet kernel read 0.3 ms). On CPUs the wall time of one call."""
    if device.type != "cuda":
        return seconds(fn, device)
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e-3 / calls


def synchronize(device: torch.device) -> None:
    """Wait until the device has run everything queued on it (nothing to wait for off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of one fn() call with the device idle before and after: host time included,
    which is what a step that the host may not keep ahead of costs."""
    synchronize(device)
    begin = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - begin


def slowest_rank(values: Sequence[float], device: torch.device, group: dist.ProcessGroup | None = None) -> list[float]:
    """Each value's maximum over the ranks of `group` (a collective; default: the default group,
    when there is one): what every rank compares, so every rank makes the same measured choice."""
    agreed = torch.tensor(list(values), dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    return agreed.tolist()


def interleaved_samples(step: Callable[[object], None], candidates: Sequence, device: torch.device, trials: int,
                        warmup: int, timer: Callable[[Callable[[], object], torch.device], float] = wall_seconds
                        ) -> list[list[float]]:
    """`timer(step(candidate))` for every candidate in turn, round by round (drifts of clocks and
    allocator spread over all of them), after `warmup` untimed rounds: each candidate's `trials`
    samples, this rank's."""
    if trials < 1 or warmup < 0:
        raise ValueError(f"trials must be >= 1 and warmup >= 0, got {trials} and {warmup}")
    for _ in range(warmup):
        for candidate in candidates:
            step(candidate)
    samples: list[list[float]] = [[] for _ in candidates]
    for _ in range(trials):
        for i, candidate in enumerate(candidates):
            samples[i].append(timer(lambda c=candidate: step(c), device))
    return samples


def time_candidates(step: Callable[[object], None], candidates: Sequence, device: torch.device, trials: int = 3,
                    warmup: int = 1) -> list[float]:
    """Median wall seconds of `step(candidate)` per candidate, timed round by round with the
    candidates interleaved (`interleaved_samples`), after `warmup` untimed rounds; the slowest
    rank's median (`slowest_rank`)."""
    samples = interleaved_samples(step, candidates, device, trials, warmup)
    return slowest_rank([statistics.median(s) for s in samples], device)
