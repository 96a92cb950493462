"""The weight gradient of a grouped GEMM as one Triton kernel: for each group g of consecutive rows
[offs[g - 1], offs[g]), x's rows transposed times dy's, (G, K, N), optionally added to a tensor
in place (`into`) in the kernel's epilogue.

The product whose groups run along the reduction is the one the experts' weight gradients take
when their rows are grouped by expert (dropless, fixed-size exchanges). `torch._grouped_mm`
(CUTLASS) computes it at about this kernel's speed (0.91-1.08x this kernel's time on phi35- and
mixtral-like shapes on an H200; docs/benchmarks.md), but cannot add into an existing gradient:
where one weight's gradient is the sum of a share computed earlier and this product (the own
pairs' share in `a2a_algo="dedup-fixed-own"`, `weft.moe.experts.GroupedWeightGradParts`), the
separate weight-sized add read and wrote ~1.3 GB a weight beside an exchange. Here the epilogue
reads the share's tile, adds the float32 sum and writes the result over it, rounded once.

The kernel is persistent (one program an SM, all but `sm_margin` of them: an exchange beside it
keeps its SMs); each work item is one (BM, BN) tile of one group's gradient, its group's rows
reduced in steps of BR: the whole steps read by the tensor memory accelerator where the operands
allow it (a block may reach into the next group's rows, so the group's last, partial step is
read by masked pointer loads, the rows past its end as zeros). Every output element is written by
one work item, its sum taken in the same order every run: two runs give bitwise equal gradients,
and a group without rows gets zeros (or `into`'s values). Rows from offs[-1] on are never read.

`weft.kernels.grouped_mm.weights_per_group` is its PyTorch reference (`grouped_weights_mm`'s
fallback and the test oracle); under Triton's interpreter (TRITON_INTERPRET=1) the kernel runs on
CPU tensors too, which is how the CPU suite tests it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from weft.kernels import tma
from weft.kernels.rows import triton, triton_usable

if triton is not None:
    import triton.language as tl


@dataclass(frozen=True)
class WGradTiles:
    """The kernel's tiles: `block_m` of x's columns (the gradient's rows), `block_n` of dy's, and
    `block_r` rows reduced a step; `group`: row tiles taken together across the column tiles (the
    programs running at once share x's and dy's blocks in L2); `per_sm`: persistent programs an SM
    (2: one program's epilogue runs beside another's loads, where both fit). The 16-bit GPU default,
    128 x 128 x 32 tiles in 5 stages, 4 warps, two programs an SM, is the fastest of those
    `scripts/wgrad_probe.py` timed on the layer configs' shapes, most of all with the epilogue's
    read of `into` (SGD's update: 3-14% below one program of 128 x 256 x 32 an SM;
    docs/benchmarks.md); 64-row steps in 4 stages do not fit the H200's shared memory beside the
    output tile."""

    block_m: int = 128
    block_n: int = 128
    block_r: int = 32
    num_warps: int = 4
    num_stages: int = 5
    group: int = 8
    per_sm: int = 2

    @staticmethod
    def for_device(device: torch.device, dtype: torch.dtype = torch.bfloat16, sm_margin: int = 0) -> WGradTiles:
        """wgmma-sized tiles for 16-bit operands on CUDA, smaller stages for float32; small tiles for
        the CPU interpreter (its programs run one after another). With SMs left to a kernel beside
        (`sm_margin`), one program an SM: two an SM would fill the spare SMs too (the hardware
        places a grid's blocks on every SM), so the 128 x 256 tiles that run best one an SM."""
        if device.type != "cuda":
            return WGradTiles(16, 16, 16, 1, 1, 2)
        if dtype == torch.float32:
            return WGradTiles(128, 128, 32, 8, 3, per_sm=1)
        if sm_margin > 0:
            return WGradTiles(128, 256, 32, 8, 5, per_sm=1)
        return WGradTiles()


def grouped_wgrad_takes(x_MK: torch.Tensor, dy_MN: torch.Tensor) -> bool:
    """Whether `grouped_wgrad` runs on these operands: both 2-D with unit column stride (any, with no
    rows: none is read), the same 16-bit or float32 dtype, the same device, where the Triton
    kernels run (`triton_usable`)."""
    return (x_MK.dim() == dy_MN.dim() == 2 and x_MK.dtype == dy_MN.dtype
            and x_MK.dtype in (torch.bfloat16, torch.float16, torch.float32) and x_MK.device == dy_MN.device
            and (x_MK.stride(1) == 1 and dy_MN.stride(1) == 1 or x_MK.shape[0] == 0) and triton_usable(x_MK))


def grouped_wgrad(x_MK: torch.Tensor, dy_MN: torch.Tensor, offs_G: torch.Tensor, into: torch.Tensor | None = None,
                  sm_margin: int = 0, tiles: WGradTiles | None = None, alpha: float = 1.0,
                  beta: float = 1.0) -> torch.Tensor:
    """(G, K, N) in x's dtype: for each group g, x's rows [offs[g - 1], offs[g]) transposed times
    dy's (`offs_G`: int32 ends on x's device, non-decreasing, at most x's rows, which may be none;
    nothing read on the host, so CUDA graphs capture the call). Accumulated in float32 (IEEE products for float32
    operands) and rounded once; with `into` (a contiguous (G, K, N) tensor of x's dtype, e.g. a
    share of the same gradient computed earlier) the sum starts from `into`'s values and is
    written there, in place of a separate weight-sized add; `alpha` and `beta` scale the two
    (beta * into + alpha * x^T dy, in float32: with `into` the weight, alpha = -lr and beta = 1 -
    lr * weight_decay, SGD's update in the epilogue). On GPUs the kernel runs persistent on
    all SMs but `sm_margin` (left to an exchange beside it)."""
    if not grouped_wgrad_takes(x_MK, dy_MN):
        raise ValueError(f"grouped_wgrad takes two 2-D row-major {x_MK.device.type} operands of one 16-bit or "
                         f"float32 dtype where Triton runs; got {tuple(x_MK.shape)} {x_MK.dtype} and "
                         f"{tuple(dy_MN.shape)} {dy_MN.dtype}")
    G, K, N = offs_G.shape[0], x_MK.shape[1], dy_MN.shape[1]
    if x_MK.shape[0] != dy_MN.shape[0]:
        raise ValueError(f"grouped_wgrad: x has {x_MK.shape[0]} rows and dy {dy_MN.shape[0]}")
    if into is not None and (into.shape != (G, K, N) or into.dtype != x_MK.dtype or not into.is_contiguous()
                             or into.device != x_MK.device):
        raise ValueError(f"grouped_wgrad: `into` must be a contiguous {(G, K, N)} {x_MK.dtype} tensor on "
                         f"{x_MK.device}; got {tuple(into.shape)} {into.dtype}")
    if into is None and (alpha != 1.0 or beta != 1.0):
        raise ValueError(f"grouped_wgrad: alpha ({alpha}) and beta ({beta}) scale a sum into `into`; none given")
    tiles = tiles or WGradTiles.for_device(x_MK.device, x_MK.dtype, sm_margin)
    out = into if into is not None else x_MK.new_empty(G, K, N)
    if out.numel() == 0:
        return out
    if x_MK.shape[0] == 0:  # no rows: every group's sum is zeros (a TMA descriptor takes no empty tensor)
        return out.zero_() if into is None else out.mul_(beta)
    x_desc = dy_desc = out_desc = None
    if tma.takes(x_MK) and tma.takes(dy_MN):
        x_desc = tma.TensorDescriptor.from_tensor(x_MK, [tiles.block_r, tiles.block_m])
        dy_desc = tma.TensorDescriptor.from_tensor(dy_MN, [tiles.block_r, tiles.block_n])
        if K % tiles.block_m == 0:  # a block never reaches the next group's rows
            out_desc = tma.TensorDescriptor.from_tensor(out.view(G * K, N), [tiles.block_m, tiles.block_n])
    n_mt, n_nt = triton.cdiv(K, tiles.block_m), triton.cdiv(N, tiles.block_n)
    work = G * n_mt * n_nt
    if x_MK.is_cuda:
        sms = torch.cuda.get_device_properties(x_MK.device).multi_processor_count
        programs = min(work, tiles.per_sm * max(1, sms - sm_margin))
        launch = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    else:  # the interpreter: one program a work item
        programs, launch = work, {}
    ieee = x_MK.dtype == torch.float32 or not x_MK.is_cuda
    _grouped_wgrad_kernel[(programs,)](
        x_MK, x_desc, dy_MN, dy_desc, out, out_desc, offs_G.to(torch.int32), K, N, x_MK.stride(0), dy_MN.stride(0),
        n_mt, n_nt, work, float(alpha), float(beta), BM=tiles.block_m, BN=tiles.block_n, BR=tiles.block_r,
        GROUP=tiles.group, TMA=x_desc is not None, TMA_OUT=out_desc is not None, ACC=into is not None, IEEE=ieee,
        INTERPRET=not x_MK.is_cuda, **launch)
    return out


def grouped_wgrad_into(into_GKN: torch.Tensor, x_MK: torch.Tensor, dy_MN: torch.Tensor, offs_G: torch.Tensor,
                       alpha: float, beta: float) -> bool:
    """`grouped_wgrad(x, dy, offs, into, alpha=alpha, beta=beta)` where it runs on these operands and
    `into` is contiguous in their dtype (SGD's step in the epilogue, with `into` a weight); False,
    `into` untouched, elsewhere."""
    if not (grouped_wgrad_takes(x_MK, dy_MN) and into_GKN.is_contiguous() and into_GKN.dtype == x_MK.dtype):
        return False
    grouped_wgrad(x_MK, dy_MN, offs_G, into=into_GKN, alpha=alpha, beta=beta)
    return True


if triton is not None:

    @triton.jit
    def _dot_t(a_RM, b_RN, acc, IEEE: tl.constexpr):
        """acc + a^T @ b in float32: IEEE products for float32 operands (not TF32) and under the
        interpreter (whose dot of bfloat16 tiles is wrong in Triton 3.6)."""
        if IEEE:
            return tl.dot(tl.trans(a_RM.to(tl.float32)), b_RN.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(tl.trans(a_RM), b_RN, acc)

    @triton.jit
    def _whole_step(acc, x, x_desc, dy, dy_desc, r0, tm, tn, m, n, m_ok, n_ok, sx, sdy, BM: tl.constexpr,
                    BN: tl.constexpr, BR: tl.constexpr, TMA: tl.constexpr, IEEE: tl.constexpr):
        """acc + x[r0:r0 + BR, m]^T @ dy[r0:r0 + BR, n], every row inside the group."""
        if TMA:
            a = x_desc.load([r0, tm * BM])
            b = dy_desc.load([r0, tn * BN])
        else:
            r = (r0 + tl.arange(0, BR)).to(tl.int64)
            a = tl.load(x + r[:, None] * sx + m[None, :], mask=m_ok[None, :], other=0.0)
            b = tl.load(dy + r[:, None] * sdy + n[None, :], mask=n_ok[None, :], other=0.0)
        return _dot_t(a, b, acc, IEEE)

    @triton.jit
    def _tile(x, x_desc, dy, dy_desc, out, out_desc, ends, K, N, sx, sdy, n_mt, n_nt, q, alpha, beta,
              BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, GROUP: tl.constexpr, TMA: tl.constexpr,
              TMA_OUT: tl.constexpr, ACC: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
        """Work item q: group q // (n_mt * n_nt), one (BM, BN) tile of its gradient (GROUP row tiles
        across every column tile), reduced over the group's rows in steps of BR, the last partial
        step by masked loads; ACC: alpha times it added to beta times what the tile holds."""
        per_group = n_mt * n_nt
        g = q // per_group
        t = q % per_group
        width = GROUP * n_nt
        first_mt = (t // width) * GROUP
        size = tl.minimum(n_mt - first_mt, GROUP)
        tm = first_mt + (t % width) % size
        tn = (t % width) // size
        start = tl.where(g > 0, tl.load(ends + tl.maximum(g - 1, 0)), 0)
        end = tl.load(ends + g)
        m = tm * BM + tl.arange(0, BM)
        n = tn * BN + tl.arange(0, BN)
        m_ok = m < K
        n_ok = n < N
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        whole = start + (end - start) // BR * BR
        if INTERPRET:  # its range() cannot take a loaded bound (numpy 2); the same steps, unpipelined
            r0 = start
            while r0 < whole:
                acc = _whole_step(acc, x, x_desc, dy, dy_desc, r0, tm, tn, m, n, m_ok, n_ok, sx, sdy,
                                  BM, BN, BR, TMA, IEEE)
                r0 += BR
        else:
            for r0 in range(start, whole, BR):
                acc = _whole_step(acc, x, x_desc, dy, dy_desc, r0, tm, tn, m, n, m_ok, n_ok, sx, sdy,
                                  BM, BN, BR, TMA, IEEE)
        if whole < end:
            r = whole + tl.arange(0, BR)
            r_ok = r < end
            r = r.to(tl.int64)
            a = tl.load(x + r[:, None] * sx + m[None, :], mask=r_ok[:, None] & m_ok[None, :], other=0.0)
            b = tl.load(dy + r[:, None] * sdy + n[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
            acc = _dot_t(a, b, acc, IEEE)
        if TMA_OUT:
            at = [g * K + tm * BM, tn * BN]
            if ACC:
                acc = beta * out_desc.load(at).to(tl.float32) + alpha * acc
            out_desc.store(at, acc.to(out_desc.dtype))
        else:
            at = out + g.to(tl.int64) * K * N + m[:, None].to(tl.int64) * N + n[None, :]
            ok = m_ok[:, None] & n_ok[None, :]
            if ACC:
                acc = beta * tl.load(at, mask=ok, other=0.0).to(tl.float32) + alpha * acc
            tl.store(at, acc.to(out.dtype.element_ty), mask=ok)

    @triton.jit
    def _grouped_wgrad_kernel(x, x_desc, dy, dy_desc, out, out_desc, ends, K, N, sx, sdy, n_mt, n_nt, work, alpha,
                              beta, BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, GROUP: tl.constexpr,
                              TMA: tl.constexpr, TMA_OUT: tl.constexpr, ACC: tl.constexpr, IEEE: tl.constexpr,
                              INTERPRET: tl.constexpr):
        """Persistent: program p takes work items p, p + programs, ... below `work` (under the
        interpreter one program a work item)."""
        if INTERPRET:
            _tile(x, x_desc, dy, dy_desc, out, out_desc, ends, K, N, sx, sdy, n_mt, n_nt, tl.program_id(0), alpha, beta,
                  BM, BN, BR, GROUP, TMA, TMA_OUT, ACC, IEEE, INTERPRET)
        else:
            for q in range(tl.program_id(0), work, tl.num_programs(0)):
                _tile(x, x_desc, dy, dy_desc, out, out_desc, ends, K, N, sx, sdy, n_mt, n_nt, q, alpha, beta,
                      BM, BN, BR, GROUP, TMA, TMA_OUT, ACC, IEEE, INTERPRET)
