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

`HostStage` is the bulk case: a checkpoint's copy of every parameter and optimizer moment to host
memory, into buffers kept from one checkpoint to the next. From the GPU they are page-locked, so
the copies run at the link's speed instead of through a pageable bounce buffer into memory the
kernel first has to fault in.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
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


class HostStage:
    """Host copies of storages in memory kept from one round of copies to the next.

    A round (`begin`, then `copy` per storage) places its copies one after another in large host
    segments (each at least `SEGMENT` bytes, a power of two); the next round starts at the first
    segment again and makes a new one only when the copies no longer fit. Each copy is a storage of
    its own of exactly the source's size (so `torch.save` writes the same bytes as of the source),
    a view of its segment's memory. Segments for copies from CUDA are page-locked (PyTorch's pinned
    host allocator, whose power-of-two blocks the segments fill), so the copies run at the link's
    speed and are queued on the current stream, complete once it has run to that point; where
    page-locked memory cannot be had the segment is pageable, the copies as correct, only slower.

    Invariant: a round overwrites the copies of the round before, so whoever reads them (a
    checkpoint's writer thread) must be done before the next `begin`.
    """

    SEGMENT = 256 << 20
    ALIGN = 64

    def __init__(self) -> None:
        self._segments: list[tuple[np.ndarray, bool]] = []  # (uint8 memory, page-locked)
        self._index = self._offset = 0
        self.staged_bytes = self.pinned_bytes = 0  # of the current round

    def begin(self) -> None:
        self._index = self._offset = self.staged_bytes = self.pinned_bytes = 0

    def copy(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        """A host copy of `storage` (queued, not yet complete, when it is on CUDA)."""
        nbytes, cuda = storage.nbytes(), storage.device.type == "cuda"
        if nbytes == 0:
            return torch.UntypedStorage(0)
        while self._index < len(self._segments) and self._offset + nbytes > self._segments[self._index][0].size:
            self._index, self._offset = self._index + 1, 0
        if self._index == len(self._segments):
            self._segments.append(self._allocate(max(self.SEGMENT, 1 << (nbytes - 1).bit_length()), cuda))
        memory, pinned = self._segments[self._index]
        host = torch.frombuffer(memory, dtype=torch.uint8, count=nbytes, offset=self._offset)
        self._offset += -(-nbytes // self.ALIGN) * self.ALIGN
        self.staged_bytes += nbytes
        self.pinned_bytes += nbytes if pinned else 0
        source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        host.copy_(source, non_blocking=cuda and pinned)
        return host.untyped_storage()

    @staticmethod
    def _allocate(nbytes: int, pin: bool) -> tuple[np.ndarray, bool]:
        if pin:
            try:
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy(), True
            except RuntimeError:  # no page-locked memory to be had: pageable, as correct
                pass
        return torch.empty(nbytes, dtype=torch.uint8).numpy(), False
