"""The experts' weight gradient over row groups as one Triton kernel: out[g] = x[rows of g]^T dy[rows of g].

Grouped along the contracted rows (the 2-D x 2-D form of `torch._grouped_mm`): group g's rows are
[ends[g - 1], ends[g]) of x (M, K) and dy (M, N), ends int32 on the device, so a CUDA graph can
hold the call whatever the counts. Each output tile (BM, BN) of one group's (K, N) is computed by
one program over that group's rows, BK at a time: the whole steps read by the tensor memory
accelerator (TMA), the group's last partial step by masked loads (a TMA block would read the next
group's rows), accumulated in float32 in row order and stored once. No atomics: two runs give
bitwise equal results; a group without rows gets zeros. `PERSISTENT`: one program per SM looping
over the tiles.

The plain per-group loop (`grouped_weights_mm_reference`) is the oracle, and runs the kernel's
steps on the CPU under Triton's interpreter (TRITON_INTERPRET=1), which runs descriptors as loads.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from weft.kernels.rows import triton, triton_usable

if triton is not None:
    import triton.language as tl
try:  # Triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None


@dataclass(frozen=True)
class WgradTiles:
    """Tile shape and pipeline of the weight-gradient kernel: (block_m, block_n) of the (K, N)
    output per tile, block_k rows a step; `persistent`: one program per SM."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    persistent: bool = False

    def __str__(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k}w{self.num_warps}s{self.num_stages}"
                + ("p" if self.persistent else ""))

    @staticmethod
    def parse(text: str) -> WgradTiles:
        """'128x128x64w8s3' -> WgradTiles(128, 128, 64, 8, 3); a trailing 'p': persistent."""
        persistent = text.endswith("p")
        shape, rest = text.removesuffix("p").split("w")
        warps, stages = rest.split("s")
        m, n, k = (int(v) for v in shape.split("x"))
        return WgradTiles(m, n, k, int(warps), int(stages), persistent)


def grouped_weights_mm_reference(x_MK: torch.Tensor, dy_MN: torch.Tensor, ends_G: torch.Tensor) -> torch.Tensor:
    """(G, K, N) in float32 per group, rounded to x's dtype: the kernel's oracle (reads the ends on the host)."""
    out = x_MK.new_empty(ends_G.shape[0], x_MK.shape[1], dy_MN.shape[1])
    start = 0
    for g, end in enumerate(ends_G.tolist()):
        out[g] = (x_MK[start:end].float().t() @ dy_MN[start:end].float()).to(out.dtype)
        start = end
    return out


def wgrad_takes(x_MK: torch.Tensor, dy_MN: torch.Tensor, tiles: WgradTiles) -> bool:
    """Whether the kernel runs on these operands: Triton on CUDA sm90+ (or the interpreter), 16-bit,
    row-major with 16-byte aligned rows, and K a multiple of block_m (each group's tiles end at its
    rows of the (G * K, N) output)."""
    if TensorDescriptor is None or not triton_usable(x_MK) or x_MK.dtype != dy_MN.dtype:
        return False
    if x_MK.dtype not in (torch.bfloat16, torch.float16) or x_MK.shape[1] % tiles.block_m:
        return False
    if x_MK.is_cuda and torch.cuda.get_device_capability(x_MK.device)[0] < 9:
        return False
    return all(m.stride(1) == 1 and m.data_ptr() % 16 == 0 and m.stride(0) * m.element_size() % 16 == 0
               for m in (x_MK, dy_MN))


