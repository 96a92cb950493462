"""The experts' weight gradient over row groups as one Triton kernel: out[g] = x[rows of g]^T dy[rows of g].

Grouped along the contracted rows (the 2-D x 2-D form of `torch._grouped_mm`): group g's rows are
[ends[g - 1], ends[g]) of x (M, K) and dy (M, N), ends int32 on the device, so a CUDA graph can
hold the call whatever the counts. Each program computes one (BM, BN) tile of one group's (K, N)
output over that group's rows in steps of BK, accumulating in float32 in row order, and stores it
once: no atomics, so two runs give bitwise equal results, and a group without rows gets zeros.

Why a kernel of our own: on an H200 `torch._grouped_mm`'s CUTLASS kernel runs this product at
379 TFLOP/s on qwen2-like groups of 256 rows, where cuBLAS's batched matmul on equal groups
reaches 526 (docs/benchmarks.md, twenty-seventh session); every dropless path pays it twice a step.
The plain per-group loop (`grouped_weights_mm_reference`) is its oracle on the CPU, where Triton's
interpreter (TRITON_INTERPRET=1) runs the kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from weft.kernels.rows import triton, triton_usable

if triton is not None:
    import triton.language as tl


@dataclass(frozen=True)
class WgradTiles:
    """Tile shape and pipeline of the weight-gradient kernel: (block_m, block_n) of the (K, N)
    output per program, block_k rows a step."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k}w{self.num_warps}s{self.num_stages}"

    @staticmethod
    def parse(text: str) -> WgradTiles:
        """'128x128x64w8s3' -> WgradTiles(128, 128, 64, 8, 3)."""
        shape, rest = text.split("w")
        warps, stages = rest.split("s")
        m, n, k = (int(v) for v in shape.split("x"))
        return WgradTiles(m, n, k, int(warps), int(stages))


def grouped_weights_mm_reference(x_MK: torch.Tensor, dy_MN: torch.Tensor, ends_G: torch.Tensor) -> torch.Tensor:
    """(G, K, N) in float32 per group, rounded to x's dtype: the kernel's oracle (reads the ends on the host)."""
    out = x_MK.new_empty(ends_G.shape[0], x_MK.shape[1], dy_MN.shape[1])
    start = 0
    for g, end in enumerate(ends_G.tolist()):
        out[g] = (x_MK[start:end].float().t() @ dy_MN[start:end].float()).to(out.dtype)
        start = end
    return out


def grouped_weights_mm_triton(x_MK: torch.Tensor, dy_MN: torch.Tensor, ends_G: torch.Tensor,
                              tiles: WgradTiles | None = None) -> torch.Tensor:
    """(G, K, N): x^T dy over each group's rows, by `_wgrad_kernel` (x, dy row-major with unit
    column stride; float32 operands multiply in IEEE float32, not TF32). Rows from ends[-1] on are
    left out."""
    if not triton_usable(x_MK):
        raise RuntimeError(f"the weight-gradient kernel needs Triton on CUDA (or TRITON_INTERPRET=1); "
                           f"got a {x_MK.device.type} tensor")
    if x_MK.shape[0] != dy_MN.shape[0] or x_MK.dtype != dy_MN.dtype:
        raise ValueError(f"x {tuple(x_MK.shape)} {x_MK.dtype} and dy {tuple(dy_MN.shape)} {dy_MN.dtype} "
                         f"need the same rows and dtype")
    tiles = tiles or WgradTiles()
    x_MK, dy_MN = _unit_columns(x_MK), _unit_columns(dy_MN)
    groups, (_, K), N = ends_G.shape[0], x_MK.shape, dy_MN.shape[1]
    out = x_MK.new_empty(groups, K, N)
    if out.numel() == 0:
        return out
    grid = (triton.cdiv(K, tiles.block_m) * triton.cdiv(N, tiles.block_n), groups)
    _wgrad_kernel[grid](
        x_MK, dy_MN, out, ends_G.to(torch.int32), K, N, x_MK.stride(0), dy_MN.stride(0),
        BM=tiles.block_m, BN=tiles.block_n, BK=tiles.block_k,
        IEEE=x_MK.dtype == torch.float32 or not x_MK.is_cuda, INTERPRET=not x_MK.is_cuda,
        **({"num_warps": tiles.num_warps, "num_stages": tiles.num_stages} if x_MK.is_cuda else {}))
    return out


def _unit_columns(m: torch.Tensor) -> torch.Tensor:
    return m if m.stride(1) == 1 else m.contiguous()


if triton is not None:
    @triton.jit
    def _wgrad_kernel(x_ptr, dy_ptr, out_ptr, ends_ptr, K, N, stride_x, stride_dy,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
                      INTERPRET: tl.constexpr):
        """Program (tile, g): out[g][m0:m0 + BM, n0:n0 + BN] = sum over group g's rows r (in steps
        of BK, rows past the group's end masked) of x[r, m0:]^T dy[r, n0:]."""
        tile = tl.program_id(0)
        g = tl.program_id(1)
        tiles_n = tl.cdiv(N, BN)
        offs_m = (tile // tiles_n) * BM + tl.arange(0, BM)
        offs_n = (tile % tiles_n) * BN + tl.arange(0, BN)
        start = tl.where(g > 0, tl.load(ends_ptr + tl.maximum(g - 1, 0)), 0)
        end = tl.load(ends_ptr + g)
        in_m = offs_m < K
        in_n = offs_n < N
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if INTERPRET:  # the interpreter cannot bound a for loop by loaded values; same steps
            row = start
            while row < end:
                acc = _wgrad_step(acc, x_ptr, dy_ptr, row, end, offs_m, offs_n, in_m, in_n, stride_x, stride_dy,
                                  BK, IEEE)
                row += BK
        else:  # a for loop, which Triton pipelines (num_stages)
            for row in range(start, end, BK):
                acc = _wgrad_step(acc, x_ptr, dy_ptr, row, end, offs_m, offs_n, in_m, in_n, stride_x, stride_dy,
                                  BK, IEEE)
        out = out_ptr + g.to(tl.int64) * K * N + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])

    @triton.jit
    def _wgrad_step(acc, x_ptr, dy_ptr, row, end, offs_m, offs_n, in_m, in_n, stride_x, stride_dy,
                    BK: tl.constexpr, IEEE: tl.constexpr):
        """acc + x[row:row + BK, offs_m]^T dy[row:row + BK, offs_n], rows from `end` on as zeros."""
        offs_r = row + tl.arange(0, BK)
        in_r = offs_r < end
        a = tl.load(x_ptr + offs_r[None, :].to(tl.int64) * stride_x + offs_m[:, None],
                    mask=in_r[None, :] & in_m[:, None], other=0.0)
        b = tl.load(dy_ptr + offs_r[:, None].to(tl.int64) * stride_dy + offs_n[None, :],
                    mask=in_r[:, None] & in_n[None, :], other=0.0)
        return dot(a, b, acc, IEEE)

    @triton.jit
    def dot(a, b, acc, IEEE: tl.constexpr):
        """acc + a @ b in float32: IEEE products for fp32 inputs (not TF32); 16-bit inputs in float32 under
        the interpreter, whose dot of bfloat16 tiles is wrong (Triton 3.6)."""
        if IEEE:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a, b, acc)
