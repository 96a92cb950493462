"""`OverlappedReduce`: the replicated gradients summed over the data-parallel ranks, and the
expert gradients over their expert-data-parallel replicas, during the backward, bucket by bucket
(DDP's overlap), with the sums of `reduce_gradients`; on gloo ranks."""
from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist

from weft import MoE
from weft.distributed import build_moe_groups, own_group
from weft.models.gpt import GPT, GPTConfig
from weft.moe import grads
from weft.moe.grads import OverlappedReduce, expert_parameters, overlapped_reduce, reduce_gradients
from weft.testing import Checks, run_checks
from weft.train.optim import MasterPlan, MasterWeights, low_precision_parameters

CONFIG = GPTConfig(block_size=16, n_layer=2, n_head=2, dim=32, moe_every=1, num_experts=4, top_k=2,
                   moe_hidden_dim=32, capacity_factor=None)
BUCKET_MB = 0.004  # ~1k floats: the small model's replicated gradients fill several buckets


@contextlib.contextmanager
def bucket_launches(seen: Callable[[object], None]) -> Iterator[Callable]:
    """`OverlappedReduce`'s all-reduces watched for the block: each asynchronous one (a bucket
    sent) calls `seen(its group)`. Yields the real all-reduce."""
    real = grads.dist.all_reduce

    def watched(tensor, *args, **kwargs):
        if kwargs.get("async_op"):
            seen(kwargs.get("group"))
        return real(tensor, *args, **kwargs)

    grads.dist.all_reduce = watched
    try:
        yield real
    finally:
        grads.dist.all_reduce = real


