"""Named stages for the torch profiler: `with stage("dispatch"): ...` marks a region as a
`weft.dispatch` range while a profiler is recording, and costs one C call otherwise; and
`seconds(fn, device)`, the one timer of a call that measuring code shares.

`weft.bench.breakdown` attributes every GPU kernel to the innermost stage that launched it,
forward and backward (a backward op inherits the stage of the forward op it differentiates).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

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
