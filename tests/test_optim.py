"""weft train's optimizer (weft.train.optim, weft.kernels.adamw): the AdamW pass against torch's
AdamW, its Triton kernel in the interpreter against the reference, bf16 weights with float32
masters against float32 weights under the same bf16 autocast, and checkpoints across both."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from test_train import SMALL_MODEL, config, losses, write_corpus
from weft.distributed import build_moe_groups
from weft.kernels.adamw import AdamWHyper, AdamWUpdate, adamw_step, adamw_step_reference, adamw_steps
from weft.kernels.rows import triton_usable
from weft.kernels.sumsq import sum_of_squares, sum_of_squares_reference
from weft.models import GPT, get_preset
from weft.moe.grads import reduce_gradients
from weft.testing import run_checks, run_distributed
from weft.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from weft.train.loop import clip_scale, gradient_norm
from weft.train.optim import (
    ClippedAdamW,
    MasterAdamW,
    MasterPlan,
    MasterWeights,
    decay_groups,
    low_precision_parameters,
    master_weights_blocker,
)
from weft.train.step import lancet_partitions_forward

# the step's device tensors on the CPU here, on a GPU where one is (`pytest -m gpu tests/test_optim.py`)
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]

CONFIG = dataclasses.replace(get_preset("tiny"), block_size=32, n_layer=2, dim=64, n_head=2, moe_every=2,
                             num_experts=4, moe_hidden_dim=96, capacity_factor=2.0)
LR, BETAS, WD = 3e-3, (0.9, 0.95), 0.1


def test_the_reference_update_is_torch_adamw():
    gen = torch.Generator().manual_seed(0)
    ours = torch.randn(37, 5, generator=gen)
    start = ours.clone()
    theirs = torch.nn.Parameter(ours.clone())
    torch_opt = torch.optim.AdamW([theirs], lr=LR, betas=BETAS, weight_decay=WD, eps=1e-8, foreach=False)
    m, v = torch.zeros_like(ours), torch.zeros_like(ours)
    for step in range(1, 6):
        grad = torch.randn(37, 5, generator=gen)
        scale = 0.5 if step % 2 else 1.0  # clipping's coefficient, applied inside the pass
        theirs.grad = grad * scale
        torch_opt.step()
        adamw_step_reference(ours, grad, m, v, AdamWHyper(LR, *BETAS, 1e-8, WD, step), grad_scale=scale)
        assert torch.allclose(ours, theirs.detach(), rtol=0, atol=1e-6), step
        assert torch.allclose(m, torch_opt.state[theirs]["exp_avg"], rtol=1e-6, atol=1e-7)
    assert (ours - start).abs().min() > 1e-6  # every element moved


def test_the_pass_checks_its_tensors():
    master = torch.zeros(4)
    with pytest.raises(TypeError, match="exp_avg must be float32"):
        adamw_step(master, torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4),
                   AdamWHyper(LR, *BETAS, 1e-8, WD, 1))
    with pytest.raises(ValueError, match=r"grad has shape \(5,\), the master \(4,\)"):
        adamw_step(master, torch.zeros(5), torch.zeros(4), torch.zeros(4), AdamWHyper(LR, *BETAS, 1e-8, WD, 1))


def adamw_float64(master, grad, exp_avg, exp_avg_sq, hyper: AdamWHyper, grad_scale: float) -> torch.Tensor:
    """The new master computed in float64 from the same float32 inputs: the exact update's value."""
    g = grad.double() * grad_scale
    m = hyper.beta1 * exp_avg.double() + (1 - hyper.beta1) * g
    v = hyper.beta2 * exp_avg_sq.double() + (1 - hyper.beta2) * g * g
    denom = v.sqrt() / hyper.bias_correction2_sqrt + hyper.eps
    return master.double() * (1 - hyper.lr * hyper.weight_decay) - hyper.lr / hyper.bias_correction1 * m / denom


def master_errors(name: str, new_master: torch.Tensor, exact: torch.Tensor, master: torch.Tensor) -> list[str]:
    """`new_master` against the float64 value: float32 rounding of the result (rtol 1e-6) plus 1e-3 of
    the update's size. A formula error (a missing scale, weight decay or bias correction, another
    element's value) moves the update by percents; the float32 passes (torch's ops, the interpreter's
    numpy ops) differ from the exact value by far less. The worst element is named with its inputs."""
    update = (exact - master.double()).abs()
    excess = (new_master.double() - exact).abs() - (1e-6 * exact.abs() + 1e-3 * update + 1e-7)
    if excess.max() <= 0:
        return []
    i = int(excess.argmax())
    return [f"{name}: element {i} is {float(new_master[i]):.9g}, exactly {float(exact[i]):.9g} "
            f"(master {float(master[i]):.9g}, update {float(update[i]):.3g}; {int((excess > 0).sum())} elements off)"]


