"""`weft.BackwardSGD`: the experts' SGD step inside the backward's weight-gradient GEMMs.

On 1, 2 and 4 gloo processes (Comet's exchange over shared-file peer buffers, and the plain
exchange), padded and dropless, relu and swiglu, two steps with weight decay: the layer called
with `expert_step` and stepped by `BackwardSGD` ends each step with the same outputs and weights as the plain layer
stepped by `torch.optim.SGD`, and the weights whose step ran in the backward got no gradient
(Comet padded: cuBLAS's `baddbmm_`, on the CPU too; dropless, Comet's and the plain exchange's:
the grouped weight-gradient kernel, under Triton's interpreter; elsewhere they get gradients and
`step()` applies them). Bad settings get one-line errors.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from weft import BackwardSGD, MoE
from weft.kernels.grouped_mm import grouped_mm_on
from weft.kernels.rows import triton_usable
from weft.moe.experts import by_source_pays
from weft.testing import Checks, run_checks

LR, WEIGHT_DECAY = 0.5, 0.1


def layers(world: int, cf, activation: str, device: str, dtype: torch.dtype, reference: str,
           stepped: str = "comet") -> tuple[MoE, MoE]:
    """The reference layer (kernels `reference`) and a twin with its weights (kernels `stepped`)."""
    torch.manual_seed(0)
    shape = dict(top_k=2, capacity_factor=cf, activation=activation, device=device, dtype=dtype)
    plain = MoE(32, 64, 4 * world, kernels=reference, **shape)
    twin = MoE(32, 64, 4 * world, kernels=stepped, **shape)
    twin.load_state_dict(plain.state_dict())
    return plain, twin


def expected_fused(stepped: str, cf, activation: str, twin: MoE, x: torch.Tensor) -> set[str]:
    """The weights the backward steps. Comet's exchange: w1 and w2 (swiglu's w3 is read after its
    gradient is made), by cuBLAS where every local expert has the same rows, else by the Triton
    kernel. The plain exchange: every weight, dropless by the Triton kernel, padded by cuBLAS in
    the Flexible layout."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if stepped != "comet":
        weights = {"experts.w1", "experts.w2"} | ({"experts.w3"} if activation == "swiglu" else set())
        if cf is None:  # on CUDA only where torch's grouped GEMM runs (bf16): elsewhere the
            # per-group products would read the groups' ends back from the device
            grouped = not x.is_cuda or grouped_mm_on(x.device, x.dtype, twin.dim, twin.hidden_dim)
            return weights if triton_usable(x) and grouped else set()
        # padded: cuBLAS's baddbmm_ in Tutel's Flexible layout (one rank, or where the per-source
        # products would move more bytes); the per-source products leave the weights their gradients
        per_source = world > 1 and by_source_pays(world, twin.stats.capacity, twin.hidden_dim, len(weights))
        return set() if per_source else weights
    if cf is not None or triton_usable(x):
        return {"experts.w1", "experts.w2"}
    counts = twin.stats.expert_counts.clone()  # rows grouped by expert on the host: cuBLAS takes the
    dist.all_reduce(counts)  # step where every local expert has the same rows, else it needs Triton
    mine = counts.view(world, -1)[rank]
    return {"experts.w1", "experts.w2"} if bool((mine == mine[0]).all()) else set()


