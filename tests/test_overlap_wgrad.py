"""Deferred weight gradients (Lancet sec. 4): best fit picks as Alg. 1 says, and a model built
from `linear` / `bmm` / `grouped_mm` gets exactly autograd's gradients and hooks whether its dW
runs under a collective, at the flush, or through autograd."""
from __future__ import annotations

import contextlib
import random
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from weft.ops.wgrad import WGradScheduler, best_fit, bmm, grouped_mm, linear, plan_in_place

DIM, HID, G, TOKENS = 8, 12, 3, 12
COUNTS = [5, 0, 7]  # group 1 is empty


# ---------------------------------------------------------------- best fit


@pytest.mark.parametrize("budget, times, expected", [
    (5.0, [1.0, 4.0, 6.0], [1, 0]),  # |5-4| ties |5-6|: lowest index; then 1.0 fits exactly
    (5.0, [1.0, 5.5], [1]),  # overshoot: 5.5 is closer to 5 than 1.0 is
    (100.0, [1.0, 2.0, 3.0], [2, 1, 0]),  # budget never used up: every item, largest first
    (2.0, [1.0, 3.0, 1.0], [0, 2]),  # three-way tie, then the exact fit
    (3.0, [], []),
    (0.0, [1.0, 2.0], []),
    (-1.0, [1.0], []),
])
def test_best_fit_cases(budget, times, expected):
    assert best_fit(budget, times) == expected


def test_best_fit_is_the_greedy_argmin_at_every_step():
    rng = random.Random(0)
    for _ in range(500):
        times = [rng.choice([0.0, 0.5, 1.0, 2.0, rng.uniform(0, 3)]) for _ in range(rng.randint(0, 7))]
        budget = rng.uniform(-1, 6)
        picks = best_fit(budget, times)
        assert len(set(picks)) == len(picks)
        t_u, left = budget, set(range(len(times)))
        for j in picks:
            assert t_u > 0
            best = min(abs(t_u - times[i]) for i in left)
            assert j == min(i for i in left if abs(t_u - times[i]) == best)
            left.remove(j)
            t_u -= times[j]
        assert t_u <= 0 or not left


# ---------------------------------------------------------------- the model


def make_params(seed: int = 0) -> dict[str, nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"w_in": (HID, DIM), "w_mid": (HID, HID), "e1": (G, HID, HID), "e2": (G, HID, DIM),
              "g1": (G, DIM, HID)}
    return {name: nn.Parameter(torch.randn(shape, generator=gen) * 0.3) for name, shape in shapes.items()}


def plain_model(p: dict, x: torch.Tensor, middle=None) -> torch.Tensor:
    """The reference: plain ops, dW through autograd."""
    h = torch.tanh(F.linear(F.gelu(F.linear(x, p["w_in"])), p["w_mid"]))
    h = middle(h) if middle else h
    e = torch.relu(torch.bmm(h.reshape(G, -1, HID), p["e1"].to(h.dtype)))
    e = torch.bmm(e, p["e2"].to(e.dtype)).reshape(-1, DIM)
    w = p["g1"].to(e.dtype)
    return torch.cat([rows @ w[g] for g, rows in enumerate(torch.split(e, COUNTS))])


def wgrad_model(p: dict, x: torch.Tensor, scheduler: WGradScheduler | None, middle=None) -> torch.Tensor:
    h = torch.tanh(linear(F.gelu(linear(x, p["w_in"], scheduler)), p["w_mid"], scheduler))
    h = middle(h) if middle else h
    e = torch.relu(bmm(h.reshape(G, -1, HID), p["e1"], scheduler))
    e = bmm(e, p["e2"], scheduler).reshape(-1, DIM)
    return grouped_mm(e, p["g1"], COUNTS, scheduler)


def record_hooks(params: dict, events: list) -> None:
    for name, p in params.items():
        p.register_post_accumulate_grad_hook(lambda t, name=name: events.append((name, t.grad.clone())))


def autocast(dtype: torch.dtype):
    return torch.autocast("cpu", dtype=torch.bfloat16) if dtype == torch.bfloat16 else contextlib.nullcontext()


