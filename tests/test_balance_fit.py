"""Pro-Prophet's performance model measured on the machine (weft.overlap.balance_model): its
constants follow from the measured numbers as eqs. 1-5 define them, a profiled GPT's balanced
layers get a model each (installed in their planners), with the overhead of a copy measured
on the layer's call, and `weft train --balance-model` is checked."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from weft import MoE
from weft.balance.planner import Placement, host_loads, host_slot_rows
from weft.bench.layer import fit_calls_line
from weft.comm.cost_model import CommCostModel
from weft.models import GPT, GPTConfig
from weft.models.gpt import MoEUnit, rotary_tables
from weft.overlap import balance_model, fit_balance_models, layer_cost_model, measure_layer_cost_model
from weft.testing import Checks, run_checks
from weft.train.config import TrainConfig

DIM, HIDDEN = 16, 32


def fit_worker() -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    checks = Checks(f"rank {rank}")
    torch.manual_seed(0)
    moe = MoE(DIM, HIDDEN, 2 * world, top_k=2, capacity_factor=None, activation="swiglu")
    # eqs. 1-5 from known numbers: 100 tokens x k 2 = 200 rows of 16 float32 values (64 bytes) per
    # rank; an all-to-all of 200 * 64 bytes takes 1 ms on this made-up machine.
    comm = CommCostModel.fit({"all_to_all": [(200 * 64, 1e-3), (400 * 64, 2e-3)]}, world, "gloo", "cpu")
    model = layer_cost_model(moe, 100, comm, expert_s=2e-3, dtype=torch.float32, forward_non_moe_s=5e-3)
    checks.expect(model.row_bytes == 64 and model.expert_param_bytes == 3 * DIM * HIDDEN * 4,
                  f"row / expert bytes {model.row_bytes}, {model.expert_param_bytes}")
    received = 200 * (world - 1) / world
    checks.expect(abs(model.bandwidth - received * 64 / 1e-3) < 1e-6 * model.bandwidth,
                  f"bandwidth {model.bandwidth}: not the received bytes over the all-to-all's time")
    checks.expect(abs(model.throughput - 200 / 2e-3) < 1e-9 * model.throughput, f"throughput {model.throughput}")
    checks.expect(model.forward_non_moe_s == 5e-3 and model.num_devices == world, "the other constants")
    # Eq. 1 on the balanced load gives back the measured all-to-all.
    checks.expect(abs(model.all_to_all_s(torch.tensor([received] * world)) - 1e-3) < 1e-12, "eq. 1 disagrees")

    measured, a2a = measure_layer_cost_model(moe, torch.randn(100, DIM), repeats=2)
    checks.expect(measured.bandwidth > 0 and measured.throughput > 0 and a2a.world_size == world,
                  f"measured model {measured}")
    everyone = [None] * world
    dist.all_gather_object(everyone, (measured.bandwidth, measured.throughput))
    checks.expect(len(set(everyone)) == 1, f"the ranks measured different models: {everyone}")

    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, dim=DIM, moe_every=2, num_experts=2 * world,
                    top_k=2, capacity_factor=None)
    torch.manual_seed(0)
    gpt = GPT(cfg, balance="pro-prophet")
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
    fitted_on = []
    fit_on_input = balance_model.with_unpriced_time

    def recording(moe, x, *args, **kwargs):
        fitted_on.append((moe, x))
        return fit_on_input(moe, x, *args, **kwargs)

    balance_model.with_unpriced_time = recording  # (a spawned worker: its module dies with it)
    fitted = fit_balance_models(gpt, idx, repeats=2)
    layers = gpt.moe_layers()
    # each layer's fit ran on its own input from the batch: the normed hidden states it gets
    with torch.no_grad():
        x, expected = gpt.tok_emb(idx), []
        for unit in gpt.units(rotary_tables(16, gpt.config.head_dim, gpt.config.rope_theta, idx.device)):
            if isinstance(unit, MoEUnit):
                expected.append((unit.moe, unit.norm(x).reshape(-1, DIM)))
            x = unit(x)
    checks.expect([m for m, _ in fitted_on] == layers == [m for m, _ in expected], "the fit's layers")
    checks.expect(all(torch.equal(a, b) for (_, a), (_, b) in zip(fitted_on, expected)),
                  "a layer's fit ran on rows that are not its input on the batch")
    checks.expect(len(fitted) == len(layers) == 2, f"{len(fitted)} models for {len(layers)} layers")
    checks.expect(all(m is layer.balancer.model for m, layer in zip(fitted, layers)), "models not installed")
    # Blocks 1 and 3 are MoE: layer 0's Trans hides under block 0 and block 1's attention, layer
    # 1's under layer 0's gate, block 2 and block 3's attention (timed: only their signs are sure).
    checks.expect(all(m.forward_non_moe_s > 0 for m in fitted), f"non-MoE forward of {fitted}")
    checks.expect(all(m.backward_non_moe_s > 0 and m.throughput > 0 for m in fitted), f"{fitted}")
    checks.expect(gpt.training, "the model left out of training mode")
    overheads = [None] * world
    dist.all_gather_object(overheads, [(m.copy_overhead_s, m.rest_s) for m in fitted])
    checks.expect(all(o >= 0 and r >= 0 for o, r in overheads[0]) and len({tuple(o) for o in overheads}) == 1,
                  f"copy overheads and rests {overheads}: negative, or different on the ranks")
    return checks.failures


def unpriced_time_worker(truth: tuple[float, float, float], kernels: str = "auto") -> list[str]:
    """`measure_unpriced_time` on calls that run for real: on the input itself, with no copy and
    with the copies the paper's model plans for its load; then on the input with its rows shifted
    to pick expert 0 and the last expert first, half each, under four placements (none; expert 0
    on every other rank; and the last expert too; expert 1 alone); each timed as if the layer
    followed the model with `truth` = (expert_scale, slot_scale, copy_overhead_s) and a rest of 1
    ms on the load its input's calls recorded: the fit gives them back, and installed, the model
    predicts every timed call. `kernels="comet"`: the timed calls are the layer's calls on Comet's
    path, the copies placed in the replica slots."""
    rank, world = dist.get_rank(), dist.get_world_size()
    checks = Checks(f"rank {rank}")
    ran, placed, loads, timed, tokens_of = [], [], [], [], []
    torch.manual_seed(0)
    moe = MoE(DIM, HIDDEN, 2 * world, top_k=2, capacity_factor=None, activation="swiglu", balance="pro-prophet",
              kernels=kernels)
    scale, slot_scale, overhead = truth
    # experts at 40 rows a millisecond: their terms as large as the timings' others, as on a GPU
    moe.balancer.model = dataclasses.replace(moe.balancer.model, throughput=40e3)
    paper = moe.balancer.model

    def fake_time_candidates(step, candidates, device, trials, warmup):
        for copies in candidates:  # each call runs for real, twice (a warm-up call and a timed one)
            step(copies)
            step(copies)
            ran.append(copies)
            loads.append(moe.stats.expert_counts.clone())
            if moe._replica_slots is not None:
                placed.append(moe._replica_slots.copied)
        tokens, owners = moe.balancer.history.predict_counts(), moe.balancer.owner_E
        seconds = []
        for copies in candidates:
            terms = balance_model.placement_terms(paper, tokens, owners, copies, 1)
            seconds.append(1e-3 + terms.rest_s + terms.experts_s(scale, slot_scale) + terms.copies * overhead)
            tokens_of.append(tokens)
        timed.extend(seconds)
        return seconds

    balance_model.time_candidates = fake_time_candidates  # this spawned process's module only
    # a skewed input: every rank's rows lean to the experts of rank 0
    x = torch.randn(40, DIM, generator=torch.Generator().manual_seed(rank))
    x = balance_model.hot_experts_input(moe, x, (0,))[:20].repeat(2, 1) * 0.5 + x * 0.5
    unpriced = balance_model.measure_unpriced_time(moe, x, overrides={"kernels": kernels})
    last = moe.num_experts - 1
    others = {e: frozenset(r for r in range(world) if r != e // 2) for e in (0, 1, last)}
    hot = [{}, {0: others[0]}, {0: others[0], last: others[last]}, {1: others[1]}]
    checks.expect(len(ran) == 6 and ran[0] == {} and ran[1] and ran[2:] == hot,
                  f"timed placements {ran}: not plain and the planned copies on the input, then the hot ones")
    plan = balance_model.greedy_placement(tokens_of[0], moe.balancer.owner_E, paper, scheduled=False).placement
    checks.expect(ran[1] == {e: r for e, r in plan.copies.items() if r}, f"planned {ran[1]}, Alg. 1 {plan.copies}")
    checks.expect(tokens_of[0] == tokens_of[1] and tokens_of[2] != tokens_of[0], "each call's load not its input's")
    if kernels == "comet":
        checks.expect(placed[0] == [] and placed[1] == sorted(ran[1]) and placed[2:] == [[], [0], [0, last], [1]],
                      f"slots held {placed}")
    else:
        checks.expect(placed == [], f"slots held {placed}")
    checks.expect(all(int(c[0]) >= 20 and int(c[last]) >= 20 for c in loads[2:]),
                  f"expert 0 and the last expert not picked by half the tokens each: {loads[2:]}")
    checks.expect(all(p.grad is None for p in moe.parameters()), "gradients left on the layer")
    fitted = (unpriced.expert_scale, unpriced.slot_scale, unpriced.copy_overhead_s, unpriced.rest_s)
    checks.expect(all(abs(a - b) <= 1e-9 for a, b in zip(fitted, (*truth, 1e-3))), f"fitted {fitted}, expected {truth}")
    installed = balance_model.with_unpriced_time(moe, x)
    checks.expect(installed is moe.balancer.model and installed.copy_overhead_s == unpriced.copy_overhead_s
                  and installed.rest_s == unpriced.rest_s and installed.expert_scale == unpriced.expert_scale
                  and installed.slot_scale == unpriced.slot_scale, f"installed model {installed}")
    owners = moe.balancer.owner_E
    for copies, seconds, tokens in zip(ran, timed, tokens_of):
        placement = Placement(owners, copies)
        h, r = host_loads(tokens, placement)
        predicted = installed.layer_s(r, h, len(copies), 1, scheduled=False, slot_D=host_slot_rows(tokens, placement))
        checks.expect(abs(predicted - seconds) <= 1e-9 * seconds, f"predicted {predicted} for a {seconds} s call")
    return checks.failures


def test_the_fit_recovers_the_scales_and_overhead_of_made_up_timings():
    """Timings made from known scales and overhead over the model's terms give them back; noise
    past the bounds is clamped; a call weighed above the others is fitted closer; calls on two
    inputs share the scales and overhead but not the rest; placements that cannot tell the scales
    apart leave the paper's."""
    ms = 1e-3
    terms = [balance_model.PlacementTerms(own, slot, rest * ms, copies) for own, slot, rest, copies in [
        ((10 * ms, 10 * ms), (0.0, 0.0), 2, 0),  # no copy: both ranks hot
        ((5 * ms, 10 * ms), (0.0, 5 * ms), 2.5, 1),  # expert 0's rows: half to rank 1's copy
        ((5 * ms, 5 * ms), (5 * ms, 5 * ms), 3, 2),  # and the last expert's to rank 0's
        ((9.8 * ms, 10 * ms), (0.0, 0.2 * ms), 2.6, 1),  # expert 1: few rows
    ]]

    def timed(scale, slot_scale, overhead, rest=1 * ms):
        return [rest + t.rest_s + t.experts_s(scale, slot_scale) + t.copies * overhead for t in terms]

    fitted = balance_model.fit_unpriced_time(timed(0.3, 1.7, 0.2 * ms), terms)
    assert abs(fitted.expert_scale - 0.3) < 1e-9 and abs(fitted.slot_scale - 1.7) < 1e-9
    assert abs(fitted.copy_overhead_s - 0.2 * ms) < 1e-12 and abs(fitted.rest_s - 1 * ms) < 1e-12
    fitted = balance_model.fit_unpriced_time(timed(0.5, 3.0, 0.0), terms)
    assert fitted.slot_scale == balance_model.SCALE_BOUNDS[1]
    flat = [balance_model.PlacementTerms((10 * ms, 10 * ms), (0.0, 0.0), 2 * ms, copies) for copies in (0, 1, 2, 1)]
    fitted = balance_model.fit_unpriced_time([13 * ms, 14 * ms, 15 * ms, 14 * ms], flat)
    assert fitted.expert_scale == fitted.slot_scale == 1.0 and abs(fitted.copy_overhead_s - 1 * ms) < 1e-12
    # a call that fits no scale and overhead the others fit: weighed above them, it is fitted closer
    off = timed(0.3, 1.7, 0.2 * ms)
    off[0] += 0.5 * ms

    def plain_error(fitted):
        plain = fitted.rest_s + terms[0].rest_s + terms[0].experts_s(fitted.expert_scale, fitted.slot_scale)
        return abs(plain - off[0])

    alike = balance_model.fit_unpriced_time(off, terms)
    heavy = balance_model.fit_unpriced_time(off, terms, [9, 1, 1, 1])
    assert plain_error(heavy) < plain_error(alike) / 2
    # calls on a second input, whose rest is its own: the scales and overhead are the calls' common
    # ones, and the rest kept is the first input's
    other = [dataclasses.replace(t, own_D=tuple(2 * v for v in t.own_D)) for t in terms]
    both = timed(0.3, 1.7, 0.2 * ms) + [3 * ms + t.rest_s + t.experts_s(0.3, 1.7) + t.copies * 0.2 * ms for t in other]
    fitted = balance_model.fit_unpriced_time(both, terms + other, inputs=["x"] * 4 + ["hot"] * 4)
    assert abs(fitted.expert_scale - 0.3) < 1e-9 and abs(fitted.slot_scale - 1.7) < 1e-9
    assert abs(fitted.copy_overhead_s - 0.2 * ms) < 1e-12 and abs(fitted.rest_s - 1 * ms) < 1e-12
    # what it met, call by call: the input, the experts copied, the seconds timed
    assert fitted.calls == tuple(zip(["x"] * 4 + ["hot"] * 4, [0, 1, 2, 1] * 2, both))
    line = fit_calls_line(fitted.calls)
    assert line.startswith(f"x 0 copied {both[0] * 1e3:.3f}, x 1 copied")
    assert f"hot 2 copied {both[6] * 1e3:.3f}" in line
    fitted = balance_model.fit_unpriced_time([3 * ms, float("inf"), float("inf"), float("inf")], terms)
    assert fitted.copy_overhead_s == float("inf")  # a placement that could not be timed never pays


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("truth", [(0.3, 1.7, 2e-3), (1.0, 1.0, 0.0), (0.0, 0.5, 1e-3)])
def test_copy_overhead_scales_and_rest_are_what_the_model_does_not_price(world_size, truth):
    failures = run_checks(unpriced_time_worker, world_size, args=(truth,), timeout=300)
    assert not failures, "\n".join(failures)


