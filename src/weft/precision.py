"""The precision training runs in: bf16 autocast on GPUs, plain float32 on the CPU."""
from __future__ import annotations

import contextlib

import torch


def training_autocast(device: torch.device):
    """Context manager for the forward pass on `device`, as `weft train` uses it."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()
