"""A transformer block split over a tensor-parallel group, and a stack of them run by a schedule
(weft.tp.schedule). The block is the block of `weft.models.gpt` (pre-norm RMSNorm, causal
self-attention with rotary embeddings, then a gelu MLP or an MoE layer) with its attention and
MLP cut as in Megatron-LM; the norms are replicated on every rank of the group.

An MoE layer is not cut: its experts are expert-parallel over its own group (in weft the whole
world, tensor- and data-parallel ranks alike), and each rank of the tensor-parallel group hands it
a different 1 / tp of the block's tokens (`TokenSplit`), so no expert work is repeated across the
group. This is Megatron-Core's layout of MoE under tensor parallelism (its sequence-parallel
split before the MoE layer); the layer then sees exactly the tokens it would see in data
parallelism over tp times the ranks, each with 1 / tp of the batch."""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from weft.distributed import group_size
from weft.tp.collectives import gather_from_tp, split_to_tp
from weft.tp.layers import TPMLP, TPAttention, load_shards
from weft.tp.schedule import DOMINO_SCHEDULES, Domino, NoComm, Sequential, Stage

SCHEDULES = ("none", *DOMINO_SCHEDULES, "no-comm")


def make_schedule(name: str, p1: int = 2, p2: int = 1):
    """The schedule called `name` ('none', 'domino' with p1 micro-batches and p2 column slices,
    'domino-copy' the same with its all-reduces copied through peer memory, 'no-comm')."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown tensor-parallel overlap {name!r}; choose from {', '.join(SCHEDULES)}")
    if name in DOMINO_SCHEDULES:
        return Domino(p1, p2, reduce=DOMINO_SCHEDULES[name])
    return Sequential() if name == "none" else NoComm()


@dataclass(frozen=True)
class TokenSplit:
    """x -> x + gather(ffn(split(norm(x)))): a token-wise sub-layer (an MoE layer) run on this
    rank's 1 / tp of the tokens of x (batch, seq, dim), the same x on every rank of `group`, and
    the outputs gathered back; the result is the same on every rank. The tokens (batch x seq)
    must divide evenly over the group (or, without gradients, every rank routes them all); rank r
    takes the r-th contiguous share, whole sequences when tp divides the batch."""

    norm: nn.Module
    ffn: nn.Module
    group: dist.ProcessGroup | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        tokens_TD = self.norm(x).reshape(-1, x.shape[-1])
        if tokens_TD.shape[0] % group_size(self.group) and not torch.is_grad_enabled():
            # Sampling one sequence: a token count the group cannot share evenly; every rank
            # routes all of them (the same result, computed on every rank; no gradient to count).
            return x + self.ffn(tokens_TD).view_as(x)
        return x + gather_from_tp(self.ffn(split_to_tp(tokens_TD, self.group)), self.group).view_as(x)


class TPBlock(nn.Module):
    """Attention split over `group`; the FFN a split MLP of `hidden_dim`, or `token_ffn` (an MoE
    layer, run by `TokenSplit`) when given."""

    def __init__(self, dim: int, n_head: int, hidden_dim: int, group: dist.ProcessGroup | None,
                 norm_eps: float = 1e-5, kernels: str = "auto", device=None, dtype=None,
                 token_ffn: nn.Module | None = None):
        super().__init__()
        self.group = group
        self.attn_norm = nn.RMSNorm(dim, eps=norm_eps, device=device, dtype=dtype)
        self.attn = TPAttention(dim, n_head, group, kernels, device=device, dtype=dtype)
        self.ffn_norm = nn.RMSNorm(dim, eps=norm_eps, device=device, dtype=dtype)
        self.ffn = token_ffn if token_ffn is not None else TPMLP(dim, hidden_dim, group, device=device, dtype=dtype)

    @property
    def token_split(self) -> bool:
        """Whether the FFN runs on a share of the tokens (an MoE layer) instead of being split."""
        return not isinstance(self.ffn, TPMLP)

    @classmethod
    def from_dense(cls, block: nn.Module, n_head: int, group: dist.ProcessGroup | None,
                   kernels: str = "auto") -> TPBlock:
        """This rank's part of a block of weft.models.gpt (attributes attn_norm, attn.qkv,
        attn.out_proj, ffn_norm, and ffn: a dense MLP with fc and out_proj, whose slices are
        taken, or an MoE layer (`block.is_moe`), which is kept as it is)."""
        weight = block.attn.qkv.weight
        token_ffn = block.ffn if block.is_moe else None
        hidden = 0 if token_ffn is not None else block.ffn.fc.weight.shape[0]
        tp_block = cls(weight.shape[1], n_head, hidden, group, block.attn_norm.eps, kernels,
                       device=weight.device, dtype=weight.dtype, token_ffn=token_ffn)
        with torch.no_grad():
            tp_block.attn_norm.load_state_dict(block.attn_norm.state_dict())
            tp_block.ffn_norm.load_state_dict(block.ffn_norm.state_dict())
        load_shards(tp_block.attn, block.attn)
        if token_ffn is None:
            load_shards(tp_block.ffn, block.ffn)
        return tp_block

    def stages(self, rope: tuple[torch.Tensor, torch.Tensor]) -> list[Stage | TokenSplit]:
        attention = functools.partial(self.attn.inner, rope=rope)
        attn = Stage(self.attn_norm, attention, self.attn.out_proj,
                     (*self.attn_norm.parameters(), *self.attn.parameters()))
        if self.token_split:
            return [attn, TokenSplit(self.ffn_norm, self.ffn, self.group)]
        return [attn, Stage(self.ffn_norm, self.ffn.inner, self.ffn.out_proj,
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
    """`blocks` one after the other: each run of split sub-layers under `schedule` (Domino's
    overlap crosses block boundaries, not MoE layers), each `TokenSplit` sub-layer on its own."""
    run: list[Stage] = []
    for stage in [stage for block in blocks for stage in block.stages(rope)]:
        if isinstance(stage, Stage):
            run.append(stage)
            continue
        if run:
            x, run = schedule.run(run, x, group), []
        x = stage(x)
    return schedule.run(run, x, group) if run else x