def run(forward, params: dict, dtype: torch.dtype, steps: int = 1, context=contextlib.nullcontext):
    """`steps` backward passes accumulating into .grad; returns grads of x and params plus the
    hook events of each step."""
    xs = [torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(10 + s)) for s in range(steps)]
    dys = [torch.randn(TOKENS, HID, generator=torch.Generator().manual_seed(20 + s)) for s in range(steps)]
    events: list = []
    record_hooks(params, events)
    x_grads, per_step = [], []
    for x, dy in zip(xs, dys):
        x = x.requires_grad_()
        with autocast(dtype):
            y = forward(params, x)
        with context():
            (y.float() * dy).sum().backward()
        x_grads.append(x.grad)
        per_step.append(list(events))
        events.clear()
    return x_grads, {n: p.grad.clone() for n, p in params.items()}, per_step


def assert_same(got, ref, dtype: torch.dtype) -> None:
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-3}
    (gx, gp, gev), (rx, rp, rev) = got, ref
    for a, b in zip(gx, rx):
        torch.testing.assert_close(a, b, **tol)
    assert gp.keys() == rp.keys()
    for name in rp:
        torch.testing.assert_close(gp[name], rp[name], **tol, msg=lambda m, name=name: f"{name}: {m}")
    for got_events, ref_events in zip(gev, rev):  # each hook once per backward, complete grad
        assert sorted(n for n, _ in got_events) == sorted(n for n, _ in ref_events) == sorted(rp)
        ref_grads = dict(ref_events)
        for name, grad in got_events:
            torch.testing.assert_close(grad, ref_grads[name], **tol, msg=lambda m, name=name: f"hook {name}: {m}")


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("in_place", [True, False])
def test_deferred_grads_equal_autograd(dtype, steps, in_place):
    ref = run(plain_model, make_params(), dtype, steps)
    scheduler = WGradScheduler(in_place=in_place)
    got = run(lambda p, x: wgrad_model(p, x, scheduler), make_params(), dtype, steps, scheduler.backward)
    assert_same(got, ref, dtype)
    # 2 linear + 2 bmm (one item per weight, all G experts) + 2 non-empty groups per backward.
    # No collective: the first backward flushes them all at the end; after it, the plan sends
    # every weight back to plain autograd (unless in_place=False).
    s = scheduler.stats
    if in_place and steps > 1:
        assert (s.deferred, s.flushed, s.in_place) == (0, 0, 0)
    else:
        assert (s.deferred, s.flushed, s.in_place) == (2 + 2 + 2, 2 + 2 + 2, 0)
    assert s.run_under_comm == 0
    weights = make_params()  # not those of `got`: the plan is per parameter object
    assert [scheduler.through_autograd(w) for w in weights.values()] == [False] * len(weights)


@pytest.mark.parametrize("dtype", DTYPES)
def test_without_scheduler_or_outside_its_context_dw_goes_through_autograd(dtype):
    ref = run(plain_model, make_params(), dtype, steps=2)
    assert_same(run(lambda p, x: wgrad_model(p, x, None), make_params(), dtype, steps=2), ref, dtype)
    scheduler = WGradScheduler()
    assert_same(run(lambda p, x: wgrad_model(p, x, scheduler), make_params(), dtype, steps=2), ref, dtype)
    assert scheduler.stats.deferred == 0 and not scheduler.active


def test_all_empty_groups_give_a_zero_gradient():
    w = nn.Parameter(torch.randn(2, DIM, HID))
    x = torch.randn(0, DIM, requires_grad=True)
    scheduler = WGradScheduler()
    fired = []
    w.register_post_accumulate_grad_hook(lambda t: fired.append(t.grad.clone()))
    with scheduler.backward():
        grouped_mm(x, w, [0, 0], scheduler).sum().backward()
    assert w.grad is not None and torch.equal(w.grad, torch.zeros_like(w))
    assert len(fired) == 1


# ---------------------------------------------------------------- under a collective


class FakeHandle:
    def __init__(self, on_wait, sleep: float = 0.0):
        self.on_wait, self.sleep, self.waited = on_wait, sleep, 0

    def wait(self) -> None:
        time.sleep(self.sleep)
        self.waited += 1
        self.on_wait()


