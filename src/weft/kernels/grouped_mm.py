"""Grouped GEMM (one matmul per row group, one kernel) where the GPU has it."""
from __future__ import annotations

import torch


def use_grouped_mm(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """torch._grouped_mm needs CUDA sm90+, bf16 and 16-byte aligned row strides."""
    if not (x.is_cuda and hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16):
        return False
    if w1.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    return w1.shape[1] % 8 == 0 and w1.shape[2] % 8 == 0
