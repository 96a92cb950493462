"""Pro-Prophet's performance model measured on the machine (weft.overlap.balance_model): its
constants follow from the measured numbers as eqs. 1-5 define them, a profiled GPT's balanced
layers get a model each (installed in their planners), with the overhead of a copy measured
on the layer's call, and `weft train --balance-model` is checked."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from weft import MoE
from weft.balance.planner import Placement, host_loads
from weft.comm.cost_model import CommCostModel
from weft.models import GPT, GPTConfig
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
    fitted = fit_balance_models(gpt, idx, repeats=2)
    layers = gpt.moe_layers()
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


def unpriced_time_worker(timings: tuple[float, float, float], kernels: str = "auto") -> list[str]:
    """`measure_unpriced_time` on given timings of its three placements (none; expert 0 on every
    rank; and the last expert too): the calls run for real on an input whose every token picks
    expert 0; `expert_scale` s and `copy_overhead_s` c solve d_i = s dE_i + dO_i + i c against the
    paper model's terms on the recorded loads (s within its bounds, c >= 0), `rest_s` is the
    plain call less the model's time for it with s; installed, the model predicts the timed plain
    call. `kernels="comet"`: the timed calls are the layer's calls on Comet's path, the copies
    placed in the replica slots."""
    rank, world = dist.get_rank(), dist.get_world_size()
    checks = Checks(f"rank {rank}")
    ran, placed, loads = [], [], []
    torch.manual_seed(0)
    moe = MoE(DIM, HIDDEN, 2 * world, top_k=2, capacity_factor=None, activation="swiglu", balance="pro-prophet",
              kernels=kernels)

    def fake_time_candidates(step, candidates, device, trials, warmup):
        for copies in candidates:  # each call runs for real
            step(copies)
            ran.append(copies)
            loads.append(moe.stats.expert_counts.clone())
            if moe._replica_slots is not None:
                placed.append(moe._replica_slots.copied)
        return list(timings)

    balance_model.time_candidates = fake_time_candidates  # this spawned process's module only
    x = torch.randn(40, DIM, generator=torch.Generator().manual_seed(rank))
    unpriced = balance_model.measure_unpriced_time(moe, x, overrides={"kernels": kernels})
    last = moe.num_experts - 1
    others = {e: frozenset(r for r in range(world) if r != e // 2) for e in (0, last)}
    checks.expect(ran == [{}, {0: others[0]}, others], f"timed placements {ran}")
    checks.expect(placed == ([[], [0], [0, last]] if kernels == "comet" else []), f"slots held {placed}")
    checks.expect(all(int(c[0]) == x.shape[0] for c in loads), f"expert 0 not picked by every token: {loads}")
    checks.expect(all(p.grad is None for p in moe.parameters()), "gradients left on the layer")
    cost, tokens, owners = moe.balancer.model, moe.balancer.history.predict_counts(), moe.balancer.owner_E
    paper = [balance_model.paper_terms(cost, tokens, owners, copies, 1) for copies in ran]
    (e0, o0), (e1, o1), (e2, o2) = paper
    d1, d2 = timings[1] - timings[0] - (o1 - o0), timings[2] - timings[0] - (o2 - o0)
    checks.expect(e2 < e0, f"the copies did not take rows off the busiest rank: {paper}")
    low, high = balance_model.EXPERT_SCALE_BOUNDS
    scale = min(high, max(low, (2 * d1 - d2) / (2 * (e1 - e0) - (e2 - e0))))
    checks.expect(abs(unpriced.expert_scale - scale) <= 1e-9, f"expert_scale {unpriced.expert_scale}, expected {scale}")
    overhead = max(0.0, d1 - scale * (e1 - e0))
    checks.expect(abs(unpriced.copy_overhead_s - overhead) <= 1e-9 * max(1.0, overhead),
                  f"overhead {unpriced.copy_overhead_s}, expected {overhead}")
    rest = max(0.0, timings[0] - o0 - scale * e0)
    checks.expect(abs(unpriced.rest_s - rest) <= 1e-9 * max(1.0, rest), f"rest {unpriced.rest_s}, expected {rest}")
    installed = balance_model.with_unpriced_time(moe, x)
    checks.expect(installed is moe.balancer.model and installed.copy_overhead_s == unpriced.copy_overhead_s
                  and installed.rest_s == unpriced.rest_s and installed.expert_scale == unpriced.expert_scale,
                  f"installed model {installed}")
    h, r = host_loads(tokens, Placement(owners))
    if timings[0] > o0 + scale * e0:  # the installed model prices the plain call as it was timed
        predicted = installed.layer_s(r, h, 0, 1, scheduled=False)
        checks.expect(abs(predicted - timings[0]) <= 1e-9 * timings[0],
                      f"predicted {predicted} for a {timings[0]} s call")
    return checks.failures


def test_the_fit_recovers_the_scale_and_overhead_of_made_up_timings():
    """Timings made from a known slope and overhead over the model's terms give them back; noise
    past the bounds is clamped; copies that move no rows leave the paper's slope."""
    terms = [(10e-3, 2e-3), (6e-3, 2.5e-3), (6.2e-3, 3e-3)]  # (experts, rest) of no copy, one, two

    def timed(scale, overhead, rest=1e-3):
        return [rest + o + scale * e + i * overhead for i, (e, o) in enumerate(terms)]

    fitted = balance_model.fit_unpriced_time(timed(0.3, 0.2e-3), terms)
    assert abs(fitted.expert_scale - 0.3) < 1e-9 and abs(fitted.copy_overhead_s - 0.2e-3) < 1e-12
    assert abs(fitted.rest_s - 1e-3) < 1e-12
    fitted = balance_model.fit_unpriced_time(timed(5.0, 0.0), terms)
    assert fitted.expert_scale == balance_model.EXPERT_SCALE_BOUNDS[1]
    flat = [(10e-3, 2e-3), (10e-3, 2.5e-3), (10e-3, 3e-3)]
    fitted = balance_model.fit_unpriced_time([3e-3, 4e-3, 5e-3], flat)
    assert fitted.expert_scale == 1.0 and abs(fitted.copy_overhead_s - 0.5e-3) < 1e-12
    fitted = balance_model.fit_unpriced_time([3e-3, float("inf"), float("inf")], terms)
    assert fitted.copy_overhead_s == float("inf")  # a placement that could not be timed never pays


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("timings", [(1.0, 3.0, 5.0), (1.0, 1.0, 1.0), (1.0, 0.5, 0.6)])
def test_copy_overhead_scale_and_rest_are_what_the_model_does_not_price(world_size, timings):
    failures = run_checks(unpriced_time_worker, world_size, args=(timings,), timeout=300)
    assert not failures, "\n".join(failures)


def test_the_copy_overhead_of_the_replica_slots_is_timed_on_their_calls():
    failures = run_checks(unpriced_time_worker, 2, args=((1.0, 3.0, 5.0), "comet"), timeout=300)
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
