"""Both Lancet passes together train exactly like the plain model (1, 2, 4 gloo ranks), and
`weft.overlap.optimize`, `weft plan`, `weft bench model` and `weft train --overlap` work end to end."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math

import pytest
import torch
import torch.distributed as dist

from weft.cli import main
from weft.distributed import MoEGroups, build_moe_groups
from weft.graphs import live_gradient_accumulators
from weft.models import GPT, GPTConfig
from weft.moe.grads import reduce_gradients
from weft.overlap import WGradScheduler, optimize, passes
from weft.overlap.forward import Range
from weft.overlap.passes import GRAPHED_MIN_GAIN, apply, choose_passes, predict_backward
from weft.overlap.planner import MoEUnit
from weft.testing import run_checks

CASES = {  # gate, top_k, capacity factor -> forward ranges (pre ranges only where the gate allows)
    ("topk", 1, 0.5): [Range(2, 4, 2, 3), Range(6, 7, 3, 7)],
    ("bpr", 2, 0.5): [Range(3, 5, 2, 3), Range(7, 7, 2, 7)],
    ("topk", 2, None): [Range(0, 3, 2, 3), Range(5, 7, 4, 7)],
}


def _config(gate, top_k, cf) -> GPTConfig:
    return GPTConfig(vocab_size=64, block_size=8, n_layer=4, n_head=2, dim=16, moe_every=2, num_experts=8,
                     top_k=top_k, gate=gate, capacity_factor=cf, aux_loss_coef=0.1, activation="swiglu")


def _train(model: GPT, batches, scheduler: WGradScheduler | None, groups: MoEGroups) -> tuple[list[float], list[int]]:
    """Three SGD steps' losses and drops, each backward under `scheduler` (the one applied to the
    model) where there is one, the gradients summed over `groups`."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, dropped = [], []
    for idx in batches:
        _, loss = model(idx[:, :-1], idx[:, 1:])
        with scheduler.backward() if scheduler is not None else contextlib.nullcontext():
            loss.backward()
        reduce_gradients(model, groups)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        dropped.append(sum(int(m.stats.dropped) for m in model.moe_layers()))
    return losses, dropped


def check_lancet_case(config: GPTConfig, ranges: list[Range], budget: float, batches: list[torch.Tensor],
                      groups: MoEGroups, degree: int = 1, device: str = "cpu",
                      kernels: str = "auto") -> tuple[list[str], list[int]]:
    """Both Lancet passes (the forward `ranges` partitioned and pipelined around their MoE layers,
    sec. 5; dW items under the all-to-alls with `budget` seconds of each, sec. 4) against the plain
    model, each MoE layer at overlap `degree` and both models on `kernels`: three SGD steps' losses,
    drops and weights (the gradients summed over `groups`, built once: each build makes new
    process groups), and no deferred dW item lost (with a budget for every item on several ranks,
    some run under an exchange). (failures, the plain model's drops a step)."""
    rank, failures = dist.get_rank(), []
    tol = 1 if device == "cpu" else 20  # GPU matmuls round differently at different partition sizes
    results = []
    for lancet in (False, True):
        torch.manual_seed(0)
        model = GPT(config, group=dist.group.WORLD, kernels=kernels).to(device)
        for moe in model.moe_layers():
            moe.overlap_degree = degree
        scheduler = WGradScheduler(comm_time=lambda nbytes: budget) if lancet else None
        if lancet:
            apply(model, ranges, scheduler)
        results.append((*_train(model, batches, scheduler, groups), scheduler, model.state_dict()))
        if lancet:
            # The model's layers hold the scheduler the training loop used for backward.
            apply(model, [], None)
    (ref_losses, ref_dropped, _, ref_state), (losses, dropped, scheduler, state) = results
    label = (f"rank {rank} {config.gate} k{config.top_k} cf{config.capacity_factor} d{degree} budget {budget} "
             f"ranges {[(r.start, r.end, r.partitions, r.moe) for r in ranges]}")
    # the scheduler the backward ran under (its last): no deferred item lost, and with a budget
    # for every item, items under the partitioned forward's exchanges (each recorded in the
    # trace the plan follows; before, the plan gave them nothing from the second backward on).
    # Only a block after an MoE block gives items before that layer's backward exchanges: the
    # head's weight (tied to the embedding) is no dW item.
    stats = scheduler.stats
    items_before_an_exchange = any(config.is_moe_block(i) for i in range(config.n_layer - 1))
    if stats.deferred != stats.run_under_comm + stats.flushed or budget == 1.0 and dist.get_world_size() > 1 \
            and items_before_an_exchange and stats.run_under_comm == 0:
        failures.append(f"{label}: the dW items {stats}")
    if dropped != ref_dropped:
        failures.append(f"{label}: dropped {dropped} != {ref_dropped}")
    if not torch.allclose(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5 * tol, atol=1e-6 * tol):
        failures.append(f"{label}: losses {losses} != {ref_losses}")
    for name, value in ref_state.items():  # relative to the tensor's norm: a tied embedding's small entries
        # take sums of many rows' gradients, which partitions and chunks add in another order
        error = float((state[name].float() - value.float()).norm() / value.float().norm().clamp_min(1e-12))
        if error > 1e-5 * tol:
            failures.append(f"{label}: {name} after 3 steps differs by {error:.2e} of its norm "
                            f"(at most {(state[name] - value).abs().max():.2e})")
    return failures, ref_dropped


def both_passes_worker(budget: float, device: str = "cpu") -> list[str]:
    rank, failures = dist.get_rank(), []
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 64, (6, 9), generator=gen).to(device) for _ in range(3)]
    groups = build_moe_groups()
    for (gate, top_k, cf), ranges in CASES.items():
        found, ref_dropped = check_lancet_case(_config(gate, top_k, cf), ranges, budget, batches, groups, device=device)
        failures += found
        if cf is not None and sum(ref_dropped) == 0:
            failures.append(f"rank {rank} {gate} k{top_k} cf{cf}: nothing dropped; the case proves nothing about "
                            "capacity")
    return failures


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_both_passes_train_like_the_plain_model(world_size):
    # A large budget runs every queued dW item under the first all-to-all; a tiny one almost none.
    for budget in (1.0, 1e-7):
        failures = run_checks(both_passes_worker, world_size, args=(budget,), timeout=300)
        assert not failures, "\n".join(failures[:10])


def scheduler_runs_items_under_comm_worker() -> list[str]:
    """With dW scheduling, items really run while all-to-alls are in flight (after the first
    backward timed them), and the gradients are complete when backward returns."""
    torch.manual_seed(0)
    model = GPT(_config("topk", 1, None), group=dist.group.WORLD)
    scheduler = WGradScheduler(comm_time=lambda nbytes: 1.0)
    apply(model, [], scheduler)
    idx = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        _, loss = model(idx[:, :-1], idx[:, 1:])
        with scheduler.backward():
            loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    stats = scheduler.stats
    failures = [f"parameters without gradient: {missing}"] if missing else []
    if stats.run_under_comm == 0 or stats.comms == 0:
        failures.append(f"no dW item ran under an all-to-all: {stats}")
    if stats.deferred != stats.run_under_comm + stats.flushed:
        failures.append(f"items lost: {stats}")
    return failures


def test_dw_items_run_under_the_all_to_alls():
    failures = run_checks(scheduler_runs_items_under_comm_worker, 2, timeout=120)
    assert not failures, "\n".join(failures)