def kernel_worker() -> list[str]:
    failures = []
    gen = torch.Generator().manual_seed(1)
    for n, grad_dtype, with_copy in ((2500, torch.bfloat16, True), (1024, torch.float32, False), (3, torch.bfloat16,
                                                                                                     True)):
        master = torch.randn(n, generator=gen)
        m, v = torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.01
        grad = torch.randn(n, generator=gen).to(grad_dtype)
        hyper = AdamWHyper(LR, *BETAS, 1e-8, WD, 7)
        exact = adamw_float64(master, grad, m, v, hyper, 0.7)
        results = []
        for fn in (adamw_step, adamw_step_reference):
            state = [master.clone(), m.clone(), v.clone(), torch.zeros(n, dtype=torch.bfloat16) if with_copy else None]
            fn(state[0], grad, state[1], state[2], hyper, grad_scale=0.7, copy=state[3])
            results.append(state)
            failures += master_errors(f"n={n} {grad_dtype} {fn.__name__}", state[0], exact, master)
        for name, a, b in zip(("exp_avg", "exp_avg_sq"), results[0][1:3], results[1][1:3]):
            if not torch.allclose(a, b, rtol=1e-6, atol=1e-7):
                failures.append(f"n={n} {grad_dtype}: {name} differs by {(a - b).abs().max():.2e}")
        if torch.equal(results[0][0], master):
            failures.append(f"n={n}: the kernel did not update the master")
        if with_copy:  # the new master in bf16: within one bf16 ulp, as Triton's interpreter truncates
            # where a GPU rounds to nearest (tests/test_gpu.py checks the GPU's copy bitwise)
            new_master, copy = results[0][0], results[0][3].float()
            if not torch.all((copy - new_master).abs() <= new_master.abs() * 2.0**-7):
                failures.append(f"n={n}: the copy is more than one bf16 ulp from the new master")
        # the scale read from memory, and a skip flag read there too: false updates, true writes nothing
        for skip in (False, True):
            state = [master.clone(), m.clone(), v.clone(), torch.zeros(n, dtype=torch.bfloat16) if with_copy else None]
            adamw_step(state[0], grad, state[1], state[2], hyper, grad_scale=torch.tensor(0.7), copy=state[3],
                       skip=torch.tensor(skip))
            if skip:
                for name, a, b in zip(("master", "exp_avg", "exp_avg_sq"), state, (master, m, v)):
                    if not torch.equal(a, b):
                        failures.append(f"n={n} skip=True, scale in memory: {name} was written")
                if with_copy and state[3].abs().max() != 0:
                    failures.append(f"n={n}: a skipped pass wrote the copy")
            else:
                failures += master_errors(f"n={n} skip=False, scale in memory", state[0], exact, master)
                for name, a, b in zip(("exp_avg", "exp_avg_sq"), state[1:3], results[1][1:3]):
                    if not torch.allclose(a, b, rtol=1e-6, atol=1e-7):
                        failures.append(f"n={n} skip=False, scale in memory: {name} differs")
    return failures


def offset_view(values: torch.Tensor, dtype: torch.dtype, offset: int, device: str) -> torch.Tensor:
    """`values` as `dtype` on `device`, starting `offset` elements into a buffer of its own."""
    buffer = torch.zeros(offset + values.numel(), dtype=dtype)
    buffer[offset:] = values
    return buffer.to(device)[offset:]


def many_tensors(device: str) -> list[tuple]:
    """(master, grad, exp_avg, exp_avg_sq, copy or None, hyper) of tensors of every kind one
    `adamw_steps` launch groups, several of each: bf16, float16 and float32 gradients, with and
    without a bf16 copy, sizes below, at and across the kernel's block (several blocks, a partial
    last one) and an empty one, and views that start 4 or 12 bytes into a buffer (not 16-byte
    aligned, as a bucket's slots can be); each with hyperparameters of its own."""
    gen = torch.Generator().manual_seed(4)
    cases = []
    for i, (n, grad_dtype, with_copy, offset) in enumerate(
            ((2500, torch.bfloat16, True, 0), (1024, torch.float32, False, 0), (3, torch.bfloat16, True, 0),
             (5000, torch.float32, True, 1), (700, torch.bfloat16, False, 1), (1, torch.float32, False, 0),
             (4097, torch.bfloat16, True, 0), (1500, torch.float32, True, 3), (33, torch.bfloat16, False, 3),
             (0, torch.bfloat16, True, 0), (2049, torch.float16, False, 0), (100, torch.float32, False, 0))):
        def make(values, dtype=torch.float32):
            return offset_view(values, dtype, offset, device)
        master, m = make(torch.randn(n, generator=gen)), make(torch.randn(n, generator=gen) * 0.1)
        v, grad = make(torch.rand(n, generator=gen) * 0.01), make(torch.randn(n, generator=gen), grad_dtype)
        copy = make(torch.zeros(n), torch.bfloat16) if with_copy else None
        hyper = AdamWHyper(LR * (i + 1), BETAS[0], BETAS[1] - 0.01 * i, 1e-8 * (i + 1), WD * (i % 3), 3 + i)
        cases.append((master, grad, m, v, copy, hyper))
    return cases


