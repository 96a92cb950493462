"""The fused routing kernels (weft.kernels.routing) against their PyTorch reference and the
layer's PyTorch routing path, in Triton's CPU interpreter (in ranks whose kernels were
defined under TRITON_INTERPRET=1: `weft.testing.run_distributed`)."""
from __future__ import annotations

import pytest
import torch

from weft.testing import run_distributed

pytest.importorskip("triton", reason="Triton is in the test extra; CPU-only installs run the torch path")


def close_to_rounding(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal up to float32 rounding of sums taken in another order: within 1e-4 of the largest
    magnitude (the gradient through renormalised gates is a difference of nearby terms)."""
    return bool((x - y).abs().max() <= 1e-4 * x.abs().max() + 1e-7)


def routing_kernels_worker(device: str = "cpu") -> list[str]:
    """`topk_positions` against its reference and the layer's PyTorch path, and `Router.route`
    fused against unfused, every gate (on `device`: the CPU's interpreter, or CUDA)."""
    from weft.kernels.routing import topk_positions, topk_positions_reference
    from weft.moe.capacity import slot_positions
    from weft.moe.gates import topk_desc
    from weft.moe.routing import ONE_PASS_GATES, Router

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
        scores = scores.to(device)
        got = topk_positions(scores, k)
        want = topk_positions_reference(scores, k)
        for name, a, b in zip(("experts", "positions", "counts"), got, want):
            expect(a.dtype == torch.long and torch.equal(a, b), f"{name} differ from the reference at {(T, E, k)}")
        # ... and from the layer's PyTorch path (sorted top-k; sort or counting positions), in
        # token order and in a priority order (batch-prioritized routing)
        experts = topk_desc(scores, k)
        for order in (None, torch.randperm(T, generator=gen).to(device)):
            got = topk_positions(scores, k, order)
            slots = slot_positions(experts, E, order)
            expect(all(torch.equal(a, b) for a, b in zip(got, topk_positions_reference(scores, k, order))),
                   f"the reference differs at {(T, E, k)} with order={order is not None}")
            expect(torch.equal(got[0], experts) and torch.equal(got[1], slots.positions)
                   and torch.equal(got[2], slots.counts),
                   f"the layer's torch path differs at {(T, E, k)} with order={order is not None}")
    flat = torch.ones(20, 6, device=device)  # every score tied: experts 0..k-1 for each token
    experts, positions, counts = topk_positions(flat, 2)
    expect(torch.equal(experts.cpu(), torch.tensor([[0, 1]] * 20)), "all-tied scores pick the lowest ids")
    expect(torch.equal(positions[:, 0].cpu(), torch.arange(20))
           and torch.equal(counts.cpu(), torch.tensor([20, 20, 0, 0, 0, 0])), "all-tied positions")
    e0, p0, c0 = topk_positions(torch.zeros(0, 4, device=device), 2)
    expect(e0.shape == (0, 2) and p0.shape == (0, 2) and torch.equal(c0.cpu(), torch.zeros(4, dtype=torch.long)),
           "an empty batch")
    try:
        topk_positions(torch.rand(3, 4, device=device), 5)
        expect(False, "k > E must be an error")
    except ValueError as e:
        expect("k must be in [1, 4]" in str(e), f"k > E message: {e}")

    # Router.route with fused=True gives the PyTorch path's Routing, and the same gate gradients;
    # also where a training call samples the experts (temperature > 0).
    for gate, cf, with_bias, normalize, temperature in (
            ("topk", 1.0, False, False, 0), ("topk", None, True, True, 0), ("cosine", 0.5, False, True, 0),
            ("topk", 0.0, True, False, 0), ("bpr", 1.0, True, False, 0), ("bpr", None, False, True, 0),
            ("random", 0.5, False, False, 0), ("topk", 1.0, False, False, 0.7), ("bpr", None, False, True, 0.5)):
        logits = torch.randn(96, 16, generator=gen).to(device)
        bias = torch.randn(16, generator=gen).to(device) * 0.05 if with_bias else None
        routings, grads = [], []
        for fused in (False, True):
            lg = logits.clone().requires_grad_()
            torch.manual_seed(7)  # the random gate's draw, or the sampling offsets
            r = Router(gate, 16, normalize, None, temperature).route(lg, 2, cf, bias, fused=fused, sample=True)
            (r.gates_S * torch.arange(r.gates_S.numel(), device=device)).sum().backward()
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
        # the one-pass kernels (weft.kernels.token_choice) sum the losses and the logits' gradient
        # in another order: equal to rounding there, bitwise where the PyTorch ops make them
        one_pass = gate in ONE_PASS_GATES and temperature == 0 and (cf is None or cf > 0)
        expect(a.slot_rows is None and (b.slot_rows is not None) == (one_pass and cf is not None),
               f"{case}: slot rows made where not expected, or missing")
        same = close_to_rounding if one_pass else torch.equal
        for name, x, y in (("aux loss", a.summary.aux_loss, b.summary.aux_loss),
                           ("z-loss", a.summary.z_loss, b.summary.z_loss), ("logit gradients", *grads)):
            expect(same(x, y), f"{case}: {name} differ by {(x - y).abs().max():.2e} (of {x.abs().max():.2e})")
    return failures


# (gates . weights, aux loss, z loss) weights of the loss whose gradient is compared: all, each alone
LOSS_TERMS = ((1.0, 0.3, 0.7), (1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0))


def one_pass_worker(device: str = "cpu") -> list[str]:
    """route_topk (weft.kernels.token_choice) against route_topk_reference on `device` (the CPU:
    Triton's interpreter): every integer equal, gates, losses and the logits' gradient to rounding,
    for each subset of the three gradients."""
    from weft.kernels.token_choice import route_topk, route_topk_reference

    failures = []
    gen = torch.Generator().manual_seed(0)
    # (T, E, k, normalize, capacity, bias): T not a multiple of the block, E not a power of two,
    # k = E, more experts than a full-height tile, one token, a capacity dropping most slots,
    # dropless (None), more tokens than the finishing program sums in one chunk of blocks
    cases = ((300, 8, 2, True, 80, False), (257, 64, 4, False, 17, True), (100, 3, 3, True, None, False),
             (70, 200, 8, False, 5, True), (1, 4, 1, False, 1, False), (129, 32, 1, True, None, True),
             (40, 5, 5, True, 3, False), (9000, 8, 2, False, 2000, False))
    fields = ("experts_TK", "positions_TK", "counts_E", "kept_TK", "rows_TK", "slot_of_row_R", "dropped", "order_S")
    for T, E, k, normalize, cap, with_bias in cases:
        logits = torch.randn(T, E, generator=gen)
        logits[: T // 2, : E // 2] = torch.round(logits[: T // 2, : E // 2])  # ties: the lower id wins
        logits = logits.to(device)
        bias = (torch.randn(E, generator=gen) * 0.05).to(device) if with_bias else None
        weights = torch.randn(T, k, generator=gen).to(device)
        case = f"T={T} E={E} k={k} normalize={normalize} cap={cap} bias={with_bias}"
        routed, grads = [], []
        for fn in (route_topk_reference, route_topk):  # one forward each, its backward for every set of terms
            lg = logits.clone().requires_grad_()
            r = fn(lg, k, normalize, cap, bias)
            parts = ((r.gates_TK * weights).sum(), r.aux_loss, r.z_loss)
            routed.append(r)
            grads.append([torch.autograd.grad(sum(w * part for w, part in zip(terms, parts) if w), lg,
                                              retain_graph=True)[0] for terms in LOSS_TERMS])
        a, b = routed
        for name in fields:
            x, y = getattr(a, name), getattr(b, name)
            if not ((x is None and y is None) or (x is not None and y is not None and x.dtype == y.dtype
                                                  and torch.equal(x, y))):
                failures.append(f"{case}: {name} differs")
        for name in ("gates_TK", "aux_loss", "z_loss"):
            if not torch.allclose(getattr(a, name), getattr(b, name), rtol=1e-5, atol=1e-7):
                failures.append(f"{case}: {name} differs beyond rounding")
        for terms, want, got in zip(LOSS_TERMS, *grads):
            if not close_to_rounding(want, got):
                failures.append(f"{case} loss terms={terms}: the logits' gradient differs by "
                                f"{(want - got).abs().max():.2e}")
    empty = route_topk(torch.zeros(0, 4, device=device), 2, True, 3)  # an empty batch: no slots, no loss
    if not (empty.experts_TK.shape == (0, 2) and empty.slot_of_row_R.tolist() == [-1] * 12
            and float(empty.aux_loss) == 0.0 and float(empty.z_loss) == 0.0 and int(empty.dropped) == 0):
        failures.append(f"an empty batch: {empty}")
    for bad, message in (((5, False, None), "k must be in [1, 4]"), ((2, False, 0), "capacity must be at least 1")):
        try:
            route_topk(torch.randn(3, 4, device=device), *bad)
            failures.append(f"{bad}: no error")
        except ValueError as e:
            if message not in str(e):
                failures.append(f"{bad}: {e}")
    return failures


def test_one_pass_routing_matches_its_reference(triton_interpreter):
    failures = run_distributed(one_pass_worker, 1, timeout=600)[0]
    assert not failures, "\n".join(failures)


def test_routing_kernels_match_the_reference_and_the_torch_path(triton_interpreter):
    failures = run_distributed(routing_kernels_worker, 1, timeout=300)[0]
    assert not failures, "\n".join(failures)