class Communicate(torch.autograd.Function):
    """Identity whose backward plays an MoE layer's: launch an all-to-all, let the scheduler
    fill its time, wait."""

    @staticmethod
    def forward(ctx, h, scheduler, handle):
        ctx.scheduler, ctx.handle = scheduler, handle
        return h.view_as(h)

    @staticmethod
    def backward(ctx, dh):
        ctx.scheduler.communicate("a2a", dh.numel() * dh.element_size(), ctx.handle)
        return dh, None, None


class RunUnder(torch.autograd.Function):
    """Identity whose backward plays a partitioned forward's exchange: launched, then waited for
    elsewhere, the scheduler told with `run_under`."""

    @staticmethod
    def forward(ctx, h, scheduler):
        ctx.scheduler = scheduler
        return h.view_as(h)

    @staticmethod
    def backward(ctx, dh):
        ctx.scheduler.run_under("a2a", dh.numel() * dh.element_size())
        return dh, None


def test_a_collective_waited_for_elsewhere_takes_the_planned_items_at_every_backward():
    """`run_under` records the collective in the trace the next backward's plan follows, as
    `communicate` does: from the second backward on the plan gives it its items (before, such a
    collective took none after the first backward, and every weight went back to autograd)."""
    scheduler = WGradScheduler(comm_time=lambda nbytes: 1.0)
    params, ref_params = make_params(), make_params()
    x = torch.randn(TOKENS, DIM, requires_grad=True)
    for _ in range(3):
        for p in params.values():
            p.grad = None
        with scheduler.backward():
            wgrad_model(params, x, scheduler, lambda h: RunUnder.apply(h, scheduler)).sum().backward()
        s = scheduler.stats
        assert s.comms == 1 and s.deferred == s.run_under_comm + s.flushed > 0, s
    assert s.run_under_comm > 0 and s.flushed == 0, s  # the last backward: every item under the collective
    # the weights whose items come after the collective in backward have none to hide under
    assert [n for n, p in params.items() if scheduler.through_autograd(p)] == ["w_in", "w_mid"]
    plain_model(ref_params, x).sum().backward()
    for name, p in params.items():
        torch.testing.assert_close(p.grad, ref_params[name].grad)


