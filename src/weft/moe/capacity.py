"""Expert capacity and slot positions (GShard/Tutel priority rule).

Slots are ranked by j (the token's j-th choice) first, then by token order (or by descending
importance for batch-prioritized routing). A slot's position in its expert is the number of
higher-ranked slots routed to the same expert; it is kept iff position < C.
Computed with one stable sort: O(T*k log(T*k)), no (T, E) or (T, E, C) tensors.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from weft.distributed import group_size
from weft.moe.gates import ceil_exact


@dataclass
class SlotPositions:
    positions: torch.Tensor  # (T, k) position of each slot in its expert
    counts: torch.Tensor  # (E,) slots routed to each expert before dropping
    sort_index: torch.Tensor  # (T*k,) slot ids (t*k + j) in (expert, position) order


def slot_positions(experts: torch.Tensor, num_experts: int, order: torch.Tensor | None = None) -> SlotPositions:
    """Positions of the (T, k) routed slots under the priority rule."""
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


def capacity_for(
    capacity_factor: float,
    top_k: int,
    num_tokens: int,
    num_experts: int,
    counts: torch.Tensor,
    group: dist.ProcessGroup | None,
) -> int:
    """Capacity C per expert per source rank for the padded modes (DESIGN.md).

    cf > 0: max(1, ceil(k*cf*T/E)); cf == 0: the smallest C that drops nothing, agreed across
    the EP group; cf < 0: min(that no-drop C, ceil(k*|cf|*T/E)).
    """
    bound = ceil_exact(top_k * abs(capacity_factor) * num_tokens / num_experts)
    if capacity_factor > 0:
        return max(1, bound)
    needed = counts.max().reshape(1).to(torch.int64)
    if group_size(group) > 1:
        dist.all_reduce(needed, op=dist.ReduceOp.MAX, group=group)
    no_drop = max(1, int(needed.item()))
    return no_drop if capacity_factor == 0 else max(1, min(no_drop, bound))
