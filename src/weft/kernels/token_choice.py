"""Token-choice routing in one pass: gates, slots, capacity drops, slot rows and both router losses
from the router's logits, as three Triton kernels forward and one backward, beside the PyTorch
reference they are tested against (the issue "Hardware speed": routing fused; docs/moe.md, "Data
movement"). The composition of PyTorch ops it replaces, with the padded layout's row maps, made 58
small launches a forward and backward (qwen2's shapes), and on a GPU the host's time to launch
them, not their work, set an eager layer step's pace (docs/benchmarks.md, twenty-sixth session).

`route_topk(logits_TE, k, normalize, capacity, bias_E)`, for the gates that rank experts by
probability (topk, cosine; no sampling offsets, tokens in id order):

- probabilities `p = softmax(logits)` by torch's own kernel, so the experts chosen (and every
  integer below) are those of the PyTorch path, bit for bit;
- `choose_kernel` (`weft.kernels.routing`'s, which ranks any scores the same way; here with
  ONE_PASS), one program per block of BLOCK_T tokens: each token's k experts (k rounds of
  argmax over p + bias, leftmost on ties), their gates (p at the experts, renormalised over the
  k when asked), the block's histogram of choices per round j (H[j, block, e]), and the block's
  partial sums for the losses: sum_t p[t, e] and sum_t logsumexp(logits_t)^2;
- the cumulative sum of H over (j, block) per expert (torch; less H: where each (j, block)
  starts counting);
- `slots_kernel` (`weft.kernels.routing`'s too; LAYOUT PADDED or DROPLESS), one program per
  block: each slot's position in its expert (GShard/Tutel
  priority: round j first, then token order), and with a capacity C whether it is kept (position
  < C), its row in the padded layout (expert * C + position, -1 dropped), which slot each row
  holds (`SlotRows`), and the gate with the drop applied; dropless, the slots in (expert,
  position) order instead (`expert_order`: slot (t, j) at start(expert) + position);
- `_finish_kernel`, one program: the slots per expert, the dropped count (sum_e max(0, n_e - C)),
  the load-balancing loss E * sum_e f_e P_e and the z-loss mean_t logsumexp(logits_t)^2.

The backward (`_backward_kernel`, one program per block) makes the logits' gradient from the
gates', the aux loss's and the z-loss's in one pass: dp from the gates (through the
renormalisation) and the aux loss, then softmax's backward p * (dp - <p, dp>), plus
2 * lse / T * p * dz. Every output element is written by one program, no atomics:
deterministic. Floats agree with the reference to rounding (sums in another order); integers
exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from weft.kernels.routing import (  # the choose and slots kernels are shared with `topk_positions`
    DROPLESS,
    MAX_EXPERTS,
    PADDED,
    choose_kernel,
    column_of,
    expert_order,
    slots_kernel,
    tiles,
    token_block,
    topk_positions_reference,
)
from weft.kernels.scan import cumsum_down

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch reference remains
    triton = None

FINISH_CHUNK = 64  # token blocks the finishing program sums at a time


@dataclass(frozen=True)
class TopkRouting:
    """One batch's token-choice routing. `gates_TK` is differentiable (0 where dropped), and so are
    `aux_loss` (E * sum_e f_e * P_e, f_e the share of slots routed to e before dropping, P_e its mean
    probability) and `z_loss` (mean_t logsumexp(logits_t)^2). With a capacity C: `kept_TK` (bool),
    `rows_TK` (the padded layout's row expert * C + position, -1 where dropped) and
    `slot_of_row_R` (R = E * C: the slot id t * k + j each row holds, -1 for an unused row);
    dropless (C None): those three are None, and `order_S` holds the slot ids t * k + j in
    (expert, position) order (`weft.kernels.routing.expert_order`; None with a capacity)."""

    experts_TK: torch.Tensor  # int64
    positions_TK: torch.Tensor  # int64
    counts_E: torch.Tensor  # int64, slots routed to each expert before dropping
    gates_TK: torch.Tensor
    kept_TK: torch.Tensor | None
    rows_TK: torch.Tensor | None
    slot_of_row_R: torch.Tensor | None
    dropped: torch.Tensor  # int64 scalar
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    order_S: torch.Tensor | None = None


def route_topk_reference(logits_TE: torch.Tensor, k: int, normalize: bool, capacity: int | None,
                         bias_E: torch.Tensor | None = None) -> TopkRouting:
    """The same routing by PyTorch ops, differentiated by autograd: the CPU oracle of `route_topk`."""
    num_tokens, num_experts = logits_TE.shape
    probs_TE = F.softmax(logits_TE, dim=-1)
    scores_TE = probs_TE.detach() if bias_E is None else probs_TE.detach() + bias_E
    experts_TK, positions_TK, counts_E = topk_positions_reference(scores_TE, k)
    gates_TK = probs_TE.gather(1, experts_TK)
    if normalize and k > 1:
        gates_TK = gates_TK / gates_TK.sum(dim=1, keepdim=True)
    if num_tokens == 0:  # no tokens, no loss (a mean over none would be NaN)
        aux_loss = z_loss = logits_TE.new_zeros(())
    else:
        f_E = counts_E.float() / (num_tokens * k)
        aux_loss = num_experts * (f_E * probs_TE.mean(dim=0)).sum()
        z_loss = torch.logsumexp(logits_TE, dim=-1).square().mean()
    if capacity is None:
        return TopkRouting(experts_TK, positions_TK, counts_E, gates_TK, None, None, None,
                           counts_E.new_zeros(()), aux_loss, z_loss, expert_order(experts_TK, positions_TK, counts_E))
    kept_TK = positions_TK < capacity
    num_rows = num_experts * capacity
    rows_TK = torch.where(kept_TK, experts_TK * capacity + positions_TK, -1)
    slot_of_row = torch.full((num_rows + 1,), -1, dtype=torch.long, device=logits_TE.device)
    slot_of_row.scatter_(0, torch.where(kept_TK, rows_TK, num_rows).reshape(-1),
                         torch.arange(num_tokens * k, device=logits_TE.device))
    return TopkRouting(experts_TK, positions_TK, counts_E, gates_TK * kept_TK, kept_TK, rows_TK,
                       slot_of_row[:num_rows], (~kept_TK).sum(), aux_loss, z_loss)


def route_topk(logits_TE: torch.Tensor, k: int, normalize: bool, capacity: int | None,
               bias_E: torch.Tensor | None = None) -> TopkRouting:
    """`route_topk_reference`'s routing by the Triton kernels (CUDA, or the CPU interpreter);
    the reference itself for an empty batch or more than MAX_EXPERTS experts."""
    num_tokens, num_experts = logits_TE.shape
    if not 1 <= k <= num_experts:
        raise ValueError(f"k must be in [1, {num_experts}], got {k}")
    if capacity is not None and capacity < 1:
        raise ValueError(f"capacity must be at least 1 slot per expert, got {capacity}")
    if num_tokens == 0 or num_experts > MAX_EXPERTS:
        return route_topk_reference(logits_TE, k, normalize, capacity, bias_E)
    outputs = _RouteTopk.apply(logits_TE, bias_E, k, normalize, capacity)
    gates, aux, z, experts, positions, counts, kept, rows, slot_of_row, dropped, order = outputs
    if capacity is None:
        return TopkRouting(experts, positions, counts, gates, None, None, None, dropped, aux, z, order)
    return TopkRouting(experts, positions, counts, gates, kept, rows, slot_of_row, dropped, aux, z)


class _RouteTopk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TE, bias_E, k, normalize, capacity):
        logits_TE = logits_TE.float().contiguous()
        num_tokens, num_experts = logits_TE.shape
        device = logits_TE.device
        probs_TE = F.softmax(logits_TE, dim=-1)  # the PyTorch path's kernel: the same experts
        meta = tiles(num_tokens, num_experts, k)
        num_blocks = triton.cdiv(num_tokens, meta["BLOCK_T"])
        experts = torch.empty(num_tokens, k, dtype=torch.long, device=device)
        gates = torch.empty(num_tokens, k, dtype=torch.float32, device=device)
        lse = torch.empty(num_tokens, dtype=torch.float32, device=device)
        hist = torch.empty(k * num_blocks, num_experts, dtype=torch.int32, device=device)
        psum = torch.empty(num_blocks, num_experts, dtype=torch.float32, device=device)
        zsum = torch.empty(num_blocks, dtype=torch.float32, device=device)
        bias = probs_TE if bias_E is None else bias_E.float().contiguous()
        choose_kernel[(num_blocks,)](logits_TE, probs_TE, bias, experts, gates, lse, hist, psum, zsum,
                                      num_tokens, num_experts, num_blocks, HAS_BIAS=bias_E is not None,
                                      NORMALIZE=normalize and k > 1, ONE_PASS=True, **meta)
        seen = cumsum_down(hist, torch.int32)  # inclusive over (j, block), per expert
        has_cap = capacity is not None
        cap = capacity if has_cap else 0
        num_rows = num_experts * cap
        positions = torch.empty_like(experts)
        slots = (num_tokens, k) if has_cap else (0,)  # dropless: nothing kept or dropped, no padded rows
        kept = torch.empty(slots, dtype=torch.uint8, device=device)
        rows = torch.empty(slots, dtype=torch.long, device=device)
        slot_of_row = torch.full((num_rows,), -1, dtype=torch.long, device=device)
        gates_kept = torch.empty_like(gates) if has_cap else gates
        order = torch.empty(0 if has_cap else num_tokens * k, dtype=torch.long, device=device)
        slots_kernel[(num_blocks,)](experts, seen, hist, gates, positions, kept, rows, slot_of_row, gates_kept,
                                     order, num_tokens, num_experts, num_blocks, cap,
                                     LAYOUT=PADDED if has_cap else DROPLESS, **meta)
        counts = torch.empty(num_experts, dtype=torch.long, device=device)
        aux = torch.empty((), dtype=torch.float32, device=device)
        z = torch.empty((), dtype=torch.float32, device=device)
        dropped = torch.empty((), dtype=torch.long, device=device)
        _finish_kernel[(1,)](psum, zsum, seen[-1], counts, aux, z, dropped, num_tokens, num_experts, num_blocks, cap,
                             1.0 / num_tokens, 1.0 / (num_tokens * k), HAS_CAP=has_cap,
                             NUM_CHUNKS=triton.cdiv(num_blocks, FINISH_CHUNK), CHUNK=FINISH_CHUNK,
                             BLOCK_E=meta["BLOCK_E"])
        kept = kept.view(torch.bool)
        ctx.save_for_backward(probs_TE, lse, experts, gates, kept, counts)
        ctx.normalize, ctx.has_cap = normalize and k > 1, has_cap
        ctx.set_materialize_grads(False)
        integers = (experts, positions, counts, kept, rows, slot_of_row, dropped, order)
        ctx.mark_non_differentiable(*integers)
        return (gates_kept, aux, z, *integers)

    @staticmethod
    def backward(ctx, grad_gates, grad_aux, grad_z, *_):
        if grad_gates is None and grad_aux is None and grad_z is None:
            return None, None, None, None, None
        probs_TE, lse, experts, gates, kept, counts = ctx.saved_tensors
        num_tokens, num_experts = probs_TE.shape
        k = experts.shape[1]
        meta = tiles(num_tokens, num_experts, k)
        grad_logits = torch.empty_like(probs_TE)
        dummy = probs_TE  # a pointer for the absent gradients; never read
        _backward_kernel[(triton.cdiv(num_tokens, meta["BLOCK_T"]),)](
            probs_TE, lse, experts, gates, kept.view(torch.uint8), counts,
            dummy if grad_gates is None else grad_gates.float().contiguous(),
            dummy if grad_aux is None else grad_aux.float().reshape(1),
            dummy if grad_z is None else grad_z.float().reshape(1),
            grad_logits, num_tokens, num_experts, 1.0 / num_tokens, 1.0 / (num_tokens * k),
            HAS_DGATES=grad_gates is not None, HAS_DAUX=grad_aux is not None, HAS_DZ=grad_z is not None,
            NORMALIZE=ctx.normalize, HAS_CAP=ctx.has_cap, **meta)
        return grad_logits, None, None, None, None


if triton is not None:

    @triton.jit
    def _finish_kernel(psum, zsum, counts_in, counts_out, aux, z, dropped, T, E, num_blocks, cap, inv_tokens, inv_slots,
                       HAS_CAP: tl.constexpr, NUM_CHUNKS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
        cols = tl.arange(0, BLOCK_E)
        col_ok = cols < E
        prob_sum = tl.zeros((BLOCK_E,), dtype=tl.float32)
        z_sum = tl.zeros((CHUNK,), dtype=tl.float32)
        for c in tl.static_range(NUM_CHUNKS):
            blocks = c * CHUNK + tl.arange(0, CHUNK)
            block_ok = blocks < num_blocks
            tile = tl.load(psum + blocks[:, None] * E + cols[None, :], mask=block_ok[:, None] & col_ok[None, :],
                           other=0.0)
            prob_sum += tl.sum(tile, axis=0)
            z_sum += tl.load(zsum + blocks, mask=block_ok, other=0.0)
        counts = tl.load(counts_in + cols, mask=col_ok, other=0).to(tl.int64)
        tl.store(counts_out + cols, counts, mask=col_ok)
        share = counts.to(tl.float32) * inv_slots
        tl.store(aux, E * tl.sum(share * (prob_sum * inv_tokens), axis=0))
        tl.store(z, tl.sum(z_sum, axis=0) * inv_tokens)
        over = tl.zeros((BLOCK_E,), dtype=tl.int64)
        if HAS_CAP:
            over = tl.maximum(counts - cap, 0)
        tl.store(dropped, tl.sum(over, axis=0))

    @triton.jit
    def _backward_kernel(probs, lse, experts, gates, kept, counts, grad_gates, grad_aux, grad_z, grad_logits, T, E,
                         inv_tokens, inv_slots, HAS_DGATES: tl.constexpr, HAS_DAUX: tl.constexpr, HAS_DZ: tl.constexpr,
                         NORMALIZE: tl.constexpr, HAS_CAP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
        block, rows, cols, row_ok, col_ok = token_block(T, E, BLOCK_T, BLOCK_E)
        ok = row_ok[:, None] & col_ok[None, :]
        offsets = rows[:, None] * E + cols[None, :]
        p = tl.load(probs + offsets, mask=ok, other=0.0)
        dp = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
        if HAS_DAUX:  # aux = E * sum_e f_e * mean_t p[t, e]
            share = tl.load(counts + cols, mask=col_ok, other=0).to(tl.float32) * inv_slots
            dp += (E * inv_tokens * tl.load(grad_aux)) * share[None, :]
        if HAS_DGATES:
            kcols = tl.arange(0, KP)
            slots = rows[:, None] * K + kcols[None, :]
            slot_ok = row_ok[:, None] & (kcols[None, :] < K)
            chosen_TK = tl.load(experts + slots, mask=slot_ok, other=-1)
            dg_TK = tl.load(grad_gates + slots, mask=slot_ok, other=0.0)
            if HAS_CAP:  # the gate of a dropped slot was multiplied by 0
                dg_TK = tl.where(tl.load(kept + slots, mask=slot_ok, other=0) != 0, dg_TK, 0.0)
            if NORMALIZE:  # g_j = p_j / S, S = sum_i p_i over the k: dp_j = (dg_j - sum_i dg_i g_i) / S
                g_TK = tl.load(gates + slots, mask=slot_ok, other=0.0)
                total = tl.zeros((BLOCK_T,), dtype=tl.float32)
                for j in tl.static_range(K):
                    chosen = column_of(chosen_TK, kcols, j)
                    total += tl.sum(tl.where(cols[None, :] == chosen[:, None], p, 0.0), axis=1)
                dot = tl.sum(dg_TK * g_TK, axis=1)
                dg_TK = (dg_TK - dot[:, None]) / tl.where(row_ok, total, 1.0)[:, None]
            for j in tl.static_range(K):
                chosen = column_of(chosen_TK, kcols, j)
                dp += tl.where(cols[None, :] == chosen[:, None], column_of(dg_TK, kcols, j)[:, None], 0.0)
        dlogit = p * (dp - tl.sum(p * dp, axis=1)[:, None])
        if HAS_DZ:  # z = mean_t lse_t^2
            scale = 2.0 * inv_tokens * tl.load(grad_z) * tl.load(lse + rows, mask=row_ok, other=0.0)
            dlogit += scale[:, None] * p
        tl.store(grad_logits + offsets, dlogit, mask=ok)