def test_communicate_runs_the_best_fit_items_before_waiting():
    params = make_params()
    ref = run(plain_model, make_params(), torch.float32)

    budgets = []
    scheduler = WGradScheduler(comm_time=lambda nbytes: budgets.append(nbytes) or 4.0)
    with scheduler.backward():  # profile every key once (on other parameters)
        wgrad_model(make_params(), torch.randn(TOKENS, DIM), scheduler).sum().backward()
    assert {k[0] for k in scheduler.times} == {"linear", "bmm", "grouped_mm"}
    # bmm keys are ("bmm", G, M, K, N, dtype): e1 has N == HID, e2 has N == DIM.
    # Queue at the collective (backward order): g1 group 0 (0.5), g1 group 2 (0.5), e2 (2.0),
    # e1 (3.0) -- one item per bmm weight; the linears' items come after the collective.
    # Budget 4: t_u=4: e1 (|4-3|=1 beats e2 |4-2|=2 and g1 |4-0.5|=3.5) -> t_u=1;
    # then g1 group 0 (|1-0.5|=0.5 beats e2 |1-2|=1; ties with group 2: lowest index) -> t_u=0.5;
    # then g1 group 2 (|0.5-0.5|=0) -> t_u=0, stop. e2 stays queued (it would overshoot).
    # A queue-order (FIFO) fill would instead take g1, g1, e2 and leave e1.
    fake = {"grouped_mm": 0.5, "bmm": None, "linear": 1.0}
    for key in scheduler.times:
        fake_t = fake[key[0]]
        scheduler.times[key] = fake_t if fake_t is not None else (3.0 if key[4] == HID else 2.0)
    bmm_keys = [k for k in scheduler.times if k[0] == "bmm"]
    assert sorted(bmm_keys) == sorted([("bmm", G, TOKENS // G, HID, HID, torch.float32),
                                       ("bmm", G, TOKENS // G, HID, DIM, torch.float32)])
    assert sorted(scheduler.times[k] for k in bmm_keys) == [2.0, 3.0]

    events: list = []
    record_hooks(params, events)
    at_wait = {}

    def on_wait():
        events.append(("wait", None))
        at_wait.update({n: None if p.grad is None else p.grad.clone() for n, p in params.items()})

    handle = FakeHandle(on_wait)
    x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(10)).requires_grad_()
    dy = torch.randn(TOKENS, HID, generator=torch.Generator().manual_seed(20))
    y = wgrad_model(params, x, scheduler, middle=lambda h: Communicate.apply(h, scheduler, handle))
    with scheduler.backward():
        (y * dy).sum().backward()

    _, ref_grads, _ = ref
    assert handle.waited == 1 and set(budgets) == {TOKENS * HID * 4}  # also asked when planning
    # Before the wait: all of e1 (every expert, one item) and all of g1 were accumulated,
    # nothing else.
    assert at_wait["w_in"] is None and at_wait["w_mid"] is None and at_wait["e2"] is None
    torch.testing.assert_close(at_wait["e1"], ref_grads["e1"])
    torch.testing.assert_close(at_wait["g1"], ref_grads["g1"])
    # g1 and e1 were complete under the collective: their hooks fired then (queue order: g1's
    # groups precede e1), every other one after.
    names = [n for n, _ in events]
    assert names.index("g1") < names.index("e1") < names.index("wait")
    assert sorted(names) == sorted(["wait", *params])
    assert all(names.index(n) > names.index("wait") for n in params if n not in ("g1", "e1"))
    assert_same(([x.grad], {n: p.grad for n, p in params.items()}, [[e for e in events if e[0] != "wait"]]),
                ref, torch.float32)

    s = scheduler.stats
    # 2 linear + 2 bmm + 2 groups deferred; e1, g1 x2 under the collective; e2, w_mid, w_in flushed
    assert (s.deferred, s.run_under_comm, s.flushed, s.comms) == (6, 3, 3, 1)
    assert s.comm_budget == 4.0 and s.placed_time == 3.0 + 0.5 + 0.5


def test_communicate_measures_an_unknown_collective_then_fills_it():
    scheduler = WGradScheduler()  # no cost model: the first sight of "a2a" is measured
    params = make_params()
    handle = FakeHandle(lambda: None, sleep=0.05)
    def middle(h):
        return Communicate.apply(h, scheduler, handle)

    x = torch.randn(TOKENS, DIM)

    with scheduler.backward():
        wgrad_model(params, x, scheduler, middle).sum().backward()
    assert handle.waited == 1 and scheduler.comm_times["a2a"] >= 0.05
    assert scheduler.stats.run_under_comm == 0 and scheduler.stats.comms == 0  # nothing timed yet
    first = {n: p.grad.clone() for n, p in params.items()}

    with scheduler.backward():  # every item is timed now and far shorter than 50 ms
        wgrad_model(params, x, scheduler, middle).sum().backward()
    # under it: the 2 bmm items (one per weight) and the 2 non-empty groups; the second linear
    # comes after the collective, so the plan from the first backward sent it back to autograd
    # (the first linear's input needs no gradient: its dW goes through autograd anyway)
    s = scheduler.stats
    assert (s.deferred, s.run_under_comm, s.flushed, s.in_place) == (2 + 2, 2 + 2, 0, 0)
    assert [n for n, p in params.items() if scheduler.through_autograd(p)] == ["w_mid"]
    for n, p in params.items():
        torch.testing.assert_close(p.grad, 2 * first[n])


@pytest.mark.parametrize("in_place", [True, False])
def test_an_item_no_collective_takes_runs_where_it_is_produced(in_place):
    # Lancet moves only the dW instructions it assigns to an all-to-all; the others stay in
    # place. The collective's budget (1e9 s: whatever the items' measured times on a loaded
    # machine) fits the items before it; w_mid's item comes after it, so from the second backward
    # on its dW runs inside autograd, before backward reaches x (in_place), not at the end.
    scheduler = WGradScheduler(comm_time=lambda nbytes: 1e9, in_place=in_place)
    params = make_params()
    handle = FakeHandle(lambda: None)
    seen = []
    for step in range(2):
        x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(step)).requires_grad_()
        x.register_hook(lambda g: seen.append(params["w_mid"].grad is not None))
        with scheduler.backward():
            wgrad_model(params, x, scheduler, lambda h: Communicate.apply(h, scheduler, handle)).sum().backward()
        for p in params.values():
            p.grad = None
    assert seen == [False, in_place]
    autograd = [n for n, p in params.items() if scheduler.through_autograd(p)]
    assert autograd == (["w_in", "w_mid"] if in_place else [])


def test_a_weight_partly_under_a_collective_runs_its_other_items_in_place():
    # g1's two groups: the plan puts group 0 under the collective and runs group 2 in place,
    # in the hook; g1's post-accumulate hook fires once, with the complete gradient.
    budget = [1e9]
    scheduler = WGradScheduler(comm_time=lambda nbytes: budget[0])
    params, ref_params = make_params(), make_params()
    events: list = []
    record_hooks(params, events)
    x = torch.randn(TOKENS, DIM, requires_grad=True)
    for step in range(3):
        if step == 1:  # the plan made at the end of this backward uses these times and budget
            scheduler.times = {k: {"grouped_mm": 0.5, "bmm": 2.0}.get(k[0], 1.0) for k in scheduler.times}
            budget[0] = 0.5
        for p in params.values():
            p.grad = None
        events.clear()
        with scheduler.backward():
            wgrad_model(params, x, scheduler, lambda h: Communicate.apply(h, scheduler, FakeHandle(lambda: None)))\
                .sum().backward()
    s = scheduler.stats
    assert (s.deferred, s.run_under_comm, s.in_place, s.flushed) == (1, 1, 1, 0)
    assert [n for n, p in params.items() if scheduler.through_autograd(p)] == ["w_in", "w_mid", "e1", "e2"]
    plain_model(ref_params, x).sum().backward()
    assert [n for n, _ in events].count("g1") == 1
    torch.testing.assert_close(dict(events)["g1"], ref_params["g1"].grad)
    for name, p in params.items():
        torch.testing.assert_close(p.grad, ref_params[name].grad)


def test_a_backward_that_stops_matching_the_plan_defers_the_rest():
    scheduler = WGradScheduler(comm_time=lambda nbytes: 1.0)
    params, ref_params = make_params(), make_params()
    x = torch.randn(TOKENS, DIM, requires_grad=True)

    def model(p, scheduler):
        return wgrad_model(p, x, scheduler, lambda h: Communicate.apply(h, scheduler, FakeHandle(lambda: None)))

    with scheduler.backward():  # the plan's trace: 4 items, the collective (it takes them all)
        model(params, scheduler).sum().backward()
    for p in params.values():
        p.grad = None
    with scheduler.backward():  # twice the model: the second one's items are not in the plan
        (model(params, scheduler) + model(params, scheduler)).sum().backward()
    (plain_model(ref_params, x) * 2).sum().backward()
    for name, p in params.items():
        torch.testing.assert_close(p.grad, ref_params[name].grad)
    # first 4 items: queued for the first collective as planned; then the plan stops applying:
    # the next 4 are deferred and placed by best fit under the second collective
    s = scheduler.stats
    assert (s.deferred, s.run_under_comm, s.flushed, s.in_place, s.comms) == (8, 8, 0, 0, 2)


def test_plan_in_place_assigns_as_alg_1_over_the_trace():
    times = {"a": 1.0, "b": 2.0, "c": 1.0, "d": 3.0}
    budgets = {"x": 2.5, "y": 0.5, "z": 1.0}
    trace = [("dw", "a", 1), ("dw", "b", 2), ("comm", "x", 0), ("dw", "c", 3), ("dw", "u", 4),
             ("comm", "y", 0), ("dw", "d", 5), ("comm", "unknown", 0), ("comm", "z", 0), ("dw", "a", 6)]
    slots = plan_in_place(trace, times, lambda key, nbytes: budgets.get(key))
    # x (2.5): b (|2.5-2| < |2.5-1|), then a (t_u 0.5, the only one left) -> both under x.
    # y (0.5): c (1.0 overshoots but is the only timed one; u was never timed).
    # no estimate for "unknown": nothing; z (1.0): d (3.0) is all that is left before it.
    # The last item comes after every collective: in place, as is u.
    assert slots == [0, 0, 1, None, 3, None]
    assert plan_in_place([("dw", "a", 1)], times, lambda *_: None) == [None]
    # A budget the first items fill exactly leaves the rest in place.
    assert plan_in_place([("dw", "a", 1), ("dw", "b", 2), ("comm", "x", 0)], times,
                         lambda *_: 2.0) == [None, 0]


# ---------------------------------------------------------------- edges


class Fail(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        return h.view_as(h)

    @staticmethod
    def backward(ctx, dh):
        raise RuntimeError("boom")


def test_an_exception_in_the_context_drops_the_queue():
    scheduler = WGradScheduler()
    params = make_params()
    x = torch.randn(TOKENS, DIM)
    y = wgrad_model(params, x, scheduler, middle=Fail.apply)
    with pytest.raises(RuntimeError, match="boom"), scheduler.backward():
        y.sum().backward()
    assert scheduler.stats.deferred == 2 + 2  # 2 bmm items (one per weight) and 2 groups before it
    assert not scheduler.active and all(p.grad is None for p in params.values())

    ref_params = make_params()
    plain_model(ref_params, x).sum().backward()
    with scheduler.backward():  # a stale queue would add the dropped items here
        wgrad_model(params, x, scheduler).sum().backward()
    for n, p in params.items():
        torch.testing.assert_close(p.grad, ref_params[n].grad, rtol=1e-5, atol=1e-6)


def test_defer_outside_the_context_is_an_error():
    with pytest.raises(RuntimeError, match="backward"):
        WGradScheduler().defer("k", lambda: None, nn.Parameter(torch.zeros(1)))


def test_a_non_leaf_weight_uses_the_plain_op():
    scheduler = WGradScheduler()
    leaves = make_params()
    x = torch.randn(TOKENS, DIM)
    gathered = {n: p * 1.0 for n, p in leaves.items()}  # e.g. all-gathered weights
    with scheduler.backward():
        wgrad_model(gathered, x, scheduler).sum().backward()
        assert all(p.grad is not None for p in leaves.values())  # already there: not deferred
    assert scheduler.stats.deferred == 0
    ref = make_params()
    plain_model(ref, x).sum().backward()
    for n, p in leaves.items():
        torch.testing.assert_close(p.grad, ref[n].grad, rtol=1e-5, atol=1e-6)


def test_an_input_without_grad_is_not_deferred_but_gets_its_gradient_and_hook_once():
    scheduler = WGradScheduler()
    w = nn.Parameter(torch.randn(HID, DIM))
    fired = []
    w.register_post_accumulate_grad_hook(lambda t: fired.append(t.grad.clone()))
    x = torch.randn(TOKENS, DIM)  # e.g. input data
    with scheduler.backward():
        linear(x, w, scheduler).square().sum().backward()
    assert scheduler.stats.deferred == 0 and len(fired) == 1
    ref = w.detach().clone().requires_grad_()
    F.linear(x, ref).square().sum().backward()
    torch.testing.assert_close(w.grad, ref.grad)
    torch.testing.assert_close(fired[0], ref.grad)


def items_under_a_collective_see(device: str) -> list[tuple]:
    """(SM carveout, preferred BLAS backend) inside each dW item that a collective runs, and after."""
    scheduler = WGradScheduler(comm_time=lambda nbytes: 1.0, in_place=False)
    weight = torch.zeros(4, device=device, requires_grad=True)
    seen = []

    def item() -> None:
        seen.append((torch._C._get_sm_carveout_experimental(), torch.backends.cuda.preferred_blas_library()))

    with scheduler.backward():
        scheduler.times["item"] = 1e-6  # timed, so the collective's best fit takes it
        scheduler.defer("item", item, weight)
        scheduler.communicate("all_to_all", 1024, None)
        assert scheduler.stats.run_under_comm == 1
    return seen + [(torch._C._get_sm_carveout_experimental(), torch.backends.cuda.preferred_blas_library())]


def test_items_under_a_collective_on_the_cpu_change_no_matmul_setting():
    """The SM margin that dW items leave a collective (`weft.kernels.grouped_mm.leave_sms`) is for
    CUDA only (tests/test_gpu.py): on the CPU the items run with the settings as they were."""
    before = (torch._C._get_sm_carveout_experimental(), torch.backends.cuda.preferred_blas_library())
    assert items_under_a_collective_see("cpu") == [before, before]


def test_items_beside_a_collective_leave_it_sms_on_cuda_only():
    """`beside_collective(on_cuda)`, how the scheduler's items run under a collective and how the
    profile times the dW items' overlap efficiency: PyTorch's SM carveout is
    `EXCHANGE_SM_MARGIN` inside for CUDA work, unchanged otherwise, and restored on exit."""
    from weft.kernels.grouped_mm import EXCHANGE_SM_MARGIN
    from weft.ops.wgrad import beside_collective

    before = torch._C._get_sm_carveout_experimental()
    with beside_collective(True):
        assert torch._C._get_sm_carveout_experimental() == EXCHANGE_SM_MARGIN > 0
    assert torch._C._get_sm_carveout_experimental() == before
    with beside_collective(False):
        assert torch._C._get_sm_carveout_experimental() == before


def test_the_plan_lists_each_collective_its_budget_and_the_items_it_takes():
    """`WGradScheduler.planned`: after a backward, the plan the next one follows, per collective:
    its key and bytes, its expected seconds, and the items best fit gave it with their profiled
    seconds (here every timed item before the collective, the budget being far above them: g1's
    two groups, e2 and e1; the linears come after it); `plan_line` sums it in one line."""
    from weft.ops.wgrad import plan_line

    scheduler = WGradScheduler(comm_time=lambda nbytes: 1.0)
    params = make_params()
    x = torch.randn(TOKENS, DIM, requires_grad=True)
    handle = FakeHandle(lambda: None)
    assert scheduler.planned == []
    for _ in range(2):
        for p in params.values():
            p.grad = None
        with scheduler.backward():
            wgrad_model(params, x, scheduler, middle=lambda h: Communicate.apply(h, scheduler, handle)).sum().backward()
    [planned] = scheduler.planned
    assert (planned.key, planned.nbytes, planned.budget) == ("a2a", TOKENS * HID * 4, 1.0)
    assert planned.items == scheduler.stats.run_under_comm == 4  # the plan the second backward followed
    under = 2 * sum(t for k, t in scheduler.times.items() if k[0] == "grouped_mm") + \
        sum(t for k, t in scheduler.times.items() if k[0] == "bmm")
    assert planned.item_seconds == pytest.approx(under) and under > 0
    assert plan_line(scheduler.planned) == (f"dW plan: 1 of 1 collectives take 4 items, {under * 1e3:.2f} ms of them "
                                            "(profiled) beside 1000.00 ms of expected collectives")


def test_forget_brings_back_the_weights_a_plan_for_other_collectives_left_out():
    """Sending a weight to plain autograd is final while the plan holds: a configuration whose
    collective fits one item (a small budget) leaves the other weights out, and back at the
    large budget the plan keeps only what that one kept. `forget()` plans afresh: the next
    backward defers every item again and the plan after it gives the collective all four (g1's
    two groups, e2, e1). The gradients are the plain model's throughout."""
    budget = [1e9]
    scheduler = WGradScheduler(comm_time=lambda nbytes: budget[0])
    params, ref_params = make_params(), make_params()
    x = torch.randn(TOKENS, DIM, requires_grad=True)
    plain_model(ref_params, x).sum().backward()

    def steps(n: int) -> int:
        for _ in range(n):
            for p in params.values():
                p.grad = None
            with scheduler.backward():
                wgrad_model(params, x, scheduler, lambda h: Communicate.apply(h, scheduler, FakeHandle(lambda: None)))\
                    .sum().backward()
            for name, p in params.items():
                torch.testing.assert_close(p.grad, ref_params[name].grad)
        [planned] = scheduler.planned
        return planned.items

    assert steps(2) == 4
    budget[0] = 1e-12  # best fit takes the one item nearest 0
    assert steps(2) == 1
    budget[0] = 1e9
    assert steps(2) < 4  # the weights the small budget left out stay out
    scheduler.forget()
    assert scheduler.planned == [] and not any(scheduler.through_autograd(p) for p in params.values())
    assert steps(2) == 4
    with scheduler.backward(), pytest.raises(RuntimeError, match="between steps"):
        scheduler.forget()
