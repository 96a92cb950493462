"""Pro-Prophet's replicated experts (`weft.MoE(balance="pro-prophet")`) compute the plain layer's
function: on gloo with 2 and 4 ranks, over several SGD steps whose skewed routing makes the
planner copy experts (a different placement from step to step), the outputs, the input
gradients, every parameter's gradient (the copies' gradients summed back into the owners) and
the routing statistics equal the plain dropless layer's."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from weft import MoE
from weft.balance import LayerCostModel
from weft.balance import balancer as balancer_module
from weft.bench.breakdown import transfer_intervals
from weft.bench.trace import profile_trace
from weft.moe.exchange import Transfer, replicated
from weft.testing import Checks, run_checks

DIM, HIDDEN, TOP_K = 16, 32, 2


def copies_pay(world: int) -> LayerCostModel:
    """Slow experts, cheap weights: copying a hot expert always pays in this model."""
    return LayerCostModel(num_devices=world, bandwidth=1e12, throughput=1e3, row_bytes=4 * DIM,
                          expert_param_bytes=1.0, expert_grad_bytes=1.0)


def step_and_compare(layers, optimizers, x: torch.Tensor, grad_out: torch.Tensor, label: str, tolerance: float,
                     expect) -> None:
    """One SGD step of the plain layer and of the balanced one (`layers`) on the same input: their
    routed counts must be equal, their outputs, input gradients and every parameter's gradient
    equal within `tolerance` (relative): the copies' gradients are summed in another order than
    the owner's local sum, equal to float32 rounding. The stepped weights must agree within
    `tolerance` too; then every other layer takes the first layer's weights, so that each step
    starts both from the same weights and the rounding does not compound over the steps (on one
    machine's CPU it passed 1e-5 after three to six steps)."""
    results = []
    for layer, optimizer in zip(layers, optimizers):
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(grad_out)
        grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
        results.append((y.detach(), xi.grad, grads, layer.stats.expert_counts.clone()))
        optimizer.step()
        optimizer.zero_grad()
    reference = dict(layers[0].named_parameters())
    stepped = [(f"stepped {n}", p.detach().clone(), reference[n].detach()) for n, p in layers[1].named_parameters()]
    with torch.no_grad():
        for layer in layers[1:]:
            for name, p in layer.named_parameters():
                p.copy_(reference[name])
    (y0, gx0, g0, c0), (y1, gx1, g1, c1) = results
    expect(torch.equal(c0, c1), f"{label}: routed counts differ")
    for name, a, b in [("output", y0, y1), ("input gradient", gx0, gx1)] + [
            (f"gradient of {n}", g0[n], g1[n]) for n in g0] + stepped:
        error = float((a - b).norm() / b.norm().clamp_min(1e-12))
        expect(error < tolerance, f"{label}: {name} differs (relative error {error:.1e})")


def balance_worker(num_experts: int, activation: str, device: str = "cpu", tolerance: float = 1e-5,
                   n: int = 1) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    checks = Checks(f"rank {rank}")
    expect = checks.expect

    cost = copies_pay(world)
    layers = []
    for balance in (None, "pro-prophet"):
        torch.manual_seed(0)
        layers.append(MoE(DIM, HIDDEN, num_experts, TOP_K, capacity_factor=None, activation=activation,
                          balance=balance, balance_model=cost, balance_n=n, device=device))
    for layer in layers:
        with torch.no_grad():
            layer.router.weight[1, 0] += 10.0  # expert 1 (on rank 0) hot, through x[:, 0]
    plain, balanced = layers
    expect(all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), balanced.state_dict().values())),
           "the two layers start from different weights")
    optimizers = [torch.optim.SGD(layer.parameters(), lr=0.05) for layer in layers]
    copied_over_steps = []
    for step in range(5):
        gen = torch.Generator().manual_seed(100 + 10 * step + rank)
        x = torch.randn(20 + 3 * rank, DIM, generator=gen)  # uneven token counts: dropless accepts them
        x[:, 0] += 1.0 + 0.5 * step  # the skew grows: the plans differ from step to step
        grad_out = torch.randn(x.shape, generator=gen)
        step_and_compare(layers, optimizers, x.to(device), grad_out.to(device), f"step {step}", tolerance, expect)
        plan = balanced.balancer.last_plan
        copied_over_steps.append(tuple(plan.placement.replicated) if plan else ())
        if plan:  # n > 1: each copy to the W - n ranks sending its expert the most rows
            sizes = {len(devices) for devices in plan.placement.copies.values()}
            expect(sizes <= {world - n}, f"step {step}: copies went to {sizes} ranks, not W - n = {world - n}")
    expect(copied_over_steps[0] == (), "the first call has no history to plan from")
    expect(any(copied_over_steps), f"no expert was ever copied ({copied_over_steps}): the test exercised nothing")
    expect(len(set(copied_over_steps[1:])) >= 1 and all(1 in c for c in copied_over_steps if c),
           f"the hot expert 1 was not among the copies: {copied_over_steps}")
    return checks.failures


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_replicated_experts_compute_the_plain_layer(world_size, activation):
    flat = run_checks(balance_worker, world_size, args=(2 * world_size, activation), timeout=300)
    assert not flat, "\n".join(flat[:15])


