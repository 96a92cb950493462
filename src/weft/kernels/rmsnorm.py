"""RMSNorm whose output is written in the next matmul's dtype, one Triton kernel each way.

Under bf16 autocast weft's residual stream is float32 and the matmuls run in bf16. A block's
norm then writes its float32 output, autocast's cast reads it and writes a bf16 copy for the
matmul, and in the backward autocast casts the bf16 gradient back to float32 for the norm's
backward: an extra pass over a (tokens, dim) tensor each way per norm (gpt2-l-moe at batch 8 on
one H200: 0.72 ms of casts in attention's and the dense MLPs' forward, and 1.1 ms of casts back
in the backward, the experts' inputs' among them; docs/benchmarks.md, fifty-sixth session).
Here the forward kernel normalises each row in float32 and writes it in the output dtype (the
values autocast's cast would give, to float32 rounding), and the backward kernel reads that
dtype's gradient directly. For norms whose only reader is a matmul under autocast (attention's
input, a dense MLP's input: `models.gpt.MatmulInputNorm`).

Math, per row x of length D, weight w: r = 1 / sqrt(mean(x^2) + eps), y = x r w (float32, then
the output dtype); the backward, with g = dy w and x^ = x r: dx = r (g - x^ mean(g x^)),
dw = sum over rows of dy x^. The weight gradient is reduced in a fixed order (per-program
partial sums, then `torch.sum`): the same bits from run to run. `rms_norm_reference` is the
PyTorch form (the CPU path and the test oracle); the kernels agree with it to float32 rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from weft.kernels.rows import triton

if triton is not None:
    import triton.language as tl

ROWS_PER_PROGRAM = 8  # the backward's rows per program: its share of the weight gradient


def rms_norm_reference(x_MD: torch.Tensor, weight_D: torch.Tensor, eps: float | None,
                       dtype: torch.dtype) -> torch.Tensor:
    """PyTorch's RMSNorm in x's dtype, then cast to `dtype`."""
    return F.rms_norm(x_MD, (x_MD.shape[-1],), weight_D, eps).to(dtype)


if triton is not None:
    @triton.jit
    def _rms_norm_forward_kernel(x, w, y, rstd, D, eps, BLOCK_D: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        mask = d < D
        xs = tl.load(x + row * D + d, mask=mask, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(xs * xs, axis=0) / D + eps)
        ws = tl.load(w + d, mask=mask, other=0.0).to(tl.float32)
        tl.store(y + row * D + d, (xs * r * ws).to(y.dtype.element_ty), mask=mask)
        tl.store(rstd + row, r)

    @triton.jit
    def _rms_norm_backward_kernel(x, w, dy, rstd, dx, dw_partial, M, D, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
        program = tl.program_id(0)
        d = tl.arange(0, BLOCK_D)
        mask = d < D
        ws = tl.load(w + d, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_D], dtype=tl.float32)
        for i in range(ROWS):
            row = program.to(tl.int64) * ROWS + i
            live = row < M
            m = mask & live
            xs = tl.load(x + row * D + d, mask=m, other=0.0).to(tl.float32)
            g = tl.load(dy + row * D + d, mask=m, other=0.0).to(tl.float32)
            r = tl.load(rstd + row, mask=live, other=0.0)
            xhat = xs * r
            gw = g * ws
            mean = tl.sum(gw * xhat, axis=0) / D
            tl.store(dx + row * D + d, (r * (gw - xhat * mean)).to(dx.dtype.element_ty), mask=m)
            dw += g * xhat
        tl.store(dw_partial + program * D + d, dw, mask=mask)


class _RmsNormCast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MD, weight_D, eps, dtype):
        M, D = x_MD.shape
        y_MD = torch.empty(M, D, dtype=dtype, device=x_MD.device)
        rstd_M = torch.empty(M, dtype=torch.float32, device=x_MD.device)
        if M:
            _rms_norm_forward_kernel[(M,)](x_MD, weight_D, y_MD, rstd_M, D, eps,
                                           BLOCK_D=triton.next_power_of_2(D))
        ctx.save_for_backward(x_MD, weight_D, rstd_M)
        return y_MD

    @staticmethod
    def backward(ctx, dy_MD):
        x_MD, weight_D, rstd_M = ctx.saved_tensors
        M, D = x_MD.shape
        dx_MD = torch.empty_like(x_MD)
        if not M:
            return dx_MD, torch.zeros_like(weight_D), None, None
        programs = triton.cdiv(M, ROWS_PER_PROGRAM)
        partial_PD = torch.empty(programs, D, dtype=torch.float32, device=x_MD.device)  # each program writes its row
        _rms_norm_backward_kernel[(programs,)](x_MD, weight_D, dy_MD.contiguous(), rstd_M, dx_MD, partial_PD, M, D,
                                               ROWS=ROWS_PER_PROGRAM, BLOCK_D=triton.next_power_of_2(D))
        return dx_MD, partial_PD.sum(0).to(weight_D.dtype), None, None


def rms_norm_cast(x: torch.Tensor, weight: torch.Tensor, eps: float | None, dtype: torch.dtype) -> torch.Tensor:
    """`rms_norm_reference(x, weight, eps, dtype)` over x's last dimension by the Triton kernels
    (x float32 and contiguous, on a GPU or under TRITON_INTERPRET=1: the caller checks)."""
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    return _RmsNormCast.apply(x.reshape(-1, x.shape[-1]), weight, float(eps), dtype).view(x.shape)
