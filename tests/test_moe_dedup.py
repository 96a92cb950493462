"""a2a_algo="dedup" (weft.moe.dedup): each token crosses to a rank once. Its function is proven
against the dense reference in tests/test_moe_equivalence.py; here: the bytes it sends, the
plain layer's outputs and gradients over training steps, what it refuses, and `weft train`."""
from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from test_train import SMALL_MODEL, config, eager_timer, losses, write_corpus
from weft import MoE
from weft.bench import layer, model
from weft.bench.layer import LayerBenchConfig
from weft.bench.model import ModelBenchConfig
from weft.comm import async_all_to_all
from weft.graphs import live_gradient_accumulators
from weft.kernels.scan import cumsum_down
from weft.moe import dedup
from weft.moe.config import MoECall
from weft.moe.exchange import offers_dedup
from weft.moe.exchange.select import dedup_sends_fewer
from weft.testing import Checks, run_checks, run_distributed
from weft.train.config import TrainConfig
from weft.train.loop import train
from weft.tune import TuningDictionary

DIM, HIDDEN, EXPERTS, TOKENS = 16, 24, 8, 32


def recorded_rows(moe: MoE, x: torch.Tensor) -> list[int]:
    """Forward and backward of `moe` on x, returning the rows each DIM-wide float all-to-all sent."""
    sent, exchange = [], dist.all_to_all_single

    def recording(out, inp, *args, **kwargs):
        if inp.is_floating_point() and inp.dim() == 2 and inp.shape[1] == DIM:
            sent.append(inp.shape[0])
        return exchange(out, inp, *args, **kwargs)

    dist.all_to_all_single = recording
    try:
        moe(x.requires_grad_()).sum().backward()
    finally:
        dist.all_to_all_single = exchange
    return sent


class _Ops(TorchDispatchMode):
    """The names of the aten ops run under it."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, torch.int64])
def test_cumsum_down_is_the_scan_down_dim_0(dtype):
    """The pair offsets' (and the routing histogram's) scan, run along the transpose's rows."""
    x = torch.randint(0, 2 if dtype == torch.bool else 9, (37, 3)).to(dtype)
    got = cumsum_down(x, torch.int64)
    assert got.is_contiguous() and torch.equal(got, x.cumsum(0, dtype=torch.int64))


