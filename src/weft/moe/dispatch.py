"""Index-based encode (dispatch) and decode (combine), Tutel's fast encode/decode idea.

No (T, E, C) one-hot tensors and no einsum: each kept slot moves one row. Time and memory
are O(T*k*dim) plus the capacity buffer itself. Two implementations of the same function:

- `dispatch_padded` / `combine`: PyTorch index ops, differentiated by autograd (the gradient of
  a dispatched row returns to its token, each gate gets dy . expert_out); the reference, and the
  CPU path. On GPUs index_add accumulates with atomics: not bitwise reproducible.
- `dispatch_rows` / `combine_rows` over a `SlotRows` map: the Triton kernels of
  `weft.kernels.rows`, forward and backward written out, no atomics (deterministic), the
  combine's float32 sum written straight in the output dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from weft.kernels import rows as row_kernels


def dispatch_padded(x: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Buffer (num_rows, dim) with x[tokens[i]] at row rows[i]; unused rows are zero.

    `rows` may point at the extra row `num_rows` (dropped slots); that row is discarded.
    """
    buffer = x.new_zeros(num_rows + 1, x.shape[1])
    return buffer.index_copy(0, rows, x.index_select(0, tokens))[:num_rows]


def combine(
    expert_out: torch.Tensor,
    rows: torch.Tensor | None,
    tokens: torch.Tensor,
    gates: torch.Tensor,
    num_tokens: int,
    kept: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[t] = sum over slots i of token t: gates[i] * expert_out[rows[i]], accumulated in float32.

    `rows` None means slot i reads row i. Slots with `kept` False add exactly nothing (their
    row is masked, not just multiplied by a zero gate, so an inf in an unused row stays out).
    """
    picked = expert_out if rows is None else expert_out.index_select(0, rows)
    picked = picked.float() * gates.unsqueeze(1)
    if kept is not None:
        picked = torch.where(kept.unsqueeze(1), picked, 0.0)
    out = torch.zeros(num_tokens, expert_out.shape[1], dtype=torch.float32, device=expert_out.device)
    return out.index_add(0, tokens, picked)


# -- the fast path: Triton row kernels, deterministic (weft.kernels.rows) ----------------------------
@dataclass(frozen=True)
class SlotRows:
    """Where the routed slots' rows sit in the dispatched buffer, in both directions (token
    choice: slot id t * k + j for choice j of token t). `rows_TK[t, j]`: the buffer row of slot
    (t, j), -1 if dropped; `slot_of_row_R[r]`: the slot whose row r is, -1 for an unused row (its
    token is slot // k). Each row holds at most one slot, so every kernel writes each output once."""

    rows_TK: torch.Tensor
    slot_of_row_R: torch.Tensor

    @property
    def top_k(self) -> int:
        return self.rows_TK.shape[1]

    @classmethod
    def padded(cls, rows_S: torch.Tensor, kept_S: torch.Tensor | None, num_rows: int, top_k: int) -> SlotRows:
        """Padded layout: slot i at row rows_S[i] (any value where not kept)."""
        # Dropped slots write to an extra row that is cut off: no mask indexing (a host sync).
        target_S = rows_S if kept_S is None else torch.where(kept_S, rows_S, num_rows)
        slot_of_row = torch.full((num_rows + 1,), -1, dtype=torch.long, device=rows_S.device)
        slot_of_row.scatter_(0, target_S, torch.arange(rows_S.shape[0], device=rows_S.device))
        rows = target_S if kept_S is None else target_S.masked_fill(~kept_S, -1)
        return cls(rows.view(-1, top_k), slot_of_row[:num_rows])

    @classmethod
    def grouped(cls, order_S: torch.Tensor, top_k: int) -> SlotRows:
        """Dropless layout: row r holds slot order_S[r] (slots sorted by expert)."""
        rows = torch.empty_like(order_S)
        rows[order_S] = torch.arange(order_S.shape[0], device=order_S.device)
        return cls(rows.view(-1, top_k), order_S)


class _DispatchRows(torch.autograd.Function):
    """buffer[r] = x[token of row r]; backward: dx[t] = sum_j dbuffer[rows[t, j]] (float32 sum)."""

    @staticmethod
    def forward(ctx, x_TD, slot_of_row_R, rows_TK, into_RD):
        ctx.save_for_backward(rows_TK)
        ctx.x_dtype = x_TD.dtype
        return row_kernels.gather_rows(x_TD, slot_of_row_R, divisor=rows_TK.shape[1], out=into_RD)

    @staticmethod
    def backward(ctx, grad_RD):
        (rows_TK,) = ctx.saved_tensors
        return row_kernels.weighted_row_sum(grad_RD, rows_TK, None, ctx.x_dtype), None, None, None


class _CombineRows(torch.autograd.Function):
    """y[t] = sum_j gates[t, j] * out[rows[t, j]] (float32); backward: dout[r] = gate * dy[token of
    r], dgates[t, j] = dy[t] . out[rows[t, j]]. With `keep_rows` the backward reads a copy of the
    rows made by the forward's own reads (out_RD's buffer may be overwritten before the backward:
    `Staging.transient_out`), else out_RD itself."""

    @staticmethod
    def forward(ctx, out_RD, gates_TK, slot_rows: SlotRows, out_dtype, grad_into_RD, keep_rows):
        kept_RD = torch.empty(out_RD.shape, dtype=out_RD.dtype, device=out_RD.device) if keep_rows else None
        y_TD = row_kernels.weighted_row_sum(out_RD, slot_rows.rows_TK, gates_TK, out_dtype, kept_RD)
        ctx.save_for_backward(out_RD if kept_RD is None else kept_RD, gates_TK)
        ctx.slot_rows, ctx.grad_into_RD = slot_rows, grad_into_RD
        return y_TD

    @staticmethod
    def backward(ctx, grad_TD):
        out_RD, gates_TK = ctx.saved_tensors
        slot_rows = ctx.slot_rows
        grad_out = grad_gates = None
        if ctx.needs_input_grad[0]:
            grad_out = row_kernels.gather_rows(grad_TD, slot_rows.slot_of_row_R, gates_TK.reshape(-1), out_RD.dtype,
                                               divisor=slot_rows.top_k, out=ctx.grad_into_RD)
        if ctx.needs_input_grad[1]:
            grad_gates = row_kernels.row_dots(grad_TD, out_RD, slot_rows.rows_TK)
        return grad_out, grad_gates, None, None, None, None


def dispatch_rows(x_TD: torch.Tensor, slot_rows: SlotRows, into_RD: torch.Tensor | None = None) -> torch.Tensor:
    """The dispatched buffer (R, dim) by the Triton kernels: row r is x[slot_of_row[r] // k], 0 if
    unused; written into `into_RD` where given (where the exchange wants its rows: `Staging`)."""
    return _DispatchRows.apply(x_TD, slot_rows.slot_of_row_R, slot_rows.rows_TK, into_RD)


def combine_rows(out_RD: torch.Tensor, gates_TK: torch.Tensor, slot_rows: SlotRows,
                 out_dtype: torch.dtype, grad_into_RD: torch.Tensor | None = None,
                 keep_rows: bool = False) -> torch.Tensor:
    """The gate-weighted sum of each token's expert outputs by the Triton kernels, in `out_dtype`;
    the backward writes out_RD's gradient into `grad_into_RD` where given (`Staging`). `keep_rows`:
    the rows the gates' gradient reads are copied as the sum reads them, for an out_RD that is
    overwritten before the backward (`Staging.transient_out`)."""
    return _CombineRows.apply(out_RD, gates_TK, slot_rows, out_dtype, grad_into_RD, keep_rows)
