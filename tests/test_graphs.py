"""`weft.graphs` where no GPU is: what the CPU can check of the graph helpers (their captures and
replays are tested on GPUs in tests/test_gpu.py)."""
from __future__ import annotations

import math

import pytest
import torch

from weft.graphs import CaptureError, GraphedStep, time_graphed, warm_up


def test_cpu_steps_cannot_be_captured_and_time_as_infinite():
    """A step of CPU tensors is refused with CaptureError; `time_graphed` times such candidates as
    infinite (never chosen), says so in a warning per candidate with the reason, and leaves no
    gradient behind."""
    weight = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3)

    def step_of(depth: int):
        def step(x_in: torch.Tensor) -> None:
            h = x_in
            for _ in range(depth):
                h = h @ weight
            h.sum().backward()
        return step

    with pytest.raises(CaptureError, match="CUDA tensor"):
        GraphedStep(step_of(1), [x], grads_of=[weight])
    for accumulate in (True, False):
        with pytest.warns(UserWarning, match="weft: 2 timed as infinite: .*CUDA tensor") as warned:
            seconds = time_graphed(step_of, (1, 2), (x,), [weight], trials=1, accumulate=accumulate)
        assert seconds == [math.inf, math.inf] and len(warned) == 2
        assert weight.grad is None


@pytest.mark.parametrize("accumulate", [True, False])
def test_the_warm_up_starts_each_call_from_the_gradients_the_captured_step_starts_from(accumulate):
    """`GraphedStep`'s warm-up (run here on the CPU): with `accumulate` each call adds into the
    same zeroed `.grad` tensors, as the captured step will; without, each call starts with no
    `.grad` (the captured backward makes its own), so no call holds a whole set of kept gradients
    beside the ones it makes. Each call's gradients are the step's own either way."""
    weight, bias = torch.randn(4, 3, requires_grad=True), torch.randn(3, requires_grad=True)
    weight.grad = torch.full_like(weight, 7.0)  # left by an earlier step
    x = torch.randn(5, 4, requires_grad=True)
    found = []

    def step(x_in: torch.Tensor) -> None:
        found.append([None if t.grad is None else (t.grad, t.grad.clone()) for t in (weight, bias, x_in)])
        (x_in @ weight + bias).square().sum().backward()

    warm_up(step, [x], [weight, bias, x], 3, accumulate)
    expected = torch.autograd.grad((x @ weight + bias).square().sum(), [weight, bias, x])
    for call, grads in enumerate(found):
        if not accumulate:
            assert grads == [None, None, None], f"call {call} started from kept gradients"
            continue
        for i, kept in enumerate(grads):
            if call == 0 and i > 0:
                assert kept is None  # nothing to zero yet: the first backward makes them
            else:
                assert kept is not None and not kept[1].any(), f"call {call}: .grad {i} not zeroed"
        if call > 0:  # the same tensors every call: the step accumulates in place
            assert all(g[0] is p[0] for g, p in zip(grads, found[1]))
    for t, want in zip((weight, bias, x), expected):
        assert torch.allclose(t.grad, want)  # the last call's gradients alone


def released_after_each_call(capacity_factor) -> list[str]:
    """Distributed MoE calls in a row (plain exchange; Tutel's pipelined one; padded and dropless),
    each followed at once by the check a capture makes (`live_gradient_accumulators`)."""
    import torch.distributed as dist

    from weft import MoE
    from weft.graphs import live_gradient_accumulators
    from weft.testing import Checks

    checks = Checks(f"rank {dist.get_rank()}")
    torch.manual_seed(0)
    moe = MoE(16, 24, 8, top_k=4, capacity_factor=capacity_factor, parallel="adaptive", a2a_algo="linear")
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    for call in range(40):
        moe(x, overlap_degree=1 + call % 2).detach()
        moe.record(None)  # its aux loss: the only graph the caller could still hold
        held = live_gradient_accumulators(list(moe.parameters()))
        checks.expect(not held, f"call {call}: parameters {held} still have a live autograd graph")
    return checks.failures