def many_worker() -> list[str]:
    """`adamw_steps` over many tensors in one launch per kind (and a non-contiguous one, which
    takes the reference), against a launch for each tensor alone: bitwise, with the scale as a
    number and read from memory, and a skip flag that writes nothing; and against the exact
    update (float64) and the reference's moments, as `kernel_worker` checks one tensor. (Against
    `adamw_step`'s kernel, whose hyperparameters are its arguments, bitwise on a GPU:
    tests/test_gpu.py; the interpreter passes those in float64, the table holds float32.)"""
    failures = []
    for scale, skip in ((0.7, None), (torch.tensor(0.4), torch.tensor(False)), (0.5, torch.tensor(True))):
        alone, together = many_tensors("cpu"), many_tensors("cpu")
        for cases in (alone, together):  # transposed views: not contiguous
            gen = torch.Generator().manual_seed(5)
            master, m, v, grad = (torch.randn(7, 5, generator=gen).t() for _ in range(4))
            hyper = AdamWHyper(LR, *BETAS, 1e-8, WD, 2)
            cases.append((master, grad, m.abs_().mul_(0.1), v.abs_().mul_(0.01), None, hyper))
        before = [[t.clone() for t in (case[0], case[2], case[3])] for case in alone]
        for master, grad, m, v, copy, hyper in alone:
            adamw_steps([AdamWUpdate(master, grad, m, v, hyper, copy)], grad_scale=scale, skip=skip)
        adamw_steps([AdamWUpdate(master, grad, m, v, hyper, copy) for master, grad, m, v, copy, hyper in together],
                    grad_scale=scale, skip=skip)
        skipped = bool(skip is not None and skip)
        value = float(scale)
        for i, (a, b, start) in enumerate(zip(alone, together, before)):
            label = f"tensor {i} ({a[0].numel()} elements, {a[1].dtype}, scale {value}, skip {skip})"
            for name, x, y in zip(("master", "grad", "exp_avg", "exp_avg_sq", "copy"), a, b):
                if x is not None and not torch.equal(x, y):
                    failures.append(f"{label}: {name} differs by {(x.float() - y.float()).abs().max():.3g}")
            moved = not torch.equal(b[0], start[0])
            if a[0].numel() and moved == skipped:
                failures.append(f"{label}: the master {'moved' if moved else 'did not move'}")
            if skipped or not a[0].numel():
                continue
            master, m, v = (t.reshape(-1) for t in start)
            exact = adamw_float64(master, b[1].reshape(-1), m, v, b[5], value)
            failures += master_errors(label, b[0].reshape(-1), exact, master)
            ref = [t.clone() for t in start]
            adamw_step_reference(ref[0], b[1], ref[1], ref[2], b[5], grad_scale=value)
            for name, x, y in (("exp_avg", b[2], ref[1]), ("exp_avg_sq", b[3], ref[2])):
                if not torch.allclose(x, y, rtol=1e-6, atol=1e-7):
                    failures.append(f"{label}: {name} is {(x - y).abs().max():.2e} from the reference's")
    adamw_steps([])  # nothing to update: no launch
    return failures


def test_one_launch_over_many_tensors_updates_each_as_alone(triton_interpreter):
    failures = run_distributed(many_worker, 1, timeout=300)[0]
    assert not failures, "\n".join(failures)


def squares_cases(device: str) -> list[torch.Tensor]:
    """Tensors of every kind `sum_of_squares` launches apart, several of each: bf16, float16 and
    float32, sizes below, at and across its block (a partial last one), views 2 and 4 bytes into
    a buffer (not 16-byte aligned), an empty tensor, and a transposed (non-contiguous) one that
    the reference sums; magnitudes from 1e-3 to 30."""
    gen = torch.Generator().manual_seed(6)
    out = []
    for n, scale, dtype, offset in ((30000, 1e-3, torch.bfloat16, 0), (17, 5.0, torch.float32, 0),
                                    (8192, 0.1, torch.bfloat16, 0), (1, 30.0, torch.float32, 0),
                                    (20001, 1e-2, torch.float16, 0), (9000, 2.0, torch.bfloat16, 1),
                                    (300, 1.0, torch.float32, 1), (0, 1.0, torch.bfloat16, 0),
                                    (8193, 0.5, torch.float32, 3), (5, 3.0, torch.bfloat16, 0)):
        out.append(offset_view(torch.randn(n, generator=gen) * scale, dtype, offset, device))
    out.insert(4, (torch.randn(40, 30, generator=gen) * 0.3).to(device).t())
    return out


def squares_worker() -> list[str]:
    failures = []
    if not triton_usable(torch.zeros(1)):
        return ["the interpreter is not on: the kernel's path did not run"]
    # small integers: every square and every partial sum is exact in float32, whatever the order,
    # so a block counted twice or left out anywhere (any tensor, any group) changes the result
    exact_cases = [t.mul_(3).round_().clamp_(-3, 3) for t in squares_cases("cpu")]  # in place: the same views
    want = sum(int(t.double().square().sum()) for t in exact_cases)
    if float(sum_of_squares(exact_cases)) != want:
        failures.append(f"integer squares sum to {float(sum_of_squares(exact_cases))}, exactly {want}")
    cases = squares_cases("cpu")
    got = sum_of_squares(cases)
    exact = sum(float(t.double().square().sum()) for t in cases)
    if got.dtype != torch.float32 or got.shape != ():
        failures.append(f"a {got.dtype} of shape {tuple(got.shape)}, not a float32 scalar")
    if abs(float(got) - exact) > 1e-6 * exact:
        failures.append(f"sum of squares {float(got):.9g}, exactly {exact:.9g}")
    if not torch.equal(sum_of_squares(squares_cases("cpu")), got):
        failures.append("two calls gave different bits")
    for i, t in enumerate(cases):  # each tensor alone, the kernel's or the reference's path
        one = float(sum_of_squares([t]))
        want = float(t.double().square().sum())
        if abs(one - want) > 1e-6 * want + 1e-30:
            failures.append(f"tensor {i} ({t.dtype}, {t.numel()} elements, contiguous {t.is_contiguous()}): "
                            f"{one:.9g}, exactly {want:.9g}")
    return failures