@pytest.mark.parametrize("cf", [None, 0.5])
def test_pairs_compute_offsets_and_earlier_slots_only_when_read(cf):
    """A dropless call tuned to the linear exchange reads only the pair counts: no scan, no slot
    comparison; the offsets and earlier-slot counts, read later, are those the rule defines."""
    torch.manual_seed(0)
    world, top_k = 2, 3
    moe = MoE(DIM, HIDDEN, EXPERTS, top_k=top_k, capacity_factor=cf)
    routing = moe.route(torch.randn(TOKENS, DIM))
    with _Ops() as ops:
        pairs = dedup.Pairs.of(routing, TOKENS, top_k, EXPERTS // world, world)
        counts = pairs.counts()
    assert "cumsum" not in ops.names and "eq" not in ops.names, ops.names
    need = [[bool(pairs.need_TW[t, r]) for r in range(world)] for t in range(TOKENS)]
    assert counts.tolist() == [sum(row[r] for row in need) for r in range(world)]
    for r in range(world):
        seen = 0
        for t in range(TOKENS):
            if need[t][r]:
                assert int(pairs.offset_TW[t, r]) == seen
                seen += 1
    ranks = pairs.rank_TK.tolist()
    want = [[sum(ranks[t][i] == ranks[t][j] for i in range(j)) for j in range(top_k)] for t in range(TOKENS)]
    assert pairs.earlier_TK.tolist() == want


def bytes_worker(top_k: int) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    checks = Checks(f"rank {rank} k={top_k}")
    local = EXPERTS // world
    for cf in (None, 1.0):
        torch.manual_seed(0)
        plain = MoE(DIM, HIDDEN, EXPERTS, top_k=top_k, capacity_factor=cf)
        dedup = MoE(DIM, HIDDEN, EXPERTS, top_k=top_k, capacity_factor=cf, a2a_algo="dedup")
        dedup.load_state_dict(plain.state_dict())
        x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(rank))
        plain_rows, dedup_rows = recorded_rows(plain, x.clone()), recorded_rows(dedup, x.clone())
        experts_TK = torch.topk(plain.router(x), top_k).indices
        pairs = len({(t, int(e) // local) for t in range(TOKENS) for e in experts_TK[t]})
        capacity = plain.stats.capacity
        if cf is None:  # exactly the pairs: this rank's out (forward dispatch, backward of the return),
            # and the others' pairs for it back (forward return, backward of the dispatch)
            totals = torch.tensor([pairs, dedup_rows[1], dedup_rows[3]])
            dist.all_reduce(totals)
            checks.expect(plain_rows[0::2] == [TOKENS * top_k] * 2, f"dropless plain rows {plain_rows}")
            checks.expect(dedup_rows[0::2] == [pairs] * 2, f"dropless dedup rows {dedup_rows}, {pairs} pairs")
            checks.expect(totals.tolist() == [int(totals[0])] * 3, f"pairs sent vs received over the ranks {totals}")
            checks.expect(pairs < TOKENS * top_k, f"the case has no repeated rank: {pairs} pairs")
        else:  # a fixed block per destination: min(T, local experts * C)
            block = min(TOKENS, local * capacity)
            checks.expect(plain_rows == [EXPERTS * capacity] * 4, f"padded plain rows {plain_rows}")
            checks.expect(dedup_rows == [world * block] * 4, f"padded dedup rows {dedup_rows}, block {block}")
    return checks.failures


@pytest.mark.parametrize("world_size", [2, 4])
def test_dedup_sends_each_token_to_a_rank_once(world_size):
    failures = run_checks(bytes_worker, world_size, args=(4,), timeout=300)
    assert not failures, "\n".join(failures)


def close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, scaled: bool) -> bool:
    """Equal to float rounding: `rtol` per element and an absolute 1e-6; `scaled`, 1e-6 of the
    tensor's largest magnitude instead (overlap_degree=2 sums its experts' weight gradients in two
    parts, which rounds differently)."""
    scale = max(1.0, float(expected.abs().max())) if scaled else 1.0
    return torch.allclose(expected, actual, rtol=rtol, atol=1e-6 * scale)  # as the test always compared


def training_worker(cf, degree: int = 1, algo: str = "dedup", exact: bool = False) -> list[str]:
    """Three SGD steps of a plain layer and a dedup twin (`degree` 2: its own pairs computed
    last; `algo` "dedup-fixed": dropless in fixed-size exchanges): the same outputs, gradients,
    drops (`exact`: bit for bit)."""
    rank = dist.get_rank()
    checks = Checks(f"rank {rank} cf={cf} d{degree} {algo}")
    torch.manual_seed(0)
    plain = MoE(DIM, HIDDEN, EXPERTS, top_k=2, capacity_factor=cf, activation="swiglu")
    dedup = MoE(DIM, HIDDEN, EXPERTS, top_k=2, capacity_factor=cf, activation="swiglu", a2a_algo=algo,
                overlap_degree=degree)
    dedup.load_state_dict(plain.state_dict())
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, dedup)]
    for step in range(3):
        x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(10 * step + rank))
        outs = []
        for moe, opt in zip((plain, dedup), optimizers):
            opt.zero_grad()
            xi = x.clone().requires_grad_()
            y = moe(xi)
            (y.square().sum() + moe.aux_loss).backward()
            outs.append((y.detach(), xi.grad, {n: p.grad.clone() for n, p in moe.named_parameters()},
                         int(moe.stats.dropped)))
            opt.step()
        (y0, dx0, g0, d0), (y1, dx1, g1, d1) = outs
        checks.expect(d0 == d1, f"step {step}: dropped {d0} vs {d1}")
        scaled = degree == 2
        same = (lambda a, b, rtol: torch.equal(a, b)) if exact else (lambda a, b, rtol: close(a, b, rtol, scaled))
        checks.expect(same(y1, y0, 1e-5), f"step {step}: outputs differ")
        checks.expect(same(dx1, dx0, 1e-5), f"step {step}: input gradients differ")
        for name in g0:
            checks.expect(same(g1[name], g0[name], 1e-4), f"step {step}: grad {name}")
    return checks.failures


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("cf, degree, algo", [(1.0, 1, "dedup"), (None, 1, "dedup"), (1.0, 2, "dedup"),
                                              (None, 1, "dedup-fixed")])
def test_dedup_trains_like_the_plain_layer(world_size, cf, degree, algo):
    failures = run_checks(training_worker, world_size, args=(cf, degree, algo), timeout=300)
    assert not failures, "\n".join(failures)


def test_dedup_in_fixed_size_exchanges_is_the_plain_layer_bit_for_bit_on_the_cpu():
    """dedup-fixed's experts take their rows in the plain layer's order (expert, source, slot
    position), so on the CPU three dropless SGD steps on 4 ranks give the plain layer's bits."""
    failures = run_checks(training_worker, 4, args=(None, 1, "dedup-fixed", True), timeout=300)
    assert not failures, "\n".join(failures)