def pipelined_dw_worker(device: str = "cpu", capacity: float | None = 1.0) -> list[str]:
    """Lancet's dW schedule over MoE layers pipelined by Tutel's chunks (`overlap_degree=2`, what a
    graphed `--overlap lancet` step may choose; `capacity` None: dropless, the chunks cut from
    every (rank, expert) segment): the items run under each layer's first backward chunk's
    exchange (where there are any: W > 1), and three SGD steps give the plain model's losses,
    drops and weights."""
    rank, world, failures = dist.get_rank(), dist.get_world_size(), []
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    tol = 1 if device == "cpu" else 20  # on GPUs the items' sums into .grad may round in another order
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 64, (6, 9), generator=gen).to(device) for _ in range(3)]
    groups, results = build_moe_groups(), []
    for lancet in (False, True):
        torch.manual_seed(0)
        model = GPT(_config("topk", 2, capacity), group=dist.group.WORLD).to(device)
        for moe in model.moe_layers():
            moe.overlap_degree = 2
        scheduler = WGradScheduler(comm_time=lambda nbytes: 1.0) if lancet else None
        apply(model, [], scheduler)
        results.append((*_train(model, batches, scheduler, groups), model.state_dict(), scheduler))
    (ref_losses, ref_dropped, ref_state, _), (losses, dropped, state, scheduler) = results
    label = f"rank {rank} of {world}"
    if losses != pytest.approx(ref_losses, rel=1e-6 * tol) or dropped != ref_dropped:
        failures.append(f"{label}: losses {losses} / drops {dropped} against {ref_losses} / {ref_dropped}")
    for name, value in ref_state.items():
        if not torch.allclose(state[name].float(), value.float(), rtol=1e-5 * tol, atol=1e-6 * tol):
            failures.append(f"{label}: {name} differs by {(state[name] - value).abs().max():.2e}")
    stats = scheduler.stats
    under = stats.comms > 0 and stats.run_under_comm > 0
    if under != (world > 1) or stats.deferred != stats.run_under_comm + stats.flushed:
        failures.append(f"{label}: items under the chunks' exchanges {stats}")
    # one exchange of each pipelined layer's backward takes items, its first chunk's (weft.moe.pipeline)
    if world > 1 and stats.comms != len(model.moe_layers()):
        failures.append(f"{label}: {stats.comms} exchanges took items, not one per MoE layer: {stats}")
    return failures


@pytest.mark.parametrize("capacity", [1.0, None])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_dw_items_run_under_pipelined_chunks_and_train_like_the_plain_model(world_size, capacity):
    failures = run_checks(pipelined_dw_worker, world_size, args=("cpu", capacity), timeout=300)
    assert not failures, "\n".join(failures)


def optimize_worker() -> list[str]:
    torch.manual_seed(0)
    model = GPT(_config("topk", 1, 1.0), group=dist.group.WORLD)
    idx = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
    _, before = model(idx[:, :-1], idx[:, 1:])
    plan = optimize(model, idx[:, :-1], max_partitions=4, repeats=1, measure=0)  # applied as planned
    _, after = model(idx[:, :-1], idx[:, 1:])
    plan.backward(after)
    failures = []
    if abs(before.item() - after.item()) > 1e-5:
        failures.append(f"optimize changed the loss: {before.item()} -> {after.item()}")
    if dist.get_world_size() == 1:  # no all-to-all: nothing to hide dW under, so no scheduling
        if plan.scheduler is not None or model.blocks[0].attn.qkv.wgrad_scheduler is not None:
            failures.append("dW scheduling was turned on without any all-to-all")
    elif plan.scheduler is None or model.blocks[0].attn.qkv.wgrad_scheduler is not plan.scheduler:
        failures.append("dW scheduling was not applied to the model's linear layers")
    if (list(model.unit_runner.ranges) if model.unit_runner else []) != plan.ranges:
        failures.append("the forward ranges were not applied")
    summary = plan.summary()
    if "moe1" not in summary or "moe3" not in summary or not plan.predicted > 0:
        failures.append(f"summary lacks the MoE layers or a prediction:\n{summary}")
    if plan.predicted > plan.baseline * (1 + 1e-9):
        failures.append(f"the plan predicts slower than no plan: {plan.predicted} > {plan.baseline}")
    eta_dw = plan.profile.dw_efficiency  # measured by real runs here: a matmul beside gloo's all-to-all
    if (eta_dw is None) != (dist.get_world_size() == 1) or eta_dw is not None and not 0.0 <= eta_dw <= 1.0:
        failures.append(f"the dW items' η {eta_dw} on {dist.get_world_size()} ranks")
    return failures


def graphed_profile_worker() -> list[str]:
    """optimize(graphed=True) times every computation of the profile as a CUDA graph replay
    (`graph_seconds`, replaced here by a constant: the CPU cannot capture), the all-to-alls
    eagerly; graphed=False never asks for a replay."""
    from weft.overlap import profile

    calls, streams, communicated = [], set(), []
    exchanges, all_to_all = [0], dist.all_to_all_single

    def counted_all_to_all(*args, **kwargs):
        exchanges[0] += 1
        return all_to_all(*args, **kwargs)

    dist.all_to_all_single = counted_all_to_all  # this spawned process's only

    def fake_graph_seconds(fn, device, repeats=5, warmup=2, inner=5, stream=None):
        before = exchanges[0]
        fn()
        communicated.append(exchanges[0] > before)
        calls.append(fn)
        streams.add(id(stream))  # one capture stream for the whole profile (None: this is a CPU)
        return 2e-3

    profile.graph_seconds = fake_graph_seconds  # this spawned process's module only
    torch.manual_seed(0)
    model = GPT(_config("topk", 1, 1.0), group=dist.group.WORLD)
    x = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    failures = []
    plan = optimize(model, x, forward=False, partitions=(1,), repeats=1, measure=0, graphed=True, in_step=True)
    units = plan.profile.units
    # each sub-layer's forward (a dense one whole, an MoE one as its computation and its experts),
    # each sub-layer's forward + backward and forward again, the head's, the model's backward (2),
    # and where the experts communicate η's four (the all-to-all alone, one and several experts'
    # calls, both at once: `measure_overlap_efficiency` as the graphed step runs them), the same
    # four for a weight-gradient matmul (the dW items' η), and `in_step`'s forward of each
    # communicating MoE layer (no weight cast: float32 on a CPU)
    moes = sum(isinstance(u, MoEUnit) for u in units)
    efficiency, in_step = (8, moes) if dist.get_world_size() > 1 else (0, 0)
    if len(calls) != len(units) + moes + 2 * len(units) + 3 + efficiency + in_step:
        failures.append(f"{len(calls)} graph replays timed for {len(units)} sub-layers")
    if sum(communicated) != (4 + moes if dist.get_world_size() > 1 else 0):  # each η's all-to-all alone and beside
        failures.append(f"{sum(communicated)} of the replays ran an all-to-all, expected the two η's 2 each and "
                        f"one forward of each of the {moes} MoE layers")
    stepped = [t for u, t in zip(units, plan.profile.forward_in_step) if isinstance(u, MoEUnit)]
    if stepped != [2e-3 if dist.get_world_size() > 1 else None] * moes or any(plan.profile.weight_cast):
        failures.append(f"in-step forwards {plan.profile.forward_in_step}, weight casts {plan.profile.weight_cast}")
    # the plan is priced with the corrections it measured (on 2 ranks they move the all-to-alls)
    scheduled = plan.scheduler is not None
    if plan.predicted != pytest.approx(passes.predict_unpartitioned(plan.priced, (), scheduled)) or \
            (dist.get_world_size() > 1) == (plan.priced.units == plan.profile.units):
        failures.append(f"the plan's price {plan.predicted} is not its corrected profile's")
    if dist.get_world_size() > 1 and (plan.profile.overlap_efficiency, plan.profile.dw_efficiency) != (1.0, 1.0):
        failures.append(f"η {plan.profile.overlap_efficiency}, the dW items' {plan.profile.dw_efficiency} from "
                        f"replays of 2 ms each, expected 1 each: (2 + 2 - 2) / 2")
    if dist.get_world_size() == 1 and plan.profile.dw_efficiency is not None:
        failures.append(f"the dW items' η measured with nothing to overlap: {plan.profile.dw_efficiency}")
    dense = [u.time[1] for u in units if not isinstance(u, MoEUnit)]
    if dense != [2e-3] * len(dense) or plan.profile.rest != 2e-3 or any(b != 0.0 for b in plan.profile.backward):
        failures.append(f"the profile's times are not the replays': {dense}, rest {plan.profile.rest}, "
                        f"backward {plan.profile.backward}")
    comm = [u.dispatch[1] for u in units if isinstance(u, MoEUnit)]
    if dist.get_world_size() > 1 and not all(c > 0 and c != 2e-3 for c in comm):
        failures.append(f"the all-to-alls were not priced by the measured cost model: {comm}")
    if live_gradient_accumulators(list(model.parameters())):
        failures.append("the profile left an autograd graph alive")
    if len(streams) != 1:
        failures.append(f"the profile's captures used {len(streams)} capture streams, not one")
    if plan.profile.graph_replays != (len(calls), 0) or f"replays: {len(calls)} of {len(calls)} calls" \
            not in plan.summary() or plan.to_dict()["graph_replays"] != (len(calls), 0):
        failures.append(f"the plan reports {plan.profile.graph_replays} replays of {len(calls)}:\n{plan.summary()}")
    communicated.clear()
    unasked = optimize(model, x, forward=False, partitions=(1,), repeats=1, measure=0, graphed=True)
    if unasked.profile.forward_in_step or unasked.profile.weight_cast or sum(communicated) > 4:
        failures.append(f"a graphed profile not asked for them measured in-step corrections "
                        f"({sum(communicated)} replays communicated)")
    calls.clear()
    eager = optimize(model, x, forward=False, partitions=(1,), repeats=1, measure=0)
    if calls or eager.profile.graph_replays is not None or "replays" in eager.summary() \
            or eager.profile.forward_in_step:
        failures.append(f"an eager profile timed {len(calls)} graph replays, in-step forwards "
                        f"{eager.profile.forward_in_step}")
    for moe in model.moe_layers():  # a degree still to be tuned: its tuner would time inside the capture
        moe.overlap_degree = "auto"
    communicated.clear()
    tuned = optimize(model, x, forward=False, partitions=(1,), repeats=1, measure=0, graphed=True, in_step=True)
    if any(t is not None for t in tuned.profile.forward_in_step) or sum(communicated) > 4:
        failures.append(f"layers to be tuned had their forward timed: {tuned.profile.forward_in_step}")
    return failures


