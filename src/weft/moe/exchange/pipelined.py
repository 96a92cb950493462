"""Tutel's adaptive pipelining (Tutel 3.2) as an exchange: the rows are cut into d chunks so the
all-to-all of one chunk overlaps the experts of another, forward and backward. Padded: the
capacity dimension is cut (each chunk's exchange linear or 2DH); grouped (dropless): each
(destination rank, local expert) segment. Same function as `AllToAll`; the kernels live in
`weft.moe.pipeline`.
"""
from __future__ import annotations

import torch

from weft.moe.exchange.base import Exchange, ExchangeContext, Grouped
from weft.moe.pipeline import dropless_pipelined_exchange, pipelined_exchange


class Pipelined(Exchange):
    """Degree `degree` > 1; `algo` the padded chunks' all-to-all ("linear" or "2dh")."""

    def __init__(self, ctx: ExchangeContext, degree: int, algo: str = "linear"):
        super().__init__(ctx)
        self.degree, self.algo = degree, algo

    def padded(self, rows_RD: torch.Tensor, capacity: int) -> torch.Tensor:
        placement = self.ctx.placement
        return pipelined_exchange(rows_RD, self.ctx.experts, placement.group, placement.ep_size, placement.num_local,
                                  capacity, self.degree, algo=self.algo, groups_2dh=placement.groups_2dh,
                                  scheduler=self.ctx.scheduler)

    def grouped(self, rows_ND: torch.Tensor, layout: Grouped) -> torch.Tensor:
        placement = self.ctx.placement
        _, sent, received = self.ctx.expert_counts(layout)
        return dropless_pipelined_exchange(rows_ND, self.ctx.experts, placement.group, sent, received, self.degree,
                                           scheduler=self.ctx.scheduler)