def order_worker() -> list[str]:
    """overlap_degree=2 with dedup overlaps as it says, forward and backward: the experts compute
    the own pairs after the dispatch exchange starts and before it is waited for, the others'
    pairs after it, and in backward the own pairs' gradient is computed between the launch of
    the received rows' gradient exchange and its wait (autograd's order, which the docstring
    relies on)."""
    rank = dist.get_rank()
    checks = Checks(f"rank {rank}")
    events, real_blocks, real_launch = [], dedup._experts_on_blocks, async_all_to_all._launch

    def blocks(received_PD, records, gates, *args):
        own = "wait forward" not in events  # the own pairs while the others' rows travel, then theirs
        events.append("own forward" if own else "others forward")
        if own:
            received_PD.register_hook(lambda grad: events.append("own backward"))
        return real_blocks(received_PD, records, gates, *args)

    class Work:
        def __init__(self, work, name):
            self.work, self.name = work, name

        def wait(self):
            events.append(f"wait {self.name}")
            self.work.wait()

    def launch(x, group, out_splits, in_splits):
        name = "backward" if "launch forward" in events else "forward"
        events.append(f"launch {name}")
        out, work = real_launch(x, group, out_splits, in_splits)
        return out, Work(work, name)

    dedup._experts_on_blocks, async_all_to_all._launch = blocks, launch
    try:
        torch.manual_seed(0)
        moe = MoE(DIM, HIDDEN, EXPERTS, top_k=4, capacity_factor=1.0, a2a_algo="dedup", overlap_degree=2)
        x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(rank)).requires_grad_()
        moe(x).square().sum().backward()
    finally:
        dedup._experts_on_blocks, async_all_to_all._launch = real_blocks, real_launch
    expected = ["launch forward", "own forward", "wait forward", "others forward",
                "launch backward", "own backward", "wait backward"]
    checks.expect(events == expected, f"events {events}")
    return checks.failures


def test_dedup_computes_its_own_pairs_while_the_others_rows_travel():
    failures = run_checks(order_worker, 2, timeout=300)
    assert not failures, "\n".join(failures)


@contextlib.contextmanager
def fixed_call_events() -> Iterator[list[str]]:
    """Records, in order, what fixed-size dropless calls do: exchange launches and waits, the
    chunks' expert calls, rows kept for the tap's weight gradients and the tap's gradients, and
    each expert matmul with the SM margin it ran under ("mm@16": rows times weights, "dW@16": a
    weight gradient's product)."""
    from weft.moe import experts as experts_module

    events, real_launch = [], async_all_to_all._launch
    parts_class = experts_module.GroupedWeightGradParts
    real_on, real_keep, real_grad = dedup.fixed_experts, parts_class.keep, parts_class.weight_grad
    real_rows_mm, real_weights_mm = experts_module.grouped_rows_mm, experts_module.grouped_weights_mm

    class Work:  # the exchange's handle, its wait recorded
        def __init__(self, work):
            self.work = work

        def wait(self):
            events.append("wait")
            return self.work.wait()

    def launch(x, group, out_splits, in_splits):
        events.append("launch")
        out, work = real_launch(x, group, out_splits, in_splits)
        return out, Work(work)

    def recorded(name, real):
        def run(*args):
            events.append(name)
            return real(*args)
        return run

    def with_margin(name, real):
        def run(*args):
            events.append(f"{name}@{torch._C._get_sm_carveout_experimental() or 0}")
            return real(*args)
        return run

    async_all_to_all._launch, dedup.fixed_experts = launch, recorded("experts", real_on)
    parts_class.keep, parts_class.weight_grad = recorded("kept", real_keep), recorded("weight grad", real_grad)
    experts_module.grouped_rows_mm = with_margin("mm", real_rows_mm)
    experts_module.grouped_weights_mm = with_margin("dW", real_weights_mm)
    try:
        yield events
    finally:
        async_all_to_all._launch, dedup.fixed_experts = real_launch, real_on
        parts_class.keep, parts_class.weight_grad = real_keep, real_grad
        experts_module.grouped_rows_mm, experts_module.grouped_weights_mm = real_rows_mm, real_weights_mm


def fixed_call_order(**settings) -> tuple[list[str], list[str]]:
    """The events (`fixed_call_events`) of one dropless call's forward and of its backward."""
    with fixed_call_events() as events:
        torch.manual_seed(0)
        moe = MoE(DIM, HIDDEN, EXPERTS, top_k=4, capacity_factor=None, **settings)
        x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(dist.get_rank())).requires_grad_()
        y = moe(x)
        forward = list(events)
        y.square().sum().backward()
    return forward, events[len(forward):]


def pipelined_fixed_order_worker() -> list[str]:
    """dedup-fixed at degree 2 on a dropless call pipelines as it says: forward, both chunks' rows
    are launched before any expert work, each chunk's sums go back before the next chunk computes;
    backward, both returned gradients are launched first, then chunk 1's experts (their rows kept
    for the weight gradients), the launch of its rows' gradient, then chunk 0's experts under it,
    the launch of its rows' gradient, and only then each weight's gradient, once for both chunks
    (relu: w1 and w2), before anything waits for the rows' gradients: under those exchanges;
    every expert matmul, the weight gradients' too, leaves `OVERLAP_SM_MARGIN` SMs to the
    exchanges and the setting is restored after it."""
    checks = Checks(f"rank {dist.get_rank()}")
    forward, backward = fixed_call_order(a2a_algo="dedup-fixed", overlap_degree=2)
    margins = {e.split("@")[1] for e in forward + backward if "@" in e}
    forward, backward = ([e for e in events if "@" not in e] for events in (forward, backward))
    want_forward = ["launch", "launch", "wait", "experts", "launch", "wait", "experts", "launch", "wait", "wait"]
    checks.expect(forward == want_forward, f"forward {forward}")
    expected = ["launch", "launch", "wait", "kept", "kept", "launch", "wait", "kept", "kept", "launch",
                "weight grad", "weight grad", "wait", "wait"]
    checks.expect(backward == expected, f"backward {backward}")
    checks.expect(margins == {str(dedup.OVERLAP_SM_MARGIN)}, f"SM margins of the expert matmuls {margins}")
    checks.expect(torch._C._get_sm_carveout_experimental() is None, "the SM margin is not restored")
    return checks.failures


