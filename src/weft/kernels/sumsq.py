"""The sum of the squares of many tensors' elements, in float32, in one pass over memory:
gradient clipping's global norm (`weft.train.loop.gradient_norm`) over every gradient.

One Triton launch per kind of tensor (device, dtype, 16-byte alignment; `weft.kernels.multi_tensor`):
program b squares block b's `BLOCK` elements and sums them in float32 (a fixed order), the blocks'
sums are then added by `torch.sum`: the same bits from run to run. PyTorch's multi-tensor norm
runs a kernel per tensor for a list of mixed dtypes (bf16 weights' gradients beside float32
ones), and below the memory's rate for a list of one (docs/benchmarks.md, forty-eighth session).
Tensors the kernel cannot take (non-contiguous, or on the CPU without TRITON_INTERPRET=1) are
summed by `sum_of_squares_reference`, PyTorch's per-tensor norms squared and added in the list's
order, which is also the CPU's result for every tensor.
"""
from __future__ import annotations

import torch

from weft.kernels import multi_tensor
from weft.kernels.multi_tensor import aligned, block_table, kernel_takes, on_device, on_gpu_of

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch reference remains
    triton = None

BLOCK = 8192


def sum_of_squares_reference(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor's float32 norm, squared, added in the list's order (a float32 scalar)."""
    return torch.stack(torch._foreach_norm(tensors, 2.0, dtype=torch.float32)).square().sum()


def sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum over `tensors` (at least one; bf16, float16 or float32, on one device) of their
    elements' squares, in float32, as a scalar on their device (nothing waits for it)."""
    if not tensors:
        raise ValueError("sum_of_squares needs at least one tensor")
    kinds: dict[tuple, list[torch.Tensor]] = {}
    rest = []
    for t in tensors:
        if kernel_takes([t]):
            if t.numel():
                kinds.setdefault((t.device, t.dtype, aligned([t])), []).append(t)
        else:
            rest.append(t)
    if not kinds:
        return sum_of_squares_reference(tensors)
    parts = [_launch(group, device, is_aligned) for (device, _, is_aligned), group in kinds.items()]
    if rest:
        parts.append(sum_of_squares_reference(rest).reshape(1))
    return torch.cat(parts).sum()


def _launch(group: list[torch.Tensor], device: torch.device, is_aligned: bool) -> torch.Tensor:
    """The launch's blocks' sums (float32, one per block)."""
    table, blocks = block_table([t.numel() for t in group], [[t.data_ptr()] for t in group], BLOCK)
    with on_gpu_of(device):
        partials = torch.empty(blocks, dtype=torch.float32, device=device)
        _sum_of_squares_kernel[(blocks,)](on_device(table, torch.int64, device), len(group), group[0], partials,
                                          ALIGNED=is_aligned, BLOCK=BLOCK, **({"num_warps": 8} if device.type == "cuda"
                                                                              else {}))
    return partials


if triton is not None:
    row_address, tensor_of_block = multi_tensor.row_address, multi_tensor.tensor_of_block  # jit helpers

    @triton.jit
    def _sum_of_squares_kernel(table, n_tensors, like, partials, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
        """partials[b]: the sum of the squares of block b's elements (its tensor by
        `tensor_of_block`; per tensor the table holds its numel and address)."""
        b = tl.program_id(0)
        t = tensor_of_block(table, n_tensors, b)
        row = table + n_tensors + 1 + 2 * t
        n = tl.load(row)
        x_ptr = row_address(row, 1, like, ALIGNED)
        start = (b - tl.load(table + t)) * BLOCK
        offs = start + tl.arange(0, BLOCK)
        if start + BLOCK <= n:  # a whole block: unmasked, so aligned loads move 16 bytes at a time
            x = tl.load(x_ptr + offs).to(tl.float32)
        else:
            x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(partials + b, tl.sum(x * x, axis=0))
