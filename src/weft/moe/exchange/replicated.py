"""Pro-Prophet's lightweight expert placement (sec. IV-A, fig. 6), dropless: for one call, the
weights of a few heavy experts (`copied`, global ids, the same on every rank) are copied to every
rank of the expert-parallel group (Trans; the paper's n = 1), each rank computes its own rows for
those experts locally, and only the rows of the other experts travel in the all-to-alls. The
copies' weight gradients are summed back into the owners' (Agg) by the backward of the same
collective, so the layer's outputs and gradients are those of plain expert parallelism, and no
parameter or optimizer state moves between calls.

Trans is one all-gather of a (S_max, P) stack of flattened weights (P: one expert's w1, w2, w3),
S_max the most copied experts any one rank owns (ranks owning fewer pad with zeros); its
backward, a reduce-scatter, is Agg. A `Transfer` is launched when it is built and waited for
when the copies are first used, so it can start a layer early (Alg. 2, `weft.models.gpt`).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from weft.comm import start_all_gather, wait_all_gather
from weft.distributed import group_rank
from weft.moe.exchange.all_to_all import AllToAll
from weft.moe.exchange.base import Exchange, ExchangeContext, ExpertPlacement
from weft.moe.experts import Experts


class Transfer:
    """Trans of one call's `copied` experts (global ids, the same on every rank): their (w1, w2,
    w3) gathered from the owners to every rank of `group` (a group over the expert-parallel ranks,
    e.g. its `side_group`), launched when built, in `dtype` (the experts' compute dtype: bf16
    under autocast halves the bytes). `copies()` waits and returns them stacked in `copied` order,
    differentiable: their gradients are summed into the owners' weights (Agg), launched when the
    copies' gradients are complete and waited for where the transfer was built."""

    def __init__(self, experts: Experts, placement: ExpertPlacement, copied: tuple[int, ...],
                 group: dist.ProcessGroup | None, dtype: torch.dtype | None = None):
        self.copied = tuple(sorted(copied))
        self._copies: tuple | None = None
        if not self.copied:
            return
        if len(set(copied)) != len(copied) or not all(0 <= e < placement.num_experts for e in copied):
            raise ValueError(f"copied must be distinct expert ids in [0, {placement.num_experts}), got {copied}")
        if placement.expert_shards > 1:
            raise ValueError("replicated experts need whole experts on each rank (E >= W)")
        weights = experts.weights()
        local, rank = placement.num_local, group_rank(placement.group)
        owner = {e: e // local for e in self.copied}
        per_rank = [[e for e in self.copied if owner[e] == r] for r in range(placement.ep_size)]
        most = max(len(es) for es in per_rank)
        present = [w for w in weights if w is not None]
        mine = torch.tensor([e - rank * local for e in per_rank[rank]], dtype=torch.long, device=present[0].device)
        stack = torch.cat([w.index_select(0, mine).flatten(1).to(dtype or w.dtype) for w in present], dim=1)
        if stack.shape[0] < most:  # every rank sends `most` rows
            stack = torch.cat([stack, stack.new_zeros(most - stack.shape[0], stack.shape[1])])
        # each copied expert's row in the gather
        self._rows = torch.tensor([owner[e] * most + per_rank[owner[e]].index(e) for e in self.copied],
                                  dtype=torch.long, device=stack.device)
        self._shapes = [None if w is None else tuple(w.shape[1:]) for w in weights]
        self._out, self._pending = start_all_gather(stack, group)

    @classmethod
    def none(cls) -> Transfer:
        """A transfer of no expert: the call it is given to runs unbalanced."""
        return cls(None, None, (), None)  # type: ignore[arg-type]

    def copies(self) -> tuple:
        """The copied experts' (w1, w2, w3) on this rank, stacked in `copied` order (waits for the
        transfer at the first call; later calls return the same tensors)."""
        if not self.copied:
            raise ValueError("this transfer copies no expert")
        if self._copies is None:
            gathered = wait_all_gather(self._out, self._pending).index_select(0, self._rows)
            parts, start = [], 0
            for shape in self._shapes:
                if shape is None:
                    parts.append(None)
                    continue
                size = math.prod(shape)
                parts.append(gathered[:, start:start + size].reshape(-1, *shape))
                start += size
            self._copies = tuple(parts)
        return self._copies


class ReplicatedExperts(Exchange):
    """Dropless expert parallelism with the `copied` experts computed where their rows are
    (E >= W, unsharded experts)."""

    def __init__(self, ctx: ExchangeContext, transfer: Transfer):
        super().__init__(ctx)
        if not transfer.copied:
            raise ValueError("replicated experts need at least one copied expert")
        self.transfer = transfer
        self.copied = transfer.copied

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
                                                counts_E[list(self.copied)].tolist(),
                                                self.transfer.copies())
        out = sent_out.new_empty(rows_ND.shape[0], sent_out.shape[1])
        return out.index_copy(0, sent_rows, sent_out).index_copy(0, local_rows, local_out.to(sent_out.dtype))

