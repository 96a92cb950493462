"""Expert capacity and slot positions (GShard/Tutel priority rule).

Slots are ranked by j (the token's j-th choice) first, then by token order (or by descending
importance for batch-prioritized routing). A slot's position in its expert is the number of
higher-ranked slots routed to the same expert; it is kept iff position < C.
Top-1 in token order (Switch), with T*E up to `COUNTING_LIMIT`: positions are running counts (a
cumulative sum over an (E, T) one-hot in int32, scanned along its contiguous dimension: no
sort, and within the layer's O(T*E) memory bound). Otherwise one stable sort, O(T*k log(T*k)),
no (T, E) tensor. Both give the same positions, counts and order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from weft.distributed import group_size
from weft.kernels.routing import expert_order

COUNTING_LIMIT = 1 << 24  # T * E elements of int32 (64 MiB) at most for the counting path


@dataclass
class SlotPositions:
    positions: torch.Tensor  # (T, k) position of each slot in its expert
    counts: torch.Tensor  # (E,) slots routed to each expert before dropping
    sort_index: torch.Tensor | None  # (T*k,) slot ids (t*k + j) in (expert, position) order, if asked for


def slot_positions(experts: torch.Tensor, num_experts: int, order: torch.Tensor | None = None,
                   with_sort_index: bool = True) -> SlotPositions:
    """Positions of the (T, k) routed slots under the priority rule (`order`: the tokens' rank,
    None = token order); `with_sort_index=False` may leave `sort_index` None."""
    if order is None and experts.shape[1] == 1 and experts.numel() * num_experts <= COUNTING_LIMIT:
        return _counted_positions(experts, num_experts, with_sort_index)
    num_tokens, k = experts.shape
    token_rank = torch.arange(num_tokens, device=experts.device) if order is None else order
    # Slot ids in priority order: for j = 0..k-1, tokens in `token_rank` order.
    slot_ids = (token_rank.unsqueeze(0) * k + torch.arange(k, device=experts.device).unsqueeze(1)).reshape(-1)
    ranked_experts = experts.reshape(-1)[slot_ids]
    sorted_experts, perm = torch.sort(ranked_experts, stable=True)
    # Counts from the sorted ids (bincount would read max/min back to the host on GPUs).
    bounds = torch.searchsorted(sorted_experts, torch.arange(num_experts + 1, device=experts.device))
    counts = bounds.diff()
    starts = torch.cumsum(counts, 0) - counts
    sorted_pos = torch.arange(slot_ids.numel(), device=experts.device) - starts[sorted_experts]
    sort_index = slot_ids[perm]
    positions = torch.empty_like(sorted_pos)
    positions[sort_index] = sorted_pos
    return SlotPositions(positions.view(num_tokens, k), counts, sort_index)


def _counted_positions(experts: torch.Tensor, num_experts: int, with_sort_index: bool) -> SlotPositions:
    """Token-order positions as running counts: slot (t, j)'s position is how many slots before it
    in priority order (j-major, then t) went to its expert."""
    num_tokens, k = experts.shape
    ranked = experts.t().reshape(-1)  # priority order
    # (E, T*k): the scan runs along the contiguous dimension (along dim 0 it took 3 ms for qwen2's
    # routing on an H200, against 0.1 ms this way).
    one_hot = torch.zeros(num_experts, ranked.numel(), dtype=torch.int32, device=experts.device)
    one_hot.scatter_(0, ranked.unsqueeze(0), 1)
    seen = one_hot.cumsum(1, dtype=torch.int32)  # column i: slots of each expert up to slot i
    positions = (seen.gather(0, ranked.unsqueeze(0)).view(k, num_tokens).t() - 1).long()
    counts = seen[:, -1].long() if num_tokens else experts.new_zeros(num_experts)
    sort_index = expert_order(experts, positions, counts) if with_sort_index else None
    return SlotPositions(positions, counts, sort_index)


def ceil_exact(value: float) -> int:
    """ceil of a product of decimal settings: round off float noise first, so that
    ceil(1 * 1.1 * 100 / 2) is 55, not 56."""
    return math.ceil(round(value, 9))


def capacity_bound(top_k: int, capacity_factor: float, num_tokens: int, num_experts: int) -> int:
    """The one capacity formula: max(1, ceil(k * |cf| * T / E)) slots per expert per source rank,
    at most T: a token routes to an expert once, so a position is always below T and a larger
    capacity would only size buffers that stay empty (cf = 1e6 on 16 tokens: 8,000,000 rows).
    Every user (the router, Lancet's carried capacity, the profiler, expert choice) calls this."""
    share = top_k * abs(capacity_factor) / num_experts
    if share >= 1:  # ceil(share * T) >= T: no float product to overflow or round
        return max(1, num_tokens)
    return max(1, min(num_tokens, ceil_exact(share * num_tokens)))


def expert_choice_capacity(k: int, capacity_factor: float, num_tokens: int, num_experts: int) -> int:
    """Tokens each expert takes under expert choice: ceil(k * cf * T / E), within [1, T] (0 for an
    empty batch: no expert can take a token)."""
    return min(num_tokens, capacity_bound(k, capacity_factor, num_tokens, num_experts))


def capacity_for(
    capacity_factor: float,
    top_k: int,
    num_tokens: int,
    num_experts: int,
    counts: torch.Tensor,
    group: dist.ProcessGroup | None,
) -> int:
    """Capacity C per expert per source rank for the padded modes (docs/moe.md).

    cf > 0: max(1, ceil(k*cf*T/E)); cf == 0: the smallest C that drops nothing, agreed across
    the EP group; cf < 0: min(that no-drop C, ceil(k*|cf|*T/E)).
    """
    bound = capacity_bound(top_k, capacity_factor, num_tokens, num_experts)
    if capacity_factor > 0:
        return bound
    needed = counts.max().reshape(1).to(torch.int64)
    if group_size(group) > 1:
        dist.all_reduce(needed, op=dist.ReduceOp.MAX, group=group)
    no_drop = max(1, int(needed.item()))
    return no_drop if capacity_factor == 0 else min(no_drop, bound)