def own_apart_order_worker(degree: int) -> list[str]:
    """dedup-fixed-own runs in the order its docstring gives (relu: w1 and w2; M = OVERLAP_SM_MARGIN):
    forward, every chunk's rows launched, then per chunk its wait, the others' experts and the
    launch of their sums, then the own pairs' experts leaving M SMs, the waits; backward, the
    returned gradients launched, the own pairs' backward under them (each weight's share at
    once, then the input product, leaving M SMs), then per chunk, last first, its wait, the
    others' backward (their rows kept) and the launch of their rows' gradient, then the tap's
    two weight gradients (the others' product, leaving M SMs) before those exchanges are waited
    for. The others' matmuls run on every SM at one chunk (nothing beside them), leave M SMs at
    two (the next chunk's exchange beside them)."""
    checks = Checks(f"rank {dist.get_rank()}")
    forward, backward = fixed_call_order(a2a_algo="dedup-fixed-own", overlap_degree=degree)
    margin = dedup.OVERLAP_SM_MARGIN
    mm, others = f"mm@{margin}", f"mm@{margin if degree > 1 else 0}"
    want_forward = (["launch"] * degree + ["wait", "experts", others, others, "launch"] * degree
                    + ["experts", mm, mm] + ["wait"] * degree)
    checks.expect(forward == want_forward, f"forward {forward}")
    own = [f"dW@{margin}", mm] * 2
    expected = (["launch"] * degree + own + ["wait", "kept", others, "kept", others, "launch"] * degree
                + ["weight grad", f"dW@{margin}", "weight grad", f"dW@{margin}"] + ["wait"] * degree)
    checks.expect(backward == expected, f"backward {backward}")
    checks.expect(torch._C._get_sm_carveout_experimental() is None, "the SM margin is not restored")
    return checks.failures


def test_dedup_fixed_pipelines_its_chunks_exchanges_with_their_experts():
    failures = run_checks(pipelined_fixed_order_worker, 2, timeout=300)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world_size, degree", [(2, 1), (4, 1), (2, 2)])
def test_dedup_fixed_own_computes_the_own_pairs_under_the_others_exchanges(world_size, degree):
    failures = run_checks(own_apart_order_worker, world_size, args=(degree,), timeout=300)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("settings, message", [
    ({"gate": "expert_choice"}, "token-choice gate"),
    ({"overlap_degree": 4}, "runs overlap_degree 1, or 2"),
    ({"overlap_degree": "auto"}, "runs overlap_degree 1, or 2"),
    ({"overlap_degree": 2, "capacity_factor": None}, "needs a padded capacity mode"),
    ({"kernels": "comet"}, "two exchanges"),
    ({"balance": "pro-prophet", "capacity_factor": None}, "Pro-Prophet"),
])
def test_dedup_refuses_what_it_cannot_run(settings, message):
    with pytest.raises(ValueError, match=message):
        MoE(DIM, HIDDEN, EXPERTS, top_k=2, a2a_algo="dedup", **settings)


@pytest.mark.parametrize("algo", ["dedup-fixed", "dedup-fixed-own"])
def test_fixed_size_dedup_pipelines_dropless_calls_at_any_degree_and_padded_ones_as_dedup(algo):
    """dedup-fixed's and dedup-fixed-own's dropless calls take any overlap_degree (Tutel's chunks
    over the fixed-size exchange; with the own pairs apart, the others' pairs in chunks) but not
    "auto"; padded they are dedup, with dedup's degrees (1, or 2: own pairs first)."""
    for degree in (1, 2, 3, 8):
        MoE(DIM, HIDDEN, EXPERTS, top_k=2, capacity_factor=None, a2a_algo=algo, overlap_degree=degree)
    with pytest.raises(ValueError, match="on a dropless call runs a given overlap_degree"):
        MoE(DIM, HIDDEN, EXPERTS, top_k=2, capacity_factor=None, a2a_algo=algo, overlap_degree="auto")
    MoE(DIM, HIDDEN, EXPERTS, top_k=2, capacity_factor=1.0, a2a_algo=algo, overlap_degree=2)
    for degree in (3, 4):
        with pytest.raises(ValueError, match="runs overlap_degree 1, or 2"):
            MoE(DIM, HIDDEN, EXPERTS, top_k=2, capacity_factor=1.0, a2a_algo=algo, overlap_degree=degree)