def test_one_launch_sums_the_squares_of_many_tensors(triton_interpreter):
    """`sum_of_squares` (gradient clipping's global norm) in Triton's interpreter: within float32
    rounding of the exact sum over mixed dtypes, partial blocks, unaligned views and a tensor the
    reference sums; the same bits twice."""
    failures = run_distributed(squares_worker, 1, timeout=300)[0]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("device", DEVICES)
def test_the_squares_reference_sums_each_tensors_norm_in_the_lists_order(device):
    """Without Triton (the CPU, or non-contiguous tensors) the sum is PyTorch's per-tensor norms,
    squared and added in the list's order, as `gradient_norm` took it before the kernel: squares
    whose float32 sum depends on the order (2^24 + 1 ties to 2^24; 1 + 1 + 2^24 + 1 one after
    another is 2^24 + 4)."""
    ordered = [torch.tensor(values, device=device, dtype=dtype) for values, dtype in
               (([1.0], torch.bfloat16), ([1.0], torch.float32), ([4096.0], torch.bfloat16), ([1.0], torch.float32))]
    in_order = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) for t in ordered]).square().sum()
    assert torch.equal(sum_of_squares_reference(ordered), in_order)
    if device == "cpu":  # no Triton here: the reference's path
        assert torch.equal(sum_of_squares(ordered), in_order)


def test_the_triton_pass_matches_the_reference(triton_interpreter):
    failures = run_distributed(kernel_worker, 1, timeout=300)[0]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused", [True, False])