def test_the_copy_overhead_of_the_replica_slots_is_timed_on_their_calls():
    failures = run_checks(unpriced_time_worker, 2, args=((0.3, 1.7, 2e-3), "comet"), timeout=300)
    assert not failures, "\n".join(failures)


def test_graphed_overhead_timing_needs_calls_in_replica_slots_on_cuda():
    torch.manual_seed(0)
    moe = MoE(DIM, HIDDEN, 4, top_k=2, capacity_factor=None, balance="pro-prophet")
    with pytest.raises(ValueError, match="graphed=True\\) times calls in replica slots on CUDA"):
        balance_model.measure_unpriced_time(moe, torch.randn(8, DIM), graphed=True)


@pytest.mark.parametrize("world_size", [2, 4])
def test_cost_model_constants_come_from_the_measurements(world_size):
    failures = run_checks(fit_worker, world_size, timeout=300)
    assert not failures, "\n".join(failures)


def test_fitting_needs_a_balanced_model_with_ranks_to_balance():
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, dim=DIM, moe_every=2, num_experts=4,
                    capacity_factor=None)
    with pytest.raises(ValueError, match="does not balance"):
        fit_balance_models(GPT(cfg), torch.zeros(1, 16, dtype=torch.long))
    comm = CommCostModel.fit({"all_to_all": [(1024, 1e-3)]}, 1, "gloo", "cpu")
    with pytest.raises(ValueError, match="2 or more ranks"):
        layer_cost_model(MoE(DIM, HIDDEN, 4, capacity_factor=None), 10, comm, 1e-3, torch.float32)


def test_train_balance_settings_are_checked():
    with pytest.raises(ValueError, match="train.balance_model must be 'measured' or 'nominal'"):
        TrainConfig(balance_model="guessed").validate()
    with pytest.raises(ValueError, match="train.balance_n must be a positive integer"):
        TrainConfig(balance_n=0).validate()
    with pytest.raises(ValueError, match="train.balance_rounds must be a positive integer"):
        TrainConfig(balance_rounds=0).validate()
