"""Rotary position embedding as one Triton kernel each way, beside its PyTorch reference.

The reference (`rotary_reference`) is GPT-NeoX-style half rotation in float32: for x = (x1, x2)
split at head_dim / 2, y = (x1 cos - x2 sin, x1 sin + x2 cos), cast back to x's dtype. In
PyTorch that is ~9 elementwise kernels per tensor each way (an fp32 copy, the products, the
concatenation), which profiles of `weft bench model --breakdown` show costing more than the
attention matmuls at GPT-2 widths. The kernel reads x once (any strides with a contiguous last
dimension, e.g. the q/k views of a fused qkv projection) and writes y contiguous; the backward is
the same rotation by -angle (the transpose of a rotation), so it is the same kernel.
"""
from __future__ import annotations

import torch

from weft.kernels.rows import triton, use_triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _rotary_kernel(x, cos, sin, out, H, S, stride_b, stride_h, stride_s,
                       HALF: tl.constexpr, HALF_POW2: tl.constexpr, BLOCK_S: tl.constexpr, SIGN: tl.constexpr):
        bh = tl.program_id(0).to(tl.int64)
        b, h = bh // H, bh % H
        s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
        d = tl.arange(0, HALF_POW2)
        mask = (s[:, None] < S) & (d[None, :] < HALF)
        src = x + b * stride_b + h * stride_h + s[:, None].to(tl.int64) * stride_s + d[None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        table = s[:, None] * HALF + d[None, :]
        c = tl.load(cos + table, mask=mask, other=0.0)
        sn = tl.load(sin + table, mask=mask, other=0.0) * SIGN
        dst = out + (bh * S + s[:, None].to(tl.int64)) * (2 * HALF) + d[None, :]
        tl.store(dst, (x1 * c - x2 * sn).to(out.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, (x1 * sn + x2 * c).to(out.dtype.element_ty), mask=mask)


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (..., seq, head_dim) by position; cos, sin (seq, head_dim / 2); math in float32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


def _rotate(x_BHSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: int) -> torch.Tensor:
    batch, heads, seq, dim = x_BHSD.shape
    out = torch.empty(batch, heads, seq, dim, dtype=x_BHSD.dtype, device=x_BHSD.device)
    if out.numel() == 0:
        return out
    half = dim // 2
    block_s = 32
    grid = (batch * heads, triton.cdiv(seq, block_s))
    _rotary_kernel[grid](x_BHSD, cos.contiguous(), sin.contiguous(), out, heads, seq, x_BHSD.stride(0),
                         x_BHSD.stride(1), x_BHSD.stride(2), HALF=half, HALF_POW2=triton.next_power_of_2(half),
                         BLOCK_S=block_s, SIGN=sign)
    return out


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BHSD, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x_BHSD, cos, sin, 1)

    @staticmethod
    def backward(ctx, grad_BHSD):
        cos, sin = ctx.saved_tensors
        return _rotate(grad_BHSD, cos, sin, -1), None, None


def rotary(x_BHSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernels: str = "auto") -> torch.Tensor:
    """`rotary_reference` of a (batch, heads, seq, head_dim) tensor by the Triton kernel where the
    `kernels` setting picks it (`weft.kernels.rows.use_triton`) and by PyTorch otherwise."""
    if (use_triton(kernels, x_BHSD) and x_BHSD.dim() == 4 and x_BHSD.stride(-1) == 1
            and x_BHSD.shape[-1] % 2 == 0 and not cos.requires_grad and not sin.requires_grad):
        return _Rotary.apply(x_BHSD, cos.float(), sin.float())
    return rotary_reference(x_BHSD, cos, sin)