def test_a_skipped_step_changes_nothing_and_a_taken_one_clips(fused, device):
    """`ClippedAdamW.step(grad_scale=c, skip=s)` with device tensors: s true leaves parameters,
    moments and step counts as they were (the fused kernel decides it itself, as GradScaler's
    found_inf; the others read s); s false updates as AdamW on the gradients times c."""
    gen = torch.Generator().manual_seed(3)
    start = torch.randn(6, 5, generator=gen).to(device)
    grad = torch.randn(6, 5, generator=gen).to(device)
    p = torch.nn.Parameter(start.clone())
    opt = ClippedAdamW([p], lr=LR, betas=BETAS, weight_decay=WD, fused=fused or None, foreach=not fused)
    p.grad = grad.clone()
    opt.step(grad_scale=torch.tensor(0.25, device=device), skip=torch.tensor(True, device=device))
    opt.skipped()
    assert torch.equal(p.detach(), start) and int(opt.state[p].get("step", torch.tensor(0))) == 0
    p.grad = grad.clone()
    opt.step(grad_scale=torch.tensor(0.25, device=device), skip=torch.tensor(False, device=device))
    ref = torch.nn.Parameter(start.clone())
    ref.grad = grad * 0.25
    torch.optim.AdamW([ref], lr=LR, betas=BETAS, weight_decay=WD, foreach=False).step()
    assert torch.allclose(p.detach(), ref.detach(), rtol=0, atol=1e-6) and int(opt.state[p]["step"]) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_master_adamw_takes_a_skipped_step_back(device):
    """`MasterAdamW`: a step whose skip flag is true writes no master, moment or bf16 weight, and
    `skipped()` returns its step counts, so the next step's bias corrections are those of a run
    that never tried it (on a GPU: the Triton pass reads the scale and the flag from memory)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 4, bias=False, device=device)
    twin = torch.nn.Linear(8, 4, bias=False, device=device)
    twin.weight.data = layer.weight.data.clone()
    masters = MasterWeights(MasterPlan([layer.weight], []))
    opt = MasterAdamW(layer.parameters(), masters, lr=LR, betas=BETAS, weight_decay=WD)
    twin_masters = MasterWeights(MasterPlan([twin.weight], []))
    twin_opt = MasterAdamW(twin.parameters(), twin_masters, lr=LR, betas=BETAS, weight_decay=WD)
    grad = torch.randn(4, 8, device=device).to(torch.bfloat16)
    before = (layer.weight.detach().clone(), masters.master(layer.weight).clone())
    layer.weight.grad = grad.clone()
    opt.step(grad_scale=torch.tensor(0.5, device=device), skip=torch.tensor(True, device=device))
    assert torch.equal(layer.weight.detach(), before[0]) and torch.equal(masters.master(layer.weight), before[1])
    opt.skipped()
    for o, w in ((opt, layer.weight), (twin_opt, twin.weight)):
        w.grad = grad.clone()
        o.step(grad_scale=torch.tensor(0.5, device=device), skip=torch.tensor(False, device=device))
    assert int(opt.state[layer.weight]["step"]) == 1
    assert torch.equal(masters.master(layer.weight), twin_masters.master(twin.weight))
    assert torch.equal(layer.weight.detach(), twin.weight.detach())


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 256, (4, 32), generator=gen), torch.randint(0, 256, (4, 32), generator=gen)


NO_STAGING = MasterWeights(MasterPlan([], []))


def step_under_autocast(model: GPT, optimizer, tokens, max_norm: float, groups=None,
                        staging: MasterWeights = NO_STAGING) -> float:
    """One training step as weft train takes it (staged gradients, reduction, norm, clipping in
    the optimizer), with bf16 autocast on the CPU."""
    groups = groups or build_moe_groups()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(*tokens)
    loss.backward()
    staging.stage_gradients()
    with staging.float32_gradients():
        reduce_gradients(model, groups)
        optimizer.step(grad_scale=clip_scale(gradient_norm(model, groups), max_norm))
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def twins(groups) -> tuple[GPT, GPT, MasterPlan]:
    """A float32 model, a copy of it with the same weights, and the plan of the copy's master
    weights for `groups`."""
    torch.manual_seed(0)
    plain = GPT(CONFIG, group=groups.ep)
    mixed = GPT(CONFIG, group=groups.ep)
    mixed.load_state_dict(plain.state_dict())
    return plain, mixed, low_precision_parameters(mixed, groups)


def twin_runs():
    plain, mixed, plan = twins(build_moe_groups())
    masters = MasterWeights(plan)
    return (plain, ClippedAdamW(decay_groups(plain, WD), lr=LR, betas=BETAS, foreach=False),
            mixed, MasterAdamW(decay_groups(mixed, WD), masters, lr=LR, betas=BETAS), masters)


def test_master_weights_store_the_matmul_weights_in_bf16():
    plain, _, mixed, _, masters = twin_runs()
    low = {n for n, p in mixed.named_parameters() if p.dtype == torch.bfloat16}
    assert len(masters) == len(low) > 0
    assert {n.rsplit(".", 1)[-1] for n in low} == {"weight", "w1", "w2"}
    assert all(".attn." in n or ".ffn.experts." in n or ".ffn.fc" in n or ".ffn.out_proj" in n for n in low), low
    fp32 = {n for n, p in mixed.named_parameters() if p.dtype == torch.float32}
    assert "tok_emb.weight" in fp32 and any("router" in n or "gate" in n for n in fp32), fp32
    for (name, p), q in zip(mixed.named_parameters(), plain.parameters()):
        master = masters.master(p)
        if name in low:
            assert torch.equal(master, q.detach()) and torch.equal(p.detach(), q.detach().to(torch.bfloat16))
        else:
            assert master is None


def test_bf16_weights_with_masters_train_as_float32_weights_under_autocast():
    """The equivalence, with clipping active at every other step (see check_the_same_training)."""
    plain, plain_opt, mixed, mixed_opt, masters = twin_runs()
    losses, drift = [], []
    for step in range(6):
        max_norm = 100.0 if step % 2 else 0.5
        losses.append((step_under_autocast(plain, plain_opt, batch(step), max_norm),
                       step_under_autocast(mixed, mixed_opt, batch(step), max_norm)))
        drift.append(max(float((_value(p, masters) - q.detach()).abs().max())
                         for p, q in zip(mixed.parameters(), plain.parameters())))
    check_the_same_training(losses, drift)
    for p in mixed.parameters():
        if masters.master(p) is not None:
            assert torch.equal(p.detach(), masters.master(p).to(torch.bfloat16))  # the bf16 weight: master rounded
    torch.manual_seed(0)  # the run moved: its start, rebuilt from the seed
    initial = GPT(CONFIG)
    moved = max(float((q.detach() - r.detach()).abs().max()) for q, r in zip(plain.parameters(), initial.parameters()))
    assert moved > 3 * LR, moved  # several steps of the learning rate, far above drift[0]


def test_checkpoints_hold_the_masters_and_load_into_either_kind_of_run(tmp_path):
    plain, plain_opt, mixed, mixed_opt, masters = twin_runs()
    for step in range(2):
        step_under_autocast(mixed, mixed_opt, batch(step), 100.0)
    groups = build_moe_groups()
    with masters.full_precision():
        save_checkpoint(tmp_path, 2, mixed, mixed_opt, groups, {})
        saved = {n: p.detach().clone() for n, p in mixed.named_parameters()}
        state = {n: {k: v.clone() for k, v in mixed_opt.state[p].items()} for n, p in mixed.named_parameters()}
    assert all(v.dtype == torch.float32 for v in saved.values())
    path = latest_checkpoint(tmp_path)

    # into a float32 run: the masters, exactly, and AdamW's state
    load_checkpoint(path, plain, plain_opt, groups)
    for n, p in plain.named_parameters():
        assert torch.equal(p.detach(), saved[n]), n
        for key, value in state[n].items():
            assert torch.equal(plain_opt.state[p][key].cpu(), value.cpu()), (n, key)

    # into a run with master weights: the masters exactly, the bf16 weights their rounding
    torch.manual_seed(5)
    fresh = GPT(CONFIG)
    fresh_masters = MasterWeights(low_precision_parameters(fresh, groups))
    fresh_opt = MasterAdamW(decay_groups(fresh, WD), fresh_masters, lr=LR, betas=BETAS)
    with fresh_masters.full_precision():
        load_checkpoint(path, fresh, fresh_opt, groups)
    for n, p in fresh.named_parameters():
        master = fresh_masters.master(p)
        assert torch.equal(master if master is not None else p.detach(), saved[n]), n
        if master is not None:
            assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), saved[n].to(torch.bfloat16))
    # and both continue alike
    a = step_under_autocast(plain, plain_opt, batch(2), 100.0)
    b = step_under_autocast(fresh, fresh_opt, batch(2), 100.0)
    assert a == b


def test_master_weights_are_used_only_where_they_change_no_arithmetic():
    cuda = torch.device("cuda")
    model = GPT(CONFIG)
    assert master_weights_blocker(model, cuda, "none") is None
    assert "CPU" in master_weights_blocker(model, torch.device("cpu"), "none")
    assert "--overlap lancet" in master_weights_blocker(model, cuda, "lancet")  # its partitioned forward
    # a graphed step gets Lancet's dW schedule only: each weight's gradient written once, in bf16
    assert master_weights_blocker(model, cuda, "lancet", lancet_partitions=False) is None
    # which is where the step can replay as a CUDA graph (padded layers), graphs not turned off
    assert not lancet_partitions_forward(model, cuda, "auto")
    assert lancet_partitions_forward(model, cuda, "off") and lancet_partitions_forward(model, torch.device("cpu"), "on")
    assert lancet_partitions_forward(GPT(dataclasses.replace(CONFIG, capacity_factor=None)), cuda, "auto")
    assert master_weights_blocker(model, cuda, "tutel") is None  # padded: one weight-gradient matmul per chunked call
    dropless = GPT(dataclasses.replace(CONFIG, capacity_factor=None))
    assert "dropless" in master_weights_blocker(dropless, cuda, "tutel")
    # Pro-Prophet keeps master weights: Agg adds into rows nothing else wrote (see the test below)
    balanced = GPT(dataclasses.replace(CONFIG, capacity_factor=None), balance="pro-prophet")
    assert master_weights_blocker(balanced, cuda, "none") is None
    plan = low_precision_parameters(model, build_moe_groups(), grad_accum=2)  # micro-batches sum the gradients
    assert plan.direct == [] and len(plan.staged) == len(low_precision_parameters(model, build_moe_groups()).direct)


def test_staged_gradients_accumulate_in_float32_and_look_like_float32_parameters():
    """stage_gradients moves bf16 gradients into float32 sums (the first micro-step's copied);
    inside float32_gradients a staged weight is its master with that sum as its gradient."""
    weight = torch.nn.Parameter(torch.randn(3, 4))
    masters = MasterWeights(MasterPlan([], [weight]))
    grads = [torch.randn(3, 4).bfloat16() for _ in range(3)]
    for _ in range(2):  # the sum restarts at each step
        for g in grads:
            weight.grad = g.clone()
            masters.stage_gradients()
            assert torch.equal(weight.grad, torch.zeros_like(g))  # zeroed in place for the next backward
        bf16_grad = weight.grad
        with masters.float32_gradients():
            assert weight.dtype == torch.float32 and weight.grad.dtype == torch.float32
            assert torch.equal(weight.detach(), masters.master(weight))
            expected = grads[0].float() + grads[1].float() + grads[2].float()
            assert torch.equal(weight.grad, expected)
        assert weight.dtype == torch.bfloat16 and weight.grad is bf16_grad


def test_master_weights_refuse_non_float32_parameters():
    with pytest.raises(TypeError, match="float32 parameters, got torch.bfloat16"):
        MasterWeights(MasterPlan([torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))], []))


def ranks_worker(ep_size: int) -> dict:
    """On each rank: which weights go to bf16 (directly or through float32 accumulators), and bf16
    weights with masters against float32 weights over steps of expert-parallel training under bf16
    autocast, gradients reduced and clipped as weft train does."""
    groups = build_moe_groups(ep_size)
    rank = torch.distributed.get_rank()
    plain, mixed, plan = twins(groups)
    names = {id(p): n for n, p in mixed.named_parameters()}
    masters = MasterWeights(plan)
    runs = [(plain, ClippedAdamW(decay_groups(plain, WD), lr=LR, betas=BETAS, foreach=False), NO_STAGING),
            (mixed, MasterAdamW(decay_groups(mixed, WD), masters, lr=LR, betas=BETAS), masters)]
    losses, drift = [], []
    for step in range(4):
        max_norm = 100.0 if step % 2 else 0.5  # clipping at steps 0, 2
        losses.append([step_under_autocast(model, optimizer, batch(10 * step + rank), max_norm, groups, staging)
                       for model, optimizer, staging in runs])
        drift.append(max(float((_value(p, masters) - q.detach()).abs().max())
                         for p, q in zip(mixed.parameters(), plain.parameters())))
    return {"direct": sorted(names[id(p)] for p in plan.direct), "staged": sorted(names[id(p)] for p in plan.staged),
            "losses": losses, "drift": drift}


def _value(p: torch.nn.Parameter, masters: MasterWeights) -> torch.Tensor:
    """A parameter's float32 value: its master, or itself."""
    master = masters.master(p)
    return p.detach() if master is None else master


@pytest.mark.parametrize("world, ep_size", [(1, None), (2, None), (2, 1), (4, None), (4, 2)])
def test_master_weights_on_several_ranks_stage_the_gradients_ranks_sum(world, ep_size):
    results = run_distributed(ranks_worker, world, args=(ep_size,), timeout=300)
    ep = world if ep_size is None else ep_size
    for result in results:
        direct, staged = result["direct"], result["staged"]
        experts = {n for n in direct + staged if ".ffn.experts." in n}
        linears = {n for n in direct + staged if ".ffn.experts." not in n}
        assert {n.rsplit(".", 1)[-1] for n in experts} == {"w1", "w2"} and linears, (direct, staged)
        if world == 1:  # nothing summed: every weight direct
            assert staged == []
        elif ep == world:  # each rank's own experts direct; the linears' gradients summed over ranks
            assert set(direct) == experts and set(staged) == linears
        else:  # expert-data-parallel ranks sum the experts' gradients too
            assert direct == [] and set(staged) == experts | linears
        check_the_same_training(result["losses"], result["drift"])


def check_the_same_training(losses: list[tuple[float, float]], drift: list[float]) -> None:
    """The first step's loss bitwise (the same bf16 weights), its update to float32 rounding (two
    AdamW kernels); later, where the last bit of a master flips a bf16 weight, the two runs part
    by amounts Adam's normalisation scales to the learning rate: losses close, weights within a
    few steps' worth of it."""
    assert losses[0][0] == losses[0][1]
    assert drift[0] < 1e-6, drift
    for plain_loss, mixed_loss in losses:
        assert abs(plain_loss - mixed_loss) < 2e-3 * abs(plain_loss)
    assert max(drift) < LR * len(drift), drift


def test_a_resumed_run_keeps_its_own_optimizer_implementation(tmp_path):
    """A checkpoint's param groups carry the writer's `fused` / `foreach`; the loading run keeps
    the ones it chose (e.g. float32 parameters after a run with master weights)."""
    import contextlib

    from weft.train.loop import _load

    groups = build_moe_groups()
    torch.manual_seed(0)
    writer = GPT(CONFIG)
    writer_opt = ClippedAdamW(decay_groups(writer, WD), lr=LR, foreach=False)
    step_under_autocast(writer, writer_opt, batch(0), 100.0)
    save_checkpoint(tmp_path, 1, writer, writer_opt, groups, {"step": 1})
    reader = GPT(CONFIG)
    reader_opt = ClippedAdamW(decay_groups(reader, WD), lr=LR, foreach=True)
    assert _load(latest_checkpoint(tmp_path), reader, reader_opt, groups, contextlib.nullcontext)["step"] == 1
    assert all(group["foreach"] is True for group in reader_opt.param_groups)
    assert all(torch.equal(a, b) for a, b in zip(reader.parameters(), writer.parameters()))


# -- weft train itself, as it runs on GPUs: bf16 autocast (here on the CPU), master weights allowed --
def train_like_on_gpus(cfg):
    """`weft.train.loop.train` with the GPU's bf16 autocast on the CPU (which weft trains in
    float32) and the master-weights rule told it runs on a GPU: the loop's own wiring (which
    weights, checkpoints with masters, resume) on gloo ranks."""
    import weft.train.loop as loop
    import weft.train.step as step

    def bf16(device):
        return torch.autocast("cpu", dtype=torch.bfloat16)

    loop.training_autocast = step.training_autocast = bf16
    blocker = loop.master_weights_blocker
    loop.master_weights_blocker = lambda model, device, *rest: blocker(model, torch.device("cuda"), *rest)
    return loop.train(cfg)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.mark.parametrize("world, grad_accum", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)])
