"""The experts' hidden activations as PyTorch ops: the one definition the MoE layer's experts and
the references of Comet's fused epilogues (`weft.kernels.comet`, the oracle its Triton kernels
match) share."""
from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("relu", "gelu", "silu", "swiglu")
ELEMENTWISE = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}  # every activation but swiglu, of h1 alone


def activate(activation: str, h1: torch.Tensor, h3: torch.Tensor | None = None) -> torch.Tensor:
    """The experts' hidden activation of h1 = x @ w1 (swiglu: silu(h1) * h3, h3 = x @ w3)."""
    if activation == "swiglu":
        return F.silu(h1) * h3
    return ELEMENTWISE[activation](h1)