@pytest.mark.parametrize("capacity_factor", [1.0, None])
def test_no_autograd_graph_outlives_a_distributed_moe_call(capacity_factor):
    """A process group's work keeps its tensors a moment after the collective returns (gloo's
    worker thread here, NCCL's watchdog on GPUs); handed the tensors autograd links into the
    call's graph, it kept the gradient accumulators alive with them now and then, and a CUDA graph
    capture right after refused to start (bench layer's auto+graph timed such candidates as
    infinite). The collectives get detached aliases: nothing is held once the call returns."""
    from weft.testing import run_checks

    failures = run_checks(released_after_each_call, 2, args=(capacity_factor,), timeout=120)
    assert not failures, "\n".join(failures[:10])


def replays_after_a_late_rank_worker(late_s: float) -> list[float]:
    """`_replay_seconds` of a stand-in graph that holds a collective (an all-reduce), with the last
    rank reaching the timing `late_s` late: each rank's replay times."""
    import time

    import torch.distributed as dist

    from weft.graphs import _replay_seconds

    if dist.get_rank() == dist.get_world_size() - 1:
        time.sleep(late_s)
    flag = torch.ones(1)
    return _replay_seconds(lambda: dist.all_reduce(flag), (), torch.device("cpu"), 3)


def test_graph_replays_are_timed_after_a_barrier():
    """A graph with collectives waits in them for the rank the host launched last: each replay is
    timed after a barrier, so no rank's time carries another's lateness (as `weft bench layer`
    times its steps), and the ranks agree on each replay's time."""
    from weft.testing import run_distributed

    late_s = 0.5
    for rank, seconds in enumerate(run_distributed(replays_after_a_late_rank_worker, 2, args=(late_s,), timeout=120)):
        assert max(seconds) < late_s / 5, f"rank {rank} timed {seconds} s: the late rank's wait counted"


def test_rounds_time_the_candidates_there_and_back_so_a_drift_weighs_on_each_alike(monkeypatch):
    """`time_graphed(..., rounds=2)`: the candidates are captured in order, then in the reverse
    order, and each one's time is the mean of its two medians. Here every capture's replays take
    its candidate's own time plus a drift that grows by one unit per capture (a GPU slowing down
    over the timing): one round adds 0, 1, 2 to the candidates in order, enough to rank a faster
    last candidate behind; two rounds add 2.5 to each (0 + 5, 1 + 4, 2 + 3 halved). A candidate
    that cannot be captured is tried once and timed as infinite."""
    import weft.graphs as graphs

    captured = []
    own = {"a": 10.0, "b": 10.5, "c": 9.5, "bad": 0.0}

    class FakeGraph:
        def __init__(self, step, args, grads_of, accumulate, stream):
            if step == "bad":
                raise CaptureError("refused")
            self.seconds = own[step] + len(captured)
            captured.append(step)

    monkeypatch.setattr(graphs, "GraphedStep", FakeGraph)
    monkeypatch.setattr(graphs, "_replay_seconds", lambda graph, args, device, times: [graph.seconds] * times)
    x = torch.zeros(1)
    one = time_graphed(lambda c: c, ("a", "b", "c"), (x,), [], trials=2)
    assert captured == ["a", "b", "c"] and one == [10.0, 11.5, 11.5]  # c looks no faster than b
    captured.clear()
    two = time_graphed(lambda c: c, ("a", "b", "c"), (x,), [], trials=2, rounds=2)
    assert captured == ["a", "b", "c", "c", "b", "a"]
    assert two == pytest.approx([12.5, 13.0, 12.0])  # each candidate's own time + 2.5
    captured.clear()
    with pytest.warns(UserWarning, match="bad timed as infinite") as warned:
        seconds = time_graphed(lambda c: c, ("a", "bad"), (x,), [], trials=1, rounds=3)
    assert captured == ["a", "a", "a"] and len(warned) == 1 and math.isinf(seconds[1])
    with pytest.raises(ValueError, match="rounds"):
        time_graphed(lambda c: c, ("a",), (x,), [], rounds=0)
