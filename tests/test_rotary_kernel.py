"""The rotary Triton kernel (weft.kernels.rotary) against its PyTorch reference, forward and
backward, on the strided q/k views of a fused qkv projection, in Triton's CPU interpreter."""
from __future__ import annotations

import pytest
import torch

from weft.testing import run_distributed

pytest.importorskip("triton", reason="Triton is in the test extra; CPU-only installs run the torch path")


def rotary_worker() -> list[str]:
    from weft.kernels.rotary import rotary, rotary_reference
    from weft.models.gpt import rotary_tables

    failures = []
    gen = torch.Generator().manual_seed(0)
    for dtype, head_dim in ((torch.float32, 16), (torch.bfloat16, 16), (torch.float32, 12)):
        batch, seq, heads = 2, 37, 3  # seq not a multiple of the kernel's block
        cos, sin = rotary_tables(seq, head_dim, 10000.0, torch.device("cpu"))
        qkv = torch.randn(batch, seq, 3 * heads * head_dim, generator=gen).to(dtype)
        dy = torch.randn(batch, heads, seq, head_dim, generator=gen).to(dtype)
        results = []
        for fn in (lambda q: rotary(q, cos, sin, "triton"), lambda q: rotary_reference(q, cos, sin)):
            leaf = qkv.clone().requires_grad_()
            q = leaf.view(batch, seq, 3, heads, head_dim).permute(2, 0, 3, 1, 4)[0]  # strided, last dim contiguous
            y = fn(q)
            y.backward(dy)
            results.append((y.detach().float(), leaf.grad.float()))
        (y_k, g_k), (y_r, g_r) = results
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        if not torch.allclose(y_k, y_r, rtol=tol, atol=tol):
            failures.append(f"{dtype} hd={head_dim}: output differs by {(y_k - y_r).abs().max():.2e}")
        if not torch.allclose(g_k, g_r, rtol=tol, atol=tol):
            failures.append(f"{dtype} hd={head_dim}: gradient differs by {(g_k - g_r).abs().max():.2e}")
        if y_k.abs().sum() == 0:
            failures.append("the kernel wrote nothing")
    return failures


def test_rotary_kernel_matches_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    failures = run_distributed(rotary_worker, 1, timeout=300)[0]
    assert not failures, "\n".join(failures)
