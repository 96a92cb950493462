"""Each token crosses to a rank once: the all-to-alls of expert parallelism without repeated rows.

With top-k routing a token's k slots often land on experts of the same rank (qwen2-like E64 k4 on
2 ranks: 4 slots, on average 1.9 ranks), and the plain exchange sends its row once per slot, there
and back. This exchange (`a2a_algo="dedup"`) sends it once per destination rank, as DeepEP's
dispatch does (its `is_token_in_rank`), and sums a token's outputs on each rank before they
return:

- dispatch: the source sends each (token, rank) pair once (rows grouped by destination, then
  token), and beside them one small record per routed slot, at the slot's place in the layout
  the experts compute: which of those rows it reads and which of the pair's slots it is
  (`pair * K + j`, K = min(k, local experts), j counting the token's earlier kept slots on that
  rank), with the slot's gate;
- the rank expands the received rows into the layout its experts compute (padded: Tutel's
  Flexible layout (El, W * C, dim) straight away, so no layout copies either; dropless: grouped
  by local expert) with the row kernels of `weft.moe.dispatch` (deterministic on GPUs);
- combine: the rank multiplies each output by its gate and sums a token's outputs (float32, then
  the compute dtype), returning one row per pair; the source sums the ranks' rows in rank order.

Same routing, same drops, same function as the plain layer: the expert outputs are those of the
plain exchange; the gate-weighted sum is associated by rank (the plain combine sums the k slots in
slot order), and each rank's partial sum travels in the compute dtype: fp32 layers agree with the
plain one to float rounding, bf16 ones to bf16 rounding. Gradients follow by autograd through the
same differentiable pieces (row kernels, all-to-alls, the gates' scatter).

Bytes: fewer whenever some token has two slots on one rank. Padded modes send a fixed
min(T, El * C) rows per destination (no host synchronisation: T tokens can need at most T
pairs, and C slots per expert at most El * C): fewer than the plain El * C when k * cf > W
(qwen2-like on 2 ranks: half). Dropless sends exactly the pairs.

Not with: expert choice (a token takes a varying number of slots), fewer experts than ranks,
Tutel's capacity chunks in padded modes (d > 2; d = 2 is the overlap below; dropless calls in
fixed-size exchanges take any d, `dropless_fixed`), Comet's kernels, Pro-Prophet's copies
(`weft.moe.config.check_call`).

Overlap (`overlap_degree=2`, padded modes): the rank computes its own pairs, which never leave
it, while the other ranks' rows travel to it, then theirs; backward mirrors it, with the weight
gradients of all pairs (computed once, `WeightGradParts`) under the same exchange. Cutting the
capacity into chunks as Tutel does would undo the deduplication (each chunk's block would be
bounded by T again), so the overlap here is by source: it hides up to the own share (1 / W) of
the experts' forward and input-gradient time, and their weight gradients, under one exchange
each way. Dropless calls in fixed-size exchanges keep the own pairs home too
(`a2a_algo="dedup-fixed-own"`, `_dropless_fixed_own_apart`), computed under the return of the
others' sums instead, so that in backward their work fills the returned gradient's exchange.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from weft.comm import all_to_all
from weft.comm.async_all_to_all import start_all_to_all, wait_all_to_all
from weft.distributed import group_rank
from weft.hostcopy import device_tensor
from weft.kernels import rows as row_kernels
from weft.kernels.scan import cumsum_down
from weft.moe.dispatch import SlotRows, combine_rows, dispatch_rows
from weft.moe.exchange.all_to_all import by_local_expert
from weft.moe.exchange.base import ExpertPlacement, Grouped, gather_counts
from weft.moe.experts import Experts, GroupedWeightGradParts, PartCall, WeightGradParts
from weft.moe.pipeline import chunk_bounds
from weft.moe.routing import Routing
from weft.profiling import stage

# SMs the experts' matmuls leave to the exchanges beside them in a pipelined fixed-size call
# (`weft.kernels.grouped_mm.leave_sms`): NCCL's all-to-all kernel held 4 SMs on 2 x H100 with P2P
# disabled; of margins 0, 16 and 32 on the phi35-like layer, 16 was fastest (docs/benchmarks.md).
OVERLAP_SM_MARGIN = 16


@dataclass(frozen=True)
class Pairs:
    """The (token, rank) pairs of this rank's tokens: `need_TW[t, r]`, whether token t has a kept
    slot on rank r; `rank_TK[t, j]`, the rank of slot j's expert (W where the slot is dropped);
    `K`, the most slots a token has on one rank, min(k, local experts); and, computed when first
    read (a dropless call tuned to the linear exchange reads only `counts()`), `offset_TW[t, r]`,
    its pair's place among this rank's pairs for rank r (token order), and `earlier_TK[t, j]`, the
    token's earlier kept slots on that rank."""

    need_TW: torch.Tensor
    rank_TK: torch.Tensor
    K: int

    @classmethod
    def of(cls, routing: Routing, num_tokens: int, top_k: int, local: int, world: int) -> Pairs:
        return cls.of_slots(routing.experts_S, routing.kept_S, num_tokens, top_k, local, world)

    @classmethod
    def of_slots(cls, experts_S: torch.Tensor, kept_S: torch.Tensor | None, num_tokens: int, top_k: int, local: int,
                 world: int) -> Pairs:
        """The pairs of `num_tokens` tokens whose slots (t * k + j) go to `experts_S` (global ids)."""
        rank_TK = (experts_S // local).view(num_tokens, top_k)
        if kept_S is not None:  # a dropped slot: a rank past the last, cut off below
            rank_TK = torch.where(kept_S.view(num_tokens, top_k), rank_TK, world)
        need_TW = rank_TK.new_zeros(num_tokens, world + 1, dtype=torch.bool).scatter_(1, rank_TK, True)[:, :world]
        return cls(need_TW, rank_TK, min(top_k, local))

    @functools.cached_property
    def offset_TW(self) -> torch.Tensor:
        return cumsum_down(self.need_TW, torch.long) - 1

    @functools.cached_property
    def earlier_TK(self) -> torch.Tensor:
        top_k = self.rank_TK.shape[1]
        before_KK = torch.ones(top_k, top_k, dtype=torch.long, device=self.rank_TK.device).tril(-1)  # j2 < j
        return ((self.rank_TK.unsqueeze(2) == self.rank_TK.unsqueeze(1)).long() * before_KK).sum(2)

    def counts(self) -> torch.Tensor:
        """(W,) the pairs this rank sends each rank."""
        return self.need_TW.sum(0)

    def records(self, start_W: torch.Tensor | int) -> torch.Tensor:
        """(T * k,) each slot's record on its expert's rank, `unit * K + j'` with unit the pair's
        row among the rows that rank receives (this rank's pairs for rank r from `start_W[r]`);
        -1 for a dropped slot."""
        world = self.need_TW.shape[1]
        unit_TK = (self.offset_TW + start_W).gather(1, self.rank_TK.clamp(max=world - 1))
        return torch.where(self.rank_TK < world, unit_TK * self.K + self.earlier_TK, -1).view(-1)

    def send_rows(self, start_W: torch.Tensor, size: int) -> SlotRows:
        """The send buffer of `size` rows, rank r's pairs from row `start_W[r]`: for each token its
        row on each rank (-1: none) and for each row its pair's id, token * W + rank."""
        T, world = self.need_TW.shape
        rows_TW = torch.where(self.need_TW, self.offset_TW + start_W, -1)
        ids = torch.arange(T * world, device=rows_TW.device)
        return SlotRows(rows_TW, scatter_slots(ids, rows_TW.view(-1), size, fill=-1))


def gather_slots(x_TD: torch.Tensor, slot_rows: SlotRows, fused: bool) -> torch.Tensor:
    """Row r of the result is x[slot_of_row[r] // k], 0 where unused (`dispatch_rows`; the
    reference, differentiated by autograd, where not `fused`)."""
    if fused:
        return dispatch_rows(x_TD, slot_rows)
    return row_kernels.gather_rows_reference(x_TD, slot_rows.slot_of_row_R, divisor=slot_rows.top_k)


def sum_slots(src_RD: torch.Tensor, weights_TK: torch.Tensor, slot_rows: SlotRows, out_dtype: torch.dtype,
              fused: bool) -> torch.Tensor:
    """Row t of the result is sum_j weights[t, j] * src[rows[t, j]] in float32, cast to
    `out_dtype` (`combine_rows`; the reference, differentiated by autograd, where not `fused`)."""
    if fused:
        return combine_rows(src_RD, weights_TK, slot_rows, out_dtype)
    return row_kernels.weighted_row_sum_reference(src_RD, slot_rows.rows_TK, weights_TK, out_dtype)


def slot_map(slot_R: torch.Tensor, units: int, per_unit: int) -> SlotRows:
    """The SlotRows of rows holding the slots `slot_R` (-1: an unused row) of `units` units with
    `per_unit` slots each (each slot in at most one row)."""
    rows = scatter_slots(torch.arange(slot_R.shape[0], device=slot_R.device), slot_R, units * per_unit, fill=-1)
    return SlotRows(rows.view(units, per_unit), slot_R)


def scatter_slots(values_R: torch.Tensor, slot_R: torch.Tensor, size: int, fill: int = 0) -> torch.Tensor:
    """(size,) with values[r] at slot[r] and `fill` elsewhere (-1 slots left out), float32 for
    floating values (differentiable), else their dtype."""
    dtype = torch.float32 if values_R.is_floating_point() else values_R.dtype
    out = torch.full((size + 1,), fill, dtype=dtype, device=values_R.device)
    return out.scatter(0, torch.where(slot_R >= 0, slot_R, size), values_R.to(dtype))[:size]


def combine_ranks(back_PD: torch.Tensor, send_rows: SlotRows, out_dtype: torch.dtype, fused: bool) -> torch.Tensor:
    """Each token's output: the sum of its ranks' returned rows, in rank order (float32)."""
    ones_TW = torch.ones(send_rows.rows_TK.shape, dtype=torch.float32, device=back_PD.device)
    return sum_slots(back_PD, ones_TW, send_rows, out_dtype, fused)


def padded(tokens_TD: torch.Tensor, routing: Routing, experts: Experts, placement: ExpertPlacement, top_k: int,
           out_dtype: torch.dtype, fused: bool, same_tokens: bool, local_first: bool = False) -> torch.Tensor:
    """The padded layer's dispatch, exchange and combine, each token sent to a rank once (module
    docstring): fixed-size all-to-alls, no host synchronisation. `same_tokens`: every rank of the
    group routes the same number of tokens (cf > 0, checked by `MoE` at its first call); else
    (cf <= 0 agrees on C, not on T) each source's block is El * C rows. `local_first`
    (`overlap_degree=2`): the rank's own pairs stay home and are computed while the other ranks'
    rows travel in (`_exchange_local_first`)."""
    W, El, E, C = placement.ep_size, placement.num_local, placement.num_experts, routing.capacity
    T, D = tokens_TD.shape
    block = min(T, El * C) if same_tokens else El * C  # a token needs a rank once; a rank takes El * C slots
    device, me = tokens_TD.device, group_rank(placement.group)
    with stage("dispatch"):
        pairs = Pairs.of(routing, T, top_k, El, W)
        send_rows = pairs.send_rows(block * torch.arange(W, device=device), W * block)
        sent_PD = gather_slots(tokens_TD, send_rows, fused)
        # each kept slot's record and gate at its padded row e * C + position (-1 / 0: unused)
        slot_S = pairs.records(me * block)
        row_S = torch.where(slot_S >= 0, routing.experts_S * C + routing.positions_S, -1)
        record_R = scatter_slots(slot_S, row_S, E * C, fill=-1)
        gate_R = scatter_slots(routing.gates_S, row_S, E * C)
    with stage("exchange"):
        group = placement.group
        with stage("all_to_all"):  # source s's records and gates for my experts at [s]
            record_R, gate_R = exchange_records(record_R, gate_R, group, W * block * pairs.K)
        record_WGC, gate_WGC = record_R.view(W, El, C), gate_R.view(W, El, C)
        if local_first and W > 1:
            back_PD = _exchange_local_first(sent_PD, record_WGC, gate_WGC, experts, group, me, block, pairs.K, fused)
        else:
            with stage("all_to_all"):
                received_PD = all_to_all(sent_PD, group)  # source s's pairs from row s * block
            partial_PD = _experts_on_blocks(received_PD, record_WGC, gate_WGC, experts, pairs.K, fused)
            with stage("all_to_all"):
                back_PD = all_to_all(partial_PD, group)
    with stage("combine"):
        return combine_ranks(back_PD, send_rows, out_dtype, fused)


FLOAT32_INTEGERS = 2 ** 24  # every integer below it is exact in float32


def exchange_records(record_R: torch.Tensor, gate_R: torch.Tensor, group, bound: int,
                     output_splits: list[int] | None = None, input_splits: list[int] | None = None):
    """The records (int64, -1 unused) and gates (float32, differentiable) to the experts' ranks
    (all-to-all, or all-to-allv by the splits): one exchange of (record, gate) pairs as float32
    where every record is below `bound` (the most rows a rank receives times K, the slots of a
    pair: `unit * K + j`) and so exact in float32; else two exchanges. `bound` must be the same
    on every rank of the group: it decides how many collectives they make."""
    if bound <= FLOAT32_INTEGERS:
        packed = all_to_all(torch.stack([record_R.float(), gate_R], 1), group, output_splits, input_splits)
        return packed[:, 0].long(), packed[:, 1]
    return (all_to_all(record_R, group, output_splits, input_splits),
            all_to_all(gate_R, group, output_splits, input_splits))


def _experts_on_blocks(received_PD: torch.Tensor, record_SGC: torch.Tensor, gate_SGC: torch.Tensor, experts: Experts,
                       K: int, fused: bool, parts: WeightGradParts | None = None) -> torch.Tensor:
    """The experts on S sources' pair rows, in `received_PD`, which their records (S, El, C) point
    into: the rows expanded straight into Tutel's Flexible layout (El, S * C), computed, and each
    pair's gate-weighted sum returned, one row per row of `received_PD` (0 where none points).
    `parts`: this is one of several calls whose weight gradients are summed once
    (`Experts.forward_part`)."""
    S, El, C = record_SGC.shape
    D = received_PD.shape[1]
    slot_R = record_SGC.transpose(0, 1).reshape(-1)
    gate_R = gate_SGC.transpose(0, 1).reshape(-1)
    compute = experts if parts is None else functools.partial(experts.forward_part, parts=parts)
    return experts_on_pairs(received_PD, slot_R, gate_R, received_PD.shape[0], K,
                            lambda rows_RD: compute(rows_RD.view(El, S * C, D)).view(-1, D), fused)


def _exchange_local_first(sent_PD: torch.Tensor, record_WGC: torch.Tensor, gate_WGC: torch.Tensor, experts: Experts,
                          group, me: int, block: int, K: int, fused: bool) -> torch.Tensor:
    """The exchange with the rank's own pairs computed while the other ranks' rows travel
    (`overlap_degree=2` with dedup): the dispatch all-to-all starts, the experts compute this
    rank's own pairs from the rows it sent itself (they never leave it), then, once the exchange
    is done, the other ranks' pairs, whose results go back by one all-to-all. Backward mirrors it
    (`weft.comm.split`: autograd reaches the own pairs' backward after launching the exchange of
    the other pairs' input gradients and before waiting for it): there the own pairs' input
    gradients and the weight gradients of all pairs, which `WeightGradParts` computes once in
    the last backward to run, the own pairs', overlap that exchange. Returns the W blocks of
    returned rows as the one-exchange path has them (the own block, which the returned exchange
    carries empty, replaced)."""
    parts = WeightGradParts(experts, 2, experts.compute_dtype(sent_PD))
    with stage("all_to_all"):
        received_PD, pending = start_all_to_all(sent_PD, group)  # source s's pairs from row s * block
    own_WGC = record_WGC[me:me + 1]
    own_PD = _experts_on_blocks(sent_PD[me * block:(me + 1) * block],
                                torch.where(own_WGC >= 0, own_WGC - me * block * K, -1), gate_WGC[me:me + 1],
                                experts, K, fused, parts)
    with stage("all_to_all"):
        received_PD = wait_all_to_all(received_PD, pending)
    # the other sources' records and gates (slices and a kernel: no host values, so graphs capture it)
    others = torch.cat([record_WGC[:me], record_WGC[me + 1:]]), torch.cat([gate_WGC[:me], gate_WGC[me + 1:]])
    partial_PD = _experts_on_blocks(received_PD, *others, experts, K, fused, parts)  # the own block's rows: none
    with stage("all_to_all"):
        back_PD = all_to_all(partial_PD, group)
    return torch.cat([back_PD[:me * block], own_PD, back_PD[(me + 1) * block:]])


def experts_on_pairs(received_PD: torch.Tensor, slot_R: torch.Tensor, gate_R: torch.Tensor, units: int, K: int,
                     compute: Callable[[torch.Tensor], torch.Tensor], fused: bool,
                     expert_rows: SlotRows | None = None) -> torch.Tensor:
    """On the experts' rank: the received pair rows expanded to one row per record (`slot_R`, in
    the order the experts compute; -1: an unused row), `compute` (the experts on those rows), and
    each pair's gate-weighted sum of its outputs (`gate_R`), in the compute dtype: (units, D).
    `expert_rows`: `slot_map(slot_R, units, K)`, where the caller has it already."""
    expert_rows = slot_map(slot_R, units, K) if expert_rows is None else expert_rows
    out_RD = compute(gather_slots(received_PD, expert_rows, fused))
    gates_UK = scatter_slots(gate_R, slot_R, units * K).view(units, K)
    return sum_slots(out_RD, gates_UK, expert_rows, out_RD.dtype, fused)


def gather_layout(routing: Routing, pairs: Pairs | None, group, num_experts: int) -> tuple[Grouped, tuple | None]:
    """A dropless call's layout (`gather_counts`): every rank's expert counts on the host by one
    all-gather and one read, and with `pairs` every rank's pair counts in the same read
    (`pairs_WW[s][r]`: the pairs rank s sends rank r; None without `pairs`)."""
    if pairs is None:
        return gather_counts(routing.counts_E, group), None
    counted = gather_counts(torch.cat([routing.counts_E, pairs.counts().to(routing.counts_E.dtype)]), group)
    counts_WE = tuple(row[:num_experts] for row in counted.counts_WE)
    pairs_WW = tuple(row[num_experts:] for row in counted.counts_WE)
    return Grouped(routing.counts_E, counts_WE, counted.rank), pairs_WW


def dropless(tokens_TD: torch.Tensor, routing: Routing, experts: Experts, placement: ExpertPlacement,
             out_dtype: torch.dtype, fused: bool, pairs: Pairs, layout: Grouped, pairs_WW: tuple) -> torch.Tensor:
    """The dropless layer's dispatch, exchange and combine with each token sent to a rank once
    (module docstring): all-to-allv of exactly the pairs, by the host counts of `gather_layout`
    (the call's one read of the device)."""
    W, El = placement.ep_size, placement.num_local
    group, device = placement.group, tokens_TD.device
    me = layout.rank
    send_pairs, recv_pairs = list(pairs_WW[me]), [row[me] for row in pairs_WW]
    with stage("dispatch"):
        send_rows = pairs.send_rows(device_tensor([sum(send_pairs[:r]) for r in range(W)], device), sum(send_pairs))
        sent_PD = gather_slots(tokens_TD, send_rows, fused)
        # records by expert (grouped by rank, then local expert); this rank's pairs for rank r
        # follow those of the ranks before it there
        start_W = device_tensor([sum(row[r] for row in pairs_WW[:me]) for r in range(W)], device)
        record_S = pairs.records(start_W).index_select(0, routing.order_S)
        gate_S = routing.gates_S.index_select(0, routing.order_S)
    send_slots = [sum(layout.mine[r * El:(r + 1) * El]) for r in range(W)]
    received = [list(row[me * El:(me + 1) * El]) for row in layout.counts_WE]  # [source][local expert]
    recv_slots = [sum(r) for r in received]
    with stage("exchange"):
        with stage("all_to_all"):
            received_PD = all_to_all(sent_PD, group, recv_pairs, send_pairs)
            # the bound of every rank's records (the most pairs a rank receives, times K): the
            # same choice of one exchange or two on every rank
            bound = max(sum(row[r] for row in pairs_WW) for r in range(W)) * pairs.K
            record_R, gate_R = exchange_records(record_S, gate_S, group, bound, recv_slots, send_slots)
        # records arrive [source][local expert]; the experts take them grouped by local expert
        recv_counts = device_tensor([n for row in received for n in row], device)
        by_expert, per_expert = by_local_expert(recv_counts, received, sum(recv_slots))
        partial_PD = experts_on_pairs(received_PD, record_R.index_select(0, by_expert),
                                      gate_R.index_select(0, by_expert), sum(recv_pairs), pairs.K,
                                      lambda rows_RD: experts.forward_grouped(rows_RD, per_expert), fused)
        with stage("all_to_all"):
            back_PD = all_to_all(partial_PD, group, send_pairs, recv_pairs)
    with stage("combine"):
        return combine_ranks(back_PD, send_rows, out_dtype, fused)


def dropless_fixed(tokens_TD: torch.Tensor, routing: Routing, experts: Experts, placement: ExpertPlacement,
                   top_k: int, out_dtype: torch.dtype, fused: bool, degree: int = 1,
                   own_apart: bool = False) -> torch.Tensor:
    """The dropless layer with each token sent to a rank once in exchanges of a fixed size
    (`a2a_algo="dedup-fixed"`), with nothing read on the host, so a CUDA graph captures it (the
    layout of DeepEP's low-latency kernels: buffers sized for the most a rank can receive):

    - a token needs a rank at most once, so each source sends each rank a block of T rows (its
      pairs for that rank first, zeros after) and T * K records (each kept slot's local expert,
      its position there and its gate at `pair * K + j`, -1 after): the all-to-alls have equal
      splits, known without counts;
    - the experts' rank sorts the W * T * K received records on the device by local expert, then
      source, then position (the plain layer's order of rows; padding last), gathers their rows
      into a buffer of W * T * K rows and computes them by grouped GEMM with the groups' ends on
      the device (`Experts.forward_offsets`: the padding rows are not computed), then sums each
      pair's outputs with their gates as `dropless` does;
    - the pair sums return by the same fixed exchange and each token sums its ranks' rows.

    Same function as `dropless` (same routing, nothing dropped, the same sums in the same order).
    Bytes: W * T rows each way instead of the exact pairs (more than `dropless`'s dedup, fewer than
    the linear exchange's k * T where W < k); the expert buffer holds W * T * K rows, of which
    about k * T are used.

    `degree` > 1 (`overlap_degree`): Tutel's pipelining (Tutel 3.2) over these exchanges. The
    tokens are cut into `degree` contiguous chunks, each exchanged as above in blocks of its own
    size; every chunk's rows are launched first, then each chunk's experts run as soon as its rows
    are in while the later chunks' rows travel, and its sums go back while the next chunk
    computes (`weft.comm.split`: backward mirrors it). The chunks' expert calls share one weight
    gradient per weight (`GroupedWeightGradParts`), computed under the last gradient exchanges,
    and their matmuls leave `OVERLAP_SM_MARGIN` SMs to the exchanges. Same function as degree 1 (the weight
    gradients sum each expert's rows chunk by chunk: the same terms in another order).

    `own_apart` (`a2a_algo="dedup-fixed-own"`): a rank's own pairs stay out of the exchanges and
    are computed under the return of the others' sums, the others' pipelined at `degree`
    (`_dropless_fixed_own_apart`)."""
    W, El = placement.ep_size, placement.num_local
    T = tokens_TD.shape[0]
    bounds = chunk_bounds(T, degree)
    if own_apart and W > 1:
        return _dropless_fixed_own_apart(tokens_TD, routing, experts, placement, top_k, out_dtype, fused, bounds)
    if len(bounds) > 1:
        return _dropless_fixed_pipelined(tokens_TD, routing, experts, placement, top_k, out_dtype, fused, bounds)
    group = placement.group
    with stage("dispatch"):
        chunk = _FixedChunk.of(tokens_TD, routing, 0, T, top_k, El, W, fused)
    with stage("exchange"):
        with stage("all_to_all"):
            received_PD = all_to_all(chunk.sent_PD, group)  # source s's pairs from row s * T
            code_R, gate_R = exchange_records(chunk.code_R, chunk.gate_R, group, El * T)
        order = RecordOrder.of(code_R, W, T, chunk.K, T, El)
        partial_PD = fixed_experts(received_PD, order, gate_R, experts.forward_offsets, fused)
        with stage("all_to_all"):
            back_PD = all_to_all(partial_PD, group)
    with stage("combine"):
        return combine_ranks(back_PD, chunk.send_rows, out_dtype, fused)


@dataclass(frozen=True)
class _FixedChunk:
    """Tokens [start, end) of a fixed-size dropless exchange (`dropless_fixed`) on the sending
    rank: each rank's block of `tokens` rows, its pairs first (`sent_PD`, `send_rows`), and the
    slots' records and gates at `pair * K + j` of that rank's block (`code_R`: `expert * T +
    position`, T the call's tokens, so records of every chunk sort like the plain layer's rows)."""

    tokens: int
    K: int
    send_rows: SlotRows
    sent_PD: torch.Tensor
    code_R: torch.Tensor
    gate_R: torch.Tensor

    @classmethod
    def of(cls, tokens_TD: torch.Tensor, routing: Routing, start: int, end: int, top_k: int, El: int, W: int,
           fused: bool, own_last: int | None = None) -> _FixedChunk:
        """`own_last`: this rank's group rank, whose block then comes after the others' (which
        keep rank order); else every block in rank order."""
        T, n = tokens_TD.shape[0], end - start
        slots = slice(start * top_k, end * top_k)
        kept_S = routing.kept_S[slots] if routing.kept_S is not None else None
        pairs = Pairs.of_slots(routing.experts_S[slots], kept_S, n, top_k, El, W)
        block_W = torch.arange(W, device=tokens_TD.device)
        if own_last is not None:
            block_W = torch.where(block_W == own_last, W - 1, block_W - (block_W > own_last).long())
        start_W = n * block_W  # rank r's block of n rows (and n * K records)
        send_rows = pairs.send_rows(start_W, W * n)
        sent_PD = gather_slots(tokens_TD[start:end], send_rows, fused)
        # each kept slot's record at pair * K + j of its rank's block: its local expert and its
        # position there (below T: a token takes an expert once), `expert * T + position`
        at_S = pairs.records(start_W)
        size = W * n * pairs.K
        code_R = scatter_slots((routing.experts_S[slots] % El) * T + routing.positions_S[slots], at_S, size, fill=-1)
        gate_R = scatter_slots(routing.gates_S[slots], at_S, size)
        return cls(n, pairs.K, send_rows, sent_PD, code_R, gate_R)


@dataclass(frozen=True)
class RecordOrder:
    """How the experts' rank of a fixed-size exchange takes the records it received (a
    `_FixedChunk` of n tokens from each of `sources` ranks, n * K records each; `code_R`:
    `expert * T + position`, -1 unused): by local expert, then source, then position, the plain
    layer's order of rows (the same rounding in the weight gradients' sums), the padding last.
    It depends on the records alone, not on the rows, so it is computed while the rows travel
    (a sort: 0.24 ms of phi35's dropless step on 2 x H200, where it ran after the rows' wait)."""

    order_R: torch.Tensor  # the records in the experts' order
    slot_R: torch.Tensor  # per expert row, its record (-1: padding)
    expert_rows: SlotRows  # slot_map(slot_R, units, K)
    offs_E: torch.Tensor  # int32 ends of the local experts' row groups
    units: int  # sources * n: the received pair rows
    K: int

    @classmethod
    def of(cls, code_R: torch.Tensor, sources: int, n: int, K: int, T: int, El: int) -> RecordOrder:
        size = sources * n * K
        # record i (source i // (n * K)) is slot i of the received rows (pair i // K)
        expert_R = torch.where(code_R >= 0, code_R // T, El)
        source_R = torch.arange(size, device=code_R.device) // (n * K)
        order_R = torch.argsort((expert_R * sources + source_R) * T + code_R % T, stable=True)
        counts_E = torch.zeros(El + 1, dtype=torch.long, device=code_R.device).scatter_add_(0, expert_R,
                                                                                          torch.ones_like(expert_R))
        offs_E = torch.cumsum(counts_E[:El], 0).to(torch.int32)
        slot_R = torch.where(expert_R.index_select(0, order_R) < El, order_R, -1)
        return cls(order_R, slot_R, slot_map(slot_R, sources * n, K), offs_E, sources * n, K)


def fixed_experts(received_PD: torch.Tensor, order: RecordOrder, gate_R: torch.Tensor,
                  compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], fused: bool) -> torch.Tensor:
    """On the experts' rank of a fixed-size exchange: `order.units` received pair rows
    (`received_PD`, source s's block from row s * n) and their records' gates (`gate_R`, in the
    order they arrived) -> each pair's gate-weighted sum of its experts' outputs, by
    `compute(rows, ends)` on the rows grouped by local expert (`order`)."""
    return experts_on_pairs(received_PD, order.slot_R, gate_R.index_select(0, order.order_R), order.units, order.K,
                            lambda rows_RD: compute(rows_RD, order.offs_E), fused, order.expert_rows)


def _dropless_fixed_pipelined(tokens_TD: torch.Tensor, routing: Routing, experts: Experts,
                              placement: ExpertPlacement, top_k: int, out_dtype: torch.dtype, fused: bool,
                              bounds: list[tuple[int, int]]) -> torch.Tensor:
    """`dropless_fixed` at degree len(bounds): the chunks' exchanges pipelined with their experts."""
    W, El = placement.ep_size, placement.num_local
    T = tokens_TD.shape[0]
    group = placement.group
    parts = GroupedWeightGradParts(experts, len(bounds), experts.compute_dtype(tokens_TD), OVERLAP_SM_MARGIN, fused)
    with stage("dispatch"):
        chunks = [_FixedChunk.of(tokens_TD, routing, a, b, top_k, El, W, fused) for a, b in bounds]
    with stage("exchange"):
        with stage("all_to_all"):
            records = [exchange_records(c.code_R, c.gate_R, group, El * T) for c in chunks]  # small; first
            flying = [start_all_to_all(c.sent_PD, group) for c in chunks]
        orders = [RecordOrder.of(code_R, W, c.tokens, c.K, T, El) for c, (code_R, _) in zip(chunks, records)]
        # created after the launches: its backward (every weight's gradient) runs after the
        # launch of the first chunk's rows' gradient, under it (`GroupedWeightGradParts`)
        weights = parts.tapped()

        def compute(rows_RD: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
            return experts.forward_offsets_part(rows_RD, offs_E, parts, weights, PartCall(OVERLAP_SM_MARGIN))

        returning = []
        for order, (_, gate_R), (received_PD, pending) in zip(orders, records, flying):
            with stage("all_to_all"):
                received_PD = wait_all_to_all(received_PD, pending)
            partial_PD = fixed_experts(received_PD, order, gate_R, compute, fused)
            with stage("all_to_all"):
                returning.append(start_all_to_all(partial_PD, group))
        with stage("all_to_all"):
            backs = [wait_all_to_all(back_PD, pending) for back_PD, pending in returning]
    with stage("combine"):
        return torch.cat([combine_ranks(back_PD, c.send_rows, out_dtype, fused) for c, back_PD in zip(chunks, backs)])


def _dropless_fixed_own_apart(tokens_TD: torch.Tensor, routing: Routing, experts: Experts,
                              placement: ExpertPlacement, top_k: int, out_dtype: torch.dtype, fused: bool,
                              bounds: list[tuple[int, int]]) -> torch.Tensor:
    """`dropless_fixed` with the rank's own pairs apart (`a2a_algo="dedup-fixed-own"`, W > 1),
    the others' exchanged in len(bounds) chunks of tokens.

    The own pairs never need an exchange (1 / W of the expert work on average: half on 2 ranks),
    so the exchanges carry the others' blocks only (static splits, 0 for the rank itself: nothing
    read on the host) and the own pairs fill the time of exchanges each way:

    - forward: launch every chunk's rows to the others; per chunk, wait for its rows, run their
      experts and launch their sums back (Tutel's pipelining at degree > 1: a chunk's experts
      under the next chunk's rows); then the own pairs of every chunk, in one call, while the
      sums travel; wait, combine;
    - backward (autograd runs ready nodes latest-created first): launch every returned gradient,
      the own pairs' backward under them (input gradient and, `PartCall.weight_grad_now`, their
      share of each weight's gradient); per chunk, last first, wait, the others' input gradient,
      launch their rows' gradient; then the others' share of each weight's gradient (the tap,
      `GroupedWeightGradParts`, created after the rows' launches in forward) under the last
      exchanges, and the add of the own share; wait.

    The matmuls beside an exchange leave `OVERLAP_SM_MARGIN` SMs to it: the own pairs', the
    tap's, and, with several chunks, the others'. Exposed at one chunk: the rows' exchange
    forward and what the own pairs' work does not cover of one exchange each way. It costs one
    weight-sized add per weight, and the own pairs as a second grouped GEMM per weight. Same
    function as degree 1: the same rows, records and rank-order sums (`_FixedChunk` places each
    chunk's own block last); each weight's gradient is the sum of two products (own rows, others'
    rows) instead of one."""
    W, El = placement.ep_size, placement.num_local
    T = tokens_TD.shape[0]
    group = placement.group
    me = group_rank(group)
    parts = GroupedWeightGradParts(experts, len(bounds) + 1, experts.compute_dtype(tokens_TD), OVERLAP_SM_MARGIN,
                                   fused)
    others_call = PartCall(OVERLAP_SM_MARGIN if len(bounds) > 1 else 0)  # alone at one chunk
    with stage("dispatch"):
        chunks = [_FixedChunk.of(tokens_TD, routing, a, b, top_k, El, W, fused, own_last=me) for a, b in bounds]
    K = chunks[0].K
    # each chunk's exchanges carry the others' blocks: a prefix of its buffers, the own block after
    rows_of = [[0 if r == me else c.tokens for r in range(W)] for c in chunks]
    cuts = [(W - 1) * c.tokens for c in chunks]
    with stage("exchange"):
        with stage("all_to_all"):
            records = [exchange_records(c.code_R[:cut * K], c.gate_R[:cut * K], group, El * T,
                                        [n * K for n in rows_W], [n * K for n in rows_W])
                       for c, cut, rows_W in zip(chunks, cuts, rows_of)]  # small; first
            flying = [start_all_to_all(c.sent_PD[:cut], group, rows_W, rows_W)
                      for c, cut, rows_W in zip(chunks, cuts, rows_of)]
        # the records' orders (sorts) while the rows travel: the others' chunks', then the own block's
        # (every chunk's, one call: chunk [a, b)'s n = b - a pair rows at a, records at a * K)
        orders = [RecordOrder.of(code_R, W - 1, c.tokens, K, T, El) for c, (code_R, _) in zip(chunks, records)]
        own_order = RecordOrder.of(_joined([c.code_R[cut * K:] for c, cut in zip(chunks, cuts)]), 1, T, K, T, El)
        # created after the rows' launches and before their waits: its backward runs after the
        # launch of the rows' gradients and before their waits
        weights = parts.tapped()

        def compute(call: PartCall) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
            return lambda rows_RD, offs_E: experts.forward_offsets_part(rows_RD, offs_E, parts, weights, call)

        returning = []
        for order, (_, gate_R), (received_PD, pending), rows_W in zip(orders, records, flying, rows_of):
            with stage("all_to_all"):
                received_PD = wait_all_to_all(received_PD, pending)
            partial_PD = fixed_experts(received_PD, order, gate_R, compute(others_call), fused)
            with stage("all_to_all"):
                returning.append(start_all_to_all(partial_PD, group, rows_W, rows_W))
        # every chunk's own block, one call
        own_PD = fixed_experts(_joined([c.sent_PD[cut:] for c, cut in zip(chunks, cuts)]), own_order,
                               _joined([c.gate_R[cut * K:] for c, cut in zip(chunks, cuts)]),
                               compute(PartCall(OVERLAP_SM_MARGIN, weight_grad_now=True)), fused)
        with stage("all_to_all"):
            backs = [wait_all_to_all(back_PD, pending) for back_PD, pending in returning]
    with stage("combine"):
        return _joined([combine_ranks(torch.cat([back_PD, own_PD[a:b]]), c.send_rows, out_dtype, fused)
                        for c, back_PD, (a, b) in zip(chunks, backs, bounds)])


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors concatenated along dim 0 (one: itself, no copy)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)