def test_weft_train_with_master_weights_has_the_float32_losses_and_resumes_exactly(corpus, tmp_path, world,
                                                                                    grad_accum):
    env = {"WEFT_CACHE": str(tmp_path / "cache")}
    for name, master, kw in (("on", "on", {}), ("off", "off", {}),
                             ("split", "on", {"steps": 20, "lr_decay_steps": 30}),
                             ("split", "on", {"resume": True})):
        cfg = config(corpus, tmp_path / name, master_weights=master, grad_accum=grad_accum, **kw)
        run_distributed(train_like_on_gpus, world, args=(cfg,), timeout=300, env=env)
    on, off, split = (losses(tmp_path / name) for name in ("on", "off", "split"))
    assert sorted(on) == list(range(1, 31))
    assert on[1] == off[1]  # the same bf16 weights at the first step
    # ... and the same gradients, summed over micro-batches and ranks in float32 (to summation order)
    assert losses(tmp_path / "on", "grad_norm")[1] == pytest.approx(losses(tmp_path / "off", "grad_norm")[1],
                                                                    rel=1e-5)
    assert all(abs(on[s] - off[s]) < 0.02 * off[s] for s in on), (on, off)
    assert sum(on[s] for s in range(26, 31)) < sum(on[s] for s in range(1, 6)) - 2.0  # it learns
    assert [split[s] for s in range(21, 31)] == [on[s] for s in range(21, 31)]  # resumed exactly