def backward(model: GPT, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x, y = (torch.randint(0, 256, (2, 16), generator=gen) for _ in range(2))
    model(x, y)[1].backward()


def reference_grads(model: GPT, groups, steps: list[int]) -> dict[str, torch.Tensor]:
    """The gradients `reduce_gradients` leaves after backwards of `steps` (accumulated)."""
    model.zero_grad(set_to_none=True)
    for step in steps:
        backward(model, step)
    reduce_gradients(model, groups)
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def overlapped_grads(model: GPT, groups, reducer: OverlappedReduce, steps: list[int], events: list[str]):
    """The gradients after backwards of `steps` in one armed window, `finish()` and
    `reduce_gradients(..., reducer)`; `events` gets "backward done" between them and the launches."""
    model.zero_grad(set_to_none=True)
    with reducer.armed():
        for step in steps:
            backward(model, step)
    events.append("backward done")
    reducer.finish()
    reduce_gradients(model, groups, reducer)
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def equal_or_close(got: dict, want: dict, exact: bool, atol_of_max: float = 0.0) -> list[str]:
    """Names whose gradients differ: bitwise (`exact`), else to float32 rounding (an atol of 1e-9,
    or `atol_of_max` times the tensor's largest magnitude: sums of several micro-batches in
    another order of summation)."""
    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.allclose(a, b, rtol=1e-6, atol=max(1e-9, atol_of_max * b.abs().max().item()))
    wrong = [n for n in want if n not in got or not (torch.equal(got[n], want[n]) if exact else close(got[n], want[n]))]
    return wrong + [n for n in got if n not in want]


def overlapped_reduce_worker(ep_size: int | None) -> list[str]:
    """From the second armed backward on, every bucket but each group's last is sent before the
    backward returns (the first backward only records the order: all sent at `finish`), and the
    gradients equal `reduce_gradients`' (bitwise on 2 ranks, to float32 rounding on more); with
    `ep_size` below the world the expert gradients are the reducer's too, sent over their
    replicas; after `forget()` the next armed backward records the order again (sends nothing
    during it) and the one after sends again; an unarmed backward sends nothing; two backwards
    in one armed window (a gradient finished again after its bucket was sent) give the
    accumulated gradients' sums."""
    checks = Checks(f"rank {dist.get_rank()}")
    groups = build_moe_groups(ep_size)
    exact = dist.get_world_size() == 2
    torch.manual_seed(0)
    model = GPT(CONFIG, group=groups.ep)
    reducer = overlapped_reduce(model, groups, bucket_mb=BUCKET_MB)
    experts = expert_parameters(model)
    covered = [reducer.covers(p) for p in experts]
    checks.expect(all(covered) if groups.edp_size > 1 else not any(covered),
                  f"ep_size {ep_size}: the expert gradients covered {covered}")
    checks.expect(all(reducer.covers(p) for p in model.parameters() if all(p is not e for e in experts)),
                  "a replicated parameter is not covered")
    parts = 2 if groups.edp_size > 1 else 1
    events: list[str] = []
    with bucket_launches(lambda group: events.append(("launch", group))):
        for step in (1, 2, 3):
            want = reference_grads(model, groups, [step])
            events.clear()
            got = overlapped_grads(model, groups, reducer, [step], events)
            wrong = equal_or_close(got, want, exact)
            checks.expect(not wrong, f"armed backward {step}: gradients differ from reduce_gradients' at {wrong}")
            during = events.index("backward done")
            buckets = len(events) - 1
            groups_used = len({group for _, group in events[:during] + events[during + 1:]})
            checks.expect(buckets > 2 * parts, f"backward {step}: {buckets} buckets (the test wants several)")
            checks.expect(groups_used == parts, f"backward {step}: buckets sent over {groups_used} groups, not {parts}")
            if step == 1:
                checks.expect(during == 0, f"the first backward sent {during} buckets before it returned")
            else:
                checks.expect(during >= buckets - parts,
                              f"backward {step}: {during} of {buckets} buckets sent during it")
        reducer.forget()  # the next armed backward records the order again: nothing sent during it
        for step, first in ((7, True), (8, False)):
            want = reference_grads(model, groups, [step])
            events.clear()
            got = overlapped_grads(model, groups, reducer, [step], events)
            wrong = equal_or_close(got, want, exact)
            checks.expect(not wrong, f"after forget, backward {step}: gradients differ at {wrong}")
            during, buckets = events.index("backward done"), len(events) - 1
            checks.expect(during == 0 if first else during >= buckets - parts,
                          f"after forget, backward {step}: {during} of {buckets} buckets sent during it")
        events.clear()
        backward(model, 4)
        checks.expect(events == [], f"an unarmed backward launched {events}")
        model.zero_grad(set_to_none=True)
        want = reference_grads(model, groups, [5, 6])
        got = overlapped_grads(model, groups, reducer, [5, 6], events)
        wrong = equal_or_close(got, want, exact, atol_of_max=0.0 if exact else 1e-6)  # two micro-batches' sums
        checks.expect(not wrong, f"two backwards in one armed window: gradients differ at {wrong}")
    return checks.failures


@pytest.mark.parametrize("world,ep_size", [(2, None), (4, None), (2, 1), (4, 2)])
def test_overlapped_reduce_sends_buckets_during_backward_with_reduce_gradients_sums(world, ep_size):
    failures = run_checks(functools.partial(overlapped_reduce_worker, ep_size), world, timeout=300)
    assert not failures, "\n".join(failures)


def test_overlapped_reduce_refuses_bad_arguments():
    frozen, weight = torch.nn.Parameter(torch.ones(2), requires_grad=False), torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="require gradients"):
        OverlappedReduce([([frozen], None)], 1)
    with pytest.raises(ValueError, match="bucket_mb must be positive"):
        OverlappedReduce([([weight], None)], 1, bucket_mb=0)
    with pytest.raises(ValueError, match="a parameter is in two parts"):
        OverlappedReduce([([weight], None), ([weight], None)], 1)


def rank_order_worker() -> list[str]:
    """Ranks whose backwards finish the gradients in different orders still put the same
    parameters in each bucket (the group's first rank's order) and get `reduce_gradients`' sums."""
    checks = Checks(f"rank {dist.get_rank()}")
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (300, 500, 200, 700)]
    reducer = OverlappedReduce([(params, dist.group.WORLD)], dist.get_world_size(), bucket_mb=0.002)
    order = list(range(4)) if dist.get_rank() == 0 else [2, 0, 3, 1]
    for step in range(3):
        for p in params:
            p.grad = None
        gen = torch.Generator().manual_seed(10 * step + dist.get_rank())
        scales = [torch.randn(p.shape, generator=gen) for p in params]
        with reducer.armed():
            sum((params[i] * scales[i]).sum() for i in order).backward()  # autograd finishes them in order's reverse
        reducer.finish()
        reducer.write_back()
        for i, p in enumerate(params):
            want = scales[i].clone()
            dist.all_reduce(want)
            checks.expect(torch.equal(p.grad, want / dist.get_world_size()), f"step {step}: parameter {i}'s sum")
    mine = [[next(i for i, q in enumerate(params) if q is p) for p in bucket.params]
            for part in reducer._parts for bucket in part.buckets]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    checks.expect(all(b == everyone[0] for b in everyone), f"the ranks' buckets differ: {everyone}")
    checks.expect(len(mine) > 1, f"one bucket: {mine}")
    return checks.failures