def backward_sgd_worker(device: str = "cpu", dtype: torch.dtype = torch.float32, tol: float = 1e-5,
                        lr: float = LR, reference: str = "auto") -> list[str]:
    """Two SGD steps, each from the same weights, of the reference layer (the plain one; "torch":
    the PyTorch path, under Triton's interpreter too; "comet": Comet's, so that bf16 compares the
    fused step alone, not the two paths' rounding) stepped by `torch.optim.SGD` and of a twin
    (Comet's exchange, then the plain one) with the experts stepped in the backward: the same
    outputs, input gradients and weights after each (to `tol` of the largest value), and no
    gradient on the weights whose step the backward fused."""
    rank, world = dist.get_rank(), dist.get_world_size()
    checks = Checks(f"rank {rank} {device} {dtype}")
    gen = torch.Generator().manual_seed(10 + rank)
    for stepped, cf, activation in itertools.product(("comet", "auto"), (1.0, None), ("relu", "swiglu")):
        label = f"{stepped} cf {cf} {activation}"
        plain, twin = layers(world, cf, activation, device, dtype, reference, stepped)
        sgd = torch.optim.SGD(plain.parameters(), lr=lr, weight_decay=WEIGHT_DECAY, foreach=False)
        backward_sgd = BackwardSGD(twin.parameters(), lr=lr, weight_decay=WEIGHT_DECAY, foreach=False)
        for step in range(2):
            x = torch.randn(24, 32, generator=gen).to(device, dtype)
            g = torch.randn(24, 32, generator=gen).to(device, dtype)
            x_plain, x_twin = x.clone().requires_grad_(), x.clone().requires_grad_()
            y_plain, y_twin = plain(x_plain), twin(x_twin, expert_step=backward_sgd)
            fused = expected_fused(stepped, cf, activation, twin, x)
            (y_plain.float() * g.float()).sum().backward()
            (y_twin.float() * g.float()).sum().backward()
            no_grad = {name for name, p in twin.named_parameters() if p.grad is None}
            checks.expect(no_grad == fused, f"{label} step {step}: no gradient on {sorted(no_grad)}, "
                                            f"expected {sorted(fused)}")
            sgd.step()
            backward_sgd.step()
            sgd.zero_grad()
            backward_sgd.zero_grad()
            for what, a, b in (("outputs", y_plain, y_twin), ("input gradients", x_plain.grad, x_twin.grad)):
                err, scale = (a.float() - b.float()).abs().max().item(), a.float().abs().max().item()
                checks.expect(err <= tol * scale, f"{label} step {step}: {what} differ by {err:.3g}")
            for (name, a), b in zip(plain.named_parameters(), twin.parameters()):
                err, scale = (a.float() - b.float()).abs().max().item(), a.float().abs().max().item()
                checks.expect(err <= tol * scale, f"{label} step {step}: {name} differs by {err:.3g} "
                                                  f"(largest {scale:.3g})")
            # the next step from the same weights: one step's rounding, not amplified by a routing
            # or relu flip the next forward makes of it (bf16)
            plain.load_state_dict(twin.state_dict())
    return checks.failures


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_experts_stepped_in_the_backward_match_sgd_after_the_backward(world_size):
    flat = run_checks(backward_sgd_worker, world_size, timeout=300)
    assert not flat, f"{len(flat)} mismatches, first ones:\n" + "\n".join(flat[:15])


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_dropless_experts_stepped_in_the_grouped_kernel_match_sgd(world_size, triton_interpreter):
    """Dropless through Triton's kernels (interpreter): the step runs in the grouped
    weight-gradient kernel's epilogue, on Comet's exchange and on the plain one; the reference
    layer runs the PyTorch path, the kernels' oracle."""
    flat = run_checks(backward_sgd_worker, world_size, args=("cpu", torch.float32, 1e-5, LR, "torch"), timeout=900)
    assert not flat, f"{len(flat)} mismatches, first ones:\n" + "\n".join(flat[:15])


