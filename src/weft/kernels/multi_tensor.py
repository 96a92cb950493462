"""Multi-tensor launches: one Triton launch over many tensors of one kind, whose programs find
their tensor in a table the host builds (the multi-tensor form of torch's `_foreach` kernels,
which take at most a few dozen tensors a launch and fall back to a kernel per tensor for lists of
mixed dtypes).

The table (int64, on the device): the tensors' first blocks `starts[0 : T + 1]` (tensor t owns
the launch's blocks [starts[t], starts[t + 1])), then a row per tensor of `1 + A` values: its
number of elements and A addresses. `tensor_of_block` finds a block's tensor by binary search;
`row_address` reads an address as a typed pointer. Tensors with no element are left out by the
caller (the starts must increase).
"""
from __future__ import annotations

import contextlib

import torch

from weft.kernels.rows import triton_usable

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch references remain
    triton = None


def block_table(numels: list[int], addresses: list[list[int]], block: int) -> tuple[list[int], int]:
    """The table's values (module docstring) for tensors of `numels` elements (none zero) and
    their addresses, and the launch's number of blocks of `block` elements."""
    starts = [0]
    for n in numels:
        starts.append(starts[-1] + -(-n // block))
    return starts + [v for n, row in zip(numels, addresses) for v in (n, *row)], starts[-1]


def on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small table on `device`, copied from pinned memory without waiting for the kernels queued
    before it (a copy from pageable memory would wait for them; PyTorch's pinned-memory allocator
    keeps the host block until the copy is done), on the current stream."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    if torch.cuda.is_current_stream_capturing():  # a replay would read a host block freed since
        raise RuntimeError("a multi-tensor table is copied from the host per call: not inside a CUDA graph capture")
    host = torch.tensor(values, dtype=dtype)
    return host.pin_memory().to(device, non_blocking=True)


def kernel_takes(tensors: list[torch.Tensor]) -> bool:
    """Whether a Triton kernel can read and write `tensors` through their addresses: where Triton
    runs on them (`triton_usable`) and each is contiguous."""
    return triton_usable(tensors[0]) and all(t.is_contiguous() for t in tensors)


def on_gpu_of(device: torch.device) -> contextlib.AbstractContextManager:
    """`device` made the current GPU (its current stream takes the table's copy and the launch);
    nothing on the CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def aligned(tensors: list[torch.Tensor]) -> bool:
    """Whether every tensor starts on a 16-byte boundary (the kernels' 16-byte loads)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


if triton is not None:
    @triton.jit
    def tensor_of_block(table, n_tensors, b):
        """t with table[t] <= b < table[t + 1]: the tensor whose blocks include block b."""
        lo = 0
        hi = n_tensors
        while hi - lo > 1:  # table[lo] <= b < table[hi]
            mid = (lo + hi) // 2
            if tl.load(table + mid) <= b:
                lo = mid
            else:
                hi = mid
        return lo

    @triton.jit
    def row_address(row, i, like, ALIGNED: tl.constexpr):
        """row[i] as a pointer to `like`'s dtype (16-byte aligned where ALIGNED)."""
        ptr = tl.load(row + i).to(tl.pointer_type(like.dtype.element_ty))
        if ALIGNED:
            ptr = tl.multiple_of(ptr, 16)
        return ptr