def test_dedup_pipelines_dropless_calls_only_in_fixed_size_exchanges():
    with pytest.raises(ValueError, match="pipelines dropless calls"):
        MoE(DIM, HIDDEN, EXPERTS, top_k=2, capacity_factor=None, a2a_algo="dedup", overlap_degree=2)


def refusals_worker() -> bool:
    moe = MoE(DIM, HIDDEN, 2, top_k=1, parallel="adaptive")
    with pytest.raises(ValueError, match="whole experts"):
        moe(torch.randn(4, DIM), a2a_algo="dedup")
    moe = MoE(DIM, HIDDEN, 4, top_k=1, parallel="adaptive")
    with pytest.raises(ValueError, match="r = 1"):
        moe(torch.randn(4, DIM), a2a_algo="dedup", parallel=0)
    return True


def test_dedup_refuses_fewer_experts_than_ranks_and_other_r():
    assert all(run_distributed(refusals_worker, 4, timeout=120))


def test_weft_train_with_dedup_or_auto_has_the_linear_losses(tmp_path):
    """`weft train --a2a-algo dedup|dedup-d2|dedup-fixed|dedup-fixed-own|auto` (auto on the CPU: each layer's tuning
    dictionary times linear and dedup, eagerly) on 2 gloo ranks: the losses of linear, padded and
    dropless (dedup-d2: padded only, and a one-line refusal dropless)."""
    corpus = write_corpus(tmp_path)
    cache = tmp_path / "cache"
    results = {}
    algos = ("linear", "dedup", "dedup-d2", "dedup-fixed", "dedup-fixed-own", "auto")
    runs = list(itertools.product(algos, ({}, {"capacity_factor": None})))
    for algo, shape in runs:
        out = tmp_path / f"{algo}-{len(shape)}"
        cfg = config(corpus, out, steps=6, log_interval=1, a2a_algo=algo, model={**SMALL_MODEL, **shape})
        if algo == "dedup-d2" and shape:
            with pytest.raises(ValueError, match="'dedup-d2' needs a padded capacity mode"):
                cfg.validate()
            continue
        run_distributed(train, 2, args=(cfg,), timeout=300, env={"WEFT_CACHE": str(cache)})
        results[algo, len(shape)] = losses(out)
    for algo, dropless in results:
        linear, other = results["linear", dropless], results[algo, dropless]
        assert sorted(other) == list(range(1, 7))
        assert all(abs(linear[s] - other[s]) <= 1e-5 * abs(linear[s]) for s in linear), (algo, linear, other)
    assert ("dedup-d2", 0) in results


def test_train_config_refuses_dedup_with_overlap_or_balance():
    with pytest.raises(ValueError, match="overlap 'tutel'"):
        TrainConfig(a2a_algo="dedup", overlap="tutel").validate()
    with pytest.raises(ValueError, match="balance 'pro-prophet'"):
        TrainConfig(a2a_algo="dedup", balance="pro-prophet").validate()
    with pytest.raises(ValueError, match="a2a_algo must be one of"):
        TrainConfig(a2a_algo="2dh").validate()


def auto_worker(cf) -> list[str]:
    """a2a_algo="auto" times the deduplicating all-to-all beside the linear one (every call, while
    tuning and after, equal to the plain layer) and the ranks keep the same winner."""
    rank = dist.get_rank()
    checks = Checks(f"rank {rank} cf={cf}")
    tuning = TuningDictionary(bucket_size=1 << 20, trials=2)
    torch.manual_seed(0)
    plain = MoE(DIM, HIDDEN, EXPERTS, top_k=4, capacity_factor=cf)
    auto = MoE(DIM, HIDDEN, EXPERTS, top_k=4, capacity_factor=cf, a2a_algo="auto", tuning=tuning)
    auto.load_state_dict(plain.state_dict())
    names = [c.name for c in auto.candidates()]
    checks.expect(names == ["d1-linear", "d1-dedup"], f"candidates {names}")
    gen = torch.Generator().manual_seed(rank)
    for step in range(6):
        x = torch.randn(TOKENS, DIM, generator=gen)
        xa, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yp = auto(xa), plain(xp)
        ya.square().sum().backward()
        yp.square().sum().backward()
        checks.expect(torch.allclose(ya, yp, rtol=1e-5, atol=1e-6), f"call {step}: outputs differ")
        checks.expect(torch.allclose(xa.grad, xp.grad, rtol=1e-5, atol=1e-6), f"call {step}: input gradients differ")
    entry = next(iter(next(iter(tuning.table.values())).values()))
    checks.expect(len(entry["times_ms"].get("d1-dedup", [])) == 2, f"dedup timed {entry['times_ms']}")
    best = [None] * dist.get_world_size()
    dist.all_gather_object(best, entry["best"])
    checks.expect(best[0] is not None and len({tuple(b) for b in best}) == 1, f"winners {best}")
    return checks.failures


