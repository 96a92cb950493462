"""Every exchange strategy (weft.moe.exchange) against the expert function written out here.

Each strategy takes a rank's dispatched rows, padded (E * C rows, slot c of expert e at row
e * C + c) or grouped (sorted by expert, `counts[e]` rows each, uneven across ranks), and must
return expert_e(row) for every row, with the input gradients of those rows and, on each expert's
owner, the weight gradients summed over every rank's rows. The oracle gathers the whole experts
with plain torch.distributed and runs the FFN per row."""
from __future__ import annotations

import itertools
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from weft import MoE
from weft.balance import LayerCostModel
from weft.moe.exchange import (
    AllToAll,
    DataParallelExperts,
    ExchangeContext,
    Padded,
    Pipelined,
    ReplicatedExperts,
    SlicedExperts,
    Transfer,
    gather_counts,
)
from weft.testing import run_checks

DIM, HIDDEN, CAPACITY = 8, 12, 5


def _gather(w: torch.Tensor, shards: int) -> torch.Tensor:
    """Every rank's (El, a, b) weight, joined into the whole experts (shards along the hidden dim)."""
    parts = [torch.empty_like(w) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, w.detach())
    hidden_axis = 1 if w.shape[1] != DIM else 2  # w2 is (., hidden, dim); w1 and w3 (., dim, hidden)
    experts = []
    for i in range(0, len(parts), shards):
        experts.append(torch.cat(parts[i:i + shards], dim=hidden_axis) if shards > 1 else parts[i])
    return torch.cat(experts)


def _ffn(activation: str, x: torch.Tensor, w1, w2, w3) -> torch.Tensor:
    h = x @ w1
    if activation == "swiglu":
        h = F.silu(h) * (x @ w3)
    else:
        h = {"relu": F.relu, "gelu": F.gelu}[activation](h)
    return h @ w2


def _oracle(moe: MoE, rows: torch.Tensor, expert_of_row: torch.Tensor, dy: torch.Tensor):
    """Outputs, input gradients and this rank's share of the whole experts' weight gradients."""
    shards = moe.expert_shards
    weights = [None if w is None else _gather(w, shards).requires_grad_() for w in moe.experts.weights()]
    x = rows.detach().requires_grad_()
    outs = [_ffn(moe.experts.activation, x[i], *[None if w is None else w[int(e)] for w in weights])
            for i, e in enumerate(expert_of_row)]
    out = torch.stack(outs) if outs else rows.new_zeros(0, DIM)
    if outs:
        (out * dy).sum().backward()
    grads = [None if w is None else (w.grad if w.grad is not None else torch.zeros_like(w)).clone() for w in weights]
    dx = x.grad if x.grad is not None else torch.zeros_like(x)
    for g in grads:
        if g is not None:
            dist.all_reduce(g)  # the expert gradient holds every rank's rows
    return out.detach(), dx, grads


def _owned(moe: MoE, full_grad: torch.Tensor, index: int) -> torch.Tensor:
    """The part of a whole-expert gradient that this rank's parameter holds."""
    rank, shards, local = dist.get_rank(), moe.expert_shards, moe.num_local_experts
    if shards == 1:
        return full_grad[rank * local:(rank + 1) * local]
    expert, shard = rank // shards, rank % shards
    width = HIDDEN // shards
    hidden_axis = 1 if index == 1 else 2
    return full_grad[expert:expert + 1].narrow(hidden_axis, shard * width, width)


def _compare(moe, strategy, rows, layout, expert_of_row, dy, label) -> list[str]:
    moe.zero_grad(set_to_none=True)
    x = rows.detach().requires_grad_()
    out = strategy(x, layout)
    (out * dy).sum().backward()
    want_out, want_dx, want_grads = _oracle(moe, rows, expert_of_row, dy)
    pairs = [("out", out.detach(), want_out), ("dx", x.grad, want_dx)]
    for i, (w, g) in enumerate(zip(moe.experts.weights(), want_grads)):
        if w is not None:
            pairs.append((f"dw{i + 1}", w.grad, _owned(moe, g, i)))
    failures = []
    for name, got, want in pairs:
        if got is None or got.shape != want.shape or not torch.allclose(got, want, atol=1e-5, rtol=1e-4):
            err = None if got is None or got.shape != want.shape else float((got - want).abs().max())
            failures.append(f"rank {dist.get_rank()} {label}: {name} differs (max abs error {err})")
    return failures


