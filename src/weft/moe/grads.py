"""Gradient reduction of expert-parallel training (docs/moe.md, "Gradients").

The MoE layer reduces nothing itself: after `backward`, a rank's router (and every other
replicated parameter) holds its own tokens' gradient, and an expert's owner holds the gradient of
every EP rank's tokens routed to it. `reduce_gradients` turns both into the gradient of the mean
loss over all data-parallel ranks: replicated parameters are summed over every rank, expert
parameters over their expert-data-parallel replicas, and both are divided by the world size.

Under tensor parallelism (weft.tp) each rank of a TP group routes its own share of the group's
tokens: its routers' gradients are the share's, so they are first summed over the TP group; the
data-parallel size is then the number of TP groups, and an expert's gradient, summed over every
rank's share by the all-to-all backward, already counts each group's tokens once.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from weft.distributed import MoEGroups, group_size
from weft.moe.experts import Experts
from weft.moe.layer import MoE


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters that are sharded over the EP group (the weights of every `weft` expert block)."""
    params: list[nn.Parameter] = []
    for module in model.modules():
        if isinstance(module, Experts):
            params.extend(module.parameters())
    return params


def token_split_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of MoE layers that are not experts (routers): under tensor parallelism each
    rank's gradient of them is its share of the tokens'."""
    experts = {id(p) for p in expert_parameters(model)}
    return [p for m in model.modules() if isinstance(m, MoE) for p in m.parameters() if id(p) not in experts]


def _all_reduce_mean(grads: list[torch.Tensor], group: dist.ProcessGroup | None, divisor: int) -> None:
    """Sum `grads` over `group` in one flat bucket per dtype, then divide by `divisor` (a group of
    one rank: divided in place, without the bucket's copies)."""
    if group_size(group) == 1:
        torch._foreach_div_(grads, divisor)
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for bucket in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in bucket])
        if group_size(group) > 1:
            dist.all_reduce(flat, group=group)
        flat.div_(divisor)
        parts = flat.split([g.numel() for g in bucket])
        torch._foreach_copy_(bucket, [part.view_as(g) for part, g in zip(parts, bucket)])


def reduce_gradients(model: nn.Module, groups: MoEGroups) -> None:
    """Make every gradient the gradient of the mean loss over all data-parallel ranks.

    Call after `backward` and before the optimizer step. Expert gradients (already summed over
    the EP group by the all-to-all backward) are summed over expert-data-parallel replicas;
    all other gradients over every rank; both are divided by the data-parallel world size.
    With tensor parallelism the routers' gradients are summed over the TP group first.
    """
    if groups.tp_size > 1:
        routers = [p.grad for p in token_split_parameters(model) if p.grad is not None]
        if routers:
            _all_reduce_mean(routers, groups.tp, 1)
    world = group_size(groups.dp)
    if world == 1:
        return
    experts = {id(p) for p in expert_parameters(model)}
    expert_grads, dense_grads = [], []
    for p in model.parameters():
        if p.grad is None:
            continue
        (expert_grads if id(p) in experts else dense_grads).append(p.grad)
    if expert_grads:
        _all_reduce_mean(expert_grads, groups.edp, world)
    if dense_grads:
        _all_reduce_mean(dense_grads, groups.dp, world)

