"""The router's product x @ W^T in float32 from bf16 rows, as Triton kernels beside the PyTorch
reference.

`router_matmul(x_TD, weight_ED)` is `x.float() @ weight.t()` (the routers' logits, and the cosine
router's projection) to float32's rounding. The reference first writes a float32 copy of x (twice
x's bytes), keeps it for the backward, multiplies on cuBLAS's float32 (non-tensor-core) GEMM and
casts the input gradient from float32 afterwards. Here x is read in bf16 and kept as it is, and
the products run on the tensor cores: a float32 operand is split into three bf16 parts whose sum
is it exactly (8 + 8 + 8 significant bits), so bf16 x times each part of the weight is exact in
float32 and only the float32 sums round, as in the reference (in another order). The input
gradient (float32 times float32) keeps the six products of parts above 2^-24 of the whole
(bf16x6) and is written in bf16 by the kernel that makes it; the weight gradient is made from
the bf16 rows.

Each output element is written by one program, with no atomics: the weight gradient's tokens are
split between programs and their float32 partial sums added in a fixed order, so two runs give
bitwise equal results. The kernels run on CUDA tensors, and on CPU tensors under Triton's
interpreter (TRITON_INTERPRET=1), which is how the CPU suite tests them.
"""
from __future__ import annotations

import torch

from weft.kernels.rows import triton, triton_usable

if triton is not None:
    import triton.language as tl

# Tiles (BLOCK_T, BLOCK_D, BLOCK_E) of each kernel. The products are thin (E columns, or K = E),
# so the kernels are bound by x's bytes: many short programs. D and E are compile-time constants
# (the loops' bounds): one compilation per router shape.
LOGITS_TILES = (32, 128, 64)
INPUT_GRAD_TILES = (64, 128, 32)
WEIGHT_GRAD_TILES = (64, 128, 64)
WGRAD_ROWS = 512  # tokens a weight-gradient program sums before its partial is written


