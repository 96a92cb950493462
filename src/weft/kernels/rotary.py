"""Rotary position embedding as one Triton kernel each way, beside its PyTorch reference.

The reference (`rotary_reference`) is GPT-NeoX-style half rotation in float32: for x = (x1, x2)
split at head_dim / 2, y = (x1 cos - x2 sin, x1 sin + x2 cos), cast back to x's dtype. In
PyTorch that is ~9 elementwise kernels per tensor each way (an fp32 copy, the products, the
concatenation), which profiles of `weft bench model --breakdown` show costing more than the
attention matmuls at GPT-2 widths. The kernel reads x and writes y with any strides that keep
the last dimension contiguous (e.g. the q/k views of a fused qkv projection); the backward is the
same rotation by -angle (the transpose of a rotation), so it is the same kernel.

`qkv_heads` splits a fused qkv projection into rotated q and k heads and the v heads, and its
backward writes the three gradients straight into the projection's layout: autograd's own
backward of the split (view, permute, unbind) took two more passes over the whole qkv gradient, a
stack of the three and a copy back into the projection's layout (~4.3 ms of a 77-ms gpt2-l-moe
step on one H200; docs/benchmarks.md, fifty-sixth session).
"""
from __future__ import annotations

import torch

from weft.kernels.rows import triton, use_triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _rotary_kernel(x, cos, sin, out, H, S, stride_b, stride_h, stride_s, out_b, out_h, out_s,
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
        dst = out + b * out_b + h * out_h + s[:, None].to(tl.int64) * out_s + d[None, :]
        tl.store(dst, (x1 * c - x2 * sn).to(out.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, (x1 * sn + x2 * c).to(out.dtype.element_ty), mask=mask)


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (..., seq, head_dim) by position; cos, sin (seq, head_dim / 2); math in float32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


def _rotate(x_BHSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: int,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """x rotated by sign * angle into `out` (any strides with a contiguous last dimension; default a
    new contiguous tensor)."""
    batch, heads, seq, dim = x_BHSD.shape
    if x_BHSD.stride(-1) != 1:
        x_BHSD = x_BHSD.contiguous()
    if out is None:
        out = torch.empty(batch, heads, seq, dim, dtype=x_BHSD.dtype, device=x_BHSD.device)
    if out.numel() == 0:
        return out
    half = dim // 2
    block_s = 32
    grid = (batch * heads, triton.cdiv(seq, block_s))
    _rotary_kernel[grid](x_BHSD, cos.contiguous(), sin.contiguous(), out, heads, seq, x_BHSD.stride(0),
                         x_BHSD.stride(1), x_BHSD.stride(2), out.stride(0), out.stride(1), out.stride(2),
                         HALF=half, HALF_POW2=triton.next_power_of_2(half), BLOCK_S=block_s, SIGN=sign)
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
    `kernels` setting picks it (`kernel_takes`) and by PyTorch otherwise."""
    if kernel_takes(x_BHSD, cos, sin, kernels):
        return _Rotary.apply(x_BHSD, cos.float(), sin.float())
    return rotary_reference(x_BHSD, cos, sin)


def kernel_takes(x_BHSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernels: str) -> bool:
    """Whether the kernel rotates x (batch, heads, seq, head_dim): where `kernels` picks Triton
    (`weft.kernels.rows.use_triton`), x's last dimension is contiguous and even, and the tables
    are constants on x's device."""
    return (use_triton(kernels, x_BHSD) and x_BHSD.dim() == 4 and x_BHSD.stride(-1) == 1
            and x_BHSD.shape[-1] % 2 == 0 and not cos.requires_grad and not sin.requires_grad
            and cos.device == x_BHSD.device)


def _heads(qkv_BSX: torch.Tensor, n_head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The q, k and v heads of a fused projection (batch, seq, 3 * n_head * head_dim) as strided
    (batch, n_head, seq, head_dim) views."""
    batch, seq, width = qkv_BSX.shape
    q, k, v = qkv_BSX.view(batch, seq, 3, n_head, width // (3 * n_head)).permute(2, 0, 3, 1, 4)
    return q, k, v


class _QkvHeads(torch.autograd.Function):
    """Rotated q and k (new tensors, the rotary kernel) and v (a view of the projection); the
    backward writes the rotated-back q and k gradients and v's into one gradient of the
    projection's layout.

    q and k are stored (batch, seq, n_head, head_dim), the projection's own order, and returned as
    (batch, n_head, seq, head_dim) views of that: PyTorch's cuDNN attention allocates its output in
    q's stride order (and flash attention in this one), so attention's output transposed back to
    (batch, seq, dim) for the output projection is a view instead of a copy."""

    @staticmethod
    def forward(ctx, qkv_BSX, n_head, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.n_head, ctx.shape, ctx.dtype = n_head, qkv_BSX.shape, qkv_BSX.dtype
        q, k, v = _heads(qkv_BSX, n_head)
        batch, heads, seq, dim = q.shape

        def rotated(x_BHSD):
            out_BHSD = x_BHSD.new_empty(batch, seq, heads, dim).transpose(1, 2)
            return _rotate(x_BHSD, cos, sin, 1, out=out_BHSD)

        return rotated(q), rotated(k), v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        grad_BSX = torch.empty(ctx.shape, dtype=ctx.dtype, device=cos.device)
        for into, grad, rotated in zip(_heads(grad_BSX, ctx.n_head), (dq, dk, dv), (True, True, False)):
            if grad is None:
                into.zero_()
            elif rotated:
                _rotate(grad, cos, sin, -1, out=into)
            else:
                into.copy_(grad)
        return grad_BSX, None, None, None


def qkv_heads(qkv_BSX: torch.Tensor, n_head: int, cos: torch.Tensor, sin: torch.Tensor,
              kernels: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused qkv projection (batch, seq, 3 * n_head * head_dim) as its rotated q, its rotated k
    and its v heads, each (batch, n_head, seq, head_dim): `rotary` of the q and k views, v as
    is. Where the Triton kernel runs (`kernel_takes`), one autograd node whose backward writes
    the projection's gradient in one pass, and q and k laid out (batch, seq, n_head, head_dim)
    (`_QkvHeads`); otherwise PyTorch's views and `rotary_reference`. The same values either way
    (the backward's copies are exact)."""
    q, k, v = _heads(qkv_BSX, n_head)
    if kernel_takes(q, cos, sin, kernels):
        return _QkvHeads.apply(qkv_BSX, n_head, cos.float(), sin.float())
    return rotary(q, cos, sin, kernels), rotary(k, cos, sin, kernels), v
