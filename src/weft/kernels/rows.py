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

A program covers a tile of several rows by up to 512 columns (`row_tile`; docs/benchmarks.md has
the tiles timed). Every output element is written by exactly one program, with no atomics: two runs
on the same input give bitwise equal results (the index_add path accumulates with atomics on GPUs
and does not). Rows skipped by a negative index are never read, nor their slot's weight or scale
nor, for the dots, the token's row, so an inf or NaN there stays out, as the reference's masking
keeps it out. The Triton kernels run on CUDA tensors, and on CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1), which is how the CPU suite tests them.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch references remain
    triton = None

BLOCK_D = 512  # the most columns a row kernel's program covers
TILE_ELEMENTS = 2048  # the most elements of its tile: rows x columns (row_tile)
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
def row_tile(columns: int, rows_per_item: int = 1) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_D): the rows (tokens for `row_dots`) and columns one program covers. At most
    512 columns, fewer where the rows are narrower; rows up to TILE_ELEMENTS elements in all, counting
    `rows_per_item` source rows an item reads at once (`row_dots` reads its token's k rows in one
    tile). Depends on the width alone, so a model's shapes compile one kernel each."""
    block_d = min(BLOCK_D, triton.next_power_of_2(columns))
    return max(1, TILE_ELEMENTS // (block_d * rows_per_item)), block_d


if triton is not None:

    @triton.jit
    def _gather_rows_kernel(src, index, scale, out, R, D, stride_src, stride_out, divisor,
                            HAS_SCALE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        rs = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        inside = cols < D
        i = tl.load(index + rs, mask=rs < R, other=-1).to(tl.int64)
        used = i >= 0
        row = tl.where(used, i, 0) // divisor
        values = tl.load(src + row[:, None] * stride_src + cols[None, :], mask=used[:, None] & inside[None, :],
                         other=0.0).to(tl.float32)
        if HAS_SCALE:
            values = values * tl.load(scale + i, mask=used, other=0.0).to(tl.float32)[:, None]
        tl.store(out + rs[:, None] * stride_out + cols[None, :], values.to(out.dtype.element_ty),
                 mask=(rs < R)[:, None] & inside[None, :])

    @triton.jit
    def _weighted_row_sum_kernel(src, rows, weights, out, kept, T, D, stride_src, stride_out, stride_kept,
                                 K: tl.constexpr, HAS_WEIGHTS: tl.constexpr, KEEP: tl.constexpr,
                                 BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        ts = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        inside = cols < D
        acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
        for j in tl.static_range(K):
            r = tl.load(rows + ts * K + j, mask=ts < T, other=-1).to(tl.int64)
            read_mask = (r >= 0)[:, None] & inside[None, :]
            read = tl.load(src + r[:, None] * stride_src + cols[None, :], mask=read_mask, other=0.0)
            if KEEP:
                tl.store(kept + r[:, None] * stride_kept + cols[None, :], read, mask=read_mask)
            picked = read.to(tl.float32)
            if HAS_WEIGHTS:
                picked = picked * tl.load(weights + ts * K + j, mask=r >= 0, other=0.0).to(tl.float32)[:, None]
            acc += picked
        tl.store(out + ts[:, None] * stride_out + cols[None, :], acc.to(out.dtype.element_ty),
                 mask=(ts < T)[:, None] & inside[None, :])

    @triton.jit
    def _row_dots_kernel(a, src, rows, out, T, D, stride_a, stride_src, blocks,
                         K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        """Partial dots over one block of columns: out[t, block, j], for BLOCK_R tokens' (t, j)
        pairs laid out as the tile's rows."""
        pairs = tl.arange(0, BLOCK_R * K_POW2)
        ts = tl.program_id(0).to(tl.int64) * BLOCK_R + pairs // K_POW2
        js = pairs % K_POW2
        valid = (ts < T) & (js < K)
        block = tl.program_id(1)
        r = tl.load(rows + ts * K + js, mask=valid, other=-1).to(tl.int64)
        cols = block * BLOCK_D + tl.arange(0, BLOCK_D)
        inside = cols < D
        a_rows = tl.load(a + ts[:, None] * stride_a + cols[None, :], mask=(r >= 0)[:, None] & inside[None, :],
                         other=0.0).to(tl.float32)
        picked = tl.load(src + r[:, None] * stride_src + cols[None, :], mask=(r >= 0)[:, None] & inside[None, :],
                         other=0.0).to(tl.float32)
        tl.store(out + (ts * blocks + block) * K + js, tl.sum(picked * a_rows, axis=1), mask=valid)


def _program_tile(tile: tuple[int, int] | None, name: str, columns: int, rows_per_item: int = 1) -> tuple[int, int]:
    """`tile` where given and two powers of two (Triton's block sizes; else ValueError naming the
    call `name`), `row_tile(columns, rows_per_item)` where not."""
    if tile is None:
        return row_tile(columns, rows_per_item)
    if len(tile) != 2 or any(not isinstance(n, int) or n < 1 or n & (n - 1) for n in tile):
        raise ValueError(f"{name}: tile must be (BLOCK_R, BLOCK_D), two powers of two, got {tile}")
    return tile


def _rows_ok(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def gather_rows(src_ND: torch.Tensor, index_R: torch.Tensor, scale_I: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None, divisor: int = 1, out: torch.Tensor | None = None,
                tile: tuple[int, int] | None = None) -> torch.Tensor:
    """(R, D): with i = index[r], row r is scale[i] * src[i // divisor] (float32 product, cast to
    `out_dtype`, default src's), zero where i < 0; written into `out` where given (rows of unit
    column stride, e.g. a slice of a peer buffer), which is returned. `tile`: (BLOCK_R, BLOCK_D)
    of a program, default `row_tile(D)`."""
    shape, dtype = (index_R.shape[0], src_ND.shape[1]), out_dtype or src_ND.dtype
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=src_ND.device)
    elif tuple(out.shape) != shape or out.dtype != dtype or out.device != src_ND.device or out.stride(1) != 1:
        raise ValueError(f"gather_rows: out must be {shape} {dtype} on {src_ND.device} with unit column stride, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device} strides {out.stride()}")
    if out.numel() == 0:
        return out
    src_ND, index_R = _rows_ok(src_ND), index_R.contiguous()
    block_r, block_d = _program_tile(tile, "gather_rows", src_ND.shape[1])
    grid = (triton.cdiv(index_R.shape[0], block_r), triton.cdiv(src_ND.shape[1], block_d))
    _gather_rows_kernel[grid](src_ND, index_R, scale_I if scale_I is not None else index_R, out, index_R.shape[0],
                              src_ND.shape[1], src_ND.stride(0), out.stride(0), divisor,
                              HAS_SCALE=scale_I is not None, BLOCK_R=block_r, BLOCK_D=block_d)
    return out


def weighted_row_sum(src_RD: torch.Tensor, rows_TK: torch.Tensor, weights_TK: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None, kept_RD: torch.Tensor | None = None,
                     tile: tuple[int, int] | None = None) -> torch.Tensor:
    """(T, D): row t is sum_j weights[t, j] * src[rows[t, j]] over rows[t, j] >= 0, in float32.
    `kept_RD` (src's shape and dtype, unit column stride), where given: every row read is also
    written there at its own index, in the same pass; the rows no index names are left as they
    were. `tile`: (BLOCK_R, BLOCK_D) of a program, default `row_tile(D)`."""
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
    block_r, block_d = _program_tile(tile, "weighted_row_sum", src_RD.shape[1])
    grid = (triton.cdiv(num_tokens, block_r), triton.cdiv(src_RD.shape[1], block_d))
    _weighted_row_sum_kernel[grid](src_RD, rows_TK, weights, out, kept, num_tokens, src_RD.shape[1],
                                   src_RD.stride(0), out.stride(0), kept.stride(0), K=k,
                                   HAS_WEIGHTS=weights_TK is not None, KEEP=kept_RD is not None,
                                   BLOCK_R=block_r, BLOCK_D=block_d)
    return out


def row_dots(a_TD: torch.Tensor, src_RD: torch.Tensor, rows_TK: torch.Tensor,
             tile: tuple[int, int] | None = None) -> torch.Tensor:
    """(T, K) float32: a[t] . src[rows[t, j]], 0 where rows[t, j] < 0. `tile`: (BLOCK_R tokens,
    BLOCK_D) of a program, default `row_tile(D, next_power_of_2(K))`."""
    num_tokens, k = rows_TK.shape
    if num_tokens * k == 0:
        return torch.zeros(num_tokens, k, dtype=torch.float32, device=a_TD.device)
    a_TD, src_RD, rows_TK = _rows_ok(a_TD), _rows_ok(src_RD), rows_TK.contiguous()
    k_pow2 = triton.next_power_of_2(k)
    block_r, block_d = _program_tile(tile, "row_dots", a_TD.shape[1], k_pow2)
    blocks = triton.cdiv(a_TD.shape[1], block_d)
    partial = torch.empty(num_tokens, blocks, k, dtype=torch.float32, device=a_TD.device)
    _row_dots_kernel[(triton.cdiv(num_tokens, block_r), blocks)](
        a_TD, src_RD, rows_TK, partial, num_tokens, a_TD.shape[1], a_TD.stride(0), src_RD.stride(0), blocks, K=k,
        K_POW2=k_pow2, BLOCK_R=block_r, BLOCK_D=block_d)
    return partial.sum(1)  # a fixed-order reduction over the column blocks: deterministic