@pytest.mark.parametrize("top_k, cf, ranks, fewer", [
    (1, 1.25, 2, False), (1, None, 2, False),  # one expert per token: nothing to deduplicate
    (2, 1.0, 2, False), (2, 1.25, 2, True),  # padded: El * C rows per rank against min(T, El * C)
    (4, 1.0, 2, True), (4, 1.0, 4, False), (2, None, 4, True), (2, 0.0, 8, True), (2, -2.0, 8, True)])
def test_auto_times_dedup_only_where_it_could_send_fewer_rows(top_k, cf, ranks, fewer):
    """Where dedup moves as many rows as the linear all-to-all (e.g. phi35 and mixtral, top_k 2,
    at cf 1.0 on 2 ranks) it only adds work, so auto does not spend tuning runs on it."""
    call = MoECall(top_k, cf, a2a_algo="auto")
    assert dedup_sends_fewer(call, ranks) == fewer
    assert offers_dedup(call, True, ranks, 1, False) == fewer


def candidates_worker() -> dict:
    names = {}
    for cf in (1.0, None):
        moe = MoE(DIM, HIDDEN, EXPERTS, top_k=4, capacity_factor=cf, overlap_degree="auto", a2a_algo="auto")
        names[cf] = [c.name for c in moe.candidates()]
    return names


def test_auto_degrees_time_dedup_with_its_own_pairs_last_in_padded_modes():
    names = run_distributed(candidates_worker, 2, timeout=120)[0]
    assert names[1.0] == ["d1-linear", "d1-dedup", "d2-linear", "d2-dedup", "d4-linear", "d8-linear"]
    assert names[None] == ["d1-linear", "d1-dedup", "d2-linear", "d4-linear", "d8-linear"]  # dropless: d1 only


@pytest.mark.parametrize("cf", [1.0, None])
def test_auto_times_dedup_as_a_candidate(cf):
    failures = run_checks(auto_worker, 2, args=(cf,), timeout=300)
    assert not failures, "\n".join(failures)


def test_model_benchmark_times_dedup_beside_none(tmp_path):
    """`weft bench model --modes none,dedup,dedup-d2`: whole training iterations with every MoE
    layer deduplicating, checked against `none` on the same weights and batch, then timed."""
    out = tmp_path / "model.json"
    cfg = ModelBenchConfig(preset="tiny", batch_size=2, modes=("none", "dedup", "dedup-d2"), steps=2, warmup=1,
                           json=str(out), profile_steps=0)
    run_distributed(model.run, 2, args=(cfg,), timeout=300)
    rows = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["none"]["max_error"] == 0.0
    for mode in ("dedup", "dedup-d2"):
        assert rows[mode]["max_error"] < 1e-5 and rows[mode]["iteration_ms"] > 0
    with pytest.raises(ValueError, match="token-choice gate"):
        ModelBenchConfig(preset="tiny", modes=("none", "dedup"), gate="expert_choice").validate()
    with pytest.raises(ValueError, match="dedup-d2: needs a padded capacity mode"):
        ModelBenchConfig(preset="tiny", modes=("none", "dedup-d2"), capacity=None).validate()


def graph_choice_worker(fastest: str) -> list[str]:
    """`--a2a-algo auto` with a graphed micro-step: linear, dedup and dedup-d2 timed (here by a
    timer that runs each step eagerly, as `time_graphed` replays its capture) with every layer at
    that all-to-all (dedup-d2: degree 2 too), the same losses, and the `fastest` set on every layer."""
    from weft.models import GPT, GPTConfig
    from weft.train.step import GRAPH_TUNED, choose_fastest, eager_micro_step, graph_candidates, with_layers_at

    checks = Checks(f"rank {dist.get_rank()}")
    torch.manual_seed(0)
    gpt = GPT(GPTConfig.from_dict({**SMALL_MODEL, "moe_every": 1, "top_k": 2}))
    for moe in gpt.moe_layers():
        moe.a2a_algo = "auto"  # what weft train sets; a layer built "linear" tunes linear and dedup
    seen, losses = [], []
    timer = eager_timer(gpt, ("overlap_degree", "a2a_algo"), fastest, seen, losses)
    candidates = GRAPH_TUNED["a2a_algo"]
    checks.expect(graph_candidates(gpt, "a2a_algo") == candidates, "dedup not offered at top_k 2, cf 1.25")
    best, _ = choose_fastest(gpt, with_layers_at(gpt, eager_micro_step(gpt, 1), "a2a_algo"), timer, "a2a_algo",
                             candidates)
    checks.expect(candidates == ("linear", "dedup", "dedup-d2") and best == fastest, f"{candidates}: chose {best}")
    checks.expect(seen == [{(1, "linear")}, {(1, "dedup")}, {(2, "dedup")}], f"layers ran {seen}")
    checks.expect(max(losses) - min(losses) < 1e-5, f"losses {losses}")
    chosen = {(moe.overlap_degree, moe.a2a_algo) for moe in gpt.moe_layers()}
    checks.expect(chosen == {(2 if fastest == "dedup-d2" else 1, "dedup")}, f"the layers run {chosen}")
    top1 = GPT(GPTConfig.from_dict({**SMALL_MODEL, "moe_every": 1, "top_k": 1}))
    for moe in top1.moe_layers():
        moe.a2a_algo = "auto"
    checks.expect(graph_candidates(top1, "a2a_algo") == ("linear",), "dedup offered at top_k 1")
    return checks.failures


