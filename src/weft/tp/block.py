"""A dense transformer block split over a tensor-parallel group, and a stack of them run by a
schedule (weft.tp.schedule). The block is the dense block of `weft.models.gpt` (pre-norm
RMSNorm, causal self-attention with rotary embeddings, gelu MLP) with its attention and MLP cut
as in Megatron-LM; the norms are replicated on every rank of the group."""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from weft.tp.layers import TPMLP, TPAttention, load_shards
from weft.tp.schedule import Domino, NoComm, Sequential, Stage

SCHEDULES = {"none": Sequential, "domino": Domino, "no-comm": NoComm}


def make_schedule(name: str, p1: int = 2, p2: int = 1):
    """The schedule called `name` ('none', 'domino' with p1 micro-batches and p2 column slices,
    'no-comm')."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown tensor-parallel overlap {name!r}; choose from {', '.join(SCHEDULES)}")
    return Domino(p1, p2) if name == "domino" else SCHEDULES[name]()


class TPBlock(nn.Module):
    def __init__(self, dim: int, n_head: int, hidden_dim: int, group: dist.ProcessGroup | None,
                 norm_eps: float = 1e-5, kernels: str = "auto", device=None, dtype=None):
        super().__init__()
        self.attn_norm = nn.RMSNorm(dim, eps=norm_eps, device=device, dtype=dtype)
        self.attn = TPAttention(dim, n_head, group, kernels, device=device, dtype=dtype)
        self.ffn_norm = nn.RMSNorm(dim, eps=norm_eps, device=device, dtype=dtype)
        self.ffn = TPMLP(dim, hidden_dim, group, device=device, dtype=dtype)

    @classmethod
    def from_dense(cls, block: nn.Module, n_head: int, group: dist.ProcessGroup | None,
                   kernels: str = "auto") -> TPBlock:
        """This rank's part of a dense block (attributes attn_norm, attn.qkv, attn.out_proj,
        ffn_norm, ffn.fc, ffn.out_proj, as in weft.models.gpt.Block with a dense MLP)."""
        weight = block.attn.qkv.weight
        tp_block = cls(weight.shape[1], n_head, block.ffn.fc.weight.shape[0], group, block.attn_norm.eps, kernels,
                       device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            tp_block.attn_norm.load_state_dict(block.attn_norm.state_dict())
            tp_block.ffn_norm.load_state_dict(block.ffn_norm.state_dict())
        load_shards(tp_block.attn, block.attn)
        load_shards(tp_block.ffn, block.ffn)
        return tp_block

    def stages(self, rope: tuple[torch.Tensor, torch.Tensor]) -> list[Stage]:
        attention = functools.partial(self.attn.inner, rope=rope)
        return [Stage(self.attn_norm, attention, self.attn.out_proj,
                      (*self.attn_norm.parameters(), *self.attn.parameters())),
                Stage(self.ffn_norm, self.ffn.inner, self.ffn.out_proj,
                      (*self.ffn_norm.parameters(), *self.ffn.parameters()))]


class TPStack(nn.Module):
    """Tensor-parallel blocks run one after the other by `schedule` over `group`: x (batch, seq,
    dim), the same on every rank of the group, to the same shape, the same on every rank."""

    def __init__(self, blocks: Sequence[TPBlock], group: dist.ProcessGroup | None, schedule=None):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.group = group
        self.schedule = schedule if schedule is not None else Sequential()

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], schedule=None) -> torch.Tensor:
        return run_blocks(self.blocks, x, rope, self.group, schedule or self.schedule)


def run_blocks(blocks: Sequence[TPBlock], x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               group: dist.ProcessGroup | None, schedule) -> torch.Tensor:
    """`blocks` one after the other under `schedule` (Domino's overlap crosses block boundaries)."""
    return schedule.run([stage for block in blocks for stage in block.stages(rope)], x, group)
