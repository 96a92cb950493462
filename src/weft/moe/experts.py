"""Expert FFN weights and their computation.

Weights are stacked per local expert: w1 (El, dim, hidden), w2 (El, hidden, dim) and, for
swiglu, w3 (El, dim, hidden). With fewer experts than ranks (Tutel's switchable parallelism),
a rank holds one shard of one expert: the hidden columns [j * h, (j + 1) * h), h = hidden / m.
Padded layouts compute with one batched matmul; dropless (variable rows per expert) with
grouped GEMM on GPUs that have it, a per-expert loop elsewhere.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from weft.hostcopy import offsets
from weft.kernels.grouped_mm import use_grouped_mm
from weft.ops import wgrad
from weft.profiling import stage

ACTIVATIONS = ("relu", "gelu", "silu", "swiglu")
_ACT = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}


def activate(activation: str, h1: torch.Tensor, h3: torch.Tensor | None = None) -> torch.Tensor:
    """The experts' hidden activation of h1 = x @ w1 (swiglu: silu(h1) * h3, h3 = x @ w3)."""
    if activation == "swiglu":
        return F.silu(h1) * h3
    return _ACT[activation](h1)


class Experts(nn.Module):
    """The `num_local` experts of this rank; global expert ids `first_expert + i`.

    Initialisation depends only on the global expert id and one seed drawn from torch's RNG,
    so the full set of experts is the same whatever the expert-parallel size. `shard=(j, m)`
    keeps only shard j of m of each expert's hidden dimension (the same values as unsharded).
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_local: int,
        activation: str = "gelu",
        first_expert: int = 0,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        shard: tuple[int, int] = (0, 1),
    ):
        super().__init__()
        self.dim, self.hidden_dim, self.num_local, self.activation = dim, hidden_dim, num_local, activation
        self.first_expert = first_expert
        self.shard_index, self.num_shards = shard
        if hidden_dim % self.num_shards or not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"shard {shard} does not split hidden_dim {hidden_dim} evenly")
        width = hidden_dim // self.num_shards
        factory = {"dtype": dtype, "device": device}
        self.w1 = nn.Parameter(torch.empty(num_local, dim, width, **factory))
        self.w2 = nn.Parameter(torch.empty(num_local, width, dim, **factory))
        if activation == "swiglu":
            self.w3 = nn.Parameter(torch.empty(num_local, dim, width, **factory))
        else:
            self.register_parameter("w3", None)
        # Lancet's backward pass (weft.overlap): a WGradScheduler here defers each local
        # expert's weight gradients so they can run while an all-to-all is in flight.
        self.wgrad_scheduler = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform(+-1/sqrt(fan_in)) per expert from a generator seeded by its global id.

        Values depend on the device type's generator (CPU or CUDA), not on the EP size.
        """
        seed = int(torch.randint(0, 2**62, (1,), device="cpu").item())
        if self.w1.device.type == "meta":
            return
        width, start = self.w1.shape[-1], self.shard_index * self.w1.shape[-1]
        for i in range(self.num_local):
            gen = torch.Generator(device=self.w1.device).manual_seed(seed + self.first_expert + i)
            for w, fan_in, axis in ((self.w1, self.dim, 1), (self.w2, self.hidden_dim, 0), (self.w3, self.dim, 1)):
                if w is None:
                    continue
                bound = 1.0 / math.sqrt(fan_in)
                full = list(w.shape[1:])
                full[axis] = self.hidden_dim
                # Draw the whole expert, keep the shard: values do not depend on the sharding.
                values = torch.empty(full, dtype=w.dtype, device=w.device).uniform_(-bound, bound, generator=gen)
                with torch.no_grad():
                    w[i].copy_(values.narrow(axis, start, width))

    def _hidden(self, h1: torch.Tensor, h3: torch.Tensor | None) -> torch.Tensor:
        return activate(self.activation, h1, h3)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return self.w1, self.w2, self.w3

    def forward(self, x: torch.Tensor, weights: tuple | None = None) -> torch.Tensor:
        """Padded layout: x (G, M, dim) -> (G, M, dim), one bmm per weight. `weights` (w1, w2, w3)
        stacked over G experts replaces this rank's own (e.g. all experts, gathered)."""
        with stage("experts"):
            w1, w2, w3 = weights or self.weights()
            x = x.to(self.compute_dtype(x))
            if self.wgrad_scheduler is not None and weights is None:
                mm = functools.partial(wgrad.bmm, scheduler=self.wgrad_scheduler)
            else:
                mm = torch.bmm
            h3 = mm(x, w3) if w3 is not None else None
            return mm(self._hidden(mm(x, w1), h3), w2)

    def forward_grouped(self, x: torch.Tensor, counts: list[int], weights: tuple | None = None) -> torch.Tensor:
        """Dropless layout: rows of x (M, dim) sorted by expert, `counts[i]` rows each."""
        with stage("experts"):
            return self._forward_grouped(x, counts, weights)

    def _forward_grouped(self, x: torch.Tensor, counts: list[int], weights: tuple | None) -> torch.Tensor:
        w1, w2, w3 = weights or self.weights()
        x = x.to(self.compute_dtype(x))
        if self.wgrad_scheduler is not None and weights is None:
            mm = functools.partial(wgrad.grouped_mm, counts=counts, scheduler=self.wgrad_scheduler)
            h3 = mm(x, w3) if w3 is not None else None
            return mm(self._hidden(mm(x, w1), h3), w2)
        if use_grouped_mm(x, w1, w2):
            offs = offsets(counts, x.device)
            h1 = torch._grouped_mm(x, w1, offs=offs)
            h3 = torch._grouped_mm(x, w3, offs=offs) if w3 is not None else None
            return torch._grouped_mm(self._hidden(h1, h3), w2, offs=offs)
        return grouped_mm_reference(x, counts, self, (w1, w2, w3))

    def compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        return self.w1.dtype


def grouped_mm_reference(x: torch.Tensor, counts: list[int], experts: Experts,
                         weights: tuple | None = None) -> torch.Tensor:
    """Per-expert loop over the row groups: the plain-PyTorch oracle for grouped GEMM."""
    w1, w2, w3 = weights or experts.weights()
    outs = []
    for i, rows in enumerate(torch.split(x, counts)):
        h3 = rows @ w3[i] if w3 is not None else None
        outs.append(experts._hidden(rows @ w1[i], h3) @ w2[i])
    return torch.cat(outs) if outs else x.new_zeros(0, experts.dim)