def router_matmul_reference(x_TD: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:
    """The CPU path and the test oracle: x in float32 times the float32 weight."""
    return x_TD.float() @ weight_ED.float().t()


def fused_router_matmul_on(x_TD: torch.Tensor, weight_ED: torch.Tensor) -> bool:
    """Whether `router_matmul` runs here: bf16 rows and a float32 weight where Triton runs (on
    float32 rows the reference makes no copy; fp16 rows would need fp16 parts of the weight,
    whose range is too short for its low parts)."""
    return x_TD.dtype == torch.bfloat16 and weight_ED.dtype == torch.float32 and triton_usable(x_TD)


def router_matmul(x_TD: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:
    """(T, E) float32 = x (T, D; bf16) @ weight (E, D; float32)^T, differentiable in both."""
    if x_TD.dim() != 2 or weight_ED.dim() != 2 or x_TD.shape[1] != weight_ED.shape[1]:
        raise ValueError(f"router_matmul: x {tuple(x_TD.shape)} and weight {tuple(weight_ED.shape)} do not "
                         f"make (T, D) @ (E, D)^T")
    if not fused_router_matmul_on(x_TD, weight_ED):
        raise ValueError(f"router_matmul takes bf16 rows and a float32 weight where Triton runs; got "
                         f"{x_TD.dtype} rows and a {weight_ED.dtype} weight on {x_TD.device.type}")
    return _RouterMatmul.apply(x_TD, weight_ED)


class _RouterMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:
        x_TD, weight_ED = x_TD.contiguous(), weight_ED.contiguous()
        ctx.save_for_backward(x_TD, weight_ED)
        return _logits(x_TD, weight_ED)

    @staticmethod
    def backward(ctx, grad_TE: torch.Tensor):
        x_TD, weight_ED = ctx.saved_tensors
        grad_TE = grad_TE.float().contiguous()
        grad_x = _input_grad(grad_TE, weight_ED, x_TD.dtype) if ctx.needs_input_grad[0] else None
        grad_w = _weight_grad(grad_TE, x_TD) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


def _tiles(tiles: tuple[int, int, int], x: torch.Tensor) -> dict:
    return dict(zip(("BLOCK_T", "BLOCK_D", "BLOCK_E"), tiles), INTERPRET=not x.is_cuda)


def _logits(x_TD: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:
    (T, D), E = x_TD.shape, weight_ED.shape[0]
    out_TE = torch.empty(T, E, device=x_TD.device, dtype=torch.float32)
    if T == 0:
        return out_TE
    bt, _, be = LOGITS_TILES
    _logits_kernel[(triton.cdiv(T, bt), triton.cdiv(E, be))](x_TD, weight_ED, out_TE, T, D, E,
                                                             **_tiles(LOGITS_TILES, x_TD))
    return out_TE


def _input_grad(grad_TE: torch.Tensor, weight_ED: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    (T, E), D = grad_TE.shape, weight_ED.shape[1]
    out_TD = torch.empty(T, D, device=grad_TE.device, dtype=dtype)
    if T == 0:
        return out_TD
    bt, bd, _ = INPUT_GRAD_TILES
    _input_grad_kernel[(triton.cdiv(T, bt), triton.cdiv(D, bd))](grad_TE, weight_ED, out_TD, T, D, E,
                                                                 **_tiles(INPUT_GRAD_TILES, grad_TE))
    return out_TD


def _weight_grad(grad_TE: torch.Tensor, x_TD: torch.Tensor) -> torch.Tensor:
    (T, E), D = grad_TE.shape, x_TD.shape[1]
    if T == 0:
        return torch.zeros(E, D, device=x_TD.device, dtype=torch.float32)
    splits = triton.cdiv(T, WGRAD_ROWS)
    partials_SED = torch.empty(splits, E, D, device=x_TD.device, dtype=torch.float32)
    _, bd, be = WEIGHT_GRAD_TILES
    _weight_grad_kernel[(triton.cdiv(D, bd), triton.cdiv(E, be), splits)](
        grad_TE, x_TD, partials_SED, T, D, E, ROWS=WGRAD_ROWS, **_tiles(WEIGHT_GRAD_TILES, x_TD))
    return partials_SED.sum(0)  # a fixed order: deterministic


if triton is not None:
    @triton.jit
    def _split3(v):
        """float32 v as three bfloat16 parts whose sum is v exactly (8 + 8 + 8 significant bits:
        each remainder is exact in float32), highest first."""
        hi = v.to(tl.bfloat16)
        rest = v - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
        return hi, mid, lo

    @triton.jit
    def _dot(a, b, acc, INTERPRET: tl.constexpr):
        """acc + a @ b for bf16 a and b on the tensor cores. The interpreter's dot misreads a bf16
        operand made by a conversion, so there the bf16 values are multiplied as float32 (the
        products are exact either way)."""
        if INTERPRET:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def _tile(ptr, rows, cols, n_rows, n_cols, row_stride, col_stride):
        """The (rows, cols) tile of a matrix at ptr, zeros outside its n_rows x n_cols."""
        return tl.load(ptr + rows[:, None].to(tl.int64) * row_stride + cols[None, :].to(tl.int64) * col_stride,
                       mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)

    @triton.jit
    def _logits_kernel(x_ptr, w_ptr, out_ptr, T, D: tl.constexpr, E: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                       INTERPRET: tl.constexpr):
        """out[t, e] = sum_d x[t, d] * w[e, d], one (BLOCK_T, BLOCK_E) tile a program: bf16 x
        times w's three bf16 parts on the tensor cores, each product exact in float32, summed in
        float32."""
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
        acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            ds = d0 + tl.arange(0, BLOCK_D)
            x = _tile(x_ptr, rows, ds, T, D, D, 1)
            hi, mid, lo = _split3(_tile(w_ptr, ds, cols, D, E, 1, D))  # w^T's (BLOCK_D, BLOCK_E) tile
            acc = _dot(x, lo, acc, INTERPRET)
            acc = _dot(x, mid, acc, INTERPRET)
            acc = _dot(x, hi, acc, INTERPRET)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * E + cols[None, :], acc,
                 mask=(rows[:, None] < T) & (cols[None, :] < E))

    @triton.jit
    def _input_grad_kernel(g_ptr, w_ptr, out_ptr, T, D: tl.constexpr, E: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                           INTERPRET: tl.constexpr):
        """out[t, d] = sum_e g[t, e] * w[e, d] in float32, stored in out's dtype: g's and w's three
        bf16 parts, the six products of parts above 2^-24 of the whole (bf16x6)."""
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        for e0 in range(0, E, BLOCK_E):
            es = e0 + tl.arange(0, BLOCK_E)
            g_hi, g_mid, g_lo = _split3(_tile(g_ptr, rows, es, T, E, E, 1))
            w_hi, w_mid, w_lo = _split3(_tile(w_ptr, es, ds, E, D, D, 1))
            acc = _dot(g_hi, w_lo, acc, INTERPRET)
            acc = _dot(g_mid, w_mid, acc, INTERPRET)
            acc = _dot(g_lo, w_hi, acc, INTERPRET)
            acc = _dot(g_hi, w_mid, acc, INTERPRET)
            acc = _dot(g_mid, w_hi, acc, INTERPRET)
            acc = _dot(g_hi, w_hi, acc, INTERPRET)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * D + ds[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rows[:, None] < T) & (ds[None, :] < D))

    @triton.jit
    def _weight_grad_kernel(g_ptr, x_ptr, partial_ptr, T, D: tl.constexpr, E: tl.constexpr, ROWS: tl.constexpr,
                            BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                            INTERPRET: tl.constexpr):
        """partial[s, e, d] = sum over the tokens t of split s (ROWS of them) of g[t, e] * x[t, d]:
        g's three bf16 parts times bf16 x, each product exact in float32."""
        ds = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
        es = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
        split = tl.program_id(2)
        acc = tl.zeros((BLOCK_E, BLOCK_D), dtype=tl.float32)
        for t0 in range(0, ROWS, BLOCK_T):  # constant bounds (the interpreter's range takes no others)
            ts = split * ROWS + t0 + tl.arange(0, BLOCK_T)
            x = _tile(x_ptr, ts, ds, T, D, D, 1)
            hi, mid, lo = _split3(_tile(g_ptr, es, ts, E, T, 1, E))  # g^T's (BLOCK_E, BLOCK_T) tile
            acc = _dot(lo, x, acc, INTERPRET)
            acc = _dot(mid, x, acc, INTERPRET)
            acc = _dot(hi, x, acc, INTERPRET)
        tl.store(partial_ptr + (split * E + es[:, None]).to(tl.int64) * D + ds[None, :], acc,
                 mask=(es[:, None] < E) & (ds[None, :] < D))