@pytest.mark.parametrize("fastest", ["dedup", "dedup-d2"])
def test_a_graphed_step_chooses_the_faster_all_to_all(fastest):
    failures = run_checks(graph_choice_worker, 2, args=(fastest,), timeout=300)
    assert not failures, "\n".join(failures)


def fixed_size_choice_worker(winner: str | None) -> list[str]:
    """`--a2a-algo auto` on a dropless model with CUDA graphs allowed (`choose_fixed_size`): the
    eager step with the layers' own tuning against the step in fixed-size exchanges at degrees 1
    and 2, with the own pairs apart, and with Comet's kernels (offered on GPUs whose ranks map each
    other's memory; here given as a form, its exchange over shared files), timed here by stand-ins
    that run each step eagerly (a replay runs its capture); all compute the same losses, the
    fastest is set on every layer (eager: at the degree they had, kernels back at "auto"), and
    only a graphable form passes `graph_blocker`. Then `time_tuned_eager` for real: the layers'
    tuning decides first, the gradients are left None."""
    from weft.models import GPT, GPTConfig
    from weft.train.step import (
        COMET_FORM,
        FIXED_SIZE_ALGO,
        FIXED_SIZE_FORMS,
        choose_fixed_size,
        comet_form_offered,
        eager_micro_step,
        graph_blocker,
        time_tuned_eager,
    )

    checks = Checks(f"rank {dist.get_rank()}")
    torch.manual_seed(0)
    gpt = GPT(GPTConfig.from_dict({**SMALL_MODEL, "moe_every": 1, "top_k": 2, "capacity_factor": None}))
    for moe in gpt.moe_layers():
        moe.a2a_algo = "auto"  # what weft train sets for --a2a-algo auto
    cuda = torch.device("cuda")  # graph_blocker reads the device type only
    checks.expect("dropless" in (graph_blocker(gpt, cuda, "none") or ""), "a dropless step at auto graphs as it is")
    checks.expect(graph_blocker(gpt, cuda, "none", fixed_size=True) is None, "dedup-fixed would not make it graph")
    checks.expect(graph_blocker(gpt, cuda, "lancet", fixed_size=True) is not None, "Lancet's step graphs")
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 256, (2, 16), generator=gen), torch.randint(0, 256, (2, 16), generator=gen)
    seen, losses = [], []
    seconds = {None: 1.0, "dedup-fixed": 2.0, "dedup-fixed-d2": 3.0, "dedup-fixed-own": 4.0, COMET_FORM: 5.0}
    seconds[winner] = 0.5
    checks.expect(not comet_form_offered(gpt), "Comet's form offered on the CPU (graphs need GPUs)")
    forms = (*FIXED_SIZE_FORMS, COMET_FORM)

    def run(step) -> None:
        gpt.zero_grad(set_to_none=True)
        losses.append(float(step(x, y)[0][0]))
        seen.append({(moe.a2a_algo, moe.overlap_degree, moe.kernels) for moe in gpt.moe_layers()})

    def eager_timer(step) -> float:
        run(step)
        return seconds[None]

    def graph_timer(step_of, candidates) -> list[float]:
        for value in candidates:
            run(step_of(value))
        return [seconds[value] for value in candidates]

    chosen, eager_s, graph_s = choose_fixed_size(gpt, eager_micro_step(gpt, 1), eager_timer, graph_timer, forms)
    want_graphs = {form: seconds[form] for form in forms}
    checks.expect((chosen, eager_s, graph_s) == (winner, seconds[None], want_graphs),
                  f"chose {chosen} at {eager_s} / {graph_s}")
    checks.expect(seen == [{("auto", 1, "auto")}, {(FIXED_SIZE_ALGO, 1, "auto")}, {(FIXED_SIZE_ALGO, 2, "auto")},
                           {("dedup-fixed-own", 1, "auto")}, {("linear", 1, "comet")}], f"the layers ran {seen}")
    checks.expect(max(losses) - min(losses) < 1e-5, f"losses {losses}")
    now = {(moe.a2a_algo, moe.overlap_degree, moe.kernels) for moe in gpt.moe_layers()}
    want = {None: ("auto", 1, "auto"), "dedup-fixed": (FIXED_SIZE_ALGO, 1, "auto"),
            "dedup-fixed-d2": (FIXED_SIZE_ALGO, 2, "auto"), "dedup-fixed-own": ("dedup-fixed-own", 1, "auto"),
            COMET_FORM: ("linear", 1, "comet")}[winner]
    checks.expect(now == {want}, f"the layers run {now}")
    checks.expect((graph_blocker(gpt, cuda, "none") is None) == (winner is not None),
                  "graph_blocker disagrees with the choice")
    checks.expect(live_gradient_accumulators(list(gpt.parameters())) == [], "a candidate's autograd graph kept")
    if winner is None:
        seconds_eager = time_tuned_eager(gpt, eager_micro_step(gpt, 1), (x, y))
        decided = [moe.tuning.chosen() for moe in gpt.moe_layers()]
        checks.expect(seconds_eager > 0 and all(decided), f"{seconds_eager} s, the layers' tuning decided {decided}")
        checks.expect(all(p.grad is None for p in gpt.parameters()), "gradients left behind")
    return checks.failures


