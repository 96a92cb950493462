"""Grouped GEMM (one matmul per row group, one kernel) where the GPU has it."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def use_grouped_mm(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """torch._grouped_mm needs CUDA sm90+, bf16 and 16-byte aligned row strides."""
    return w1.dtype == w2.dtype == x.dtype and grouped_mm_on(x.device, x.dtype, w1.shape[1], w1.shape[2])


def grouped_mm_on(device: torch.device, dtype: torch.dtype, dim: int, hidden: int) -> bool:
    """Whether `use_grouped_mm` holds for experts of widths (dim, hidden) whose rows and weights
    are `dtype` on `device`, asked before any rows exist."""
    return device.type == "cuda" and _cuda_kernel_on(device, dtype) and dim % 8 == 0 and hidden % 8 == 0


def _cuda_kernel_on(device: torch.device, dtype: torch.dtype) -> bool:
    """torch._grouped_mm's CUDA kernel: bfloat16 operands on an sm90+ GPU."""
    return (hasattr(torch, "_grouped_mm") and dtype == torch.bfloat16
            and torch.cuda.get_device_capability(device)[0] >= 9)


_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # torch._grouped_mm's on the CPU


def grouped_mm_takes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm(a, b, offs=...)` runs on these operands: on CUDA, sm90+ and
    bfloat16 (as `use_grouped_mm`); on the CPU, where PyTorch computes it group by group, float32,
    bfloat16 or float16 (not float64); everywhere, both operands row- or column-major with 16-byte
    aligned data and leading strides."""
    if not hasattr(torch, "_grouped_mm") or a.dtype != b.dtype or a.dtype not in _GROUPED_MM_DTYPES:
        return False
    if a.is_cuda and not _cuda_kernel_on(a.device, a.dtype):  # b's dtype is a's (above)
        return False
    return _aligned(a) and _aligned(b)


def _aligned(m: torch.Tensor) -> bool:
    if m.data_ptr() % 16:
        return False
    rows, cols = m.stride(-2), m.stride(-1)
    lead = rows if cols == 1 else cols if rows == 1 else None
    return lead is not None and lead * m.element_size() % 16 == 0


def grouped_rows_mm(x_MK: torch.Tensor, w_GKN: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    """(M, N): rows [offs[g - 1], offs[g]) of x times w[g] (int32 ends on x's device). Rows from
    offs[-1] on are padding: on GPUs (`torch._grouped_mm`) left unwritten, nothing may read them;
    elsewhere the per-group reference, which reads the ends on the host and writes zeros there."""
    if x_MK.is_cuda and grouped_mm_takes(x_MK, w_GKN):
        return torch._grouped_mm(x_MK, w_GKN, offs=offs_G)
    _no_host_read_in_capture(x_MK)
    out = x_MK.new_zeros(x_MK.shape[0], w_GKN.shape[-1])
    start = 0
    for g, end in enumerate(offs_G.tolist()):
        out[start:end] = x_MK[start:end] @ w_GKN[g]
        start = end
    return out


def grouped_weights_mm(x_MK: torch.Tensor, dy_MN: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    """(G, K, N): for each group g, x^T dy over its rows [offs[g - 1], offs[g]) (the weight
    gradient of `grouped_rows_mm`); rows from offs[-1] on are left out. `torch._grouped_mm`
    wherever it takes the operands (the CPU included), else the per-group reference."""
    x_KM = x_MK.t()
    if grouped_mm_takes(x_KM, dy_MN):
        return torch._grouped_mm(x_KM, dy_MN, offs=offs_G)
    _no_host_read_in_capture(x_MK)
    return weights_per_group(x_MK, dy_MN, offs_G)


def batched_wgrad_into(into_GKN: torch.Tensor, x_GMK: torch.Tensor, dy_GMN: torch.Tensor, alpha: float,
                       beta: float) -> bool:
    """into = beta * into + alpha * x^T dy per batch by cuBLAS's `baddbmm_` (the scaling and the add
    in its epilogue, rounded once; with `into` a weight, alpha = -lr and beta = 1 - lr * weight_decay:
    SGD's step without the gradient written), where `into` is contiguous in the operands' dtype;
    False, `into` untouched, elsewhere."""
    if not (into_GKN.is_contiguous() and into_GKN.dtype == x_GMK.dtype == dy_GMN.dtype):
        return False
    into_GKN.baddbmm_(x_GMK.transpose(1, 2), dy_GMN, beta=beta, alpha=alpha)
    return True


def weights_per_group(x_MK: torch.Tensor, dy_MN: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    """`grouped_weights_mm` one matmul per group (reads the ends on the host; an empty group gets
    zeros): its fallback, and the reference of `weft.kernels.grouped_wgrad`."""
    out = x_MK.new_empty(offs_G.shape[0], x_MK.shape[1], dy_MN.shape[1])
    start = 0
    for g, end in enumerate(offs_G.tolist()):
        torch.mm(x_MK[start:end].t(), dy_MN[start:end], out=out[g])
        start = end
    return out


# SMs that matmuls launched just after an exchange leave to it (`leave_sms`): NCCL's all-to-all
# kernel held 4 SMs on 2 x H200 (P2P disabled and NVLink); launched a few microseconds after a
# persistent GEMM that took every SM, it started only when the GEMM ended (docs/benchmarks.md,
# thirtieth session).
EXCHANGE_SM_MARGIN = 8


@contextlib.contextmanager
def leave_sms(count: int) -> Iterator[None]:
    """Matmuls launched inside (`torch._grouped_mm`'s CUTLASS kernel, `mm` / `bmm`) run on all but
    `count` of the GPU's SMs, left to kernels of other streams (0: all SMs, nothing changed).

    Why: these GEMMs are persistent kernels, one block per SM looping over the tiles; beside an
    NCCL kernel that holds a few SMs, the blocks that find no free SM start only when it ends,
    and the GEMM ends that much later (docs/benchmarks.md: an exchange's 0.8 ms added to each
    overlapped GEMM). Launched just before an exchange's kernel, such a GEMM takes every SM and
    the exchange waits for its end. Comet's adaptive assignment (sec. 3.2.2) splits the SMs the
    same way. The setting is PyTorch's process-wide SM carveout, read when a matmul is launched (a
    CUDA graph keeps the value of its capture), and restored on exit. cuBLAS proper ignores it, so
    inside, PyTorch's cuBLAS matmuls go through cuBLASLt, which honours it (CUDA builds only)."""
    if count <= 0:
        yield
        return
    previous = torch._C._get_sm_carveout_experimental()
    backend = torch.backends.cuda.preferred_blas_library() if torch.cuda.is_available() else None
    torch._C._set_sm_carveout_experimental(count)  # PyTorch logs once that the setting is experimental
    try:
        if backend is not None:
            torch.backends.cuda.preferred_blas_library("cublaslt")
        yield
    finally:
        torch._C._set_sm_carveout_experimental(previous)
        if backend is not None:
            torch.backends.cuda.preferred_blas_library(backend)


def _no_host_read_in_capture(x: torch.Tensor) -> None:
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ValueError(f"a CUDA graph of grouped rows needs torch._grouped_mm (bfloat16 on sm90+, 16-byte "
                         f"aligned rows); these are {x.dtype} {tuple(x.shape)}, whose groups are read on the host")