@pytest.mark.parametrize("n", [2, 3])
def test_copies_to_some_ranks_compute_the_plain_layer(n):
    """Pro-Prophet's n > 1 on 4 ranks: each copy goes point to point to the 4 - n ranks sending
    its expert the most rows, and their gradients come back to the owner."""
    flat = run_checks(balance_worker, 4, args=(8, "swiglu", "cpu", 1e-5, n), timeout=300)
    assert not flat, "\n".join(flat[:15])


def test_balance_n_is_checked():
    with pytest.raises(ValueError, match=r"balance n must be in \[1, 1\]"):
        MoE(DIM, HIDDEN, 4, balance="pro-prophet", balance_n=2)


def test_balance_settings_are_checked():
    with pytest.raises(ValueError, match="unknown balance 'fast'"):
        MoE(DIM, HIDDEN, 4, balance="fast")


def test_one_rank_has_nothing_to_copy_and_computes_the_plain_layer():
    torch.manual_seed(0)
    plain = MoE(DIM, HIDDEN, 4, TOP_K, capacity_factor=None)
    torch.manual_seed(0)
    balanced = MoE(DIM, HIDDEN, 4, TOP_K, capacity_factor=None, balance="pro-prophet")
    x = torch.randn(30, DIM, generator=torch.Generator().manual_seed(1))
    for _ in range(3):  # later calls would plan from the earlier ones' loads if there were ranks to copy to
        ys = [layer(x) for layer in (plain, balanced)]
        for y in ys:
            y.square().sum().backward()
        assert torch.equal(ys[0], ys[1]) and balanced.balancer.last_copied == []
    for (name, p), q in zip(plain.named_parameters(), balanced.parameters()):
        assert torch.equal(p.grad, q.grad), name


def plan_ahead_worker() -> list[str]:
    """Each balanced call plans the next one once its own work is launched (from the loads it
    recorded), in the form it ran: copied by itself (eq. 6) or launched ahead by `start_transfer`
    (eq. 8). The next call, or `start_transfer`, finds the plan made and the same as one made
    then: no search in the next call."""
    checks = Checks(f"rank {dist.get_rank()}")
    searches = []
    search = balancer_module.greedy_placement
    balancer_module.greedy_placement = lambda *a, **kw: searches.append(kw["scheduled"]) or search(*a, **kw)
    torch.manual_seed(0)
    moe = MoE(DIM, HIDDEN, 4, TOP_K, capacity_factor=None, balance="pro-prophet", balance_model=copies_pay(2))
    with torch.no_grad():  # experts 0 and 1, both on rank 0, take every token
        moe.router.weight[:2, 0] += 10.0
    x = torch.randn(24, DIM, generator=torch.Generator().manual_seed(dist.get_rank()))
    x[:, 0] += 2.0
    moe(x).sum().backward()  # no load before it: nothing to plan from, then this call's load recorded
    checks.expect(searches == [False], f"searches after the first call {searches}, expected one, eq. 6")
    want = search(moe.balancer.history.predict_counts(), moe.balancer.owner_E, moe.balancer.model, scheduled=False)
    moe(x).sum().backward()  # copies what the plan says, without searching, then plans the next
    checks.expect(searches == [False, False], f"searches after the second call {searches}")
    checks.expect(moe.balancer.last_plan == want, f"the call ran {moe.balancer.last_plan}, planned then {want}")
    checks.expect(moe.balancer.last_copied != [], "nothing copied: the test has no copy")
    moe(x, transfer=moe.start_transfer()).sum().backward()  # no plan for eq. 8 yet: start_transfer makes it
    checks.expect(searches == [False, False, True, True], f"searches around a scheduled call {searches}")
    moe(x, transfer=moe.start_transfer()).sum().backward()
    checks.expect(searches == [False, False, True, True, True], f"searches after a second scheduled call {searches}")
    return checks.failures