def test_a_weight_without_a_gradient_in_the_first_micro_step_is_staged_from_zero():
    """A weight that no micro-step of a step touched has no gradient; one first touched at a later
    micro-step starts its sum there (nothing left from the step before)."""
    a, b = torch.nn.Parameter(torch.randn(2, 2)), torch.nn.Parameter(torch.randn(2, 2))
    masters = MasterWeights(MasterPlan([], [a, b]))
    ga, gb = torch.ones(2, 2, dtype=torch.bfloat16), torch.full((2, 2), 3.0, dtype=torch.bfloat16)
    a.grad, b.grad = ga.clone(), gb.clone()
    masters.stage_gradients()
    with masters.float32_gradients():
        assert torch.equal(b.grad, gb.float())
    a.grad, b.grad = None, None  # the next step: b untouched at first, then touched; a untouched
    masters.stage_gradients()
    b.grad = gb.clone()
    masters.stage_gradients()
    with masters.float32_gradients():
        assert a.grad is None
        assert torch.equal(b.grad, gb.float())  # not 2 x gb: the old sum is gone


# -- Pro-Prophet with master weights: the float32 weights' gradients --------------------------------
def agg_with_master_weights_worker(micro_batches: int) -> list[str]:
    """A balanced layer with float32 weights and its twin with bf16 experts and float32 masters
    (direct with one micro-batch, staged with more, as `low_precision_parameters` makes them on
    expert-parallel ranks), under bf16 autocast (the CPU's here), expert 1 copied to every other
    rank in every call: every expert weight's gradient is bitwise the float32 weights'. What makes
    it exact: the owner computes its own rows of a copied expert from the copy, so its experts' own
    gradient is zero in those rows, and Agg's sum (reduced in bf16 either way) lands on zeros."""
    import torch.distributed as dist

    from weft import MoE
    from weft.moe.exchange import Transfer
    from weft.testing import Checks

    rank, world = dist.get_rank(), dist.get_world_size()
    checks = Checks(f"rank {rank}")
    layers = []
    for _ in range(2):
        torch.manual_seed(0)
        layers.append(MoE(16, 32, 2 * world, 2, capacity_factor=None, balance="pro-prophet"))
    plain, mixed = layers
    experts = [p for p in mixed.experts.parameters() if p.requires_grad]
    masters = MasterWeights(MasterPlan(experts, []) if micro_batches == 1 else MasterPlan([], experts))
    copies = {1: frozenset(range(1, world))}  # expert 1 lives on rank 0
    for micro in range(micro_batches):
        gen = torch.Generator().manual_seed(10 * micro + rank)
        x = torch.randn(24, 16, generator=gen)
        x[:, 0] += 2.0
        grad_out = torch.randn(24, 16, generator=gen)
        for layer in layers:
            transfer = Transfer(layer.experts, layer.placement, copies, layer.group, torch.bfloat16)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = layer(x.clone().requires_grad_(), transfer=transfer)
            y.backward(grad_out.to(y.dtype))
        masters.stage_gradients()
    with masters.float32_gradients():
        for (name, p), q in zip(mixed.experts.named_parameters(), plain.experts.parameters()):
            if not p.requires_grad:
                continue
            checks.expect(p.grad is not None, f"{name}: no gradient")
            grad = p.grad.float()
            checks.expect(torch.equal(grad, q.grad),
                          f"{name}: gradient differs by {float((grad - q.grad).abs().max()):.2e}")
            if rank == 0 and world > 1:  # the copied expert's rows got the other ranks' gradients
                checks.expect(bool(q.grad[1].abs().sum() > 0), f"{name}: expert 1 got no gradient")
    return checks.failures


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_master_weights_give_a_balanced_layer_the_float32_gradients(world, micro_batches):
    """World 1 copies nothing (no other rank): the bf16 experts alone."""
    flat = run_checks(agg_with_master_weights_worker, world, args=(micro_batches,), timeout=300)
    assert not flat, "\n".join(flat[:15])


