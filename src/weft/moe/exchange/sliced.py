"""Fewer experts than ranks (Tutel 3.1, fig. 7): the m = W / E ranks of an expert form r
model-parallel slices of its hidden dimension (r a divisor of m), each served by g = m / r
data-parallel ranks that all-gather their shards. Every row goes to all r slices (local repeat)
and the r partial outputs are summed (local sum). r = 1 is EP+DP, r = m is EP+MP."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from weft.moe.exchange.base import Exchange, ExchangeContext, Grouped
from weft.moe.exchange.data_parallel import gathered_weights
from weft.moe.pipeline import pipelined_exchange


class SlicedExperts(Exchange):
    """Slices `r` > 0; padded rows may be pipelined with `degree` (each chunk linear or 2DH)."""

    def __init__(self, ctx: ExchangeContext, r: int, degree: int = 1, algo: str = "linear"):
        super().__init__(ctx)
        self.r, self.degree, self.algo = r, degree, algo
        self.peers = ctx.placement.expert_shards // r  # g ranks share one slice

    def padded(self, rows_RD: torch.Tensor, capacity: int) -> torch.Tensor:
        """Destination rank q = e*m + s*g + i gets, from every source, part i of the source's
        capacity block for expert e (local repeat over the r slices s); the r partial outputs that
        come back are summed (local sum)."""
        ctx, r, peers = self.ctx, self.r, self.peers
        dim, experts = rows_RD.shape[-1], ctx.placement.num_experts
        part = -(-capacity // peers)
        padded = F.pad(rows_RD.view(experts, capacity, dim), (0, 0, 0, part * peers - capacity))
        send = padded.view(experts, 1, peers, part, dim).expand(experts, r, peers, part, dim).reshape(-1, dim)
        if self.degree > 1 and ctx.communicate:
            # The send buffer is a padded exchange with one "local expert" (this rank's slice) and
            # capacity `part` per destination: Tutel's pipelining applies unchanged.
            placement = ctx.placement
            back = pipelined_exchange(send, ctx.experts, placement.group, placement.ep_size, 1, part, self.degree,
                                      algo=self.algo, groups_2dh=placement.groups_2dh, weights=self.slice_weights())
        else:
            received = ctx.all_to_all(send, algo=self.algo)
            out = ctx.experts(received.view(1, -1, dim), self.slice_weights())
            back = ctx.all_to_all(out.view(-1, dim), algo=self.algo)
        summed = back.view(experts, r, part * peers, dim).float().sum(1).to(back.dtype)
        return summed[:, :capacity].reshape(experts * capacity, dim)

    def grouped(self, rows_ND: torch.Tensor, layout: Grouped) -> torch.Tensor:
        """Expert e's rows are cut into g near-equal parts, part i going to every slice's replica i
        (all-to-allv)."""
        ctx, counts_E = self.ctx, layout.counts_E
        # The g parts of expert e's segment, in order, are the segment itself: destinations
        # (e, s, i) in rank order get the segment r times. A stable sort of r copies of the rows by
        # expert gives that order (copy 0 of e, then copy 1 of e, ...).
        rows = rows_ND.shape[0]
        expert_of_row = torch.repeat_interleave(torch.arange(ctx.placement.num_experts, device=counts_E.device),
                                                counts_E, output_size=rows)
        index = torch.sort(expert_of_row.repeat(self.r), stable=True).indices % max(rows, 1)
        send_splits = self._splits(layout.mine)
        # What each source sends here: its own splits (from its counts, on the host) at this rank.
        recv_splits = [self._splits(row)[layout.rank] for row in layout.counts_WE] if ctx.communicate else send_splits
        received = ctx.all_to_all(rows_ND.index_select(0, index), recv_splits, send_splits)
        out = ctx.experts(received.unsqueeze(0), self.slice_weights()).squeeze(0)
        back = ctx.all_to_all(out, send_splits, recv_splits)
        summed = back.new_zeros(rows, back.shape[-1], dtype=torch.float32).index_add_(0, index, back.float())
        return summed.to(back.dtype)

    def _splits(self, counts_E) -> list[int]:
        """A source's rows per destination rank (e, s, i), from its rows per expert."""
        peers = self.peers
        return [b - a for n in counts_E for _ in range(self.r)
                for a, b in ((n * i // peers, n * (i + 1) // peers) for i in range(peers))]

    def slice_weights(self) -> tuple:
        """Slice s = (rank % m) // g of this rank's expert (hidden / r wide), all-gathered over the
        g ranks that share it; their gradients are reduce-scattered back (summed)."""
        group = self.ctx.placement.slice_groups.get(self.r)
        if group is None:  # r = m: the slice is this rank's own shard
            return self.ctx.experts.weights()
        return gathered_weights(self.ctx.experts, group, self.peers)
