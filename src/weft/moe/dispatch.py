"""Index-based encode (dispatch) and decode (combine), Tutel's fast encode/decode idea.

No (T, E, C) one-hot tensors and no einsum: each kept slot moves one row. Time and memory
are O(T*k*dim) plus the capacity buffer itself. Autograd differentiates the index ops:
the gradient of a dispatched row returns to its token, and each gate gets dy . expert_out.
"""
from __future__ import annotations

import torch


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
