"""Small values between the host and the GPU without waiting for unrelated work.

`torch.tensor(values, device="cuda")` copies from pageable host memory, which PyTorch does with a
copy followed by a synchronisation of the current stream: the host stops until every kernel queued
before it has run, and the GPU then idles while the host launches what comes next. The dropless
layer builds such tensors in the middle of its call (the grouped GEMM's offsets after the
all-to-all of the rows, Pro-Prophet's copy indices), so each one exposed the launch latency of the
rest of the call. `device_tensor` stages the values in pinned memory and copies asynchronously on
the current stream instead; PyTorch's caching host allocator keeps the pinned block until that copy
has run.

The other way, `host_tensor_async` queues a small device tensor's copy to pinned memory at once, so
a later read waits only for the work queued before it: the training loop reads a step's metrics
after launching the next step, and a `.cpu()` there would wait for that next step as well.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


def device_tensor(values: Sequence[int] | Sequence[float], device: torch.device | str,
                  dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)`, asynchronous on CUDA (see the module
    docstring); on other devices the same as that call."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    if torch.cuda.is_current_stream_capturing():
        # a captured copy would read this pinned buffer again at every replay, long after it is reused
        raise RuntimeError("device_tensor: host values cannot be copied inside a CUDA graph capture "
                           "(their sizes and contents change per call)")
    return host.pin_memory().to(device, non_blocking=True)


def offsets(counts: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """The int32 end offsets of consecutive groups of `counts` rows (cumulative sums, computed on
    the host), as `torch._grouped_mm` takes them."""
    return device_tensor(list(itertools.accumulate(counts)), device, torch.int32)


def host_tensor_async(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """`values` on the host, valid once the returned event has completed (None: at once, for a
    tensor not on CUDA, which is returned as it is). On CUDA the copy into pinned memory is queued
    now on the current stream, behind the work that produced `values` only."""
    if values.device.type != "cuda":
        return values, None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready
