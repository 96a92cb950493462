"""The RMSNorm kernels that write the next matmul's dtype (weft.kernels.rmsnorm) against PyTorch's
RMSNorm followed by autocast's cast, forward and backward, in Triton's CPU interpreter (and on
CUDA from tests/test_gpu.py); and the model's `MatmulInputNorm`, which runs them under autocast."""
from __future__ import annotations

import pytest
import torch

from weft.testing import run_checks

pytest.importorskip("triton", reason="Triton is in the test extra; CPU-only installs run the torch path")


def rmsnorm_worker(device: str = "cpu") -> list[str]:
    """Per case: the output in float32 to float32 rounding and in bf16 to one unit in the last
    place (the float32 values' rounding may land either side where they differ in their last bits;
    on a GPU, where the cast rounds to nearest, at most 2% of them differ),
    x's and the weight's gradients to float32 rounding, and the weight's gradient bitwise the same
    in a second run."""
    from weft.kernels.rmsnorm import ROWS_PER_PROGRAM, rms_norm_cast, rms_norm_reference

    failures = []
    gen = torch.Generator().manual_seed(0)
    for rows, dim, eps, dtype in ((37, 48, 1e-5, torch.bfloat16), (2 * ROWS_PER_PROGRAM, 64, None, torch.float32),
                                  (5, 1024, 1e-6, torch.bfloat16), (0, 32, 1e-5, torch.bfloat16)):
        case = f"rows={rows} dim={dim} eps={eps} {dtype}"
        x = (torch.randn(2, rows, dim, generator=gen) * 3).to(device)
        weight = (1 + 0.1 * torch.randn(dim, generator=gen)).to(device)
        dy = torch.randn(2, rows, dim, generator=gen).to(device, dtype)
        results = []
        for kernel in (True, True, False):
            xl, wl = x.clone().requires_grad_(), weight.clone().requires_grad_()
            # else PyTorch's norm in float32, then autocast's cast (its backward casts dy to float32)
            y = (rms_norm_cast if kernel else rms_norm_reference)(xl, wl, eps, dtype)
            y.backward(dy)
            results.append((y.detach(), xl.grad, wl.grad))
        (y_k, dx_k, dw_k), (_, _, dw_again), (y_r, dx_r, dw_r) = results
        if y_k.dtype != dtype or y_k.shape != x.shape:
            failures.append(f"{case}: output {y_k.dtype} {tuple(y_k.shape)}")
            continue
        if dtype == torch.float32:
            if not torch.allclose(y_k, y_r, rtol=1e-6, atol=1e-6):
                failures.append(f"{case}: output differs by {(y_k - y_r).abs().max():.2e}")
        elif rows:
            ulp = y_r.float().abs() * 2.0 ** -7 + 1e-30
            if ((y_k.float() - y_r.float()).abs() > ulp).any():
                failures.append(f"{case}: output more than one bf16 unit from autocast's cast")
            # a GPU rounds to nearest as PyTorch's cast does: outputs differ only where the float32
            # values do, near a rounding boundary (Triton's interpreter truncates its bf16 casts)
            if device != "cpu" and (y_k != y_r).float().mean() > 0.02:
                failures.append(f"{case}: {(y_k != y_r).float().mean():.1%} of the outputs differ")
        if not torch.allclose(dx_k, dx_r, rtol=1e-5, atol=1e-5):
            failures.append(f"{case}: x's gradient differs by {(dx_k - dx_r).abs().max():.2e}")
        if not torch.allclose(dw_k, dw_r, rtol=1e-5, atol=1e-4):
            failures.append(f"{case}: the weight's gradient differs by {(dw_k - dw_r).abs().max():.2e}")
        if not torch.equal(dw_k, dw_again):
            failures.append(f"{case}: the weight's gradient differs between two runs")
        if rows and not dx_k.abs().sum() > 0:
            failures.append(f"{case}: no gradient written")
    return failures


def test_rmsnorm_kernels_match_the_norm_and_autocasts_cast(triton_interpreter):
    failures = run_checks(rmsnorm_worker, 1, timeout=300)
    assert not failures, "\n".join(failures)


def module_worker() -> list[str]:
    """`MatmulInputNorm`: under bf16 autocast with the Triton kernels, the kernel's bf16 output
    (what the next matmul reads), and through a bf16 linear the gradients of `nn.RMSNorm` and
    autocast to bf16 rounding; without autocast, with kernels="torch", or on a non-contiguous
    input, `nn.RMSNorm` itself, bit for bit."""
    from weft.models.gpt import MatmulInputNorm

    failures = []
    torch.manual_seed(0)
    x = torch.randn(3, 7, 64)
    linear = torch.nn.Linear(64, 32, bias=False)
    plain = torch.nn.RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        plain.weight.add_(0.1 * torch.randn(64))
    for kernels in ("triton", "torch"):
        norm = MatmulInputNorm(64, 1e-5, kernels)
        norm.load_state_dict(plain.state_dict())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = norm(x)
            h_plain = plain(x)
        if kernels == "triton" and h.dtype != torch.bfloat16:
            failures.append(f"under autocast the kernel's output is {h.dtype}, not bf16")
        if kernels == "torch" and not torch.equal(h, h_plain):
            failures.append("kernels='torch' is not nn.RMSNorm")
        grads = []
        for module in (norm, plain):
            module.zero_grad()
            xl = x.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = linear(module(xl)).float().square().sum()
            loss.backward()
            grads.append((xl.grad, module.weight.grad))
        (dx, dw), (dx_p, dw_p) = grads
        # through a bf16 linear: where the kernel's output rounds the other way (one bf16 unit, as the
        # kernel test allows) the linear's bf16 backward moves by about as much
        gap_x, gap_w = ((a - b).abs().max() / b.abs().max() for a, b in ((dx, dx_p), (dw, dw_p)))
        if gap_x > 1e-2 or gap_w > 1e-2 or (kernels == "torch" and (gap_x or gap_w)):
            failures.append(f"kernels={kernels}: gradients differ by {gap_x:.2e} (x), {gap_w:.2e} (weight) of their "
                            "largest")
        outside = norm(x)  # no autocast: the float32 norm
        strided = norm(x.transpose(0, 1))
        if not (torch.equal(outside, plain(x)) and torch.equal(strided, plain(x.transpose(0, 1)))):
            failures.append(f"kernels={kernels}: without autocast or on a strided input, not nn.RMSNorm")
    return failures


def test_the_matmul_input_norm_writes_autocasts_dtype_and_has_the_norms_gradients(triton_interpreter):
    failures = run_checks(module_worker, 1, timeout=300)
    assert not failures, "\n".join(failures)