def test_overlapped_reduce_buckets_follow_the_first_rank_when_the_orders_differ():
    failures = run_checks(rank_order_worker, 2, timeout=120)
    assert not failures, "\n".join(failures)


def finished_twice_worker(from_step: int) -> list[str]:
    """A parameter one rank's backward finishes twice (used by two backward calls there, once on
    the other rank): the collectives pair up and the sums are the gradients'. Finished twice in
    the recording backward (`from_step` 0), it goes in a bucket every rank sends only at
    `finish`; from a later backward on (1), its bucket, sent early, is sent again at `finish` by
    every rank (the hosts agree), not by that rank alone. (Here the first call completes every
    bucket before parameter 1 finishes the second time.)"""
    checks = Checks(f"rank {dist.get_rank()}")
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (600, 700, 800, 900)]  # a bucket each
    reducer = OverlappedReduce([(params, dist.group.WORLD)], dist.get_world_size(), bucket_mb=0.002)
    launches: list[list] = []  # per step, the groups of the buckets sent
    with bucket_launches(lambda group: launches[-1].append(group)) as real:
        for step in range(4):
            launches.append([])
            for p in params:
                p.grad = None
            gen = torch.Generator().manual_seed(10 * step + dist.get_rank())
            scales = [torch.randn(p.shape, generator=gen) for p in params]
            terms = [(p * s).sum() for p, s in zip(params, scales)]
            with reducer.armed():
                if dist.get_rank() == 0 or step < from_step:
                    sum(terms).backward()
                else:
                    (terms[3] + terms[2] + terms[1] / 2).backward()
                    ((params[1] * scales[1]).sum() / 2 + terms[0]).backward()
            want = [p.grad.clone() for p in params]
            for w in want:
                real(w)
            reducer.finish()
            reducer.write_back()
            for i, (p, w) in enumerate(zip(params, want)):
                checks.expect(torch.equal(p.grad, w / dist.get_world_size()), f"step {step}: parameter {i}'s sum")
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [len(sent) for sent in launches])
    checks.expect(all(counts == everyone[0] for counts in everyone), f"the ranks' launches per step: {everyone}")
    late = [bucket.params for part in reducer._parts for bucket in part.buckets if not bucket.early]
    if from_step == 0:
        checks.expect(len(late) == 1 and len(late[0]) == 1 and late[0][0] is params[1],
                      f"the buckets sent at finish hold {[[p.numel() for p in b] for b in late]}")
    else:
        checks.expect(not late and everyone[0][1:] == [5] * 3, f"late buckets {late}, launches {everyone[0]}")
    return checks.failures


@pytest.mark.parametrize("from_step", [0, 1])
def test_a_gradient_one_rank_finishes_twice_is_sent_at_finish_by_every_rank(from_step):
    failures = run_checks(functools.partial(finished_twice_worker, from_step), 2, timeout=120)
    assert not failures, "\n".join(failures)


