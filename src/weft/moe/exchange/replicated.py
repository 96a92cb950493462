"""Pro-Prophet's lightweight expert placement (sec. IV-A, fig. 6), dropless: for one call, the
weights of a few heavy experts (`copied`, global ids, the same on every rank) are copied to every
rank of the expert-parallel group (Trans; the paper's n = 1), each rank computes its own rows for
those experts locally, and only the rows of the other experts travel in the all-to-alls. The
copies' weight gradients are summed back into the owners' (Agg) by the backward of the same
collective, so the layer's outputs and gradients are those of plain expert parallelism, and no
parameter or optimizer state moves between calls.

Trans is one all-gather of a (S_max, P) stack of flattened weights (P: one expert's w1, w2, w3),
S_max the most copied experts any one rank owns (ranks owning fewer pad with zeros); its
backward, a reduce-scatter, is Agg.
"""
from __future__ import annotations

import torch

from weft.comm import all_gather
from weft.distributed import group_rank
from weft.moe.exchange.all_to_all import AllToAll
from weft.moe.exchange.base import Exchange, ExchangeContext


class ReplicatedExperts(Exchange):
    """Dropless expert parallelism with the `copied` experts computed where their rows are
    (E >= W, unsharded experts)."""

    def __init__(self, ctx: ExchangeContext, copied: tuple[int, ...]):
        super().__init__(ctx)
        placement = ctx.placement
        if placement.expert_shards > 1:
            raise ValueError("replicated experts need whole experts on each rank (E >= W)")
        if not copied or len(set(copied)) != len(copied) or not all(0 <= e < placement.num_experts for e in copied):
            raise ValueError(f"copied must be distinct expert ids in [0, {placement.num_experts}), got {copied}")
        self.copied = tuple(sorted(copied))

    def padded(self, rows_RD: torch.Tensor, capacity: int) -> torch.Tensor:
        raise ValueError("replicated experts balance dropless layers only: a padded layout already computes "
                         "every expert's full capacity")

    def grouped(self, rows_ND: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        ctx, placement = self.ctx, self.ctx.placement
        device = rows_ND.device
        copied_E = torch.zeros(placement.num_experts, dtype=torch.bool, device=device)
        copied_E[list(self.copied)] = True
        expert_of_row = torch.repeat_interleave(torch.arange(placement.num_experts, device=device), counts_E,
                                                output_size=rows_ND.shape[0])
        local_N = copied_E[expert_of_row]
        local_rows, sent_rows = local_N.nonzero().squeeze(1), (~local_N).nonzero().squeeze(1)
        sent_out = AllToAll(ctx).grouped(rows_ND.index_select(0, sent_rows), torch.where(copied_E, 0, counts_E))
        local_out = ctx.experts.forward_grouped(rows_ND.index_select(0, local_rows),
                                                counts_E[list(self.copied)].tolist(), self.copies())
        out = sent_out.new_empty(rows_ND.shape[0], sent_out.shape[1])
        return out.index_copy(0, sent_rows, sent_out).index_copy(0, local_rows, local_out.to(sent_out.dtype))

    def copies(self) -> tuple:
        """Trans: the copied experts' (w1, w2, w3) on every rank, stacked in `copied` order;
        differentiable (their gradients are summed into the owners' weights: Agg). One all-gather
        of the owned copied experts' weights, flattened into one row per expert."""
        placement, weights = self.ctx.placement, self.ctx.experts.weights()
        local, rank = placement.num_local, group_rank(placement.group)
        owner = {e: e // local for e in self.copied}
        per_rank = [[e for e in self.copied if owner[e] == r] for r in range(placement.ep_size)]
        most = max(len(es) for es in per_rank)
        present = [w for w in weights if w is not None]
        mine = torch.tensor([e - rank * local for e in per_rank[rank]], dtype=torch.long, device=present[0].device)
        stack = torch.cat([w.index_select(0, mine).flatten(1) for w in present], dim=1)  # (owned, P)
        if stack.shape[0] < most:  # every rank sends `most` rows
            stack = torch.cat([stack, stack.new_zeros(most - stack.shape[0], stack.shape[1])])
        rows = torch.tensor([owner[e] * most + per_rank[owner[e]].index(e) for e in self.copied], dtype=torch.long,
                            device=stack.device)  # each copied expert's row in the gather
        gathered = all_gather(stack, placement.group).index_select(0, rows)
        parts, start = [], 0
        for w in weights:
            if w is None:
                parts.append(None)
                continue
            size = w[0].numel()
            parts.append(gathered[:, start:start + size].reshape(-1, *w.shape[1:]))
            start += size
        return tuple(parts)
