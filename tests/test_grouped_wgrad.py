"""The grouped weight gradient kernel (`weft.kernels.grouped_wgrad`) against its reference in
Triton's CPU interpreter (in ranks whose kernels were defined under TRITON_INTERPRET=1:
`weft.testing.run_distributed`), also scaled into a tensor (SGD's update), and the own-apart dropless layer through it
against the dense reference."""
from __future__ import annotations

import pytest
import torch

from weft.testing import Checks, run_checks

pytest.importorskip("triton", reason="Triton is in the test extra; CPU-only installs run the torch path")


def operands(rows, K, N, dtype, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x, dy = torch.randn(rows, K, generator=gen), torch.randn(rows, N, generator=gen)
    return x.to(device, dtype), dy.to(device, dtype)


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return bool(torch.allclose(a.float(), b.float(), rtol=tol, atol=tol * 8))


def kernel_worker(device: str = "cpu") -> list[str]:
    """The kernel on `device` (the CPU: in the interpreter, at its small tiles; CUDA: at the GPU
    tiles, with the larger case below)."""
    from weft.kernels.grouped_mm import weights_per_group as grouped_wgrad_reference
    from weft.kernels.grouped_wgrad import WGradTiles, grouped_wgrad, triton_usable

    checks = Checks(f"grouped_wgrad {device}")
    checks.expect(triton_usable(torch.zeros(1, device=device)), "TRITON_INTERPRET did not reach the worker")
    if device == "cuda":  # whole 64-row steps and a partial one, tiles of 128 x 256 not dividing N,
        # fewer programs than tiles (a persistent loop of several items each), twice bitwise
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 1e-2)):
            x, dy = operands(1100, 256, 384, dtype, seed=3, device=device)
            offs = torch.tensor([0, 300, 301, 1000], dtype=torch.int32, device=device)
            want = grouped_wgrad_reference(x.double(), dy.double(), offs)
            got = grouped_wgrad(x, dy, offs, sm_margin=torch.cuda.get_device_properties(0).multi_processor_count - 3)
            checks.expect(close(got, want, tol), f"cuda {dtype}: max error {(got.double() - want).abs().max():.3g}")
            checks.expect(torch.equal(got, grouped_wgrad(x, dy, offs)), f"cuda {dtype}: two runs differ")
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        # groups of 0, 5, 32 (two whole steps of 16) and 13 rows (a partial step); rows after the
        # last end hold NaN, never read; tiles that divide K and N and ones that do not; bf16 rows
        # of 12 are not 16-byte aligned (pointer loads, not the TMA)
        for K, N in ((32, 48), (40, 24), (12, 20)):
            x, dy = operands(60, K, N, dtype, device=device)
            x[50:], dy[50:] = float("nan"), float("nan")
            offs = torch.tensor([0, 5, 37, 50], dtype=torch.int32, device=device)
            got = grouped_wgrad(x, dy, offs)
            want = grouped_wgrad_reference(x.float(), dy.float(), offs)
            label = f"{dtype} K={K} N={N}"
            checks.expect(got.dtype == dtype and got.shape == (4, K, N), f"{label}: {got.dtype} {tuple(got.shape)}")
            checks.expect(not got[0].any(), f"{label}: an empty group is not zeros")
            checks.expect(close(got, want, tol), f"{label}: max error {(got.float() - want).abs().max():.3g}")
        # `into`: the product added to a share, in place
        x, dy = operands(50, 32, 40, dtype, seed=1, device=device)
        offs = torch.tensor([20, 20, 50], dtype=torch.int32, device=device)
        share = torch.randn(3, 32, 40).to(device, dtype)
        want = grouped_wgrad_reference(x.float(), dy.float(), offs) + share.float()
        into = share.clone()
        got = grouped_wgrad(x, dy, offs, into=into)
        checks.expect(got.data_ptr() == into.data_ptr(), f"{dtype}: the sum is not written into the share")
        checks.expect(close(got, want, tol), f"{dtype} into: max error {(got.float() - want).abs().max():.3g}")
        # SGD's update in the epilogue: beta * share + alpha * product, in float32, rounded once
        alpha, beta = -0.25, 0.75
        want = alpha * grouped_wgrad_reference(x.float(), dy.float(), offs) + beta * share.float()
        into = share.clone()
        grouped_wgrad(x, dy, offs, into=into, alpha=alpha, beta=beta)
        checks.expect(close(into, want, tol), f"{dtype} into, alpha and beta: max error "
                                              f"{(into.float() - want).abs().max():.3g}")
    # no rows at all: zeros, or `into` scaled by beta alone
    x, dy = operands(0, 32, 40, torch.float32, device=device)
    offs = torch.zeros(3, dtype=torch.int32, device=device)
    checks.expect(not grouped_wgrad(x, dy, offs).any(), "no rows: the sums are not zeros")
    share = torch.randn(3, 32, 40).to(device)
    into = share.clone()
    grouped_wgrad(x, dy, offs, into=into, alpha=-0.5, beta=0.75)
    checks.expect(torch.equal(into, share * 0.75), "no rows: into is not beta times itself")
    if device == "cuda":
        return checks.failures
    # the same sums at other tiles; bitwise the same twice
    x, dy = operands(70, 32, 32, torch.float32, seed=2)
    offs = torch.tensor([30, 70], dtype=torch.int32)
    small = WGradTiles(16, 16, 16, 1, 1, 2)
    first = grouped_wgrad(x, dy, offs, tiles=small)
    checks.expect(torch.equal(first, grouped_wgrad(x, dy, offs, tiles=small)), "two runs differ")
    checks.expect(close(grouped_wgrad(x, dy, offs, tiles=WGradTiles(32, 16, 32, 1, 1, 1)), first, 1e-5),
                  "other tiles give another sum")
    # bad operands: one line naming what is wrong
    x, dy = operands(16, 8, 8, torch.float32)
    ends = torch.tensor([8, 16], dtype=torch.int32)
    for args, into, word in (((x, dy[:-1]), None, "rows"), ((x, dy.double()), None, "dtype"),
                             ((x.t(), dy), None, "row-major"), ((x, dy), torch.zeros(2, 8, 4), "into"),
                             ((x, dy), torch.zeros(2, 8, 8).double(), "into")):
        try:
            grouped_wgrad(*args, ends, into=into)
            checks.expect(False, f"no error for bad {word}")
        except ValueError as e:
            checks.expect(word in str(e), f"the error does not name {word}: {e}")
    try:  # a scale with nothing to scale into
        grouped_wgrad(x, dy, ends, alpha=-0.5)
        checks.expect(False, "no error for alpha without into")
    except ValueError as e:
        checks.expect("into" in str(e), f"the error does not name into: {e}")
    # beside an exchange that keeps SMs, one program an SM (two would fill the kept SMs too)
    cuda = torch.device("cuda")
    checks.expect(WGradTiles.for_device(cuda).per_sm == 2 and WGradTiles.for_device(cuda, sm_margin=8).per_sm == 1,
                  "the tiles beside an exchange take more than one program an SM")
    return checks.failures


def test_grouped_wgrad_matches_its_reference_adds_in_place_scaled_and_refuses_bad_operands(triton_interpreter):
    failures = run_checks(kernel_worker, 1, timeout=300)
    assert not failures, "\n".join(failures)