def grouped_weights_mm_triton(x_MK: torch.Tensor, dy_MN: torch.Tensor, ends_G: torch.Tensor,
                              tiles: WgradTiles | None = None) -> torch.Tensor:
    """(G, K, N): x^T dy over each group's rows, by `_wgrad_kernel` (`wgrad_takes` must hold).
    Rows from ends[-1] on are left out."""
    tiles = tiles or WgradTiles()
    if not wgrad_takes(x_MK, dy_MN, tiles):
        raise ValueError(f"the weight-gradient kernel does not take x {tuple(x_MK.shape)} {x_MK.dtype} "
                         f"and dy {tuple(dy_MN.shape)} {dy_MN.dtype} on {x_MK.device}")
    groups, (_, K), N = ends_G.shape[0], x_MK.shape, dy_MN.shape[1]
    out = x_MK.new_empty(groups, K, N)
    if out.numel() == 0:
        return out
    BM, BN, BK = tiles.block_m, tiles.block_n, tiles.block_k
    x_desc = TensorDescriptor.from_tensor(x_MK, [BK, BM])
    dy_desc = TensorDescriptor.from_tensor(dy_MN, [BK, BN])
    out_desc = TensorDescriptor.from_tensor(out.view(groups * K, N), [BM, BN])
    n_tiles = groups * (K // BM) * triton.cdiv(N, BN)
    programs = n_tiles
    if tiles.persistent and x_MK.is_cuda:
        programs = min(n_tiles, torch.cuda.get_device_properties(x_MK.device).multi_processor_count)
    options = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages} if x_MK.is_cuda else {}
    _wgrad_kernel[(programs,)](
        x_desc, dy_desc, out_desc, x_MK, dy_MN, ends_G.to(torch.int32), K, N, x_MK.stride(0), dy_MN.stride(0),
        n_tiles, BM=BM, BN=BN, BK=BK, IEEE=not x_MK.is_cuda, INTERPRET=not x_MK.is_cuda, **options)
    return out


if triton is not None:
    @triton.jit
    def _wgrad_kernel(x_desc, dy_desc, out_desc, x_ptr, dy_ptr, ends_ptr, K, N, stride_x, stride_dy, n_tiles,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
                      INTERPRET: tl.constexpr):
        """Tiles pid, pid + programs, ... (`_wgrad_tile`): a tile's whole BK steps of rows by TMA,
        the partial last one masked."""
        if INTERPRET:  # the interpreter bounds no for loop by a program id or a loaded value: while loops
            t = tl.program_id(0)
            while t < n_tiles:
                _wgrad_tile(t, x_desc, dy_desc, out_desc, x_ptr, dy_ptr, ends_ptr, K, N, stride_x, stride_dy,
                            BM, BN, BK, IEEE, INTERPRET)
                t += tl.num_programs(0)
        else:
            for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
                _wgrad_tile(t, x_desc, dy_desc, out_desc, x_ptr, dy_ptr, ends_ptr, K, N, stride_x, stride_dy,
                            BM, BN, BK, IEEE, INTERPRET)

    @triton.jit
    def _wgrad_tile(t, x_desc, dy_desc, out_desc, x_ptr, dy_ptr, ends_ptr, K, N, stride_x, stride_dy,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
                    INTERPRET: tl.constexpr):
        """Tile t: group t // (tiles a group), then row tile, then column tile."""
        tiles_n = tl.cdiv(N, BN)
        per_group = (K // BM) * tiles_n
        g = t // per_group
        m0 = (t % per_group) // tiles_n * BM
        n0 = (t % per_group) % tiles_n * BN
        start = tl.where(g > 0, tl.load(ends_ptr + tl.maximum(g - 1, 0)), 0)
        end = tl.load(ends_ptr + g)
        whole = start + (end - start) // BK * BK
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if INTERPRET:
            row = start
            while row < whole:
                acc = dot(x_desc.load([row, m0]).T, dy_desc.load([row, n0]), acc, IEEE)
                row += BK
        else:
            for row in range(start, whole, BK):
                acc = dot(x_desc.load([row, m0]).T, dy_desc.load([row, n0]), acc, IEEE)
        if whole < end:  # the group's last rows, fewer than BK: masked (a block would read the next group's)
            offs_r = whole + tl.arange(0, BK)
            in_r = offs_r < end
            a = tl.load(x_ptr + offs_r[:, None].to(tl.int64) * stride_x + (m0 + tl.arange(0, BM))[None, :],
                        mask=in_r[:, None], other=0.0)
            offs_n = n0 + tl.arange(0, BN)
            b = tl.load(dy_ptr + offs_r[:, None].to(tl.int64) * stride_dy + offs_n[None, :],
                        mask=in_r[:, None] & (offs_n < N)[None, :], other=0.0)
            acc = dot(a.T, b, acc, IEEE)
        out_desc.store([g * K + m0, n0], acc.to(out_desc.dtype))

    @triton.jit
    def dot(a, b, acc, IEEE: tl.constexpr):
        """acc + a @ b in float32: IEEE products for fp32 inputs (not TF32); 16-bit inputs in float32 under
        the interpreter, whose dot of bfloat16 tiles is wrong (Triton 3.6)."""
        if IEEE:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a, b, acc)