def _padded_rows(moe: MoE, gen: torch.Generator, device: str):
    rows = torch.randn(moe.num_experts * CAPACITY, DIM, generator=gen).to(device)
    return rows, torch.arange(moe.num_experts).repeat_interleave(CAPACITY), Padded(CAPACITY)


def _grouped_rows(moe: MoE, gen: torch.Generator, device: str):
    counts = torch.randint(0, 5, (moe.num_experts,), generator=gen)  # uneven, zeros included
    rows = torch.randn(int(counts.sum()), DIM, generator=gen).to(device)
    return rows, torch.arange(moe.num_experts).repeat_interleave(counts), gather_counts(counts.to(device), moe.group)


def exchange_worker(num_experts: int, activation: str, device: str = "cpu") -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    moe = MoE(DIM, HIDDEN, num_experts, top_k=1, activation=activation, parallel="adaptive", a2a_algo="auto",
              device=device)
    ctx = ExchangeContext(moe.experts, moe.placement)
    if moe.expert_shards == 1:
        strategies = {
            "all-to-all": (AllToAll(ctx), "padded grouped"),
            "2dh": (AllToAll(ctx, "2dh"), "padded"),
            "pipelined d2": (Pipelined(ctx, 2), "padded grouped"),
            "pipelined d3 2dh": (Pipelined(ctx, 3, "2dh"), "padded"),
            "data-parallel": (DataParallelExperts(ctx), "padded grouped"),
        }
    else:
        strategies = {f"sliced r{r}": (SlicedExperts(ctx, r), "padded grouped")
                      for r in moe.parallel_choices() if r > 0}
        strategies.update({f"sliced r{r} d2": (SlicedExperts(ctx, r, 2), "padded")
                           for r in moe.parallel_choices() if r > 0})
        strategies["data-parallel"] = (DataParallelExperts(ctx), "padded grouped")
    gen = torch.Generator().manual_seed(100 + rank)
    failures = []
    if world == 4 and moe.groups_2dh.num_nodes != 2:
        failures.append(f"2DH spans {moe.groups_2dh.num_nodes} node(s); the test expects 2")
    for (name, (strategy, layouts)), layout_name in itertools.product(strategies.items(), ("padded", "grouped")):
        if layout_name not in layouts:
            continue
        rows, expert_of_row, layout = (_padded_rows if layout_name == "padded" else _grouped_rows)(moe, gen, device)
        dy = torch.randn(rows.shape, generator=gen).to(device)
        failures += _compare(moe, strategy, rows, layout, expert_of_row, dy, f"{name} {layout_name}")
    if moe.expert_shards == 1 and world > 1:  # Pro-Prophet's copies (dropless only), built where used
        others = lambda e: frozenset(range(world)) - {e // moe.num_local_experts}  # noqa: E731
        every = {e: others(e) for e in range(num_experts)}
        cases = [("replicated, expert 1 copied", {1: others(1)}),
                 ("replicated, every expert copied (no row sent)", every)]
        if world > 2:  # ranks with no copy (and none of their experts copied) send all their rows
            cases.append(("replicated, expert 1 copied to rank 2 only", {1: frozenset({2})}))
        for name, copies in cases:
            rows, expert_of_row, layout = _grouped_rows(moe, gen, device)
            dy = torch.randn(rows.shape, generator=gen).to(device)
            strategy = ReplicatedExperts(ctx, Transfer(moe.experts, moe.placement, copies, moe.group))
            failures += _compare(moe, strategy, rows, layout, expert_of_row, dy, f"{name} grouped")
    return failures


@pytest.mark.parametrize("world_size, num_experts", [(1, 4), (2, 4), (4, 8), (2, 1), (4, 2), (4, 1)])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_every_exchange_computes_the_expert_function(world_size, num_experts, activation):
    failures = run_checks(exchange_worker, world_size, args=(num_experts, activation), timeout=300,
                          env={"LOCAL_WORLD_SIZE": 2})
    assert not failures, "\n".join(failures[:10])


_READS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")


def _count_reads(run) -> list[str]:
    """The tensor-to-host reads (`tolist`, `item`, `int(t)`, ...) made while `run()` runs: on a GPU
    each waits for every kernel queued before it."""
    seen, saved = [], {name: getattr(torch.Tensor, name) for name in _READS}

    def counting(name):
        def read(self, *args, **kwargs):
            seen.append(name)
            return saved[name](self, *args, **kwargs)
        return read

    for name in _READS:
        setattr(torch.Tensor, name, counting(name))
    try:
        run()
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
    return seen


def _count_syncs(run) -> list[str]:
    """The synchronisations of the CUDA stream with the host while `run()` runs (PyTorch's sync
    debug mode warns at each), each named by the innermost line of weft or of this test that
    made it."""
    torch.cuda.synchronize()
    seen = []

    def record(message, *args, **kwargs):
        if "called a synchronizing CUDA operation" in str(message):  # not the mode's own notice
            ours = [f for f in traceback.extract_stack() if "/weft/" in f.filename or "/tests/" in f.filename]
            seen.append(f"{ours[-1].filename.rsplit('/', 1)[-1]}:{ours[-1].lineno} {ours[-1].line}" if ours else "?")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return seen


def reads_worker(device: str = "cpu") -> list[str]:
    """On the CPU the reads of tensor values counted; on a GPU the stream's synchronisations."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    count = _count_syncs if device.startswith("cuda") else _count_reads
    # Slow experts, cheap weights: copying the hot expert pays in this model (a copy every call).
    cost = LayerCostModel(num_devices=world, bandwidth=1e12, throughput=1e3, row_bytes=4 * DIM,
                          expert_param_bytes=1.0, expert_grad_bytes=1.0)
    settings = {"plain": {}, "auto (tuned)": {"overlap_degree": "auto"},
                "dedup": {"a2a_algo": "dedup"},
                "auto with dedup (tuned)": {"overlap_degree": "auto", "a2a_algo": "auto"},
                "pro-prophet": {"balance": "pro-prophet", "balance_model": cost}}
    failures = []
    for name, options in settings.items():
        torch.manual_seed(0)
        moe = MoE(DIM, HIDDEN, 2 * world, top_k=2, capacity_factor=None, device=device, **options)
        with torch.no_grad():
            moe.router.weight[:2, 0] += 10.0  # experts 0 and 1 (rank 0's) hot through x[:, 0]
        gen = torch.Generator().manual_seed(rank)
        inputs = []
        for _ in range(41):  # made up front: copying one to the GPU is not the layer's read
            x = torch.randn(16 + 3 * rank, DIM, generator=gen)  # uneven counts: dropless takes them
            x[:, 0] += 2.0
            inputs.append(x.to(device))

        def call():
            moe(inputs.pop().requires_grad_()).sum().backward()

        for _ in range(40):  # the first call checks the ranks agree, "auto" tunes, Pro-Prophet plans
            call()
        reads = count(call)
        if len(reads) != 1:
            failures.append(f"rank {rank} {name}: a dropless call (forward and backward) read the device "
                            f"{len(reads)} times ({reads}), not once")
        if name == "pro-prophet" and world > 1 and not moe.balancer.last_copied:
            failures.append(f"rank {rank}: the balanced layer copied no expert, so its copying path went uncounted")
    return failures


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_a_dropless_call_reads_the_device_once(world_size):
    """A dropless call needs every rank's counts on the host (the all-to-allv's splits); it reads
    them once, and the tuner's bucket, the splits of every strategy and Pro-Prophet's load history
    come from that copy."""
    failures = run_checks(reads_worker, world_size, timeout=300)
    assert not failures, "\n".join(failures[:10])


def test_one_rank_dropless_call_keeps_its_counts_on_the_device(monkeypatch):
    """One rank has nothing to exchange: its dropless call takes the groups' ends from the device
    (`Experts.forward_offsets`) instead of every rank's counts on the host (`gather_layout`, never
    called here), with the host layout's outputs and gradients, bit for bit; it claims a CUDA
    graph can hold it only where the grouped GEMM runs on the GPU (not this CPU's float32
    experts), and never for Pro-Prophet's or Comet's calls."""
    import weft.moe.dedup as dedup
    from weft.moe.experts import Experts

    def host_layout(*args, **kwargs):
        raise AssertionError("a one-rank dropless call read every rank's counts on the host")

    torch.manual_seed(0)
    moe = MoE(DIM, HIDDEN, 4, top_k=2, capacity_factor=None, kernels="torch")
    x = torch.randn(24, DIM)
    x[:, 0] += 2.0
    ends = []
    offsets = Experts.forward_offsets
    monkeypatch.setattr(Experts, "forward_offsets",
                        lambda self, rows, offs, *step: ends.append(offs) or offsets(self, rows, offs, *step))

    def step(on_device: bool) -> list[torch.Tensor]:
        with monkeypatch.context() as m:
            if on_device:
                m.setattr(dedup, "gather_layout", host_layout)
            else:
                m.setattr(MoE, "_counts_stay_on_device", lambda *args: False)
            xi = x.clone().requires_grad_()
            y = moe(xi)
            y.square().sum().backward()
            out = [y.detach(), xi.grad] + [p.grad.clone() for p in moe.parameters()]
            moe.zero_grad()
            return out

    on_host = step(False)
    assert not ends, "the host layout's call took the device path"
    on_device = step(True)
    assert len(ends) == 1 and ends[0].tolist() == moe.stats.expert_counts.cumsum(0).tolist()
    assert all(torch.equal(a, b) for a, b in zip(on_device, on_host))
    assert not moe.counts_stay_on_device()  # float32 experts on the CPU: the ends are read to loop over the groups
    monkeypatch.setattr(Experts, "offsets_stay_on_device", lambda self, dtype: True)
    assert moe.counts_stay_on_device()
    assert not MoE(DIM, HIDDEN, 4, top_k=2, capacity_factor=None, kernels="comet").counts_stay_on_device()
    assert not MoE(DIM, HIDDEN, 4, top_k=2, capacity_factor=None, balance="pro-prophet").counts_stay_on_device()


def no_comm_on_device_worker() -> list[str]:
    """A dropless call that does not communicate (the benchmarks' no-comm bound) on several ranks,
    its counts left on the device, against the same call through the host layout, bit for bit."""
    import weft.moe.dedup as dedup
    from weft.moe.experts import Experts

    rank, world = dist.get_rank(), dist.get_world_size()
    failures = []
    torch.manual_seed(0)
    moe = MoE(DIM, HIDDEN, 2 * world, top_k=2, capacity_factor=None, kernels="torch")
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(12 + 5 * rank, DIM, generator=gen)  # uneven counts on every rank
    x[:, 0] += 2.0
    ends, offsets, host_layout, stays = [], Experts.forward_offsets, dedup.gather_layout, MoE._counts_stay_on_device

    def no_host_layout(*args, **kwargs):
        raise AssertionError("a no-comm dropless call with its counts on the device read them on the host")

    def step(on_device: bool) -> list[torch.Tensor]:
        if on_device:
            dedup.gather_layout = no_host_layout
        else:
            MoE._counts_stay_on_device = lambda *args: False
        try:
            xi = x.clone().requires_grad_()
            y = moe(xi, communicate=False)
            y.square().sum().backward()
            out = [y.detach(), xi.grad] + [p.grad.clone() for p in moe.parameters()]
            moe.zero_grad()
            return out
        finally:
            dedup.gather_layout, MoE._counts_stay_on_device = host_layout, stays

    Experts.forward_offsets = lambda self, rows, offs, *step: ends.append(offs) or offsets(self, rows, offs, *step)
    try:
        on_host, on_device = step(False), step(True)
    finally:
        Experts.forward_offsets = offsets
    local = moe.num_local_experts
    expected = moe.stats.expert_counts.view(world, local).sum(0).cumsum(0).tolist()
    if len(ends) != 1 or ends[0].tolist() != expected:
        failures.append(f"rank {rank}: the grouped GEMM's ends {[e.tolist() for e in ends]}, not {expected} "
                        "(each local expert's rows from every rank's block)")
    if not all(torch.equal(a, b) for a, b in zip(on_device, on_host)):
        failures.append(f"rank {rank}: no-comm with its counts on the device differs from the host layout's call")
    no_comm = moe.call_with(communicate=False)
    if moe.counts_stay_on_device(no_comm):
        failures.append(f"rank {rank}: float32 experts on the CPU claim a graph-safe no-comm call")
    claims = Experts.offsets_stay_on_device
    Experts.offsets_stay_on_device = lambda self, dtype: True  # as on an H200
    try:
        if not moe.counts_stay_on_device(no_comm):
            failures.append(f"rank {rank}: no-comm with a GPU grouped GEMM does not claim its counts stay")
        if moe.counts_stay_on_device():
            failures.append(f"rank {rank}: a communicating plain call on {world} ranks claims its counts stay")
    finally:
        Experts.offsets_stay_on_device = claims
    return failures


@pytest.mark.parametrize("world_size", [2, 4])
def test_no_comm_dropless_call_on_several_ranks_keeps_its_counts_on_the_device(world_size):
    """Where no rank communicates, nothing needs every rank's counts: the no-comm bound's dropless
    call groups its own rows by local expert on the device and runs the grouped GEMM on the
    ends there (so `weft bench layer` can graph `no-comm+graph` dropless on several ranks), with
    the host layout's outputs and gradients bit for bit. (One rank: the test above.)"""
    failures = run_checks(no_comm_on_device_worker, world_size, timeout=120)
    assert not failures, "\n".join(failures)


def test_received_rows_are_regrouped_by_a_permutation_without_a_fill_or_an_add():
    """The dropless exchange groups the rows it receives ([source][local expert]) by local expert
    for the grouped GEMM and puts the outputs back (`experts_on_received`, and the no-comm call on
    the device). `permute_rows` does both ways as gathers, forward and backward, bit for bit what
    index_select and zeros_like(...).index_copy gave, without their fills and index_add of every
    row."""
    from torch.profiler import ProfilerActivity, profile

    from weft.moe.exchange.all_to_all import experts_on_received, inverse_permutation, permute_rows

    torch.manual_seed(0)
    x = torch.randn(9, DIM, requires_grad=True)
    perm = torch.randperm(9)
    upstream = torch.randn(9, DIM)
    permute_rows(x, perm, inverse_permutation(perm)).backward(upstream)
    x_ref = x.detach().clone().requires_grad_()
    y_ref = x_ref.index_select(0, perm)
    y_ref.backward(upstream)
    assert torch.equal(permute_rows(x, perm, inverse_permutation(perm)), y_ref)
    assert torch.equal(x.grad, x_ref.grad)

    moe = MoE(DIM, HIDDEN, 3, top_k=2, capacity_factor=None, kernels="torch")
    received = [[2, 0, 3], [1, 4, 2]]  # rows from 2 sources for 3 local experts
    recv = torch.randn(12, DIM, requires_grad=True)
    recv_counts = torch.tensor([n for row in received for n in row])
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        out = experts_on_received(moe.experts, recv, recv_counts, received)
        out.backward(torch.ones_like(out))
    by_expert = torch.tensor([0, 1, 5, 6, 7, 8, 9, 2, 3, 4, 10, 11])  # grouped by expert, sources in order
    grouped = recv.detach().index_select(0, by_expert)
    expected = torch.zeros(12, DIM)
    expected[by_expert] = moe.experts.forward_grouped(grouped, [3, 4, 5]).detach()
    assert torch.equal(out.detach(), expected)
    row_writes = [e.key for e in prof.events() if e.key in ("aten::index_add_", "aten::index_add", "aten::index_copy",
                                                            "aten::index_copy_", "aten::zeros_like")
                  and [12, DIM] in e.input_shapes]
    assert not row_writes, row_writes