def fresh_gradients_worker() -> list[str]:
    """Every backward Lancet's profile times (each sub-layer's, the embedding/head's and the whole
    model's) finds no gradient on the parameters it writes, as a training step's backward does:
    one that found them would add into them, two reads and a write of every gradient that the
    step does not pay (a large model's whole backward then looks several ms slower). Checked by a hook
    on every parameter, which runs just before autograd stores its gradient."""
    torch.manual_seed(0)
    model = GPT(_config("topk", 1, 1.0), group=dist.group.WORLD)
    x = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    found, stored = [], []

    def hook(name):
        def check(grad):
            stored.append(name)
            if dict(model.named_parameters())[name].grad is not None:
                found.append(name)
        return check

    handles = [p.register_hook(hook(n)) for n, p in model.named_parameters()]
    optimize(model, x, forward=False, partitions=(1,), repeats=2, measure=0)
    for h in handles:
        h.remove()
    failures = []
    if not stored:
        failures.append("the profile ran no backward")
    if found:
        failures.append(f"{len(found)} of {len(stored)} gradients were added into existing ones, e.g. "
                        f"{sorted(set(found))[:4]}")
    return failures


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_profile_times_every_backward_from_no_gradient(world_size):
    failures = run_checks(fresh_gradients_worker, world_size, timeout=300)
    assert not failures, "\n".join(failures)


def graph_profile_captures_worker() -> list[str]:
    """GPUs (NCCL): optimize(graphed=True) as `weft train` runs it (padded MoE layers, bf16
    autocast) captures every call its profile times (no eager fallback), and its plan predicts a
    positive time; the profile leaves no autograd graph alive."""
    from weft.overlap import profile

    real, results = profile.graph_seconds, []

    def recorded(*args, **kwargs):
        results.append(real(*args, **kwargs))
        return results[-1]

    profile.graph_seconds = recorded  # this spawned process's module only
    device = f"cuda:{torch.cuda.current_device()}"
    torch.manual_seed(0)
    model = GPT(_config("topk", 1, 1.0), group=dist.group.WORLD).to(device)
    x = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(dist.get_rank())).to(device)
    plan = optimize(model, x, forward=False, partitions=(1,), repeats=2, measure=0, graphed=True, degrees=(2,),
                    in_step=True)
    failures = []
    moes = [i for i, u in enumerate(plan.profile.units) if isinstance(u, MoEUnit)]
    communicates = dist.get_world_size() > 1  # in-step corrections: float32 weights cast under autocast
    measured = [(plan.profile.weight_cast[i], plan.profile.forward_in_step[i]) for i in moes]
    if communicates and not all(cast > 0 and stepped is not None and stepped > 0 for cast, stepped in measured):
        failures.append(f"in-step corrections not measured: (weight cast, forward with all-to-alls) {measured}")
    corrected = plan.predicted_pipelined((2,) * len(moes), True)
    uncorrected = passes.predicted_uncorrected(plan, True, (2,) * len(moes))
    if communicates and not (uncorrected is not None and 0 < corrected != uncorrected):
        failures.append(f"the step priced with the in-step corrections {corrected}, without {uncorrected}")
    if not results or any(r is None for r in results):
        failures.append(f"{sum(r is None for r in results)} of {len(results)} profiled calls could not be captured")
    if plan.profile.graph_replays != (len(results), 0):
        failures.append(f"the plan reports {plan.profile.graph_replays} for {len(results)} calls")
    if not plan.predicted > 0:
        failures.append(f"predicted {plan.predicted}")
    if live_gradient_accumulators(list(model.parameters())):
        failures.append("the profile left an autograd graph alive")
    return failures


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_graphed_profile_times_the_computation_as_graph_replays(world_size):
    failures = run_checks(graphed_profile_worker, world_size, timeout=300)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world_size", [1, 2])
def test_optimize_applies_a_plan_that_keeps_the_loss(world_size):
    failures = run_checks(optimize_worker, world_size, timeout=300)
    assert not failures, "\n".join(failures)


def measured_plan_worker(fake_ms: dict[str, float]) -> list[str]:
    """optimize with its measurement: every combination runs (and computes the plain loss), and
    the one `choose_passes` keeps from the (here given) times is the one applied on every rank."""
    failures, ran = [], []

    def fake_time_candidates(step, names, device, trials, warmup):
        for name in names:  # each combination runs a real forward + backward on the model
            step(name)
            ran.append(name)
        return [fake_ms[name] * 1e-3 for name in names]

    passes.time_candidates = fake_time_candidates  # this spawned process's module only
    torch.manual_seed(0)
    model = GPT(_config("topk", 1, 1.0), group=dist.group.WORLD)
    idx = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
    _, before = model(idx[:, :-1], idx[:, 1:])
    plan = optimize(model, idx[:, :-1], max_partitions=4, repeats=1, forward=False)
    if ran != ["none", "backward"] or set(plan.measured) != {"none", "backward"}:
        failures.append(f"measured {ran}, reported {plan.measured}: expected none and backward")
    expected = choose_passes({k: fake_ms[k] for k in ("none", "backward")})
    if plan.chosen != expected:
        failures.append(f"kept {plan.chosen}, expected {expected} from {fake_ms}")
    scheduling = expected == "backward"
    applied = model.blocks[0].attn.qkv.wgrad_scheduler is not None
    if (plan.scheduler is not None) != scheduling or applied != scheduling:
        failures.append(f"dW scheduling applied: {plan.scheduler is not None}, expected {scheduling}")
    if any(p.grad is not None for p in model.parameters()):
        failures.append("measuring left gradients on the model")
    if f"kept: {expected}" not in plan.summary():
        failures.append(f"the summary does not say what was kept:\n{plan.summary()}")
    _, after = model(idx[:, :-1], idx[:, 1:])
    plan.backward(after)
    if abs(before.item() - after.item()) > 1e-5:
        failures.append(f"optimize changed the loss: {before.item()} -> {after.item()}")
    kept = [None] * dist.get_world_size()
    dist.all_gather_object(kept, plan.chosen)
    if len(set(kept)) != 1:
        failures.append(f"the ranks kept different passes: {kept}")
    return failures


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("fake_ms", [{"none": 10.0, "backward": 9.0}, {"none": 10.0, "backward": 9.95},
                                     {"none": 10.0, "backward": 12.0}])