def frozen_and_zeroed_worker() -> list[str]:
    """Weights whose gradient autograd does not want are not stepped (w1 frozen: only w2 moves in
    the backward), and a fused weight holding zeros (a gradient of an unfused step, then
    `zero_grad(set_to_none=False)`) is decayed once, as torch's SGD does, not again by `step()`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    checks = Checks(f"rank {rank}")
    plain, comet = layers(world, 1.0, "relu", "cpu", torch.float32, "auto")
    for layer in (plain, comet):
        layer.experts.w1.requires_grad_(False)
    sgd = torch.optim.SGD(plain.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    backward_sgd = BackwardSGD(comet.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    gen = torch.Generator().manual_seed(rank)
    for step in range(3):
        x = torch.randn(24, 32, generator=gen).requires_grad_()  # layer0's backward runs for x's gradient
        plain(x).square().sum().backward()
        # step 0 unfused: w2 gets a gradient, zeroed in place after it; later steps fuse w2's step
        comet(x, expert_step=backward_sgd if step else None).square().sum().backward()
        sgd.step()
        backward_sgd.step()
        sgd.zero_grad(set_to_none=False)
        backward_sgd.zero_grad(set_to_none=False)
        for (name, a), b in zip(plain.named_parameters(), comet.parameters()):
            err = (a - b).abs().max().item()
            checks.expect(err <= 1e-5 * a.abs().max().item(), f"step {step}: {name} differs by {err:.3g}")
        plain.load_state_dict(comet.state_dict())  # each step from the same weights (see backward_sgd_worker)
    return checks.failures


@pytest.mark.parametrize("world_size", [1, 2])
def test_frozen_weights_stay_and_zeroed_gradients_decay_once(world_size):
    flat = run_checks(frozen_and_zeroed_worker, world_size, timeout=300)
    assert not flat, "\n".join(flat[:15])


def empty_rank_worker(device: str = "cpu", dtype: torch.dtype = torch.float32) -> list[str]:
    """A rank whose experts receive no rows (the plain exchange's dropless call, the step in the
    grouped kernel): its weights still take the step, weight decay alone."""
    from weft.moe.experts import Experts

    checks = Checks(f"empty rank {device} {dtype}")
    torch.manual_seed(0)
    experts = Experts(16, 24, 4, activation="swiglu", device=device, dtype=dtype)
    before = [w.detach().clone() for w in experts.weights()]
    sgd = BackwardSGD(experts.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    x = torch.randn(0, 16, device=device, dtype=dtype, requires_grad=True)
    checks.expect(experts._steps_grouped(sgd, x), "the stepped grouped path is not taken here")
    experts.forward_grouped(x, [0, 0, 0, 0], step=sgd).sum().backward()
    sgd.step()
    for old, w in zip(before, experts.weights()):
        checks.expect(w.grad is None and torch.equal(w.detach(), old * (1 - LR * WEIGHT_DECAY)),
                      "a weight of a rank without rows was not decayed in the backward alone")
    checks.expect(x.grad is not None and x.grad.shape == (0, 16), "no input gradient")
    return checks.failures


def test_a_rank_without_rows_takes_its_step(triton_interpreter):
    flat = run_checks(empty_rank_worker, 1, timeout=300)
    assert not flat, "\n".join(flat)


def test_bad_settings_are_named():
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, top_k=2)
    with pytest.raises(ValueError, match="lr and weight_decay"):
        BackwardSGD(moe.parameters(), lr=-1.0)
    with pytest.raises(ValueError, match="expert_step must be a weft.BackwardSGD"):
        moe(torch.randn(4, 8), expert_step=torch.optim.SGD(moe.parameters(), lr=0.1))
    balanced = MoE(8, 16, 4, top_k=2, capacity_factor=None, balance="pro-prophet")
    with pytest.raises(ValueError, match="balanced layer"):
        balanced(torch.randn(4, 8), expert_step=BackwardSGD(balanced.parameters(), lr=0.1))


def test_only_the_optimizers_own_tensors_without_momentum_are_stepped():
    """`update_of` names the very tensors the optimizer holds (a cast or a copy is another tensor),
    in groups without momentum, each with its group's lr and weight decay."""
    a, b, c = (torch.nn.Parameter(torch.ones(2)) for _ in range(3))
    opt = BackwardSGD([{"params": [a]}, {"params": [b], "lr": 0.2, "weight_decay": 0.5}], lr=0.1)
    assert opt.update_of(a).alpha == -0.1 and opt.update_of(a).beta == 1.0
    assert opt.update_of(b).alpha == -0.2 and opt.update_of(b).beta == pytest.approx(0.9)
    assert opt.update_of(c) is None and opt.update_of(a.detach()) is None and opt.update_of(a.double()) is None
    opt.param_groups[0]["momentum"] = 0.9  # e.g. a state dict from torch's SGD: not stepped in the backward
    assert opt.update_of(a) is None