def accumulated(model: GPT, groups, masters, steps: list[int], reducer: OverlappedReduce | None,
                events: list) -> dict[str, torch.Tensor]:
    """The gradients the optimizer would read after the micro-batches `steps` of one step, each
    staged into `masters`' float32 accumulators as `weft train` does: summed after the backward
    (`reducer` None) or by `reducer` armed for the last micro-batch's backward alone (with
    several, its `earlier`: the accumulators, unfilled ones zeroed first), whose weights are then
    not staged again; `events` gets "backward done" after each micro-batch's backward."""
    for i, step in enumerate(steps):
        last = reducer is not None and i == len(steps) - 1
        if last and len(steps) > 1:
            masters.zero_unfilled()
        with reducer.armed() if last else contextlib.nullcontext():
            backward(model, step)
        events.append("backward done")
        if last:
            reducer.finish()
        masters.stage_gradients(reducer.covers if last else None)
    with masters.float32_gradients():
        reduce_gradients(model, groups, reducer)
        out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def accumulated_steps_worker(ep_size: int | None) -> list[str]:
    """Several micro-batches per step (`--grad-accum`): only the last one's backward is armed, its
    buckets add the earlier micro-batches' sums (`earlier`: `MasterWeights`' float32
    accumulators of the staged weights; the other parameters accumulate in `.grad`), and the
    gradients equal those of staging every micro-batch and summing after the backward (bitwise
    on 2 ranks). The armed backward's weights are not staged again (`stage_gradients(summed)`).
    The earlier micro-batches' backwards send nothing; the last one's sends its buckets during
    it."""
    checks = Checks(f"rank {dist.get_rank()}")
    groups = build_moe_groups(ep_size)
    exact = dist.get_world_size() == 2
    torch.manual_seed(0)
    model = GPT(CONFIG, group=groups.ep)
    plan = low_precision_parameters(model, groups, grad_accum=2)
    checks.expect(len(plan.staged) > 0 and not plan.direct, f"plan: {len(plan.direct)} direct, {len(plan.staged)}")
    masters = MasterWeights(plan, dtype=torch.float32)  # float32 storage: the CPU has no autocast
    reducer = overlapped_reduce(model, groups, bucket_mb=BUCKET_MB, earlier=masters.accumulators())
    launches: list = []
    with bucket_launches(lambda group: launches.append("launch")):
        for first, steps in enumerate(([1, 2], [3, 4, 5], [6, 7])):
            want = accumulated(model, groups, masters, steps, None, [])
            launches.clear()
            got = accumulated(model, groups, masters, steps, reducer, launches)
            wrong = equal_or_close(got, want, exact, atol_of_max=1e-6)
            checks.expect(not wrong, f"micro-batches {steps}: gradients differ from the staged sums at {wrong}")
            done = [i for i, e in enumerate(launches) if e == "backward done"]
            checks.expect(done[:-1] == list(range(len(steps) - 1)), f"{steps}: an unarmed backward sent {launches}")
            sent_during = done[-1] - done[-2] - 1
            total = len(launches) - len(steps)
            checks.expect(total > 2 and (first == 0 and sent_during == 0 or first > 0 and sent_during >= total - 2),
                          f"{steps}: {sent_during} of {total} buckets sent during the last backward")
    return checks.failures


@pytest.mark.parametrize("world,ep_size", [(2, None), (4, None), (2, 1), (4, 2)])
def test_the_last_micro_batch_sends_the_sum_of_the_step(world, ep_size):
    failures = run_checks(functools.partial(accumulated_steps_worker, ep_size), world, timeout=300)
    assert not failures, "\n".join(failures)


def adopted_worker(ep_size: int | None, several: bool) -> list[str]:
    """`adopt=MasterWeights.adopt`: once the buckets are built every staged weight the reducer
    covers keeps its float32 accumulator in its bucket slot (the same storage), the others keep
    their own; the gradients the optimizer reads equal those of staging and summing after the
    backward (bitwise on 2 ranks), for several steps and after `forget()` (new buckets, adopted
    again). With `several` micro-batches a step (`earlier` too) the slots hold the earlier
    micro-batches' sum and add the last one's gradient, the reducer keeps no reference to the old
    accumulators (their memory is freed), and a bucket whose gradient changed after it was sent
    cannot be sent again (an error, on every rank)."""
    checks = Checks(f"rank {dist.get_rank()}")
    groups = build_moe_groups(ep_size)
    exact = dist.get_world_size() == 2
    torch.manual_seed(0)
    model = GPT(CONFIG, group=groups.ep)
    masters = MasterWeights(low_precision_parameters(model, groups, grad_accum=2 if several else 1),
                            dtype=torch.float32)
    reducer = overlapped_reduce(model, groups, bucket_mb=BUCKET_MB, earlier=masters.accumulators() if several else None,
                                adopt=masters.adopt)
    staged = [p for p in model.parameters() if id(p) in masters.accumulators()]
    checks.expect(any(reducer.covers(p) for p in staged), "no staged weight is covered")
    schedule = ([1, 2], [3, 4, 5], None, [6, 7], [8, 9]) if several else ([1], [2], [3], None, [4], [5])
    for steps in schedule:
        if steps is None:
            reducer.forget()
            continue
        want = accumulated(model, groups, masters, steps, None, [])
        got = accumulated(model, groups, masters, steps, reducer, [])
        # several micro-batches sum in another order on more ranks; one micro-batch to float32 rounding
        wrong = equal_or_close(got, want, exact, atol_of_max=1e-6 if several else 0.0)
        checks.expect(not wrong, f"micro-batches {steps}: gradients differ from the staged sums at {wrong}")
        misplaced = misplaced_accumulators(reducer, masters, staged)
        checks.expect(not misplaced, f"{steps}: {misplaced} staged weights not where they belong")
        kept = sum(id(p) in part.earlier for part in reducer._parts for p in staged if reducer.covers(p))
        checks.expect(kept == 0, f"{steps}: the reducer still refers to {kept} old accumulators")
    if several:
        masters.zero_unfilled()
        with reducer.armed():
            backward(model, 10)
        # as a gradient finished again after the launch would
        next(b for part in reducer._parts for b in part.buckets if b.accumulating).stale = True
        with pytest.raises(RuntimeError, match="cannot be sent again"):
            reducer.finish()
    return checks.failures