def test_optimize_keeps_dw_scheduling_only_where_it_measured_faster(world_size, fake_ms):
    failures = run_checks(measured_plan_worker, world_size, args=(fake_ms,), timeout=300)
    assert not failures, "\n".join(failures)


def graphed_wgrad_choice_worker(fake_ms: dict[str, float]) -> list[str]:
    """`weft train --overlap lancet` in a graphed step (`weft.train.step.choose_wgrad_schedule`):
    the plain and the scheduled micro-step are timed (here by a timer that runs each three times
    eagerly, as `time_graphed` warms up and captures, and reports the given times); both give the
    same gradients, the scheduled one runs dW items under the all-to-alls, and the schedule is
    applied to the model only where it was faster by the graphs' margin (`GRAPHED_MIN_GAIN`)."""
    from weft.train.step import choose_wgrad_schedule

    torch.manual_seed(0)
    model = GPT(_config("topk", 1, 1.0), group=dist.group.WORLD)
    idx = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
    x, y = idx[:, :-1], idx[:, 1:]
    plan = optimize(model, x, forward=False, partitions=(1,), repeats=1, measure=0)
    grads, stats, failures = {}, {}, []

    def timer(step_of, names):
        for name in names:
            for _ in range(3):  # the scheduler follows its plan from the second backward on
                model.zero_grad(set_to_none=True)
                step_of(name)(x, y)
            grads[name] = [p.grad.clone() for p in model.parameters()]
            stats[name] = plan.scheduler.stats.run_under_comm if name == "backward" else None
        model.zero_grad(set_to_none=True)
        return [fake_ms[name] * 1e-3 for name in names]

    kept, seconds = choose_wgrad_schedule(model, plan, 1, timer)
    if seconds != [fake_ms["none"] * 1e-3, fake_ms["backward"] * 1e-3]:
        failures.append(f"times {seconds} for {fake_ms}")
    if not stats["backward"]:
        failures.append("the scheduled step ran no dW item under an all-to-all")
    worst = max(float((a - b).abs().max()) for a, b in zip(grads["none"], grads["backward"]))
    if worst > 1e-6:
        failures.append(f"the scheduled step's gradients differ from the plain step's by {worst}")
    expected = fake_ms["backward"] < fake_ms["none"] * (1 - GRAPHED_MIN_GAIN)
    applied = model.blocks[0].attn.qkv.wgrad_scheduler
    if kept != expected or (applied is plan.scheduler) != expected or (applied is None) == expected:
        failures.append(f"kept {kept}, applied {applied}; expected {expected} from {fake_ms}")
    return failures


def graphed_schedule_worker() -> list[str]:
    """GPUs (NCCL): Lancet's dW schedule captured in a CUDA graph of the micro-step (padded MoE
    layers, float32 weights, bf16 autocast as `weft train` runs it). The capture places dW items
    under the all-to-alls; a replay on a new batch gives the gradients and loss of the same
    scheduled step run eagerly (the same kernels: 1e-6), and of the plain step (1e-2: bf16)."""
    from weft.graphs import GraphedStep
    from weft.train.step import eager_micro_step

    device = f"cuda:{torch.cuda.current_device()}"
    torch.manual_seed(0)
    model = GPT(_config("topk", 1, 1.0), group=dist.group.WORLD).to(device)
    gen = torch.Generator().manual_seed(dist.get_rank())
    (x0, y0), (x1, y1) = [(b[:, :-1].to(device), b[:, 1:].to(device))
                          for b in (torch.randint(0, 64, (4, 9), generator=gen) for _ in range(2))]
    plan = optimize(model, x0, forward=False, partitions=(1,), repeats=1, measure=0)
    scheduled = eager_micro_step(model, 1, plan.backward)
    graph = GraphedStep(scheduled, (x0, y0), grads_of=list(model.parameters()), accumulate=False)
    failures = [] if plan.scheduler.stats.run_under_comm > 0 else [f"the capture ran no dW item under an "
                                                                   f"all-to-all: {plan.scheduler.stats}"]
    results = {}
    for name, step in (("graph", graph), ("eager", scheduled), ("plain", None)):
        if step is None:
            apply(model, [], None)
            step = eager_micro_step(model, 1)
        if name != "graph":
            model.zero_grad(set_to_none=True)
        losses, _ = step(x1, y1)
        results[name] = [losses[0].clone()] + [p.grad.clone() for p in model.parameters()]
    for other, tol in (("eager", 1e-6), ("plain", 1e-2)):
        worst = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
                    for a, b in zip(results["graph"], results[other]))
        if worst > tol:
            failures.append(f"the graph's loss and gradients differ from the {other} step's by {worst:.2e} (relative)")
    return failures


@pytest.mark.parametrize("world_size, fake_ms", [(2, {"none": 10.0, "backward": 9.0}),
                                                  (2, {"none": 10.0, "backward": 9.95}),  # kept: 0.5% > margin
                                                  (2, {"none": 10.0, "backward": 9.99}),  # dropped: within it
                                                  (4, {"none": 10.0, "backward": 9.0})])
def test_a_graphed_step_keeps_lancets_dw_schedule_only_where_its_graph_is_faster(world_size, fake_ms):
    # (one rank has no all-to-all, so no dW schedule to keep: optimize turns none on, tested above)
    failures = run_checks(graphed_wgrad_choice_worker, world_size, args=(fake_ms,), timeout=300)
    assert not failures, "\n".join(failures)


def test_measured_choice_needs_a_gain_over_every_simpler_combination():
    assert choose_passes({"none": 10.0}) == "none"
    assert choose_passes({"none": 10.0, "backward": 9.0}) == "backward"
    assert choose_passes({"none": 10.0, "backward": 9.95}) == "none"  # within the 1% margin
    assert choose_passes({"none": 10.0, "backward": 9.95}, min_gain=0.0) == "backward"
    assert choose_passes({"none": 10.0, "forward": 11.0}) == "none"
    # both must beat each pass alone, not only none
    assert choose_passes({"none": 10.0, "backward": 8.0, "forward": 9.0, "both": 7.99}) == "backward"
    assert choose_passes({"none": 10.0, "backward": 8.0, "forward": 9.0, "both": 7.0}) == "both"
    assert choose_passes({"none": 10.0, "backward": 12.0, "forward": 8.0, "both": 7.95}) == "forward"


def test_backward_prediction_hides_at_most_the_pool():
    from weft.overlap import planner
    from weft.overlap.profile import ModelProfile

    units = [planner.ComputeUnit("attn0", {1: 1.0}),
             planner.MoEUnit("moe0", {1: 0.1}, {1: 1.0}, {1: 1.0}, {1: 1.0}, True),
             planner.ComputeUnit("attn1", {1: 1.0})]
    profile = ModelProfile(units, backward=[2.0, 2.0, 2.0], backward_comm=[0.0, 4.0, 0.0], rest=0.0,
                           names=["attn0", "moe0", "attn1"])
    assert predict_backward(profile, False) == pytest.approx(6.0 + 4.0)
    # attn1's dW (1.0) hides under combine's backward (2.0); then the experts' dW (1.0) under dispatch's.
    assert predict_backward(profile, True) == pytest.approx(6.0 + 1.0 + 1.0)
    # of the 2.0 s overlapped, only the measured share is saved
    assert predict_backward(dataclasses.replace(profile, overlap_efficiency=0.25), True) == pytest.approx(
        6.0 + 4.0 - 0.25 * 2.0)
    assert predict_backward(dataclasses.replace(profile, overlap_efficiency=0.0), True) == pytest.approx(10.0)