def test_each_call_plans_the_next_once_its_work_is_launched():
    flat = run_checks(plan_ahead_worker, 2, timeout=120)
    assert not flat, "\n".join(flat)


def transfer_paths_worker() -> list[str]:
    """n = 1 (every copy to every rank but its owner): one all-gather where every rank owns as many
    copied experts, else one broadcast per owning rank forward and one reduce per owning rank
    backward (only the owners' bytes move); either way the plain layer's outputs and gradients."""
    rank, world = dist.get_rank(), dist.get_world_size()
    checks = Checks(f"rank {rank}")
    calls = []
    for name in ("broadcast", "reduce"):
        collective = getattr(dist, name)
        setattr(dist, name, lambda *a, name=name, collective=collective, **kw:
                calls.append(name) or collective(*a, **kw))

    class CountedGather(replicated.PendingGather):
        def launch(self, x):
            calls.append("all_gather")
            return super().launch(x)

    replicated.PendingGather = CountedGather
    layers = []
    for balance in (None, "pro-prophet"):
        torch.manual_seed(0)
        layers.append(MoE(DIM, HIDDEN, 2 * world, TOP_K, capacity_factor=None, balance=balance))
    plain, balanced = layers
    x = torch.randn(24, DIM, generator=torch.Generator().manual_seed(rank))
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(10 + rank))

    def fwd_bwd(layer, **kw):
        xi = x.clone().requires_grad_()
        y = layer(xi, **kw)
        y.backward(grad)
        out = (y.detach(), xi.grad, {n: p.grad.clone() for n, p in layer.named_parameters()})
        layer.zero_grad(set_to_none=True)
        return out

    y0, gx0, g0 = fwd_bwd(plain)
    # experts e on rank e // 2: one owner; two owners with 2 and 1; every rank one
    for copied, want in (((1,), ["broadcast", "reduce"]), ((0, 1, 2), ["broadcast"] * 2 + ["reduce"] * 2),
                         (tuple(range(1, 2 * world, 2)), ["all_gather"])):
        copies = {e: frozenset(range(world)) - {e // 2} for e in copied}
        calls.clear()
        y1, gx1, g1 = fwd_bwd(balanced, transfer=Transfer(balanced.experts, balanced.placement, copies, balanced.group))
        checks.expect(calls == want, f"copies of {copied}: collectives {calls}, expected {want}")
        checks.expect(torch.allclose(y1, y0, atol=1e-6) and torch.allclose(gx1, gx0, atol=1e-6),
                      f"copies of {copied}: outputs or input gradients differ")
        for n in g0:
            checks.expect(torch.allclose(g1[n], g0[n], atol=1e-5), f"copies of {copied}: gradient of {n} differs")
    return checks.failures


@pytest.mark.parametrize("world_size", [2, 4])
def test_copies_to_every_rank_move_only_the_owners_bytes(world_size):
    flat = run_checks(transfer_paths_worker, world_size, timeout=120)
    assert not flat, "\n".join(flat[:15])


def transfer_stages_worker() -> list[str]:
    """A profiled balanced call (expert 1 copied from rank 0): `transfer_intervals` counts the
    kernels of the ops launched in Trans's and Agg's stages (the broadcast and the reduce), and not
    those of the counts' all-gather or the all-to-alls. The trace's ops are the real ones; gloo
    launches no kernels, so each collective op gets a stand-in NCCL kernel with its External id."""
    rank = dist.get_rank()
    checks = Checks(f"rank {rank}")
    torch.manual_seed(0)
    layer = MoE(DIM, HIDDEN, 4, TOP_K, capacity_factor=None, balance="pro-prophet")
    x = torch.randn(24, DIM, generator=torch.Generator().manual_seed(rank))

    def step():
        transfer = Transfer(layer.experts, layer.placement, {1: frozenset({1})}, layer.group)
        layer(x, transfer=transfer).sum().backward()

    step()
    trace = profile_trace(step, 1)
    ops = [e for e in trace["traceEvents"] if e.get("cat") == "cpu_op" and e.get("name", "").startswith("c10d::")]
    names = sorted({e["name"] for e in ops})
    for ts, e in enumerate(ops):
        trace["traceEvents"].append({"ph": "X", "cat": "kernel", "name": f"ncclDevKernel_{e['name']}",
                                     "ts": 10 * ts, "dur": 1 + ts, "args": {"External id": e["args"]["External id"]}})
    transfers, _ = transfer_intervals(trace)
    picked = sorted(e["name"] for ts, e in enumerate(ops) if (10.0 * ts, 10.0 * ts + 1 + ts) in transfers)
    checks.expect(picked == ["c10d::broadcast_", "c10d::reduce_"],
                  f"Trans/Agg kernels from {picked}, expected the broadcast and the reduce (ops: {names})")
    checks.expect(any("allgather" in n for n in names) and any("alltoall" in n or "all_to_all" in n for n in names),
                  f"the call's other collectives missing from the trace: {names}")
    return checks.failures


def test_trans_and_agg_kernels_are_told_by_their_launching_op():
    flat = run_checks(transfer_stages_worker, 2, timeout=120)
    assert not flat, "\n".join(flat)


def weight_passes_worker(n: int) -> list[str]:
    """The ops that read or write a whole expert weight (its full (E_local, ...) shape), counted by
    the profiler in one dropless call's forward and backward, plain and with expert 0 copied: Agg
    adds the copies' gradients into the copied rows of `.grad` only, so the copy adds no
    weight-sized pass (autograd's gradient of an index_select would be a weight-sized tensor, added
    to the experts' own gradient)."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    from weft.moe.exchange import Transfer

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    moe = MoE(DIM, HIDDEN, 2 * world, TOP_K, capacity_factor=None, activation="swiglu", balance="pro-prophet",
              balance_n=n)
    shapes = {tuple(w.shape) for w in moe.experts.weights() if w is not None}
    x = torch.randn(64, DIM, generator=torch.Generator().manual_seed(rank))
    holders = frozenset(range(1, world)) if n == 1 else frozenset({1})

    def passes(copies: dict) -> Counter:
        transfer = Transfer(moe.experts, moe.placement, copies, moe.group) if copies else Transfer.none()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            moe(x.clone().requires_grad_(), transfer=transfer).square().sum().backward()
        moe.zero_grad(set_to_none=True)
        return Counter(e.name for e in prof.events() if not in_index_add(e)
                       and any(tuple(s) in shapes for s in e.input_shapes if isinstance(s, (list, tuple))))

    def in_index_add(event) -> bool:  # Agg's add into the copied rows (and the ops it runs as)
        while event is not None:
            if event.name == "aten::index_add_":
                return True
            event = event.cpu_parent
        return False

    plain, copied = passes({}), passes({0: holders})
    extra = copied - plain
    return [f"rank {rank}: the copy added weight-sized ops {dict(extra)}"] if extra else []


@pytest.mark.parametrize("world_size, n", [(2, 1), (4, 1), (4, 2)])
def test_a_copy_adds_no_pass_over_the_whole_expert_weights(world_size, n):
    failures = run_checks(weight_passes_worker, world_size, args=(n,), timeout=120)
    assert not failures, "\n".join(failures)