@pytest.mark.parametrize("several", [False, True], ids=["one micro-batch", "several"])
@pytest.mark.parametrize("world,ep_size", [(2, None), (4, None), (2, 1), (4, 2)])
def test_the_buckets_hold_the_adopted_accumulators(world, ep_size, several):
    failures = run_checks(functools.partial(adopted_worker, ep_size, several), world, timeout=300)
    assert not failures, "\n".join(failures)


def misplaced_accumulators(reducer: OverlappedReduce, masters: MasterWeights, staged: list) -> int:
    """How many staged weights keep their float32 accumulator elsewhere than their bucket slot
    (covered by the reducer) or in a slot (not covered)."""
    slots = {id(p): slot for part in reducer._parts for b in part.buckets for p, slot in zip(b.params, b.slots)}
    held = {id(p): masters.accumulators()[id(p)].data_ptr() for p in staged}
    return sum(not (held[id(p)] == slots[id(p)].data_ptr() if reducer.covers(p) else
                    held[id(p)] not in {slot.data_ptr() for slot in slots.values()}) for p in staged)


def unfilled_worker() -> list[str]:
    """A staged weight without a gradient in the step's earlier micro-batches: its accumulator
    still holds the last step's sum, which `zero_unfilled` clears before the armed backward adds
    it; the sums are the staged ones, and a weight with no gradient in the whole step keeps none."""
    checks = Checks(f"rank {dist.get_rank()}")
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (300, 500, 200, 400)]
    masters = MasterWeights(MasterPlan([], params[:2] + params[3:]), dtype=torch.float32)
    reducer = OverlappedReduce([(params, dist.group.WORLD)], dist.get_world_size(), bucket_mb=0.002,
                               earlier=masters.accumulators())
    for step in range(3):
        gen = torch.Generator().manual_seed(10 * step + dist.get_rank())
        scales = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(2)]
        used = [[0, 2], [0, 1, 2]]  # parameter 1 only in the last micro-batch; 3 in none
        results = []
        for armed in (False, True):
            for micro in range(2):
                last = armed and micro == 1
                if last:
                    masters.zero_unfilled()
                with reducer.armed() if last else contextlib.nullcontext():
                    sum((params[i] * scales[micro][i]).sum() for i in used[micro]).backward()
                if last:
                    reducer.finish()
                masters.stage_gradients(reducer.covers if last else None)
            with masters.float32_gradients():
                if armed:
                    reducer.write_back()
                else:
                    for p in params:
                        if p.grad is not None:
                            dist.all_reduce(p.grad)
                            p.grad /= dist.get_world_size()
                results.append([None if p.grad is None else p.grad.clone() for p in params])
            for p in params:
                p.grad = None
        for i, (want, got) in enumerate(zip(*results)):
            same = got is None if want is None else got is not None and torch.equal(got, want)
            checks.expect(same, f"step {step}: parameter {i}: {got} against {want}")
        checks.expect(results[1][3] is None, f"step {step}: parameter 3 got a gradient")
    return checks.failures


def test_a_weight_without_earlier_gradients_adds_zeros():
    failures = run_checks(unfilled_worker, 2, timeout=120)
    assert not failures, "\n".join(failures)


