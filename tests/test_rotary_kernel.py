"""The rotary Triton kernel (weft.kernels.rotary) against its PyTorch reference, forward and
backward, on the strided q/k views of a fused qkv projection, in Triton's CPU interpreter."""
from __future__ import annotations

import pytest
import torch

from weft.testing import run_checks, run_distributed

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


def test_rotary_kernel_matches_reference(triton_interpreter):
    failures = run_distributed(rotary_worker, 1, timeout=300)[0]
    assert not failures, "\n".join(failures)


def qkv_heads_worker(device: str = "cpu") -> list[str]:
    """`qkv_heads` with the kernel on `device`: the outputs and the projection's gradient of the
    path it replaces (PyTorch's views of the projection, `rotary` of q and k by the same kernel)
    bit for bit, with every head's gradient given, with v's missing, and through attention
    (PyTorch's math backend: the same sums in both runs); and against PyTorch's reference to
    rounding. q and k are laid out (batch, seq, heads, head_dim), and on CUDA attention's default
    kernel writes its output in that layout too."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from weft.kernels.rotary import _heads, qkv_heads, rotary
    from weft.models.gpt import rotary_tables

    failures = []
    gen = torch.Generator().manual_seed(1)
    for dtype, heads, head_dim, use in ((torch.float32, 3, 16, "all"), (torch.bfloat16, 2, 16, "all"),
                                        (torch.float32, 3, 12, "qk"), (torch.float32, 2, 16, "attention")):
        batch, seq = 2, 37
        cos, sin = rotary_tables(seq, head_dim, 10000.0, torch.device(device))
        qkv = torch.randn(batch, seq, 3 * heads * head_dim, generator=gen).to(device, dtype)
        weights = [torch.randn(batch, heads, seq, head_dim, generator=gen).to(device, dtype) for _ in range(3)]

        def replaced(x):  # the split before `qkv_heads`: autograd's views, the kernel for q and k
            q, k, v = _heads(x, heads)
            return rotary(q, cos, sin, "triton"), rotary(k, cos, sin, "triton"), v

        results = {}
        for name, split in (("fused", lambda x: qkv_heads(x, heads, cos, sin, "triton")), ("replaced", replaced),
                            ("torch", lambda x: qkv_heads(x, heads, cos, sin, "torch"))):
            leaf = qkv.clone().requires_grad_()
            q, k, v = split(leaf)
            if use == "attention":  # PyTorch's math backend: the same sums in both runs, on any device
                with sdpa_kernel(SDPBackend.MATH):
                    loss = (F.scaled_dot_product_attention(q, k, v, is_causal=True) * weights[0]).sum()
            else:
                loss = sum((t * w).sum() for t, w in zip((q, k, v) if use == "all" else (q, k), weights))
            loss.backward()
            results[name] = [t.detach() for t in (q, k, v)] + [leaf.grad]
        case = f"{dtype} heads={heads} hd={head_dim} {use}"
        for i, (a, b) in enumerate(zip(results["fused"], results["replaced"])):
            if (i == 2 and a.stride() != b.stride()) or not torch.equal(a, b):  # v: the same view of the projection
                failures.append(f"{case}: output {i} differs from the replaced split's")
        for name, t in zip("qk", results["fused"]):  # stored (batch, seq, heads, head_dim)
            if not t.transpose(1, 2).is_contiguous():
                failures.append(f"{case}: {name} is not laid out (batch, seq, heads, head_dim): strides {t.stride()}")
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        for i, (a, b) in enumerate(zip(results["fused"], results["torch"])):
            if not torch.allclose(a.float(), b.float(), rtol=tol, atol=tol):
                gap = (a.float() - b.float()).abs().max()
                failures.append(f"{case}: output {i} differs from PyTorch's by {gap:.2e}")
        if results["fused"][3].abs().sum() == 0:
            failures.append(f"{case}: no gradient written")
    if device == "cuda":  # attention's default kernel keeps q's layout: its output transposes back as a view
        cos, sin = rotary_tables(256, 64, 10000.0, torch.device(device))
        qkv = torch.randn(2, 256, 3 * 4 * 64, generator=gen).to(device, torch.bfloat16)
        y = F.scaled_dot_product_attention(*qkv_heads(qkv, 4, cos, sin, "triton"), is_causal=True)
        if not y.transpose(1, 2).is_contiguous():
            failures.append(f"attention's output on the heads has strides {y.stride()}: transposing it back copies")
    return failures


def test_qkv_heads_write_the_projection_gradient_in_one_pass(triton_interpreter):
    failures = run_checks(qkv_heads_worker, 1, timeout=300)
    assert not failures, "\n".join(failures)