def test_pipelined_moe_layers_are_priced_as_tutels_chunks():
    """A graphed step's MoE layers pipelined at degree d (Tutel's chunks) are priced from the
    profiled chunk times: forward gate + chunked exchange; backward the chunked input gradients
    with the weight gradients after them, of what that leaves exposed the first chunk's exchange
    hidden by the dW pool."""
    from weft.overlap import planner
    from weft.overlap.passes import OverlapPlan, pipelined_predictions, predict_forward
    from weft.overlap.profile import ModelProfile

    units = [planner.ComputeUnit("attn0", {1: 1.0}),
             planner.MoEUnit("moe0", {1: 0.1}, {1: 1.0}, {1: 1.0}, {1: 1.0}, True),
             planner.ComputeUnit("attn1", {1: 1.0})]
    profile = ModelProfile(units, backward=[2.0, 2.0, 2.0], backward_comm=[0.0, 2.0, 0.0], rest=0.5,
                           names=["attn0", "moe0", "attn1"], chunks=[{}, {2: (0.5, 0.5)}, {}])
    # degree 1 (or none given): the serial forward, the backward as before
    assert predict_forward(profile) == predict_forward(profile, (1,)) == pytest.approx(5.1)
    assert predict_backward(profile, False, (1,)) == predict_backward(profile, False) == pytest.approx(8.0)
    # forward at degree 2: chunk sends 0-.5, .5-1; experts .5-1, 1-1.5; receives 1-1.5, 1.5-2
    assert predict_forward(profile, (2,)) == pytest.approx(1.0 + 0.1 + 2.0 + 1.0)
    # backward at degree 2: the chain ends at 2.5 (its weight gradients 1.5-2.5 beside the last
    # receive), 2.0 of it computation (two chunks' input gradients, the weight gradients), so 0.5
    # exposed; nothing else of the layer's 2.0 s backward (the experts' dX and dW are 2 x 1.0)
    assert predict_backward(profile, False, (2,)) == pytest.approx(2.0 + 2.0 + 0.5 + 2.0)
    # attn1's dW share (1.0) hides those 0.5
    assert predict_backward(profile, True, (2,)) == pytest.approx(6.0)
    # efficiency 0.5: the chain's 1.5 s of overlap cost half: 3.25, 1.25 exposed; of the pool's 1.0 only
    # the first chunk's exchange (0.5) is hidden (the scheduler runs items beside it alone), at half
    half = dataclasses.replace(profile, overlap_efficiency=0.5)
    assert predict_backward(half, False, (2,)) == pytest.approx(6.0 + 1.25)
    assert predict_backward(half, True, (2,)) == pytest.approx(6.0 + 1.25 - 0.5 * 0.5)
    plan = OverlapPlan([], object(), None, profile, predicted=0.0, baseline=0.0)
    assert plan.predicted_pipelined((2,), True) == pytest.approx(4.1 + 6.0 + 0.5)
    assert plan.predicted_pipelined((4,), True) is None  # degree 4 was not profiled
    with pytest.raises(KeyError):
        predict_forward(profile, (4,))
    # `weft plan`'s table: every layer at each degree, with and without the dW schedule (degree 1
    # scheduled: attn1's and the experts' dW shares hide both halves of the 2.0 s exchange)
    table = pipelined_predictions(plan, (1, 2, 4))
    assert set(table) == {1, 2}  # degree 4 left out
    assert table[1] == pytest.approx({"plain": 5.6 + 8.0, "scheduled": 5.6 + 6.0})
    assert table[2] == pytest.approx({"plain": 4.6 + 6.5, "scheduled": 4.6 + 6.0})
    dense = dataclasses.replace(profile, units=[units[0], units[2]], backward=[2.0, 2.0], backward_comm=[0.0, 0.0],
                                names=["attn0", "attn1"], chunks=[{}, {}])
    assert pipelined_predictions(dataclasses.replace(plan, profile=dense), (1, 2)) == {}  # no degree to price


def test_in_step_shares_the_chunks_weight_cast_and_prices_the_all_to_alls_as_the_graphed_layer_took_them():
    """`in_step`: a padded MoE layer's weight cast moves from its experts to its gate (cast once
    per call, before the matmuls), so its chunks pay only their matmuls; its all-to-alls
    (partitions, chunks, backward) scale to what they took in the layer's graphed forward. A
    sub-layer with nothing measured, and an eager profile, stay as they are."""
    from weft.overlap import planner
    from weft.overlap.passes import OverlapPlan, pipelined_predictions, predict_unpartitioned, predicted_uncorrected
    from weft.overlap.profile import ModelProfile, in_step

    moe = planner.MoEUnit("moe0", {1: 0.1, 2: 0.05}, {1: 1.0, 2: 0.6}, {1: 1.0, 2: 0.5}, {1: 1.0, 2: 0.6}, True)
    unmeasured = planner.MoEUnit("moe1", {1: 0.1}, {1: 1.0}, {1: 1.0}, {1: 1.0}, True)
    units = [planner.ComputeUnit("attn0", {1: 1.0, 2: 0.5}), moe, unmeasured]
    eager = ModelProfile(units, backward=[2.0, 2.0, 2.0], backward_comm=[0.0, 2.0, 2.0], rest=0.5,
                         names=["attn0", "moe0", "moe1"], chunks=[{}, {2: (0.8, 0.5), 4: (0.7, 0.3)}, {2: (0.8, 0.5)}])
    # the layer's graphed forward took 4.1 s: gate 0.1 and experts 1.0 leave 3.0 s of all-to-all
    # where the cost model priced 2.0 (x 1.5); a weight cast of 0.4 s was in each chunk's 0.8 / 0.7
    graphed = dataclasses.replace(eager, weight_cast=[0.0, 0.4, 0.0], forward_in_step=[None, 4.1, None])
    fixed = in_step(graphed)
    assert fixed.units[0] == units[0] and fixed.units[2] == unmeasured and fixed.chunks[2] == {2: (0.8, 0.5)}
    assert fixed.units[1].dispatch == pytest.approx({1: 1.5, 2: 0.9})
    assert fixed.units[1].combine == pytest.approx({1: 1.5, 2: 0.9})
    assert fixed.units[1].gate == pytest.approx({1: 0.5, 2: 0.45})  # the cast before the matmuls
    assert fixed.units[1].experts == pytest.approx({1: 0.6, 2: 0.1})
    assert planner.serial_time(fixed.units[1]) == pytest.approx(0.1 + 1.0 + 3.0)  # the stages' sum kept
    assert fixed.backward_comm == pytest.approx([0.0, 3.0, 2.0])
    assert fixed.chunks[1][2] == pytest.approx((0.8 - 0.4, 0.75))  # a chunk's matmuls alone
    assert fixed.chunks[1][4] == pytest.approx((0.7 - 0.4, 0.45))
    assert in_step(eager) is eager
    # a graphed plan's prices come from the corrected profile; the uncorrected one is kept beside
    # them (None for an eager profile, which measured nothing: its one price is the plan's)
    plan = OverlapPlan([], None, None, graphed, predicted=0.0, baseline=0.0)
    assert plan.priced == fixed and dataclasses.replace(plan, profile=eager).priced is eager
    assert plan.predicted_pipelined((2, 2), False) == pytest.approx(predict_unpartitioned(fixed, (2, 2), False))
    assert predicted_uncorrected(plan, False, (2, 2)) == pytest.approx(predict_unpartitioned(graphed, (2, 2), False))
    assert predicted_uncorrected(plan, False, (2, 2)) != pytest.approx(plan.predicted_pipelined((2, 2), False))
    assert pipelined_predictions(plan, (2,))[2]["plain"] == pytest.approx(predict_unpartitioned(fixed, (2, 2), False))
    assert plan.to_dict()["profile_s"]["backward_comm"] == pytest.approx([0.0, 3.0, 2.0])
    assert plan.to_dict()["profile_s"]["forward_in_step"] == [None, 4.1, None]  # what it was corrected by
    assert predicted_uncorrected(dataclasses.replace(plan, profile=eager), False) is None
    assert predicted_uncorrected(plan, False, (8, 8)) is None  # degree 8 was not profiled
    # a graphed profile whose layers all went unmeasured (dropless, one rank) has one price
    unmeasured = dataclasses.replace(plan, profile=dataclasses.replace(
        eager, weight_cast=[0.0, 0.0, 0.0], forward_in_step=[None, None, None]))
    assert predicted_uncorrected(unmeasured, False, (2, 2)) is None
    assert "in-step corrections" in plan.summary() and "in-step corrections" not in unmeasured.summary()


