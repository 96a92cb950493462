"""Row movement of MoE dispatch and combine as Triton kernels, each beside its PyTorch reference.

Three primitives cover the forward and backward of both (docs/moe.md, "Data movement"):

- `gather_rows(src_ND, index_R, scale_I, divisor)`: with i = index[r], out[r] =
  scale[i] * src[i // divisor], zero where i < 0 (dispatch forward with i a slot id t * k + j and
  divisor k; combine backward's expert-output gradient with scale the slots' gates);
- `weighted_row_sum(src_RD, rows_TK, weights_TK)`: out[t] = sum_j weights[t, j] * src[rows[t, j]]
  over the j with rows[t, j] >= 0, accumulated in float32 in j order (combine forward; dispatch
  backward with weights None = 1); with `kept_RD`, each row it reads is also written there, at
  the same index (the combine's copy of rows whose buffer is overwritten before its backward);
- `row_dots(a_TD, src_RD, rows_TK)`: out[t, j] = a[t] . src[rows[t, j]] in float32, 0 where
  rows[t, j] < 0 (combine backward's gate gradient).

Every output element is written by exactly one program, with no atomics: two runs on the same
input give bitwise equal results (the index_add path accumulates with atomics on GPUs and does
not). Rows skipped by a negative index are never read, so an inf or NaN in an unused row stays
out, as the reference's masking keeps it out. The Triton kernels run on CUDA tensors, and on CPU
tensors under Triton's interpreter (TRITON_INTERPRET=1), which is how the CPU suite tests them.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch references remain
    triton = None

BLOCK_D = 512
KERNELS = ("auto", "torch", "triton", "comet")  # the `kernels` setting of weft.MoE, GPT and weft train


def triton_usable(x: torch.Tensor) -> bool:
    """True where these Triton kernels can run on x: CUDA with Triton, or the CPU interpreter."""
    if triton is None:
        return False
    return x.is_cuda or (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def use_triton(kernels: str, x: torch.Tensor) -> bool:
    """Whether the `kernels` setting runs the Triton kernels on x: never for "torch"; for "auto"
    and "comet" (whose dispatch and combine are these) where they can run; for "triton" always
    (RuntimeError where they cannot)."""
    if kernels == "torch":
        return False
    usable = triton_usable(x)
    if kernels == "triton" and not usable:
        raise RuntimeError(f"kernels='triton' needs Triton and a CUDA tensor (or TRITON_INTERPRET=1 on the CPU); "
                           f"got a {x.device.type} tensor")
    return usable


# -- references (the CPU path and the test oracle) -------------------------------------------------
def gather_rows_reference(src_ND: torch.Tensor, index_R: torch.Tensor, scale_I: torch.Tensor | None = None,
                          out_dtype: torch.dtype | None = None, divisor: int = 1) -> torch.Tensor:
    used = (index_R >= 0).unsqueeze(1)
    index = index_R.clamp(min=0)
    rows = src_ND.index_select(0, index // divisor).float()
    if scale_I is not None:
        rows = rows * scale_I.float().index_select(0, index).unsqueeze(1)
    return torch.where(used, rows, 0.0).to(out_dtype or src_ND.dtype)


def weighted_row_sum_reference(src_RD: torch.Tensor, rows_TK: torch.Tensor, weights_TK: torch.Tensor | None = None,
                               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    num_tokens, k = rows_TK.shape
    out = torch.zeros(num_tokens, src_RD.shape[1], dtype=torch.float32, device=src_RD.device)
    for j in range(k):
        used = (rows_TK[:, j] >= 0).unsqueeze(1)
        picked = src_RD.index_select(0, rows_TK[:, j].clamp(min=0)).float()
        if weights_TK is not None:
            picked = picked * weights_TK[:, j].float().unsqueeze(1)
        out = out + torch.where(used, picked, 0.0)
    return out.to(out_dtype or src_RD.dtype)


def row_dots_reference(a_TD: torch.Tensor, src_RD: torch.Tensor, rows_TK: torch.Tensor) -> torch.Tensor:
    picked = src_RD.index_select(0, rows_TK.clamp(min=0).reshape(-1)).float().view(*rows_TK.shape, -1)
    dots = (picked * a_TD.float().unsqueeze(1)).sum(-1)
    return torch.where(rows_TK >= 0, dots, 0.0)


# -- Triton kernels ----------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _gather_rows_kernel(src, index, scale, out, D, stride_src, stride_out, divisor,
                            HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < D
        i = tl.load(index + r).to(tl.int64)
        used = i >= 0
        row = tl.where(used, i, 0) // divisor
        values = tl.load(src + row * stride_src + cols, mask=inside & used, other=0.0).to(tl.float32)
        if HAS_SCALE:
            values = values * tl.load(scale + tl.where(used, i, 0)).to(tl.float32)
        tl.store(out + r * stride_out + cols, values.to(out.dtype.element_ty), mask=inside)

    @triton.jit
    def _weighted_row_sum_kernel(src, rows, weights, out, kept, D, stride_src, stride_out, stride_kept,
                                 K: tl.constexpr, HAS_WEIGHTS: tl.constexpr, KEEP: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < D
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(K):
            r = tl.load(rows + t * K + j).to(tl.int64)
            read = tl.load(src + r * stride_src + cols, mask=inside & (r >= 0), other=0.0)
            if KEEP:
                tl.store(kept + r * stride_kept + cols, read, mask=inside & (r >= 0))
            picked = read.to(tl.float32)
            if HAS_WEIGHTS:
                picked = picked * tl.load(weights + t * K + j).to(tl.float32)
            acc += picked
        tl.store(out + t * stride_out + cols, acc.to(out.dtype.element_ty), mask=inside)

    @triton.jit
    def _row_dots_kernel(a, src, rows, out, D, stride_a, stride_src, blocks,
                         K: tl.constexpr, K_POW2: tl.constexpr, BLOCK: tl.constexpr):
        """Partial dots over one block of columns: out[t, block, j]."""
        t = tl.program_id(0).to(tl.int64)
        block = tl.program_id(1)
        js = tl.arange(0, K_POW2)
        r = tl.load(rows + t * K + js, mask=js < K, other=-1).to(tl.int64)
        cols = block * BLOCK + tl.arange(0, BLOCK)
        inside = cols < D
        a_row = tl.load(a + t * stride_a + cols, mask=inside, other=0.0).to(tl.float32)
        picked = tl.load(src + r[:, None] * stride_src + cols[None, :],
                         mask=(r[:, None] >= 0) & inside[None, :], other=0.0).to(tl.float32)
        tl.store(out + (t * blocks + block) * K + js, tl.sum(picked * a_row[None, :], axis=1), mask=js < K)


def _rows_ok(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def gather_rows(src_ND: torch.Tensor, index_R: torch.Tensor, scale_I: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None, divisor: int = 1, out: torch.Tensor | None = None
                ) -> torch.Tensor:
    """(R, D): with i = index[r], row r is scale[i] * src[i // divisor] (float32 product, cast to
    `out_dtype`, default src's), zero where i < 0; written into `out` where given (rows of unit
    column stride, e.g. a slice of a peer buffer), which is returned."""
    shape, dtype = (index_R.shape[0], src_ND.shape[1]), out_dtype or src_ND.dtype
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=src_ND.device)
    elif tuple(out.shape) != shape or out.dtype != dtype or out.device != src_ND.device or out.stride(1) != 1:
        raise ValueError(f"gather_rows: out must be {shape} {dtype} on {src_ND.device} with unit column stride, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device} strides {out.stride()}")
    if out.numel() == 0:
        return out
    src_ND = _rows_ok(src_ND)
    grid = (index_R.shape[0], triton.cdiv(src_ND.shape[1], BLOCK_D))
    _gather_rows_kernel[grid](src_ND, index_R, scale_I if scale_I is not None else index_R, out, src_ND.shape[1],
                              src_ND.stride(0), out.stride(0), divisor, HAS_SCALE=scale_I is not None, BLOCK=BLOCK_D)
    return out


def weighted_row_sum(src_RD: torch.Tensor, rows_TK: torch.Tensor, weights_TK: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None, kept_RD: torch.Tensor | None = None) -> torch.Tensor:
    """(T, D): row t is sum_j weights[t, j] * src[rows[t, j]] over rows[t, j] >= 0, in float32.
    `kept_RD` (src's shape and dtype, unit column stride), where given: every row read is also
    written there at its own index, in the same pass; the rows no index names are left as they
    were."""
    num_tokens, k = rows_TK.shape
    out = torch.empty(num_tokens, src_RD.shape[1], dtype=out_dtype or src_RD.dtype, device=src_RD.device)
    if kept_RD is not None and (kept_RD.shape != src_RD.shape or kept_RD.dtype != src_RD.dtype
                                or kept_RD.device != src_RD.device or kept_RD.stride(1) != 1):
        raise ValueError(f"weighted_row_sum: kept_RD must be {tuple(src_RD.shape)} {src_RD.dtype} on {src_RD.device} "
                         f"with unit column stride, got {tuple(kept_RD.shape)} {kept_RD.dtype} on {kept_RD.device} "
                         f"strides {kept_RD.stride()}")
    if out.numel() == 0:
        return out
    src_RD, rows_TK = _rows_ok(src_RD), rows_TK.contiguous()
    weights = weights_TK.contiguous() if weights_TK is not None else rows_TK
    kept = kept_RD if kept_RD is not None else out
    grid = (num_tokens, triton.cdiv(src_RD.shape[1], BLOCK_D))
    _weighted_row_sum_kernel[grid](src_RD, rows_TK, weights, out, kept, src_RD.shape[1], src_RD.stride(0),
                                   out.stride(0), kept.stride(0), K=k, HAS_WEIGHTS=weights_TK is not None,
                                   KEEP=kept_RD is not None, BLOCK=BLOCK_D)
    return out


def row_dots(a_TD: torch.Tensor, src_RD: torch.Tensor, rows_TK: torch.Tensor) -> torch.Tensor:
    """(T, K) float32: a[t] . src[rows[t, j]], 0 where rows[t, j] < 0."""
    num_tokens, k = rows_TK.shape
    if num_tokens * k == 0:
        return torch.zeros(num_tokens, k, dtype=torch.float32, device=a_TD.device)
    a_TD, src_RD, rows_TK = _rows_ok(a_TD), _rows_ok(src_RD), rows_TK.contiguous()
    blocks = triton.cdiv(a_TD.shape[1], BLOCK_D)
    partial = torch.empty(num_tokens, blocks, k, dtype=torch.float32, device=a_TD.device)
    _row_dots_kernel[(num_tokens, blocks)](a_TD, src_RD, rows_TK, partial, a_TD.shape[1], a_TD.stride(0),
                                           src_RD.stride(0), blocks, K=k, K_POW2=triton.next_power_of_2(k),
                                           BLOCK=BLOCK_D)
    return partial.sum(1)  # a fixed-order reduction over the column blocks: deterministic