def micro_steps_worker() -> list[str]:
    """`build_micro_step` with two micro-batches per step and a reducer: the first micro-batch's
    step sends nothing, the last one's (`MicroSteps.of`) sends the step's sums during its
    backward, and the gradients are `reduce_gradients`' of both micro-batches."""
    from weft.train.step import build_micro_step

    checks = Checks(f"rank {dist.get_rank()}")
    groups = build_moe_groups(None)
    torch.manual_seed(0)
    model = GPT(CONFIG, group=groups.ep)
    reducer = overlapped_reduce(model, groups, bucket_mb=BUCKET_MB)
    gen = torch.Generator().manual_seed(dist.get_rank())
    batches = [tuple(torch.randint(0, 256, (2, 16), generator=gen) for _ in range(2)) for _ in range(2)]
    steps = build_micro_step(model, 2, "off", batches[0], reducer=reducer)
    checks.expect(steps.of(0, 2) is steps.run and steps.of(1, 2) is steps.last and steps.last is not None,
                  "the last micro-batch's step is not its own")
    launches: list[list] = []  # per micro-batch, the groups of the buckets sent
    with bucket_launches(lambda group: launches[-1].append(group)):
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            for micro, (x, y) in enumerate(batches):
                launches.append([])
                steps.of(micro, 2)(x, y)
            reduce_gradients(model, groups, steps.reduced)
            got = {n: p.grad.clone() for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
            for x, y in batches:
                (model(x, y)[1] / 2).backward()
            reduce_gradients(model, groups)
            wrong = equal_or_close(got, {n: p.grad for n, p in model.named_parameters()}, exact=True)
            checks.expect(not wrong, f"the gradients differ from reduce_gradients' at {wrong}")
    sent = [len(groups_sent) for groups_sent in launches]
    checks.expect(sent[0] == sent[2] == 0 and sent[1] > 2 and sent[3] == sent[1],
                  f"buckets sent per micro-batch: {sent}")
    return checks.failures


def test_the_training_micro_steps_arm_only_the_last_micro_batch():
    failures = run_checks(micro_steps_worker, 2, timeout=120)
    assert not failures, "\n".join(failures)


def train_step_worker(grad_accum: int) -> list[str]:
    """`weft train`'s own step (`weft.train.loop._train_step`) with master weights (float32
    storage: the CPU has no autocast) and the reducer `gradient_reducer` builds for
    `--grad-reduce overlap`, whose buckets adopt the staged accumulators (checked), the experts
    replicated on both ranks (`--ep-size 1`): three
    AdamW steps with the sums beside the backward (the last micro-batch's; its weights not
    staged again) leave the weights, the masters and the gradient norms of the same steps summed
    after the backward, bitwise."""
    import numpy as np

    from weft.train.config import TrainConfig
    from weft.train.data import BatchSampler
    from weft.train.loop import _train_step, gradient_reducer
    from weft.train.optim import MasterAdamW, decay_groups
    from weft.train.step import build_micro_step

    checks = Checks(f"rank {dist.get_rank()}")
    groups = build_moe_groups(1)
    data = np.random.RandomState(0).randint(0, 256, 20000).astype(np.int64)
    batches = BatchSampler(data, 2, CONFIG.block_size, dist.get_rank(), dist.get_world_size(), seed=3)
    cfg = TrainConfig(grad_accum=grad_accum, batch_size=2, grad_reduce="overlap")
    out = {}
    for mode in ("after", "overlap"):
        torch.manual_seed(0)
        model = GPT(CONFIG, group=groups.ep)
        masters = MasterWeights(low_precision_parameters(model, groups, grad_accum), dtype=torch.float32)
        optimizer = MasterAdamW(decay_groups(model, 0.1), masters, lr=1e-3)
        reducer = gradient_reducer(model, cfg, groups, torch.device("cpu"), lambda line: None,
                                   masters) if mode == "overlap" else None
        steps = build_micro_step(model, grad_accum, "off", batches.get(0, 0), reducer=reducer)
        pending, norms = None, []
        for step in range(1, 5):
            finished, pending = _train_step(model, optimizer, batches, step, cfg, groups, torch.device("cpu"), steps,
                                            masters, 1e-3, pending)
            norms += [finished["grad_norm"]] if finished is not None else []
        if reducer is not None:
            staged = [p for p in model.parameters() if id(p) in masters.accumulators()]
            checks.expect(any(reducer.covers(p) for p in staged), "no staged weight is summed in the buckets")
            misplaced = misplaced_accumulators(reducer, masters, staged)
            checks.expect(not misplaced, f"{misplaced} staged accumulators are not their bucket slots")
        weights = [p.detach().clone() for p in model.parameters()]
        out[mode] = (weights, [masters.master(p).clone() for p in model.parameters() if masters.master(p) is not None],
                     norms)
    (w_after, m_after, n_after), (w_over, m_over, n_over) = out["after"], out["overlap"]
    checks.expect(len(m_after) > 0 and len(n_after) == 3, f"{len(m_after)} masters, norms {n_after}")
    checks.expect(n_over == n_after, f"gradient norms {n_over} against {n_after}")
    checks.expect(all(torch.equal(a, b) for a, b in zip(w_over, w_after)), "the weights differ")
    checks.expect(all(torch.equal(a, b) for a, b in zip(m_over, m_after)), "the masters differ")
    return checks.failures


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_the_training_step_with_master_weights_sums_as_after_the_backward(grad_accum):
    failures = run_checks(functools.partial(train_step_worker, grad_accum), 2, timeout=180)
    assert not failures, "\n".join(failures)


def mean_worker(device: str = "cpu") -> list[str]:
    """`mean_reduction`'s op and the division it leaves give each rank's sum divided by the
    divisor, the same bits as the sum divided after it (the divisors are powers of two, whose
    products are exact), on every rank and in a group of the ranks' own (`own_group`), float32
    and bf16 (whose sum is divided after it everywhere); on GPUs (NCCL, float32: each value
    multiplied by 1 / divisor inside the all-reduce, nothing left to divide) also captured in a
    CUDA graph and replayed on new values."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device(f"cuda:{torch.cuda.current_device()}" if device == "cuda" else "cpu")
    checks = Checks(f"rank {rank} of {world}")
    own = own_group(None)
    for (divisor, dtype), group in itertools.product(
            itertools.product((1, 2, 4), (torch.float32, torch.bfloat16)), (dist.group.WORLD, own)):
        op, left = grads.mean_reduction(group, divisor, dev, dtype)
        inside = dev.type == "cuda" and dtype == torch.float32 and divisor > 1
        checks.expect(left == (1 if inside else divisor), f"divisor {divisor}, {dtype}: {left} left to divide")
        parts = [torch.randn(1000, generator=torch.Generator().manual_seed(10 * divisor + r)).to(dev, dtype)
                 for r in range(world)]
        expected = (parts[0].float() + parts[1].float()).to(dtype) / divisor if world == 2 else None
        mine = parts[rank].clone()
        dist.all_reduce(mine, op=op, group=group)
        if left != 1:
            mine.div_(left)
        plain = parts[rank].clone()
        dist.all_reduce(plain, group=group)
        plain.div_(divisor)
        checks.expect(torch.equal(mine, plain), f"divisor {divisor}, {dtype}: not the sum divided after it")
        if expected is not None:
            checks.expect(torch.equal(mine, expected), f"divisor {divisor}, {dtype}: not the two ranks' sum divided")
        if inside and group is dist.group.WORLD:  # the op's scalar kept by a captured graph
            flat = torch.zeros(1000, device=dev, dtype=dtype)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # NCCL's first call on a stream, outside the capture
                dist.all_reduce(flat, op=op)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                dist.all_reduce(flat, op=op)
            for replay in range(2):
                flat.copy_(parts[rank] * (replay + 1))
                graph.replay()
                torch.cuda.synchronize()
                checks.expect(torch.equal(flat, plain * (replay + 1)), f"divisor {divisor}: replay {replay} differs")
    return checks.failures


@pytest.mark.parametrize("world", [2, 4])
def test_the_mean_reduction_divides_like_a_sum_divided_after_it(world):
    """On gloo (CPU): the plain sum, the whole divisor left to divide (`mean_reduction`)."""
    failures = run_checks(mean_worker, world, timeout=120)
    assert not failures, "\n".join(failures[:10])


class Branchy(torch.nn.Module):
    """Replicated weights: `used` takes part on every rank, `skipped` on rank 0 only (a branch the
    other ranks skip), `unused` on none."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.used, self.skipped, self.unused = (torch.nn.Parameter(torch.randn(8, generator=gen)) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        loss = (x * self.used).sum()
        if dist.get_rank() == 0:
            loss = loss + (x * self.skipped).square().sum()
        return loss


def branchy_means(model: Branchy, x0: torch.Tensor, world: int) -> dict[str, torch.Tensor]:
    """What `reduce_gradients` leaves on every rank when rank r's input is x0 + r: the ranks' mean
    for `used`, rank 0's gradient over the world for `skipped` (zeros elsewhere)."""
    return {"used": sum(x0 + r for r in range(world)) / world, "skipped": 2 * x0 * x0 * model.skipped.detach() / world}


def check_branchy_means(checks: Checks, model: Branchy, want: dict[str, torch.Tensor], label: str) -> None:
    """The means `branchy_means` says on `used` and `skipped`, and still no gradient on `unused`."""
    for name, value in want.items():
        grad = getattr(model, name).grad
        checks.expect(grad is not None and torch.allclose(grad, value, rtol=1e-6, atol=0),
                      f"{label}: {name}'s gradient {grad}, expected the ranks' mean {value}")
    checks.expect(model.unused.grad is None, f"{label}: a weight without a gradient anywhere got one")


def some_ranks_worker(overlapped: bool, device: str = "cpu") -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    checks = Checks(f"rank {rank}")
    model = Branchy().to(device)
    groups = build_moe_groups(ep_size=None)
    reducer = overlapped_reduce(model, groups, bucket_mb=BUCKET_MB) if overlapped else None
    x0 = torch.arange(8.0, device=device)
    want = branchy_means(model, x0, world)
    for step in range(3):  # the first armed backward builds the buckets
        model.zero_grad(set_to_none=True)
        with reducer.armed() if reducer else contextlib.nullcontext():
            model(x0 + rank).backward()
        if reducer:
            reducer.finish()
        reduce_gradients(model, groups, reducer)
        check_branchy_means(checks, model, want, f"step {step}")
    return checks.failures


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("overlapped", [False, True], ids=["after", "overlapped"])
def test_a_gradient_some_ranks_lack_counts_as_zeros_there(world, overlapped):
    """A replicated weight with a gradient on rank 0 only: every rank ends with the mean (rank 0's
    gradient over the world), where the ranks' buckets used to differ (the sum after the backward
    aborted in gloo or hung, or on NCCL could mix one weight's values with another's; the
    overlapped one left the other ranks without a gradient, so their weights drifted from rank
    0's); a weight unused everywhere keeps None."""
    failures = run_checks(functools.partial(some_ranks_worker, overlapped), world, timeout=120)
    assert not failures, "\n".join(failures[:10])


def rank_zero_worker(ep_size: int | None, tp_size: int) -> list[str]:
    """A MoE layer's gradients set on rank 0 only (its router's and its experts'), then
    `reduce_gradients`; against the same with every other rank's gradients zeros, which the old
    code summed fine: equal where a group had a gradient, None only where the reference is zeros
    (no rank of the groups it is summed over had one)."""
    rank = dist.get_rank()
    checks = Checks(f"rank {rank}")
    groups = build_moe_groups(ep_size=ep_size, tp_size=tp_size, experts=True)
    layer = MoE(8, 16, num_experts=4, top_k=2, group=groups.ep)
    params = dict(layer.named_parameters())
    assert expert_parameters(layer) and grads.token_split_parameters(layer)

    def set_grads(others_zero: bool) -> None:
        for i, p in enumerate(params.values()):
            value = torch.full_like(p, float(i + 1)) if rank == 0 else torch.zeros_like(p)
            p.grad = value if rank == 0 or others_zero else None

    set_grads(others_zero=True)
    reduce_gradients(layer, groups)
    want = {n: p.grad.clone() for n, p in params.items()}
    set_grads(others_zero=False)
    reduce_gradients(layer, groups)
    for n, p in params.items():
        if p.grad is None:
            checks.expect(not want[n].any(), f"{n}: no gradient, where the ranks' sum is {want[n].flatten()[:3]}")
        else:
            checks.expect(torch.equal(p.grad, want[n]),
                          f"{n}: {p.grad.flatten()[:3]}, expected {want[n].flatten()[:3]}")
    return checks.failures


@pytest.mark.parametrize("world,ep_size,tp_size", [(2, None, 1), (4, 2, 1), (2, None, 2), (4, None, 2)])
def test_a_layers_gradients_on_one_rank_only_are_summed_as_with_zeros_elsewhere(world, ep_size, tp_size):
    """The expert gradients (over expert-data-parallel replicas: 4 ranks, EP 2) and, under tensor
    parallelism, the routers' (over the TP group, then the data-parallel one) agree as the
    replicated ones do: a rank without a gradient sums zeros."""
    failures = run_checks(functools.partial(rank_zero_worker, ep_size, tp_size), world, timeout=120)
    assert not failures, "\n".join(failures[:10])
