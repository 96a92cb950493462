"""Named stages for the torch profiler: `with stage("dispatch"): ...` marks a region as a
`weft.dispatch` range while a profiler is recording, and costs one C call otherwise.

`weft.bench.breakdown` attributes every GPU kernel to the innermost stage that launched it,
forward and backward (a backward op inherits the stage of the forward op it differentiates).
"""
from __future__ import annotations

import contextlib

import torch

PREFIX = "weft."


def stage(name: str) -> contextlib.AbstractContextManager:
    """A profiler range `weft.<name>` while the profiler records; nothing otherwise."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(PREFIX + name)
    return contextlib.nullcontext()
