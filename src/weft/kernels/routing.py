"""Token-choice routing's discrete part as two Triton kernels, beside its PyTorch reference.

`topk_positions(scores_TE, k)` gives, for each token t, its k experts `experts[t, j]` (the k
largest scores, descending, ties to the lower expert id: a stable descending sort's first k) and
each slot's position in its expert under the GShard/Tutel priority rule in token order: slot
(t, j) is preceded by every slot (t', j') with j' < j, or j' == j and t' < t; its position is how
many of those went to the same expert (docs/moe.md, "Slot priority"); with a priority order
(batch-prioritized routing) the tokens are ranked by it instead of by id. Also the slots routed
to each expert (E,). The layer's PyTorch path (a sort per token, then a sort or a running count over
the slots: ~80 small kernels for a forward) computes the same integers.

- `choose_kernel`, one program per block of BLOCK_T tokens: the k experts of each token by k
  rounds of argmax (leftmost on ties) with the chosen expert masked out after each, and the
  block's histogram of choices per round j: H[j, block, e];
- an inclusive cumulative sum of H over (j, block) per expert (torch): less H, where each
  (j, block) starts counting in each expert;
- `slots_kernel`, one program per block: within-block ranks by a cumulative sum of the one-hot
  choices down the block, plus that start.

The same two kernels, with their `ONE_PASS` / `LAYOUT` switches, are `weft.kernels.token_choice`'s
one-pass routing (gates, losses, capacity drops and the layouts' row maps on the way). Here the
scores are not differentiable: the gates are gathered from the probabilities outside
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
TILE_ELEMENTS = 2048  # a program's (tokens x experts) tile at most (`tiles`)
# `slots_kernel`'s outputs beside the positions: none, the padded layout's (capacity drops, row
# maps, masked gates), or the dropless layout's expert order
POSITIONS, PADDED, DROPLESS = 0, 1, 2


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
    meta = tiles(num_tokens, num_experts, k)
    num_blocks = triton.cdiv(num_tokens, meta["BLOCK_T"])
    device = scores_TE.device
    experts_TK = torch.empty(num_tokens, k, dtype=torch.long, device=device)
    hist = torch.empty(k * num_blocks, num_experts, dtype=torch.int32, device=device)
    unused = scores_TE  # the pointers of outputs this call does not make; never read or written
    choose_kernel[(num_blocks,)](unused, scores_TE, unused, experts_TK, unused, unused, hist, unused, unused,
                                  num_tokens, num_experts, num_blocks, HAS_BIAS=False, NORMALIZE=False,
                                  ONE_PASS=False, **meta)
    seen = cumsum_down(hist, torch.int32)  # inclusive over (j, block), per expert
    positions_TK = torch.empty_like(experts_TK)
    slots_kernel[(num_blocks,)](experts_TK, seen, hist, unused, positions_TK, unused, unused, unused, unused, unused,
                                 num_tokens, num_experts, num_blocks, 0, LAYOUT=POSITIONS, **meta)
    return experts_TK, positions_TK, seen[-1].long()


def tiles(num_tokens: int, num_experts: int, k: int) -> dict:
    """The programs' tiles: BLOCK_T tokens by BLOCK_E (E rounded up to a power of two) experts,
    TILE_ELEMENTS at most (16 tokens at least), so that a 4096-token batch makes 128 programs for
    64 experts and 64 for 8."""
    block_e = triton.next_power_of_2(num_experts)
    return dict(K=k, KP=triton.next_power_of_2(k), BLOCK_T=max(16, min(64, TILE_ELEMENTS // block_e)),
                BLOCK_E=block_e)


def expert_order(experts_TK: torch.Tensor, positions_TK: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """(T*k,) slot ids t*k + j in (expert, position) order: slot t*k + j goes to row
    start(expert) + position, start(e) the slots of the experts before e."""
    starts = counts_E.cumsum(0) - counts_E
    sort_index = torch.empty(experts_TK.numel(), dtype=torch.long, device=experts_TK.device)
    sort_index[(starts[experts_TK] + positions_TK).reshape(-1)] = torch.arange(experts_TK.numel(),
                                                                              device=experts_TK.device)
    return sort_index


if triton is not None:
    _PADDED, _DROPLESS = tl.constexpr(PADDED), tl.constexpr(DROPLESS)  # as the kernels read them

    @triton.jit
    def token_block(T, E, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
        """This program's block id, its token rows (int64), the expert columns and their masks."""
        block = tl.program_id(0)
        rows = (block * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        cols = tl.arange(0, BLOCK_E)
        return block, rows, cols, rows < T, cols < E

    @triton.jit
    def column_of(tile, kcols, j):
        """Column j of a (BLOCK_T, KP) tile."""
        return tl.sum(tl.where(kcols[None, :] == j, tile, 0), axis=1)

    @triton.jit
    def choose_kernel(logits, probs, bias, experts, gates, lse_out, hist, psum, zsum, T, E, num_blocks,
                       HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr, ONE_PASS: tl.constexpr, K: tl.constexpr,
                       KP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
        """Each token's k experts by the scores `probs` (+ `bias`) and the block's histogram of
        choices per round; `ONE_PASS` (weft.kernels.token_choice): `probs` are the probabilities of
        `logits`, and the gates (p at the experts, renormalised over the k when NORMALIZE) and the
        block's partial sums of both losses are made too (logits, bias, gates, lse_out, psum and
        zsum are not touched otherwise)."""
        block, rows, cols, row_ok, col_ok = token_block(T, E, BLOCK_T, BLOCK_E)
        ok = row_ok[:, None] & col_ok[None, :]
        offsets = rows[:, None] * E + cols[None, :]
        p = tl.load(probs + offsets, mask=ok, other=0.0)
        if ONE_PASS:
            logit = tl.load(logits + offsets, mask=ok, other=float("-inf"))
            top = tl.where(row_ok, tl.max(logit, axis=1), 0.0)
            lse = top + tl.log(tl.where(row_ok, tl.sum(tl.exp(logit - top[:, None]), axis=1), 1.0))
            tl.store(lse_out + rows, lse, mask=row_ok)
            tl.store(zsum + block, tl.sum(tl.where(row_ok, lse * lse, 0.0), axis=0))
            tl.store(psum + block * E + cols, tl.sum(p, axis=0), mask=col_ok)
        scores = p
        if HAS_BIAS:
            scores = p + tl.load(bias + cols, mask=col_ok, other=0.0)[None, :]
        scores = tl.where(ok, scores, float("-inf"))
        kcols = tl.arange(0, KP)
        chosen_TK = tl.zeros((BLOCK_T, KP), dtype=tl.int64)
        gates_TK = tl.zeros((BLOCK_T, KP), dtype=tl.float32)
        for j in tl.static_range(K):
            chosen = tl.argmax(scores, axis=1, tie_break_left=True)
            hit = (cols[None, :] == chosen[:, None]) & row_ok[:, None]
            tl.store(hist + (j * num_blocks + block) * E + cols, tl.sum(hit.to(tl.int32), axis=0), mask=col_ok)
            chosen_TK = tl.where(kcols[None, :] == j, chosen[:, None].to(tl.int64), chosen_TK)
            if ONE_PASS:
                gate = tl.sum(tl.where(hit, p, 0.0), axis=1)
                gates_TK = tl.where(kcols[None, :] == j, gate[:, None], gates_TK)
            scores = tl.where(hit, float("-inf"), scores)
        out = rows[:, None] * K + kcols[None, :]
        out_ok = row_ok[:, None] & (kcols[None, :] < K)
        tl.store(experts + out, chosen_TK, mask=out_ok)
        if ONE_PASS:
            if NORMALIZE:  # correctly rounded, as torch divides (Triton's `/` on CUDA is not)
                total = tl.broadcast_to(tl.where(row_ok, tl.sum(gates_TK, axis=1), 1.0)[:, None], (BLOCK_T, KP))
                gates_TK = tl.math.div_rn(gates_TK, total)
            tl.store(gates + out, gates_TK, mask=out_ok)

    @triton.jit
    def slots_kernel(experts, seen, hist, gates, positions, kept, rows_out, slot_of_row, gates_kept, order, T, E,
                      num_blocks, cap, LAYOUT: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
        """Each slot's position in its expert: where its (round, block) starts counting (`seen`,
        the inclusive cumulative sum of `hist` over (round, block), less `hist`) plus its rank
        down the block. LAYOUT PADDED: with capacity `cap`, whether it is kept, its row (expert *
        cap + position, -1 dropped), the slot each row holds and the gate with the drop applied;
        DROPLESS: the slots in (expert, position) order (`expert_order`); POSITIONS: nothing more
        (the pointers of the other outputs are not touched)."""
        block, rows, cols, row_ok, col_ok = token_block(T, E, BLOCK_T, BLOCK_E)
        if LAYOUT == _DROPLESS:  # where each expert's slots start in (expert, position) order
            total = tl.load(seen + (K * num_blocks - 1) * E + cols, mask=col_ok, other=0)
            expert_start = (tl.cumsum(total, axis=0) - total).to(tl.int64)
        for j in tl.static_range(K):
            slot = rows * K + j
            chosen = tl.load(experts + slot, mask=row_ok, other=-1)
            hit = cols[None, :] == chosen[:, None]  # no hit on rows past T
            running = tl.cumsum(hit.to(tl.int32), axis=0)  # inclusive, down the block
            rank = tl.sum(tl.where(hit, running, 0), axis=1) - 1
            at = (j * num_blocks + block) * E + tl.where(row_ok, chosen, 0)  # where (j, block) starts counting
            start = tl.load(seen + at, mask=row_ok, other=0) - tl.load(hist + at, mask=row_ok, other=0)
            position = (start + rank).to(tl.int64)
            tl.store(positions + slot, position, mask=row_ok)
            if LAYOUT == _PADDED:
                keep = position < cap
                row = tl.where(keep, chosen * cap + position, -1)
                tl.store(kept + slot, keep.to(tl.uint8), mask=row_ok)
                tl.store(rows_out + slot, row, mask=row_ok)
                tl.store(slot_of_row + tl.where(keep, row, 0), slot, mask=row_ok & keep)
                gate = tl.load(gates + slot, mask=row_ok, other=0.0)
                tl.store(gates_kept + slot, tl.where(keep, gate, 0.0), mask=row_ok)
            if LAYOUT == _DROPLESS:
                start_of_expert = tl.sum(tl.where(hit, expert_start[None, :], 0), axis=1)
                tl.store(order + start_of_expert + position, slot, mask=row_ok)
else:  # CPU-only installs: no kernels (the names `weft.kernels.token_choice` imports)
    token_block = column_of = choose_kernel = slots_kernel = None
