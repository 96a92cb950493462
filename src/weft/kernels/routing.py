"""Token-choice routing's discrete part as two Triton kernels, beside its PyTorch reference.

`topk_positions(scores_TE, k)` gives, for each token t, its k experts `experts[t, j]` (the k
largest scores, descending, ties to the lower expert id: a stable descending sort's first k) and
each slot's position in its expert under the GShard/Tutel priority rule in token order: slot
(t, j) is preceded by every slot (t', j') with j' < j, or j' == j and t' < t; its position is how
many of those went to the same expert (docs/moe.md, "Slot priority"); with a priority order
(batch-prioritized routing) the tokens are ranked by it instead of by id. Also the slots routed
to each expert (E,). The layer's PyTorch path (a sort per token, then a sort or a running count over
the slots: ~80 small kernels for a forward) computes the same integers.

- `_topk_histogram_kernel`, one program per block of BLOCK_T tokens: the k experts of each token
  by k rounds of argmax (leftmost on ties) with the chosen expert masked out after each, and the
  block's histogram of choices per round j: H[j, block, e].
- an exclusive cumulative sum of H over (j, block) per expert (torch): where each (j, block)
  starts counting in each expert;
- `_positions_kernel`, one program per block: within-block ranks by a cumulative sum of the
  one-hot choices down the block, plus that start.

The scores are not differentiable here: the gates are gathered from the probabilities outside
(`weft.moe.gates`). Integers only, every output written once: deterministic. The kernels run on
CUDA tensors, and on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1), which is how
the CPU suite tests them.
"""
from __future__ import annotations

import torch

from weft.kernels.scan import cumsum_down

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch reference remains
    triton = None

MAX_EXPERTS = 1024  # one program holds a (BLOCK_T, next_pow2(E)) tile; wider routers use the reference


def topk_positions_reference(scores_TE: torch.Tensor, k: int, order_T: torch.Tensor | None = None,
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(experts (T, k) int64, positions (T, k) int64, counts (E,) int64) by the rule written out:
    a stable descending sort per token, then running counts over the slots in priority order
    (j-major, then the tokens in `order_T`, default token order)."""
    num_tokens, num_experts = scores_TE.shape
    experts_TK = torch.sort(scores_TE, dim=-1, descending=True, stable=True).indices[:, :k]
    order = torch.arange(num_tokens, device=scores_TE.device) if order_T is None else order_T
    ranked = experts_TK[order].t().reshape(-1)  # priority order: j-major, then the tokens' rank
    one_hot = torch.nn.functional.one_hot(ranked, num_experts)
    seen = one_hot.cumsum(0)  # row i: slots of each expert up to and including slot i
    positions = seen.gather(1, ranked.unsqueeze(1)).squeeze(1) - 1
    counts_E = seen[-1] if ranked.numel() else ranked.new_zeros(num_experts)
    positions_TK = torch.empty_like(experts_TK)
    positions_TK[order] = positions.view(k, num_tokens).t()
    return experts_TK, positions_TK, counts_E


def topk_positions(scores_TE: torch.Tensor, k: int, order_T: torch.Tensor | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton kernels' (experts, positions, counts), equal to `topk_positions_reference`.
    `order_T`: the tokens' priority rank for the positions (batch-prioritized routing: the token
    ids, most important first), None = token order. Falls back to the reference for more than
    MAX_EXPERTS experts or an empty batch."""
    num_tokens, num_experts = scores_TE.shape
    if not 1 <= k <= num_experts:
        raise ValueError(f"k must be in [1, {num_experts}], got {k}")
    if order_T is not None:  # route the tokens in priority order, then put the rows back
        experts_ranked, positions_ranked, counts_E = topk_positions(scores_TE[order_T], k)
        experts_TK, positions_TK = torch.empty_like(experts_ranked), torch.empty_like(positions_ranked)
        experts_TK[order_T], positions_TK[order_T] = experts_ranked, positions_ranked
        return experts_TK, positions_TK, counts_E
    if num_tokens == 0 or num_experts > MAX_EXPERTS:
        return topk_positions_reference(scores_TE, k)
    scores_TE = scores_TE.float().contiguous()
    block_e = triton.next_power_of_2(num_experts)
    block_t = max(16, min(128, 8192 // block_e))
    num_blocks = triton.cdiv(num_tokens, block_t)
    device = scores_TE.device
    experts_TK = torch.empty(num_tokens, k, dtype=torch.long, device=device)
    hist = torch.empty(k * num_blocks, num_experts, dtype=torch.int32, device=device)
    _topk_histogram_kernel[(num_blocks,)](scores_TE, experts_TK, hist, num_tokens, num_experts, num_blocks,
                                          K=k, BLOCK_T=block_t, BLOCK_E=block_e)
    seen = cumsum_down(hist, torch.int32)  # inclusive over (j, block), per expert
    starts = seen - hist
    positions_TK = torch.empty_like(experts_TK)
    _positions_kernel[(num_blocks,)](experts_TK, starts, positions_TK, num_tokens, num_experts, num_blocks,
                                     K=k, BLOCK_T=block_t, BLOCK_E=block_e)
    return experts_TK, positions_TK, seen[-1].long()


def expert_order(experts_TK: torch.Tensor, positions_TK: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """(T*k,) slot ids t*k + j in (expert, position) order: slot t*k + j goes to row
    start(expert) + position, start(e) the slots of the experts before e."""
    starts = counts_E.cumsum(0) - counts_E
    sort_index = torch.empty(experts_TK.numel(), dtype=torch.long, device=experts_TK.device)
    sort_index[(starts[experts_TK] + positions_TK).reshape(-1)] = torch.arange(experts_TK.numel(),
                                                                              device=experts_TK.device)
    return sort_index


if triton is not None:

    @triton.jit
    def _tile(T, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
        """This program's block id, its token rows (int64), the expert columns, and which rows exist."""
        block = tl.program_id(0)
        rows = (block * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        return block, rows, tl.arange(0, BLOCK_E), rows < T

    @triton.jit
    def _topk_histogram_kernel(scores, experts, hist, T, E, num_blocks,
                               K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
        block, rows, cols, row_ok = _tile(T, BLOCK_T, BLOCK_E)
        col_ok = cols < E
        s = tl.load(scores + rows[:, None] * E + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                    other=float("-inf"))
        for j in tl.static_range(K):
            chosen = tl.argmax(s, axis=1, tie_break_left=True)
            tl.store(experts + rows * K + j, chosen.to(tl.int64), mask=row_ok)
            hit = (cols[None, :] == chosen[:, None]) & row_ok[:, None]
            tl.store(hist + (j * num_blocks + block) * E + cols, tl.sum(hit.to(tl.int32), axis=0), mask=col_ok)
            s = tl.where(hit, float("-inf"), s)

    @triton.jit
    def _positions_kernel(experts, starts, positions, T, E, num_blocks,
                          K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
        block, rows, cols, row_ok = _tile(T, BLOCK_T, BLOCK_E)
        for j in tl.static_range(K):
            chosen = tl.load(experts + rows * K + j, mask=row_ok, other=-1)
            hit = cols[None, :] == chosen[:, None]  # no hit on rows past T
            seen = tl.cumsum(hit.to(tl.int32), axis=0)  # inclusive, down the block
            rank = tl.sum(tl.where(hit, seen, 0), axis=1) - 1
            start = tl.load(starts + (j * num_blocks + block) * E + tl.where(row_ok, chosen, 0), mask=row_ok, other=0)
            tl.store(positions + rows * K + j, (start + rank).to(tl.int64), mask=row_ok)
