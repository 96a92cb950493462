"""Expert parallelism by one all-to-all each way (GShard / Tutel): the plain exchange.

Padded: a fixed-size all-to-all (linear, or Tutel's 2DH over nodes, appendix A); the local
experts compute on the received rows where they lie, by source rank then expert (W, El, C, dim),
one batched matmul per source (`Experts.forward_by_source`), the function of Tutel's Flexible
layout (El, W * C, dim) without copying the rows into it and back. Grouped (dropless): the splits come from every rank's
counts, which the layout holds on the host, then exactly the routed rows go (all-to-allv), and
the local experts run one grouped GEMM; on one rank (or where no rank communicates: the no-comm
bound) the counts stay on the device (`GroupedOnDevice`) and the grouped GEMM takes its groups'
ends from there.
"""
from __future__ import annotations

import torch

from weft.moe.exchange.base import Exchange, ExchangeContext, Grouped, GroupedOnDevice


class AllToAll(Exchange):
    """One exchange each way; `algo` "linear" or "2dh" (padded only: 2DH needs equal splits)."""

    def __init__(self, ctx: ExchangeContext, algo: str = "linear"):
        super().__init__(ctx)
        self.algo = algo

    def padded(self, rows_RD: torch.Tensor, capacity: int) -> torch.Tensor:
        placement, dim = self.ctx.placement, rows_RD.shape[-1]
        ep, local = placement.ep_size, placement.num_local
        received = self.ctx.all_to_all(rows_RD, algo=self.algo)  # (W * El * C, dim), source-major
        out = self.ctx.experts.forward_by_source(received.view(ep, local, capacity, dim), self.ctx.expert_step)
        return self.ctx.all_to_all(out.view(ep * local * capacity, dim), algo=self.algo)

    def grouped(self, rows_ND: torch.Tensor, layout: Grouped) -> torch.Tensor:
        ctx, placement = self.ctx, self.ctx.placement
        if placement.ep_size == 1:
            return ctx.experts.forward_grouped(rows_ND, list(layout.mine), step=ctx.expert_step)
        recv_counts, sent, received = ctx.expert_counts(layout)
        send_splits = [sum(r) for r in sent]
        recv_splits = [sum(r) for r in received]
        recv = ctx.all_to_all(rows_ND, recv_splits, send_splits)  # rows by [source][local expert]
        out = experts_on_received(ctx.experts, recv, recv_counts, received, ctx.expert_step)
        return ctx.all_to_all(out, send_splits, recv_splits)

    def grouped_on_device(self, rows_ND: torch.Tensor, layout: GroupedOnDevice) -> torch.Tensor:
        """One rank, or several that do not communicate: nothing to exchange, so nothing to know
        on the host; the grouped GEMM takes the groups' ends on the device. Not communicating,
        a rank's rows for rank s's local expert i stay and its own local expert i takes them, as
        they would arrive from source s (`grouped`). Several communicating ranks need the splits
        on the host (`Grouped`)."""
        ctx, placement = self.ctx, self.ctx.placement
        if placement.ep_size == 1:
            return ctx.experts.forward_offsets(rows_ND, layout.counts_E.cumsum(0).to(torch.int32), ctx.expert_step)
        if ctx.communicate:
            return super().grouped_on_device(rows_ND, layout)
        local = placement.num_local
        by_expert = local_expert_order(layout.counts_E, placement.ep_size, local, rows_ND.shape[0])
        offs_E = layout.counts_E.view(placement.ep_size, local).sum(0).cumsum(0).to(torch.int32)
        return in_expert_order(rows_ND, by_expert,
                               lambda rows: ctx.experts.forward_offsets(rows, offs_E, ctx.expert_step))


def experts_on_received(experts, recv: torch.Tensor, recv_counts: torch.Tensor,
                        received: list[list[int]], step=None) -> torch.Tensor:
    """Run the local experts on rows that arrived grouped [source rank][local expert]
    (`received[s][i]` rows from source s for local expert i; `recv_counts` the same as a flat
    tensor; `step`: the call's `BackwardSGD`, or None); the output rows come back in the same
    order."""
    by_expert, per_expert = by_local_expert(recv_counts, received, recv.shape[0])
    return in_expert_order(recv, by_expert, lambda rows: experts.forward_grouped(rows, per_expert, step=step))


def by_local_expert(recv_counts: torch.Tensor, received: list[list[int]], total: int) -> tuple[torch.Tensor, list[int]]:
    """Rows that arrived grouped [source rank][local expert] (`received[s][i]` rows, `recv_counts`
    the same as a flat device tensor, `total` rows in all): the permutation that groups them by
    local expert instead (stable: sources in order within an expert), and the rows per local
    expert."""
    ep, local = len(received), len(received[0])
    return local_expert_order(recv_counts, ep, local, total), [sum(r[i] for r in received) for i in range(local)]


def local_expert_order(counts_WE: torch.Tensor, ep: int, local: int, total: int) -> torch.Tensor:
    """Rows grouped [source rank][local expert] (`counts_WE`, W * El counts as a flat device
    tensor summing to `total`) -> the permutation that groups them by local expert (stable:
    sources in order within an expert). Reads nothing on the host."""
    expert_of_row = torch.arange(local, device=counts_WE.device).repeat(ep)
    expert_of_row = expert_of_row.repeat_interleave(counts_WE, output_size=total)
    return torch.sort(expert_of_row, stable=True).indices


def in_expert_order(rows: torch.Tensor, by_expert: torch.Tensor, experts_on) -> torch.Tensor:
    """`experts_on(rows[by_expert])` (rows grouped by local expert) with its output rows put back
    in `rows`' order: the permutation and its inverse, both ways by gathers (`permute_rows`)."""
    back = inverse_permutation(by_expert)
    return permute_rows(experts_on(permute_rows(rows, by_expert, back)), back, by_expert)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes `perm` (inverse[perm[i]] = i), on its device, nothing read on the host."""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype))


def permute_rows(x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """x[perm] for a permutation `perm` of x's rows (`inverse` = `inverse_permutation(perm)`),
    differentiable: the backward is the gather dy[inverse]. `index_select`'s backward adds dy into a
    zero tensor of x's size, and `zeros_like(y).index_copy(0, perm, y)` (the way back) fills one:
    each a write of every row that a permutation does not need."""
    return _PermuteRows.apply(x, perm, inverse)


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, perm, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, dy):
        (inverse,) = ctx.saved_tensors
        return dy.index_select(0, inverse), None, None
