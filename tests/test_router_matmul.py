"""The router's product from bf16 rows (`weft.kernels.router_matmul`) against its reference in
Triton's CPU interpreter (in ranks whose kernels were defined under TRITON_INTERPRET=1:
`weft.testing.run_distributed`), and the routers and the layer through it: the same logits, routing and gradients as the
torch path."""
from __future__ import annotations

import pytest
import torch

from weft.testing import Checks, run_checks

pytest.importorskip("triton", reason="Triton is in the test extra; CPU-only installs run the torch path")


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    scale = b.float().abs().max().clamp_min(1e-30)
    return bool((a.float() - b.float()).abs().max() <= tol * scale)


def kernel_worker(device: str = "cpu") -> list[str]:
    """Forward and backward against the float32 reference: shapes that fill the tiles and ones
    that do not (E below 16, T and D not multiples of the tiles, more tokens than one weight
    gradient program sums); bitwise equal twice; no tokens; bad operands named."""
    from weft.kernels.router_matmul import WGRAD_ROWS, router_matmul, router_matmul_reference

    checks = Checks(f"router_matmul {device}")
    gen = torch.Generator().manual_seed(0)
    shapes = [(100, 96, 16), (37, 200, 70), (64, 64, 8), (WGRAD_ROWS * 2 + 5, 72, 24)]
    if device == "cuda":
        shapes += [(4096, 4096, 16), (4096, 2048, 64), (1024, 7168, 256)]
    for dtype in (torch.bfloat16,):
        for T, D, E in shapes:
            label = f"{dtype} T={T} D={D} E={E}"
            x = torch.randn(T, D, generator=gen).to(device, dtype)
            w = (torch.randn(E, D, generator=gen) * D ** -0.5).to(device)
            g = torch.randn(T, E, generator=gen).to(device)
            results = []
            for product in (router_matmul, router_matmul, router_matmul_reference):
                xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
                y = product(xi, wi)
                y.backward(g)
                results.append((y, xi.grad, wi.grad))
            (y, dx, dw), again, (y_ref, dx_ref, dw_ref) = results
            checks.expect(y.dtype == torch.float32 and dx.dtype == dtype and dw.dtype == torch.float32,
                          f"{label}: dtypes {y.dtype} {dx.dtype} {dw.dtype}")
            # float32 sums of D products in another order (the tensor cores': 1.2e-5 of the largest
            # logit at D = 4096 on an H200, 2.2e-5 at 7168)
            checks.expect(close(y, y_ref, 5e-5), f"{label}: logits off by {(y - y_ref).abs().max():.3g}")
            # the input gradient: float32 sums rounded once to bf16, so one unit in the last place
            checks.expect(close(dx, dx_ref, 1e-2),
                          f"{label}: input gradient off by {(dx.float() - dx_ref.float()).abs().max():.3g}")
            checks.expect(close(dw, dw_ref, 1e-5), f"{label}: weight gradient off by {(dw - dw_ref).abs().max():.3g}")
            checks.expect(all(torch.equal(a, b) for a, b in zip(results[0], again)), f"{label}: two runs differ")
    # no tokens: empty logits, an empty input gradient, a zero weight gradient
    x = torch.zeros(0, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(8, 32, device=device, requires_grad=True)
    y = router_matmul(x, w)
    y.sum().backward()
    checks.expect(y.shape == (0, 8) and x.grad.shape == (0, 32) and not w.grad.any(), "no tokens")
    # only the gradients autograd asks for
    x = torch.randn(16, 32, generator=gen).to(device, torch.bfloat16)
    w = torch.randn(8, 32, generator=gen).to(device).requires_grad_()
    router_matmul(x, w).sum().backward()
    checks.expect(x.grad is None and w.grad is not None, "a gradient was made for rows that want none")
    for args, word in (((x.float(), w), "bf16 rows"), ((x.half(), w), "bf16 rows"),
                       ((x, w.bfloat16()), "float32 weight"), ((x, w[:, :16]), "do not make"),
                       ((x[0], w), "do not make")):
        try:
            router_matmul(*args)
            checks.expect(False, f"no error for {word}")
        except ValueError as e:
            checks.expect(word in str(e), f"the error does not name {word!r}: {e}")
    return checks.failures


def test_router_matmul_matches_its_reference(triton_interpreter):
    failures = run_checks(kernel_worker, 1, timeout=600)
    assert not failures, "\n".join(failures)


def layer_worker() -> list[str]:
    """A bf16 layer (linear and cosine routers; the experts over every rank) with kernels "triton"
    against the same weights with "torch": the same routing (expert counts, drops), outputs and
    gradients to bf16 rounding."""
    import weft.moe.gates as gates
    from weft import MoE

    checks = Checks(f"layer, rank {torch.distributed.get_rank()}")
    calls = []
    kernel = gates.router_matmul
    gates.router_matmul = lambda x, w: calls.append(x.shape) or kernel(x, w)
    for gate in ("topk", "cosine"):
        torch.manual_seed(0)
        layers = [MoE(32, 64, 8, top_k=2, gate=gate, capacity_factor=1.0, dtype=torch.bfloat16, kernels=kernels)
                  for kernels in ("torch", "triton")]
        layers[1].load_state_dict(layers[0].state_dict())
        x = torch.randn(48, 32).bfloat16()
        grads = []
        for moe in layers:
            xi = x.clone().requires_grad_()
            calls.clear()
            y = moe(xi)
            checks.expect(len(calls) == (moe.default_call().kernels == "triton"),
                          f"{gate} {moe.default_call().kernels}: the kernel ran {len(calls)} times")
            (y.float() ** 2).sum().backward()
            grads.append((y, xi.grad, moe.router.weight.grad, moe.stats.expert_counts.clone(), moe.stats.dropped))
        (y_t, dx_t, dw_t, counts_t, drop_t), (y_k, dx_k, dw_k, counts_k, drop_k) = grads
        checks.expect(torch.equal(counts_t, counts_k) and drop_t == drop_k, f"{gate}: the routing differs")
        checks.expect(close(y_k, y_t, 1e-2), f"{gate}: outputs off by {(y_k.float() - y_t.float()).abs().max():.3g}")
        checks.expect(close(dx_k, dx_t, 2e-2),
                      f"{gate}: input gradients off by {(dx_k.float() - dx_t.float()).abs().max():.3g}")
        checks.expect(close(dw_k, dw_t, 2e-2), f"{gate}: router gradients off by {(dw_k - dw_t).abs().max():.3g}")
    return checks.failures


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_the_layer_routes_through_the_kernel_as_through_the_torch_path(world_size, triton_interpreter):
    failures = run_checks(layer_worker, world_size, timeout=600)
    assert not failures, "\n".join(failures)