@pytest.mark.parametrize("winner", ["dedup-fixed", "dedup-fixed-d2", "dedup-fixed-own", "comet", None])
def test_auto_on_a_dropless_model_keeps_the_fastest_of_the_eager_step_and_the_fixed_size_graphs(winner):
    failures = run_checks(fixed_size_choice_worker, 2, args=(winner,), timeout=300)
    assert not failures, "\n".join(failures)


def test_layer_benchmark_times_dedup_and_its_own_pairs_last(tmp_path):
    """`weft bench layer --modes plain,dedup,dedup-d2`: both checked against plain first (to float
    rounding) and timed; dropless has no dedup-d2 and says so in its row."""
    out = tmp_path / "layer.json"
    cfg = LayerBenchConfig("tiny", 64, capacity=(1.0, None), modes=("plain", "dedup", "dedup-d2"), steps=2,
                           warmup=1, json=str(out))
    run_distributed(layer.run, 2, args=(cfg,), timeout=300)
    rows = {(r["capacity_factor"], r["mode"]): r for r in json.loads(out.read_text())["results"]}
    for mode in ("dedup", "dedup-d2"):
        assert rows[(1.0, mode)]["max_abs_error"] < 1e-5 and rows[(1.0, mode)]["median_ms"] > 0
    assert rows[(None, "dedup")]["max_abs_error"] < 1e-5
    assert rows[(None, "dedup-d2")]["median_ms"] is None
    assert "needs a padded capacity mode" in rows[(None, "dedup-d2")]["error"]


def test_layer_benchmark_times_dedup_fixed_pipelined_against_plain(tmp_path):
    """`weft bench layer --capacity dropless --modes plain,dedup-fixed,...,dedup-fixed-own-d2`:
    each checked against plain (to float rounding) and timed."""
    out = tmp_path / "layer.json"
    modes = ("plain", "dedup-fixed", "dedup-fixed-d2", "dedup-fixed-d4", "dedup-fixed-own", "dedup-fixed-own-d2")
    cfg = LayerBenchConfig("tiny", 64, capacity=(None,), modes=modes, steps=2, warmup=1, json=str(out))
    run_distributed(layer.run, 2, args=(cfg,), timeout=300)
    rows = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    for mode in modes[1:]:
        assert rows[mode]["max_abs_error"] < 1e-5 and rows[mode]["median_ms"] > 0, rows[mode]


def records_worker() -> list[str]:
    """`dedup.exchange_records`: one exchange of (record, gate) pairs as float32 where the bound
    keeps the records exact, two exchanges above it; the same records, gates and gate gradients."""
    rank, world = dist.get_rank(), dist.get_world_size()
    checks = Checks(f"rank {rank}")
    gen = torch.Generator().manual_seed(rank)
    records = torch.randint(-1, dedup.FLOAT32_INTEGERS, (6 * world,), generator=gen)
    gates = torch.rand(6 * world, generator=gen)
    splits = [6] * world
    results, calls, real = [], [], dedup.all_to_all

    def counting(*args, **kwargs):
        calls[-1] += 1
        return real(*args, **kwargs)

    dedup.all_to_all = counting
    try:
        for bound in (dedup.FLOAT32_INTEGERS, dedup.FLOAT32_INTEGERS + 1):
            calls.append(0)
            g = gates.clone().requires_grad_()
            got_records, got_gates = dedup.exchange_records(records, g, dist.group.WORLD, bound, splits, splits)
            (got_gates * torch.arange(got_gates.numel())).sum().backward()
            results.append((got_records, got_gates.detach(), g.grad))
    finally:
        dedup.all_to_all = real
    checks.expect(calls == [1, 2], f"exchanges {calls}")
    (r1, g1, d1), (r2, g2, d2) = results
    checks.expect(r1.dtype == torch.int64 and torch.equal(r1, r2), "records differ")
    checks.expect(torch.equal(g1, g2) and torch.equal(d1, d2), "gates or their gradients differ")
    checks.expect(int(r1.max()) >= 2 ** 23, "the case has no record near the bound")
    return checks.failures


def test_records_and_gates_cross_in_one_exchange_while_exact():
    failures = run_checks(records_worker, 2, timeout=120)
    assert not failures, "\n".join(failures)
