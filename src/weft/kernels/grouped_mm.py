"""Grouped GEMM (one matmul per row group, one kernel) where the GPU has it."""
from __future__ import annotations

import torch


def use_grouped_mm(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """torch._grouped_mm needs CUDA sm90+, bf16 and 16-byte aligned row strides."""
    if not (x.is_cuda and _cuda_kernel_takes(x, w1, w2)):
        return False
    return w1.shape[1] % 8 == 0 and w1.shape[2] % 8 == 0


def _cuda_kernel_takes(*operands: torch.Tensor) -> bool:
    """torch._grouped_mm's CUDA kernel: bfloat16 operands on an sm90+ GPU."""
    if not hasattr(torch, "_grouped_mm") or any(t.dtype != torch.bfloat16 for t in operands):
        return False
    return torch.cuda.get_device_capability(operands[0].device)[0] >= 9


def grouped_mm_takes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm(a, b, offs=...)` runs on these operands: on CUDA, sm90+ and
    bfloat16 (as `use_grouped_mm`); on the CPU, where PyTorch computes it group by group, any
    floating dtype; everywhere, both operands row- or column-major with 16-byte aligned data and
    leading strides."""
    if not hasattr(torch, "_grouped_mm") or a.dtype != b.dtype or not a.dtype.is_floating_point:
        return False
    if a.is_cuda and not _cuda_kernel_takes(a, b):
        return False
    return _aligned(a) and _aligned(b)


def _aligned(m: torch.Tensor) -> bool:
    if m.data_ptr() % 16:
        return False
    rows, cols = m.stride(-2), m.stride(-1)
    lead = rows if cols == 1 else cols if rows == 1 else None
    return lead is not None and lead * m.element_size() % 16 == 0