def test_repeated_calls_drop_each_result_before_the_next():
    from weft.overlap.profile import repeated

    live, most = [0], [0]

    class Result:
        def __init__(self):
            live[0] += 1
            most[0] = max(most[0], live[0])

        def __del__(self):
            live[0] -= 1

    repeated(Result, 5)
    assert most[0] == 1 and live[0] == 0


def overlap_efficiency_worker() -> list[str]:
    """`measure_overlap_efficiency` on 2 gloo ranks with a stand-in all-to-all of 40 ms: one that
    runs beside the computation (a thread) is hidden entirely, one that holds the caller up is not
    hidden at all; every rank gets the same value."""
    import threading
    import time

    from weft.overlap.profile import measure_overlap_efficiency
    from weft.testing import Checks

    checks = Checks(f"rank {dist.get_rank()}")

    class Thread:
        def __init__(self):
            self.thread = threading.Thread(target=time.sleep, args=(0.04,))
            self.thread.start()

        def wait(self):
            self.thread.join()

    class Blocking:
        def __init__(self):
            time.sleep(0.04)

        def wait(self):
            pass

    def compute():
        time.sleep(0.04)

    cpu = torch.device("cpu")
    beside = measure_overlap_efficiency(compute, Thread, None, cpu, repeats=3)
    serial = measure_overlap_efficiency(compute, Blocking, None, cpu, repeats=3)
    checks.expect(beside > 0.7, f"an all-to-all beside the computation: efficiency {beside:.2f}, expected ~1")
    checks.expect(serial < 0.3, f"an all-to-all before the computation: efficiency {serial:.2f}, expected ~0")
    values = [None, None]
    dist.all_gather_object(values, (beside, serial))
    checks.expect(values[0] == values[1], f"the ranks measured different efficiencies: {values}")

    # a graphed profile's own timer (`time=`), each call's seconds scripted: the all-to-all alone
    # 4 ms, one computation 1 ms (so 4 of them are matched to it), those 4 alone 4 ms on rank 0 and
    # 5 ms on rank 1, both at once 6 ms. The slowest rank's: (4 + 5 - 6) / 4 saved on both ranks.
    ran, scripted = [], iter([4e-3, 1e-3, (4 + dist.get_rank()) * 1e-3, 6e-3])

    def timer(fn):
        fn()
        return next(scripted)

    timed = measure_overlap_efficiency(lambda: ran.append(1), Thread, None, cpu, time=timer)
    checks.expect(abs(timed - 0.75) < 1e-9, f"efficiency from the timer's times: {timed}, expected 0.75")
    checks.expect(len(ran) == 1 + 4 + 4, f"the timer ran the computation {len(ran)} times, expected 9: once "
                                        f"alone, 4 times as the matched computation, 4 beside the all-to-all")
    return checks.failures


def test_the_overlap_efficiency_is_what_running_both_at_once_saves():
    flat = run_checks(overlap_efficiency_worker, 2, timeout=120)
    assert not flat, "\n".join(flat)


