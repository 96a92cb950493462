"""The fused routing kernels (weft.kernels.routing) against their PyTorch reference and the
layer's PyTorch routing path, in Triton's CPU interpreter in a spawned process (TRITON_INTERPRET=1
must be set before Triton is imported)."""
from __future__ import annotations

import pytest
import torch

from weft.testing import run_distributed

pytest.importorskip("triton", reason="Triton is in the test extra; CPU-only installs run the torch path")


def routing_kernels_worker() -> list[str]:
    from weft.kernels.routing import topk_positions, topk_positions_reference
    from weft.moe.capacity import slot_positions
    from weft.moe.gates import topk_desc
    from weft.moe.routing import Router

    failures = []

    def expect(cond, what):
        if not cond:
            failures.append(what)

    gen = torch.Generator().manual_seed(0)
    # (T, E, k): one token; T not a multiple of the token block; E not a power of two; k = E;
    # more experts than one 128-token block's tile allows at full height.
    for T, E, k in ((1, 4, 1), (300, 8, 2), (257, 64, 4), (100, 3, 3), (129, 32, 1), (70, 200, 8), (40, 5, 5)):
        scores = torch.rand(T, E, generator=gen)
        scores[:, : E // 2] = torch.round(scores[:, : E // 2] * 4) / 4  # many ties: the lower id wins
        got = topk_positions(scores, k)
        want = topk_positions_reference(scores, k)
        for name, a, b in zip(("experts", "positions", "counts"), got, want):
            expect(a.dtype == torch.long and torch.equal(a, b), f"{name} differ from the reference at {(T, E, k)}")
        # ... and from the layer's PyTorch path (sorted top-k; sort or counting positions), in
        # token order and in a priority order (batch-prioritized routing)
        experts = topk_desc(scores, k)
        for order in (None, torch.randperm(T, generator=gen)):
            got = topk_positions(scores, k, order)
            slots = slot_positions(experts, E, order)
            expect(all(torch.equal(a, b) for a, b in zip(got, topk_positions_reference(scores, k, order))),
                   f"the reference differs at {(T, E, k)} with order={order is not None}")
            expect(torch.equal(got[0], experts) and torch.equal(got[1], slots.positions)
                   and torch.equal(got[2], slots.counts),
                   f"the layer's torch path differs at {(T, E, k)} with order={order is not None}")
    flat = torch.ones(20, 6)  # every score tied: experts 0..k-1 for each token
    experts, positions, counts = topk_positions(flat, 2)
    expect(torch.equal(experts, torch.tensor([[0, 1]] * 20)), "all-tied scores pick the lowest ids")
    expect(torch.equal(positions[:, 0], torch.arange(20)) and torch.equal(counts, torch.tensor([20, 20, 0, 0, 0, 0])),
           "all-tied positions")
    e0, p0, c0 = topk_positions(torch.zeros(0, 4), 2)
    expect(e0.shape == (0, 2) and p0.shape == (0, 2) and torch.equal(c0, torch.zeros(4, dtype=torch.long)),
           "an empty batch")
    try:
        topk_positions(torch.rand(3, 4), 5)
        expect(False, "k > E must be an error")
    except ValueError as e:
        expect("k must be in [1, 4]" in str(e), f"k > E message: {e}")

    # Router.route with fused=True gives the PyTorch path's Routing, and the same gate gradients;
    # also where a training call samples the experts (temperature > 0).
    for gate, cf, with_bias, normalize, temperature in (
            ("topk", 1.0, False, False, 0), ("topk", None, True, True, 0), ("cosine", 0.5, False, True, 0),
            ("topk", 0.0, True, False, 0), ("bpr", 1.0, True, False, 0), ("bpr", None, False, True, 0),
            ("random", 0.5, False, False, 0), ("topk", 1.0, False, False, 0.7), ("bpr", None, False, True, 0.5)):
        logits = torch.randn(96, 16, generator=gen)
        bias = torch.randn(16, generator=gen) * 0.05 if with_bias else None
        routings, grads = [], []
        for fused in (False, True):
            lg = logits.clone().requires_grad_()
            torch.manual_seed(7)  # the random gate's draw, or the sampling offsets
            r = Router(gate, 16, normalize, None, temperature).route(lg, 2, cf, bias, fused=fused, sample=True)
            (r.gates_S * torch.arange(r.gates_S.numel())).sum().backward()
            routings.append(r)
            grads.append(lg.grad)
        a, b = routings
        case = f"{gate} cf={cf} bias={with_bias} normalize={normalize} temperature={temperature}"
        # order_S is the dropless layout's (padded routings may leave it None)
        for field in ("token_ids_S", "experts_S", "positions_S", "gates_S", "kept_S", "counts_E") + (
                ("order_S",) if cf is None else ()):
            x, y = getattr(a, field), getattr(b, field)
            expect((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y)),
                   f"{case}: {field} differs")
        expect(a.capacity == b.capacity and torch.equal(a.summary.stats.dropped, b.summary.stats.dropped),
               f"{case}: capacity or drops differ")
        expect(torch.equal(a.summary.aux_loss, b.summary.aux_loss), f"{case}: aux loss differs")
        expect(torch.equal(grads[0], grads[1]), f"{case}: logit gradients differ")
    return failures


def test_routing_kernels_match_the_reference_and_the_torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    failures = run_distributed(routing_kernels_worker, 1, timeout=300)[0]
    assert not failures, "\n".join(failures)