@pytest.mark.parametrize("world", [2, 4])
def test_weft_train_balances_with_master_weights_and_the_float32_losses(corpus, tmp_path, world):
    """`--balance pro-prophet --master-weights on` (refused before: float32 only) trains a dropless
    model with experts copied on the way and the losses of float32 weights (the first step
    bitwise, the rest to bf16 rounding of the updates, as without balancing)."""
    env = {"WEFT_CACHE": str(tmp_path / "cache")}
    model = {**SMALL_MODEL, "capacity_factor": "dropless", "moe_every": 1}
    for master in ("on", "off"):
        # the paper's model on nominal constants: copies pay for such tiny experts (tests/test_train.py)
        cfg = config(corpus, tmp_path / master, steps=12, model=model, master_weights=master,
                     balance="pro-prophet", balance_model="nominal")
        run_distributed(train_like_on_gpus, world, args=(cfg,), timeout=300, env=env)
    on, off = losses(tmp_path / "on"), losses(tmp_path / "off")
    assert sorted(on) == list(range(1, 13))
    assert on[1] == off[1]
    assert losses(tmp_path / "on", "grad_norm")[1] == pytest.approx(losses(tmp_path / "off", "grad_norm")[1],
                                                                    rel=1e-5)
    assert all(abs(on[s] - off[s]) < 0.02 * off[s] for s in on), (on, off)
    copied = losses(tmp_path / "on", "copied_experts")
    assert any(experts for layers in copied.values() for experts in layers), "no expert was copied in 12 steps"