def test_plan_and_bench_model_cli(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main(["plan", "--preset", "tiny", "--batch-size", "2", "--nproc", "2", "--json", "plan.json"])
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["world_size"] == 2 and plan["predicted_s"] > 0
    # Tutel's chunks priced at every candidate degree; degree 1 without the schedule is the plain step
    pipelined = plan["pipelined_predicted_s"]
    assert set(pipelined) == {"1", "2", "4", "8"} and min(t["plain"] for t in pipelined.values()) > 0
    assert pipelined["1"]["plain"] == pytest.approx(plan["baseline_s"])
    assert 0.0 <= plan["overlap_efficiency"] <= 1.0  # measured on the 2 ranks' all-to-all and experts
    # the plan was measured against no plan (and its forward ranges, where the planner cut any,
    # alone and with dW scheduling), and what it kept is what it reports
    measured, partitioned = plan["measured_s"], bool(plan["forward_plan"]) and any(
        s["partitions"] > 1 for s in plan["forward_plan"]["segments"])
    expected = {"none", "backward"} | ({"forward", "both"} if partitioned else set())
    assert set(measured) == expected and min(measured.values()) > 0, (measured, plan["forward_plan"])
    assert plan["wgrad_scheduling"] == (plan["chosen"] in ("backward", "both"))
    assert bool(plan["ranges"]) == (plan["chosen"] in ("forward", "both"))
    main(["bench", "model", "--preset", "tiny", "--batch-size", "2", "--steps", "3", "--warmup", "1",
          "--nproc", "2", "--modes", "none,tutel,lancet,defer-dw,dw-in-place,none", "--json", "model.json"])
    report = json.loads((tmp_path / "model.json").read_text())
    meta, rows = report["meta"], report["results"]
    assert (meta["timing"], meta["rounds"], meta["warmup_rounds"]) == ("interleaved", 3, 1)
    assert [(r["mode"], r["repeat"]) for r in rows] == [("none", 0), ("tutel", 0), ("lancet", 0), ("defer-dw", 0),
                                                         ("dw-in-place", 0), ("none", 1)]
    for row in rows:
        assert row["max_error"] < 1e-4
        for name in ("iteration", "fwd_bwd", "forward"):
            assert 0 < row[f"{name}_ms_min"] <= row[f"{name}_ms"] and row[f"{name}_iqr_ms"] >= 0
        # forward and fwd_bwd are laps inside each timed iteration, before the optimizer step
        assert row["forward_ms_min"] <= row["fwd_bwd_ms_min"] <= row["iteration_ms_min"]
        assert row["fwd_bwd_ms"] <= row["iteration_ms"]
    lancet = rows[2]
    assert lancet["plan"]
    assert lancet["prediction_error"] == pytest.approx(lancet["predicted_ms"] / lancet["fwd_bwd_ms"] - 1)
    parts = [lancet[f"predicted_{k}_ms"] for k in ("forward", "backward", "rest")]
    assert min(parts) > 0 and sum(parts) == pytest.approx(lancet["lancet_predicted_ms"])
    # eager, the plan runs as made: the prediction is the plan's
    assert lancet["predicted_form"] == "lancet" and lancet["predicted_ms"] == lancet["lancet_predicted_ms"]
    assert "predicted_ms" not in rows[4] and rows[0]["speedup"] == 1.0
    # where the plan kept the dW schedule, the collectives it filled: each with its expected time
    assert ("wgrad_plan" in lancet) == ("backward: weight-gradient scheduling on" in lancet["plan"])
    if "wgrad_plan" in lancet:
        assert all(c["budget_ms"] > 0 for c in lancet["wgrad_plan"])
        items = sum(c["items"] for c in lancet["wgrad_plan"])
        line = lancet["wgrad_plan_line"]
        assert line.startswith("dW plan: ") and f" take {items} items" in line


def test_the_prediction_prices_the_step_as_it_ran():
    """A graphed step that dropped Lancet's dW schedule is the plain step (unpartitioned forward):
    its prediction is the plan's baseline, not the plan's own time; with a partitioned forward no
    form was priced, nor with pipelined MoE layers."""
    from types import SimpleNamespace

    from weft.overlap.passes import predicted_as_run

    dw_only = SimpleNamespace(scheduler=object(), forward_plan=None, predicted=1.0, baseline=1.5)
    assert predicted_as_run(dw_only, True) == (1.0, "lancet")
    assert predicted_as_run(dw_only, False)[0] == 1.5
    forward_only = SimpleNamespace(scheduler=None, forward_plan=object(), predicted=1.2, baseline=1.5)
    assert predicted_as_run(forward_only, False) == (1.2, "lancet")
    both = SimpleNamespace(scheduler=object(), forward_plan=object(), predicted=0.9, baseline=1.5)
    assert predicted_as_run(both, False)[0] is None and predicted_as_run(both, True)[0] == 0.9
    # a graph whose MoE layers run pipelined: priced with Tutel's chunks where the plan profiled
    # that degree, else not priced
    asked = []
    dw_only.predicted_pipelined = lambda degrees, scheduled: asked.append((degrees, scheduled)) or 1.1
    assert predicted_as_run(dw_only, True, (2, 1)) == (1.1, "lancet, MoE layers pipelined at degree 1/2")
    assert predicted_as_run(dw_only, False, (2, 2))[0] == 1.1 and asked == [((2, 1), True), ((2, 2), False)]
    dw_only.predicted_pipelined = lambda degrees, scheduled: None
    predicted, form = predicted_as_run(dw_only, True, (2, 2))
    assert predicted is None and "degree 2 (not priced)" in form


def test_graphed_modes_that_do_not_fit_say_so_in_one_line():
    """A benchmark running out of GPU memory in its CUDA graph captures or timing (every graphed
    mode's graph and gradients alive at once: `bench model --cuda-graphs on`, `bench tp` with
    +graph modes) raises a ReportedError naming the modes, the workload, the option and what to
    change; a capture that fails for another reason, or any other error, passes through unchanged."""
    from weft.bench.timing import graphs_must_fit
    from weft.graphs import CaptureError
    from weft.launch import ReportedError

    cpu = torch.device("cpu")
    cases = [(("none", "tutel", "lancet", "none"), "gpt2-l-moe at batch 4", "--cuda-graphs on",
              ["3 graphed modes (none, tutel, lancet)", "gpt2-l-moe at batch 4", "--modes none,lancet,none"]),
             (("none+graph", "domino-copy+graph", "no-comm+graph", "none+graph"),
              "32 gpt3-2.7b blocks at batch 16", "--modes with +graph",
              ["--modes with +graph keeps", "3 graphed modes (none+graph, domino-copy+graph, no-comm+graph)",
               "32 gpt3-2.7b blocks at batch 16", "--modes none+graph,no-comm+graph,none+graph"])]
    for modes, workload, option, expected in cases:
        for error in (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                      CaptureError("the step cannot be captured as a CUDA graph: CUDA out of memory. Tried ...")):
            with pytest.raises(ReportedError) as raised, graphs_must_fit(modes, workload, option, cpu):
                raise error
            message = str(raised.value)
            assert "\n" not in message and all(part in message for part in expected), message
        for error in (CaptureError("the step cannot be captured as a CUDA graph: operation not permitted"),
                      ValueError("something else")):
            with pytest.raises(type(error), match=str(error)), graphs_must_fit(modes, workload, option, cpu):
                raise error
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with pytest.raises(torch.OutOfMemoryError), graphs_must_fit((), "gpt2-l-moe at batch 4", "--cuda-graphs on", cpu):
        raise oom  # no mode graphed (eager timing): not the graphs' memory, passed through


def capture_modes_worker() -> list[str]:
    """`weft bench model --cuda-graphs on`'s captures (`_capture_modes`), with the capture replaced by
    a record of what it was given: each mode is built with the MoE layers at its values (tutel and
    lancet at degree "auto", which build_micro_step then times as graphs; dedup-d2 as dedup at
    degree 2), lancet with its dW-only plan applied, and the model is plain again after every build."""
    from weft.bench import model as bench_model
    from weft.train.step import MicroSteps, eager_micro_step

    torch.manual_seed(0)
    model = GPT(_config("topk", 1, 1.0), group=dist.group.WORLD)
    idx = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
    seen = {}

    def fake_build(gpt, grad_accum, mode, example, overlap, plan, log):
        layers = {(m.a2a_algo, m.overlap_degree) for m in gpt.moe_layers()}
        applied = {id(m.wgrad_scheduler) for m in gpt.modules() if hasattr(m, "wgrad_scheduler")}
        seen[overlap if overlap == "lancet" else sorted(layers)[0]] = (mode, grad_accum, layers, plan, applied)
        log(f"weft train: built {overlap}")
        return MicroSteps(eager_micro_step(gpt, grad_accum))

    bench_model.build_micro_step = fake_build  # this spawned process's module only
    modes = ("none", "tutel", "dedup-d2", "lancet")
    settings = {mode: bench_model._configure(mode, model, idx[:, :-1], 4, 2, 1, graphed=True) for mode in modes}
    plan = settings["lancet"].plan
    failures = []
    if plan.ranges or plan.forward_plan is not None or plan.measured:
        failures.append(f"the graphed lancet mode planned a forward or measured eagerly: {plan.summary()}")
    # every candidate degree of the layers is priced: each MoE layer's experts on one chunk, its
    # chunk's all-to-all at 1/d of the bytes (gloo's times at these sizes are noise, so only that
    # each is a positive, finite time; the prices' arithmetic is checked by hand above)
    moe_chunks = [(unit, c) for unit, c in zip(plan.profile.units, plan.profile.chunks) if c]
    if len(moe_chunks) != 2 or any(c for unit, c in zip(plan.profile.units, plan.profile.chunks)
                                   if not isinstance(unit, MoEUnit)):
        failures.append(f"chunk times of the wrong sub-layers: {plan.profile.chunks}")
    for unit, c in moe_chunks:
        priced = all(0 < comm < math.inf and 0 < experts < math.inf for experts, comm in c.values())
        if set(c) != {2, 4, 8} or not priced:
            failures.append(f"{unit.name}'s chunks {c} against its dispatch {unit.dispatch[1]}")
    for degrees in ((2, 2), (8, 1)):
        predicted = plan.predicted_pipelined(degrees, True)
        if predicted is None or not predicted > plan.profile.rest:
            failures.append(f"degrees {degrees} priced {predicted}")
    graphs, notes, degrees = bench_model._capture_modes(model, settings, (idx[:, :-1], idx[:, 1:]))
    expected = {("linear", 1): {("linear", 1)}, ("linear", "auto"): {("linear", "auto")},
                ("dedup", 2): {("dedup", 2)}}
    # one degree per MoE layer; the fake build leaves "auto" as it is, which counts as unchunked
    if degrees != {"none": (1, 1), "tutel": (1, 1), "dedup-d2": (2, 2), "lancet": (1, 1)}:
        failures.append(f"the captured degrees {degrees}")
    for key, layers in expected.items():
        if key not in seen or seen[key][2] != layers or seen[key][:2] != ("on", 1):
            failures.append(f"no capture with the layers at {layers}: {seen}")
    lancet = seen.get("lancet")
    if lancet is None or lancet[3] is not plan or lancet[4] != {id(plan.scheduler)} or \
            lancet[2] != {("linear", "auto")}:  # graphed lancet times the degrees too, as tutel
        failures.append(f"lancet was not captured with its plan's scheduler applied: {lancet}")
    if set(graphs) != set(modes) or notes["lancet"] != ["weft train: built lancet"]:
        failures.append(f"captures {sorted(graphs)}, notes {notes}")
    left = {(m.a2a_algo, m.overlap_degree, m.wgrad_scheduler) for m in model.moe_layers()}
    if left != {("linear", 1, None)} or model.blocks[0].attn.qkv.wgrad_scheduler is not None:
        failures.append(f"the model was left at {left}")
    return failures


def test_bench_model_captures_each_mode_at_its_settings():
    failures = run_checks(capture_modes_worker, 2, timeout=300)
    assert not failures, "\n".join(failures)


def test_bench_model_graphs_are_checked(capsys):
    for argv, message in ((["--modes", "none,lancet-bw"], "not lancet-bw (weft bench tp has +graph modes)"),
                          (["--modes", "none,tutel"], "--cuda-graphs on needs GPUs (CUDA graphs); this run has none")):
        with pytest.raises(SystemExit):
            main(["bench", "model", "--preset", "tiny", "--cuda-graphs", "on", *argv])
        assert message in capsys.readouterr().err


def test_interleaved_order_rotates():
    from weft.bench.timing import interleaved_order

    modes = ["none", "lancet", "none"]  # duplicates are separate entries
    order = interleaved_order(modes, 5)
    assert len(order) == 5 and all(sorted(r) == [0, 1, 2] for r in order)
    assert [r[0] for r in order] == [0, 1, 2, 0, 1]
    assert order[1] == [1, 2, 0]
    assert interleaved_order(modes, 0) == []


def setup_overlap_worker() -> list[str]:
    """`weft train --overlap lancet`'s setup: where the step replays as a CUDA graph, a dW-only plan
    and every MoE layer's degree left to the graphs' timing ("auto", as tutel); where it runs
    eagerly, the partitioned forward planned and the layers unchunked."""
    from types import SimpleNamespace

    from weft.train import loop

    failures = []
    for graphed in (True, False):
        torch.manual_seed(0)
        model = GPT(_config("topk", 1, 1.0), group=dist.group.WORLD)
        idx = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
        batches = SimpleNamespace(get=lambda step, micro: (idx[:, :-1], idx[:, 1:]))
        loop.lancet_partitions_forward = lambda *args, graphed=graphed: not graphed  # graphed: as on a GPU
        cfg = SimpleNamespace(overlap="lancet", cuda_graphs="on" if graphed else "off")
        plan = loop._setup_overlap(model, cfg, batches, 0, torch.device("cpu"), 1)  # rank 1: prints nothing
        degrees = {moe.overlap_degree for moe in model.moe_layers()}
        if graphed and (degrees != {"auto"} or plan.forward_plan is not None or plan.scheduler is None):
            failures.append(f"graphed: degrees {degrees}, forward plan {plan.forward_plan}")
        if not graphed and degrees != {1}:
            failures.append(f"eager: degrees {degrees}")
        # the log line of the micro-step as built: graphed, at the degree its graphs chose
        if graphed:
            for moe in model.moe_layers():
                moe.overlap_degree = 2
        line = loop.lancet_prediction(plan, model, True)
        form = "lancet, MoE layers pipelined at degree 2" if graphed else "lancet"
        if not line.startswith("weft train: Lancet predicts ") or not line.endswith(f"a micro-step ({form})"):
            failures.append(f"graphed {graphed}: {line}")
        apply(model, [], None)
    return failures


def test_train_lancet_times_the_pipelining_degree_where_its_step_is_graphed():
    failures = run_checks(setup_overlap_worker, 2, timeout=300)
    assert not failures, "\n".join(failures)


def test_train_overlap_lancet_matches_none(tmp_path):
    losses = {}
    for mode in ("none", "lancet"):
        run = tmp_path / mode
        main(["train", "--steps", "4", "--batch-size", "2", "--nproc", "2", "--out", str(run), "--overlap", mode,
              "--sample-tokens", "0"])
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        losses[mode] = [r["loss"] for r in rows if "loss" in r]
    assert len(losses["none"]) == 4
    assert losses["lancet"] == pytest.approx(losses["none"], rel=1e-5)


def test_bad_overlap_mode_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--overlap", "magic"])
    assert "--overlap" in capsys.readouterr().err


def test_the_dw_items_own_efficiency_prices_only_what_the_schedule_hides():
    """`predict_backward(..., dw_efficiency=)`: the share of what the dW pool hides under the
    all-to-alls that is saved. At 0 the scheduled backward costs what the unscheduled one does; by
    default it is the experts' η. `predicted_with_dw_efficiency` prices a step whose schedule ran
    with the profile's measured value, and nothing else (None)."""
    from weft.overlap import planner
    from weft.overlap.passes import OverlapPlan, predict_unpartitioned, predicted_with_dw_efficiency
    from weft.overlap.profile import ModelProfile

    moe = planner.MoEUnit("moe0", {1: 0.1}, {1: 1.0}, {1: 1.0}, {1: 1.0}, True)
    units = [planner.ComputeUnit("attn0", {1: 1.0}), moe, planner.ComputeUnit("attn1", {1: 1.0})]
    profile = ModelProfile(units, backward=[2.0, 2.0, 2.0], backward_comm=[0.0, 2.0, 0.0], rest=0.5,
                           names=["attn0", "moe0", "attn1"], overlap_efficiency=0.8, chunks=[{}, {2: (0.6, 0.5)}, {}],
                           dw_efficiency=0.25)
    plain = predict_backward(profile, False)
    # attn1's dW share (1.0) hides 1.0 of the first half all-to-all, the MoE layer's own (1.0)
    # another 1.0 of the second: 2.0 hidden, of which η is saved
    assert plain - predict_backward(profile, True) == pytest.approx(0.8 * 2.0)
    assert plain - predict_backward(profile, True, dw_efficiency=0.25) == pytest.approx(0.25 * 2.0)
    assert predict_backward(profile, True, dw_efficiency=0.0) == pytest.approx(plain)
    # pipelined, the chunks' own overlap keeps the experts' η; only the pool's share goes
    assert predict_backward(profile, True, (2,), dw_efficiency=0.0) == pytest.approx(
        predict_backward(profile, False, (2,)))
    scheduler = WGradScheduler()
    plan = OverlapPlan([], scheduler, None, profile, predicted=0.0, baseline=0.0)
    assert predicted_with_dw_efficiency(plan, True) == pytest.approx(predict_unpartitioned(profile, (), True, 0.25))
    assert predicted_with_dw_efficiency(plan, True) > predict_unpartitioned(profile, (), True)
    assert predicted_with_dw_efficiency(plan, False) is None  # the graph dropped the schedule
    assert predicted_with_dw_efficiency(dataclasses.replace(plan, profile=dataclasses.replace(
        profile, dw_efficiency=None)), True) is None
    assert "weight-gradient matmul beside an all-to-all: 0.25" in plan.summary()
    assert plan.to_dict()["dw_efficiency"] == 0.25


def test_a_changed_layer_setting_makes_the_dw_scheduler_plan_afresh():
    """`weft.train.step.set_layers` (how graphed training tries degrees and all-to-alls): a value
    that changes a layer brings back every weight the scheduler's plan had sent to autograd
    (`WGradScheduler.forget`), the same value leaves the plan alone. On one process no
    collective takes an item, so after two backwards every deferring weight is in autograd."""
    from weft.train.step import set_layers

    torch.manual_seed(0)
    model = GPT(_config("topk", 1, 1.0))
    scheduler = WGradScheduler(comm_time=lambda nbytes: 1.0)
    apply(model, [], scheduler)
    idx = torch.randint(0, 64, (2, 8))
    for _ in range(2):
        with scheduler.backward():
            model(idx, idx)[1].backward()
        model.zero_grad(set_to_none=True)
    linears = [m.weight for m in model.modules() if isinstance(m, passes.Linear)]
    assert linears and all(scheduler.through_autograd(w) for w in linears)
    set_layers(model, "overlap_degree", model.moe_layers()[0].overlap_degree)  # unchanged
    assert all(scheduler.through_autograd(w) for w in linears)
    set_layers(model, "overlap_degree", 2)
    assert not any(scheduler.through_autograd(w) for w in linears)


@pytest.mark.parametrize("ep", [[], ["--ep-size", "1"], ["--grad-accum", "2"]])
def test_train_lancet_with_the_gradient_sums_in_its_backward_matches_their_sums_after_it(tmp_path, ep):
    """`weft train --overlap lancet --grad-reduce overlap` (Lancet's forward and backward with the
    gradient sums' buckets; with --ep-size 1 the experts' sum is in them too; with --grad-accum 2
    in the second micro-batch's backward only) logs the losses and gradient norms of
    `--grad-reduce after`, to float32 rounding on 2 CPU ranks: Lancet chooses its forward
    partitions by timing, and on a loaded CPU the two runs may partition differently, which sums
    the weight gradients in another order (seen: a gradient norm 1 ulp apart). The sums
    themselves are bitwise `reduce_gradients`' (tests/test_overlapped_reduce.py; test_train's
    runs without Lancet). (On the CPU Lancet keeps no dW schedule; the hooks its scheduler fires
    for the weights it writes late are tests/test_overlap_wgrad.py's.)"""
    losses = {}
    for reduce in ("overlap", "after"):
        run = tmp_path / reduce
        main(["train", "--steps", "4", "--batch-size", "2", "--nproc", "2", "--out", str(run), "--overlap", "lancet",
              "--grad-reduce", reduce, "--sample-tokens", "0", *ep])
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        losses[reduce] = [value for r in rows if "loss" in r for value in (r["loss"], r["grad_norm"])]
    assert len(losses["after"]) == 8
    assert losses["overlap"] == pytest.approx(losses["after"], rel=1e-6)
