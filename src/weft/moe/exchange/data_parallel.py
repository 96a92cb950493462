"""Tutel's r = 0 (switchable parallelism, Tutel 3.1): data parallelism for the experts. The rows
stay on their rank and the weights come to them: every expert's weights are all-gathered from
their owners, and the backward reduce-scatters their gradients back (summed over ranks, as expert
parallelism's all-to-all backward sums them). No parameter moves between calls."""
from __future__ import annotations

import torch

from weft.comm import all_gather
from weft.moe.exchange.base import Exchange, Grouped


class DataParallelExperts(Exchange):
    def padded(self, rows_RD: torch.Tensor, capacity: int) -> torch.Tensor:
        placement, dim = self.ctx.placement, rows_RD.shape[-1]
        by_expert = rows_RD.view(placement.num_experts, capacity, dim)
        return self.ctx.experts(by_expert, self.all_weights()).reshape(-1, dim)

    def grouped(self, rows_ND: torch.Tensor, layout: Grouped) -> torch.Tensor:
        return self.ctx.experts.forward_grouped(rows_ND, list(layout.mine), self.all_weights())

    def all_weights(self) -> tuple:
        """Every expert's weights on every rank, gathered from their owners (joined from their
        hidden-dimension shards when experts are sharded)."""
        placement = self.ctx.placement
        return gathered_weights(self.ctx.experts, placement.group, placement.expert_shards)


def gathered_weights(experts, group, shards: int) -> tuple:
    """The rank's expert weights all-gathered over `group`, every `shards` consecutive
    hidden-dimension shards joined into one expert (slice); differentiable (reduce-scatter back)."""
    return tuple(None if w is None else join_shards(all_gather(w, group), shards, rows=i == 1)
                 for i, w in enumerate(experts.weights()))


def join_shards(gathered: torch.Tensor, shards: int, rows: bool) -> torch.Tensor:
    """(G * shards, ...) hidden-dimension shards in rank order -> (G, ...) whole slices: w2-like
    weights (rows=True) join along dim 1, w1/w3-like along dim 2."""
    if shards == 1:
        return gathered
    n, a, b = gathered.shape
    if rows:
        return gathered.reshape(n // shards, shards * a, b)
    return gathered.view(n // shards, shards, a, b).permute(0, 2, 1, 3).reshape(n // shards, a, shards * b)
