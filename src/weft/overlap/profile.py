"""Lancet's caching op profiler (sec. 3) for a weft GPT: the time of every sub-layer at every
partition count, the stages of every MoE layer, and the all-to-all cost from a cost model.

Each (unit, partition size) is timed once on real activations of a sample batch (median of a few
runs after warm-up; CUDA events on GPUs). Every rank profiles, and the slowest rank's time is kept
(all-reduce MAX) so all ranks plan the same pipeline. The all-to-all of an n-partitioned layer is
priced by the cost model at 1/n of the bytes (Lancet's static-shape approximation).

`graphed=True` profiles for a step that replays as one CUDA graph (`weft train`'s graphed Lancet
step): each call is captured and replayed (`graph_seconds`), so no host launch cost is timed,
which a replay does not pay; eager timing credits a small model's sub-layers with their host
time (the eager profile predicted graphed gpt2-s-moe iterations +91 to +130%: docs/overlap.md).
A call that cannot be captured is timed eagerly.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from weft.comm.cost_model import CommCostModel
from weft.distributed import group_size
from weft.graphs import CaptureError, GraphedStep
from weft.models.gpt import MoEUnit as MoESubLayer
from weft.models.gpt import rotary_tables
from weft.moe.capacity import capacity_bound
from weft.moe.exchange.select import is_tuned
from weft.moe.layer import MoE
from weft.ops.wgrad import Linear, beside_collective
from weft.overlap import planner
from weft.overlap.moe_partition import can_route_in_parts
from weft.profiling import seconds, slowest_rank


@dataclass
class ModelProfile:
    """Profiled costs of one model at one batch shape (seconds)."""

    units: list[planner.Unit]  # for the planner, one per sub-layer
    backward: list[float]  # backward compute of each sub-layer on the whole batch
    backward_comm: list[float]  # per sub-layer: its two backward all-to-alls (MoE units), else 0
    rest: float  # embedding, final norm, head and loss, forward + backward
    names: list[str]
    # graphed profiles: (calls timed as CUDA graph replays, calls that could not be captured and were timed eagerly)
    graph_replays: tuple[int, int] | None = None
    # η: the share of an all-to-all overlapped with computation that the overlap saves
    # (`measure_overlap_efficiency`; 1, Lancet's assumption, where nothing communicates)
    overlap_efficiency: float = 1.0
    # per sub-layer (empty for all but MoE units): Tutel's pipelining degree d -> (the experts'
    # seconds on one of d chunks of their rows, one chunk's all-to-all seconds), for the degrees
    # `profile_model` was asked to price (`weft.overlap.passes.predict_forward`)
    chunks: list[dict[int, tuple[float, float]]] = dataclasses.field(default_factory=list)
    # graphed profiles, per sub-layer (empty where not measured; 0 / None for all but padded MoE
    # units that communicate): what `in_step` corrects the prices by. The seconds of casting the
    # experts' weights to the compute dtype once (under autocast each profiled chunk call casts
    # them; the pipelined exchange casts them once per layer call), and the layer's forward with
    # its all-to-alls as a CUDA graph (the all-to-alls' time in the step: this less the layer's
    # forward without them)
    weight_cast: list[float] = dataclasses.field(default_factory=list)
    forward_in_step: list[float | None] = dataclasses.field(default_factory=list)
    # η of the dW schedule's own work (`measure_overlap_efficiency` with a weight-gradient matmul
    # beside the all-to-all; None where not measured): measured beside the price, which still
    # applies the experts' η to the dW items (`weft.overlap.passes.predicted_with_dw_efficiency`)
    dw_efficiency: float | None = None


def in_step(profile: ModelProfile) -> ModelProfile:
    """`profile` with two corrections for a graphed step, measured by a graphed profile (`optimize(...,
    in_step=True)`, whose plan is priced with them: `OverlapPlan.priced`; docs/overlap.md). A padded MoE layer's
    weight cast moves from its experts to its gate stage: a layer call casts the weights once
    before its matmuls (the pipelined exchange once for all its chunks, which then pay only their
    matmuls; their input gradients need no cast), so each chunk's experts time loses the whole cast
    and a partition's or the whole batch's stages keep their sum. And its all-to-alls (the cost
    model's, of partitions, chunks and the backward) are scaled to the time they took in the
    layer's graphed forward: (forward with them - gate - experts) / (dispatch + combine priced), at
    the whole batch. Sub-layers with nothing measured are kept as they are."""
    if not profile.forward_in_step:
        return profile
    units, chunks, backward_comm = [], [], []
    for unit, layer_chunks, comm, cast, stepped in zip(profile.units, profile.chunks, profile.backward_comm,
                                                        profile.weight_cast, profile.forward_in_step):
        if not isinstance(unit, planner.MoEUnit) or stepped is None:
            units.append(unit)
            chunks.append(layer_chunks)
            backward_comm.append(comm)
            continue
        priced = unit.dispatch[1] + unit.combine[1]
        ratio = max(0.0, stepped - unit.gate[1] - unit.experts[1]) / priced if priced > 0 else 1.0
        moved = {k: min(cast, t) for k, t in unit.experts.items()}
        units.append(dataclasses.replace(
            unit, gate={k: t + moved[k] for k, t in unit.gate.items()},
            dispatch={k: t * ratio for k, t in unit.dispatch.items()},
            experts={k: t - moved[k] for k, t in unit.experts.items()},
            combine={k: t * ratio for k, t in unit.combine.items()}))
        chunks.append({d: (max(0.0, experts - cast), a2a * ratio) for d, (experts, a2a) in layer_chunks.items()})
        backward_comm.append(comm * ratio)
    return dataclasses.replace(profile, units=units, chunks=chunks, backward_comm=backward_comm,
                               weight_cast=[], forward_in_step=[])


def time_call(fn: Callable[[], object], device: torch.device, repeats: int = 5, warmup: int = 2,
              inner: int = 5) -> float:
    """Median seconds of fn() over `repeats` measurements after `warmup` calls. On GPUs each
    measurement spans `inner` back-to-back calls between two events (divided by `inner`): as in
    training, the host queues work ahead of the GPU, so its launch cost is not timed as GPU time."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        inner = 1
    return statistics.median(seconds(lambda: repeated(fn, inner), device) / inner for _ in range(repeats))


def repeated(fn: Callable[[], object], times: int) -> None:
    """fn() `times` times, each result dropped before the next call: a forward's output holds its
    autograd graph and saved activations, so keeping every result would hold `times` forwards'
    activations at once (a graphed Lancet profile of gpt2-s-moe peaked at 23.3 GiB, 8.1 without)."""
    for _ in range(times):
        fn()


def graph_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 5, warmup: int = 2,
                  inner: int = 5, stream: torch.cuda.Stream | None = None) -> float | None:
    """Median seconds of fn() replayed from a CUDA graph of `inner` back-to-back calls
    (`weft.graphs.GraphedStep`, `warmup` eager rounds first); None where fn cannot be captured (a
    host synchronisation, no GPU). fn may run a backward: its gradients accumulate in place in
    the `.grad` tensors that exist at capture, one per replay, as eager calls would. `stream`: the
    capture's side stream, one for a whole series of calls (`GraphedStep`'s `stream`)."""
    if device.type != "cuda":
        return None
    nothing = torch.empty(0, device=device)  # GraphedStep replays a function of tensors; fn takes none
    try:
        graph = GraphedStep(lambda _: repeated(fn, inner), [nothing], warmup=warmup, stream=stream)
    except CaptureError:
        return None
    graph(nothing)
    return statistics.median(seconds(lambda: graph(nothing), device) / inner for _ in range(repeats))


def _all_to_all_buffers(nbytes: int, world: int, dtype: torch.dtype, device: torch.device,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(source, output) of an all-to-all of about `nbytes` per rank: a whole number of elements for
    each of the `world` ranks, at least one."""
    elem = torch.tensor([], dtype=dtype).element_size()
    numel = max(world, nbytes // elem // world * world)
    return torch.randn(numel, device=device).to(dtype), torch.empty(numel, device=device, dtype=dtype)


def measure_all_to_all(sizes: Sequence[int], group, device: torch.device, dtype: torch.dtype,
                       repeats: int = 5) -> CommCostModel:
    """A cost model through all-to-alls of the given byte counts per rank, timed here (slowest rank)."""
    world = group_size(group)
    elem = torch.tensor([], dtype=dtype).element_size()
    points = []
    for nbytes in sorted(set(max(world * elem, s) for s in sizes)):
        src, out = _all_to_all_buffers(nbytes, world, dtype, device)
        seconds = time_call(lambda: dist.all_to_all_single(out, src, group=group), device, repeats)
        points.append((src.numel() * elem, seconds))
    measured = [(b, s) for (b, _), s in zip(points, slowest_rank([s for _, s in points], device, group))]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return CommCostModel.fit({"all_to_all": measured}, world, dist.get_backend(group), name)


def measure_overlap_efficiency(compute: Callable[[], object], start_all_to_all: Callable[[], object], group,
                               device: torch.device, repeats: int = 5,
                               time: Callable[[Callable[[], object]], float] | None = None) -> float:
    """η: how much of an overlap of an all-to-all with computation is saved, measured. Lancet's
    model runs the two side by side for free; on a GPU they share the SMs and the memory
    bandwidth (NCCL's kernels run on SMs; with P2P disabled they move the rows through host
    memory), so each slows the other. Times the all-to-all (`start_all_to_all()` launches it and
    returns its work) alone, `compute` repeated to about as long alone, and both at once (the
    all-to-all on its stream, the computation on the current one), each the slowest rank's
    median, and returns (t_comm + t_compute - t_both) / min(t_comm, t_compute) clipped to [0, 1]:
    1 when the shorter one hides entirely, 0 when running them together takes as long as one
    after the other. A collective over `group`: every rank gets the same value. `time(fn)`: the
    seconds of one fn() (default `time_call`); a graphed profile passes its CUDA graph timing, so
    the three are measured as the graphed step runs them, with no host launches between kernels."""
    if time is None:
        def time(fn: Callable[[], object]) -> float:
            return time_call(fn, device, repeats)
    comm_s = time(lambda: start_all_to_all().wait())
    one_s = time(compute)
    times = max(1, round(comm_s / one_s)) if one_s > 0 else 1

    def both() -> None:
        work = start_all_to_all()
        repeated(compute, times)
        work.wait()

    comm_s, compute_s, both_s = slowest_rank([comm_s, time(lambda: repeated(compute, times)), time(both)],
                                             device, group)
    shorter = min(comm_s, compute_s)
    return 1.0 if shorter <= 0 else min(1.0, max(0.0, (comm_s + compute_s - both_s) / shorter))


def _overlap_efficiencies(model, moe: MoE, x: torch.Tensor, batch: int, ctx,
                          time: Callable[[Callable[[], object]], float]) -> tuple[float, float | None]:
    """`measure_overlap_efficiency` beside the layer `moe`'s dispatch all-to-all of the whole
    batch (x: its input), each timing by `time` (the profile's), for two kinds of work: the
    layer's experts' forward (η, `ModelProfile.overlap_efficiency`), and the work Lancet's dW
    schedule runs beside an all-to-all (sec. 4, Alg. 1), the weight-gradient matmul (dy^T x over
    the batch's tokens, in the compute dtype) of the model's largest linear layer the schedule
    defers (`ModelProfile.dw_efficiency`; None where the model has none), run as the schedule runs
    its items (`weft.ops.wgrad.beside_collective`: on CUDA it leaves the all-to-all a few SMs,
    which a persistent GEMM would hold until its end). The experts' η need not hold for the
    latter: a weight-gradient matmul reads two activations and writes a weight, and shares SMs
    and memory with NCCL's kernels in its own way."""
    tokens, dtype = _tokens(x, batch, 1), compute_dtype(moe, x, ctx)
    src, out = _all_to_all_buffers(_a2a_bytes(moe, tokens, x), group_size(moe.group), dtype, x.device)

    def dispatch() -> dist.Work:
        return dist.all_to_all_single(out, src, group=moe.group, async_op=True)

    experts, _ = expert_call(moe, x, ctx)
    efficiency = measure_overlap_efficiency(experts, dispatch, moe.group, x.device, time=time)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if not linears:
        return efficiency, None
    out_features, in_features = max(linears, key=lambda m: m.weight.numel()).weight.shape
    x_TI = torch.randn(tokens, in_features, device=x.device).to(dtype)
    dy_TO = torch.randn(tokens, out_features, device=x.device).to(dtype)

    def weight_grad() -> torch.Tensor:
        with beside_collective(x.is_cuda):
            return torch.mm(dy_TO.t(), x_TI)
    return efficiency, measure_overlap_efficiency(weight_grad, dispatch, moe.group, x.device, time=time)


def unit_inputs(model, units: Sequence, idx: torch.Tensor) -> list[torch.Tensor]:
    """Each of `units`' input on token ids `idx` (the embedding, then each unit's output), from
    one forward pass without gradients (under the caller's autocast)."""
    with torch.no_grad():
        inputs = [model.tok_emb(idx)]
        for unit in units[:-1]:
            inputs.append(unit(inputs[-1]))
    return inputs


def profile_model(
    model,
    idx: torch.Tensor,
    partitions: Sequence[int],
    cost_model: CommCostModel | None = None,
    repeats: int = 5,
    autocast: Callable[[], object] | None = None,
    graphed: bool = False,
    degrees: Sequence[int] = (),
    in_step: bool = False,
) -> tuple[ModelProfile, CommCostModel | None]:
    """Profile `model` (a weft GPT) on token ids `idx` (batch, seq) for each partition count in
    `partitions` (those above the batch size are skipped). Call on every rank of the EP group.
    `degrees`: Tutel's pipelining degrees (> 1) to price each MoE layer at (`ModelProfile.chunks`:
    its experts timed on one chunk of their rows, the chunk's all-to-all from the cost model).
    `graphed`: time the computation as CUDA graph replays (the module docstring); the all-to-alls
    are measured eagerly either way (one collective call each, no host cost to speak of).
    `in_step` (graphed only): also time what the function `in_step` corrects the prices by
    (`ModelProfile.weight_cast`, `forward_in_step`).
    Returns the profile and the cost model used (measured here when none is given)."""
    device = idx.device
    replays = [0, 0]  # replayed, timed eagerly (graphed profiles)
    side = torch.cuda.Stream(device) if graphed and device.type == "cuda" else None  # every capture's

    def time(fn: Callable[[], object]) -> float:
        """`graph_seconds` where `graphed` and fn can be captured, else `time_call`."""
        replayed = graph_seconds(fn, device, repeats, stream=side) if graphed else None
        if graphed:
            replays[replayed is None] += 1
        return replayed if replayed is not None else time_call(fn, device, repeats)
    measure_in_step = graphed and in_step
    batch = idx.shape[0]
    ks = sorted({k for k in partitions if 1 <= k <= batch} | {1})
    chunked = sorted({d for d in degrees if d > 1})
    ctx = autocast or contextlib.nullcontext
    rope_args = (idx.shape[1], model.config.head_dim, model.config.rope_theta, device)
    with ctx():
        units = model.units(rotary_tables(*rope_args))
        inputs = unit_inputs(model, units, idx)
    moes = [u.moe for u in units if isinstance(u, MoESubLayer)]
    if cost_model is None and moes and group_size(moes[0].group) > 1:
        sizes = [_a2a_bytes(m, _tokens(inputs[0], batch, k), inputs[0]) for m in moes for k in ks]
        sizes += [_a2a_bytes(m, _tokens(inputs[0], batch, 1), inputs[0]) // d for m in moes for d in chunked]
        cost_model = measure_all_to_all(sizes, moes[0].group, device, compute_dtype(moes[0], inputs[0], ctx), repeats)

    flat: list[float] = []  # every timing, in a fixed order, so one all-reduce agrees them
    for u, unit in enumerate(units):
        for k in ks:
            part = inputs[u][: math.ceil(batch / k)]
            if isinstance(unit, MoESubLayer):
                flat += _time_moe(unit, part, ctx, time, cost_model)
            else:
                flat.append(time(lambda: _forward(unit, part, ctx)))
        if isinstance(unit, MoESubLayer):
            flat += _time_chunks(unit.moe, inputs[u], ctx, time, cost_model, chunked)
            if measure_in_step:
                flat += _time_in_step(unit, inputs[u], ctx, time)
        flat.append(_time_backward(unit, inputs[u], ctx, time, list(model.blocks[u // 2].parameters())))
    flat.append(_time_rest(model, idx, inputs[-1], units[-1], ctx, time))
    flat.append(_time_model_backward(model, idx, ctx, repeats, time if graphed else None))
    agreed = torch.tensor(flat, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    values = iter(agreed.tolist())

    names = [f"{'attn' if u % 2 == 0 else ('moe' if isinstance(unit, MoESubLayer) else 'mlp')}{u // 2}"
             for u, unit in enumerate(units)]
    plan_units: list[planner.Unit] = []
    backward, backward_comm, chunks, weight_cast, forward_in_step = [], [], [], [], []
    for u, unit in enumerate(units):
        cast, stepped = 0.0, None
        if isinstance(unit, MoESubLayer):
            stages = {k: [next(values) for _ in range(4)] for k in ks}
            plan_units.append(planner.MoEUnit(
                names[u], {k: s[0] for k, s in stages.items()}, {k: s[1] for k, s in stages.items()},
                {k: s[2] for k, s in stages.items()}, {k: s[3] for k, s in stages.items()},
                partition_before=can_route_in_parts(unit.moe)))
            backward_comm.append(stages[1][1] + stages[1][3])
            chunks.append({d: (next(values), next(values)) for d in chunked})
            if measure_in_step:
                cast, stepped = next(values), next(values)
                stepped = stepped if stepped > 0 else None
        else:
            plan_units.append(planner.ComputeUnit(names[u], {k: next(values) for k in ks}))
            backward_comm.append(0.0)
            chunks.append({})
        weight_cast.append(cast)
        forward_in_step.append(stepped)
        backward.append(next(values))
    rest = next(values)
    # Sub-layers timed one by one overestimate their backward (each call pays autograd's start-up
    # and runs without the host racing ahead; docs/benchmarks.md): keep their shares, but
    # scale them to one measured backward of the whole model (all-to-alls removed, head included).
    whole = next(values)
    if sum(backward) > 0:
        scale = max(whole - rest, 0.5 * whole) / sum(backward)
        backward = [b * scale for b in backward]
    efficiency, dw_efficiency = 1.0, None
    if moes and group_size(moes[0].group) > 1:
        first = next(u for u, unit in enumerate(units) if isinstance(unit, MoESubLayer))
        efficiency, dw_efficiency = _overlap_efficiencies(model, moes[0], inputs[first], batch, ctx, time)
    return ModelProfile(plan_units, backward, backward_comm, rest, names, tuple(replays) if graphed else None,
                        efficiency, chunks, weight_cast if measure_in_step else [],
                        forward_in_step if measure_in_step else [], dw_efficiency), cost_model


def _tokens(x: torch.Tensor, batch: int, k: int) -> int:
    return math.ceil(batch / k) * (x[0].numel() // x.shape[-1])


def compute_dtype(moe: MoE, x: torch.Tensor, ctx) -> torch.dtype:
    with ctx():
        return moe.experts.compute_dtype(x)


def routed_rows(moe: MoE, tokens: int) -> int:
    """Rows a rank sends (and, balanced, receives) for `tokens` tokens: the kept slots."""
    rows = tokens * moe.top_k
    if moe.capacity_factor is not None and moe.capacity_factor > 0:
        per_expert = capacity_bound(moe.top_k, moe.capacity_factor, tokens, moe.num_experts)
        rows = min(rows, per_expert * moe.num_experts)
    return rows


def _a2a_bytes(moe: MoE, tokens: int, x: torch.Tensor) -> int:
    dtype = moe.experts.w1.dtype if x.device.type == "cpu" else torch.bfloat16
    return routed_rows(moe, tokens) * moe.dim * torch.tensor([], dtype=dtype).element_size()


def _forward(unit, x: torch.Tensor, ctx) -> torch.Tensor:
    with ctx():
        out = unit(x.detach().requires_grad_())
    if isinstance(unit, MoESubLayer):  # its routing losses would keep this call's autograd graph alive
        unit.moe.record(None)
    return out


def expert_call(moe: MoE, x: torch.Tensor, ctx, chunks: int = 1) -> tuple[Callable[[], torch.Tensor], int]:
    """The experts' forward on the rows a rank's experts receive for the tokens of x (balanced
    over its local experts), in the layout the layer uses: padded modes one batched matmul over
    (El, rows / El, dim), dropless grouped GEMM; `chunks`: on one of that many chunks of the rows
    (Tutel's pipelining degree). Returns (call, rows)."""
    rows = math.ceil(routed_rows(moe, x[0].numel() // x.shape[-1] * x.shape[0]) / chunks)
    local = moe.num_local_experts
    with ctx():
        dtype = moe.experts.compute_dtype(x)
    if moe.capacity_factor is not None:
        per_expert = math.ceil(rows / local)
        recv = torch.randn(local, per_expert, moe.dim, device=x.device).to(dtype)

        def call() -> torch.Tensor:
            with ctx():
                return moe.experts(recv.detach().requires_grad_())
        return call, local * per_expert
    counts = [rows // local + (1 if i < rows % local else 0) for i in range(local)]
    flat = torch.randn(rows, moe.dim, device=x.device).to(dtype)

    def grouped() -> torch.Tensor:
        with ctx():
            return moe.experts.forward_grouped(flat.detach().requires_grad_(), counts)
    return grouped, rows


def _local(unit):
    """An MoE sub-layer with its all-to-alls removed and the same expert work (tokens stay on the
    rank): everything it computes, without the communication the cost model prices. Other units
    are returned as they are."""
    if not isinstance(unit, MoESubLayer):
        return unit
    return dataclasses.replace(unit, overrides={**unit.overrides, "communicate": False})


def _time_moe(unit: MoESubLayer, x: torch.Tensor, ctx, time: Callable[[Callable[[], object]], float],
              cost_model) -> list[float]:
    """[gate, dispatch, experts, combine] seconds for one partition x. The gate stage holds all
    of the sub-layer's computation but the experts (norm, router, dispatch and combine copies,
    residual): the sub-layer without communication, less its experts."""
    moe = unit.moe
    experts, rows = expert_call(moe, x, ctx)
    # The sub-layer with its all-to-alls removed and the same expert work (tokens stay on the
    # rank): everything it computes, without the communication the cost model prices.
    whole = time(lambda: _forward(_local(unit), x, ctx))
    expert_time = time(experts)
    comm = _exchange_seconds(cost_model, moe, rows, x, ctx)
    return [max(0.0, whole - expert_time), comm, expert_time, comm]


def _time_chunks(moe: MoE, x: torch.Tensor, ctx, time: Callable[[Callable[[], object]], float], cost_model,
                 degrees: Sequence[int]) -> list[float]:
    """[experts, all-to-all] seconds of one of d chunks of the layer's rows on x, for each
    pipelining degree d in `degrees` (Tutel's chunks; `ModelProfile.chunks`), flat."""
    times = []
    for degree in degrees:
        experts, rows = expert_call(moe, x, ctx, degree)
        times += [time(experts), _exchange_seconds(cost_model, moe, rows, x, ctx)]
    return times


def _time_in_step(unit: MoESubLayer, x: torch.Tensor, ctx, time: Callable[[Callable[[], object]], float],
                  ) -> list[float]:
    """[the experts' weights cast to the compute dtype once, the sub-layer's forward with its
    all-to-alls] seconds on x, for `in_step` (`ModelProfile.weight_cast`, `forward_in_step`); 0
    for what is not measured: a dropless layer or one sized by its counts (capacity factor <= 0:
    its exchange sizes are read on the host, so its forward cannot be captured as the padded
    one's; dropless pipelined chunks each cast the weights), one that does not communicate or
    whose exchange is still to be tuned ("auto": the tuner would time its candidates inside the
    capture), weights already in the compute dtype (no cast)."""
    moe = unit.moe
    call = moe.call_with(**unit.overrides)
    if not (call.capacity_factor or 0) > 0 or not call.communicate or group_size(moe.group) == 1 \
            or is_tuned(call, moe.parallel, moe.ep_size):
        return [0.0, 0.0]
    dtype = compute_dtype(moe, x, ctx)
    weights = [w for w in moe.experts.weights() if w is not None]
    cast = 0.0
    if any(w.dtype != dtype for w in weights):
        cast = time(lambda: [w.detach().to(dtype) for w in weights])
    return [cast, time(lambda: _forward(unit, x, ctx))]


def _exchange_seconds(cost_model: CommCostModel | None, moe: MoE, rows: int, x: torch.Tensor, ctx) -> float:
    """The cost model's price of an all-to-all of `rows` rows of the layer's width (0 without one,
    or where the layer does not communicate)."""
    if cost_model is None or group_size(moe.group) == 1:
        return 0.0
    element = torch.tensor([], dtype=compute_dtype(moe, x, ctx)).element_size()
    return cost_model.predict("all_to_all", rows * moe.dim * element)


def drop_gradients(params: Sequence[torch.Tensor]) -> None:
    """Every `.grad` of `params` None, as a training step's backward finds them (the optimizer
    step sets them to None; a CUDA graph step that owns its gradients writes them afresh): the
    backward then takes each new gradient as `.grad`. A profiled backward that found them would
    add into them instead: two reads and a write of every float32 gradient that the step does
    not pay (gpt2-l-moe, ~1.8 B parameters per rank: ~20 GB of memory traffic, several ms on an
    H100; its graphed profile priced the plain step 5 ms, 10%, too high, docs/overlap.md)."""
    for p in params:
        p.grad = None


def _time_backward(unit, x: torch.Tensor, ctx, time: Callable[[Callable[[], object]], float],
                   params: Sequence[torch.Tensor]) -> float:
    """Backward compute of a sub-layer on the whole batch: (forward + backward) - forward, each
    backward from no gradient on `params` (its block's: `drop_gradients`). The all-to-alls of an
    MoE layer are priced separately, so it is timed without them."""
    local = _local(unit)

    def forward() -> torch.Tensor:
        return _forward(local, x, ctx)

    grad = torch.randn_like(forward())

    def both():
        drop_gradients(params)
        forward().backward(grad)

    return max(0.0, time(both) - time(forward))


def _time_model_backward(model, idx: torch.Tensor, ctx, repeats: int,
                         time: Callable[[Callable[[], object]], float] | None = None) -> float:
    """Median seconds of `loss.backward()` of the whole model on idx, without its all-to-alls,
    each from no gradient (`drop_gradients`); with `time` (graphed profiles): (forward +
    backward) - forward, each timed by it."""
    params = list(model.parameters())

    def forward() -> torch.Tensor:
        with ctx():
            return model(idx, idx, moe_overrides={"communicate": False})[1]

    def both() -> None:
        drop_gradients(params)
        forward().backward()

    if time is not None:
        backward = max(0.0, time(both) - time(forward))
    else:
        times = []
        for i in range(repeats + 1):  # the first is warm-up
            loss = forward()
            drop_gradients(params)
            elapsed = seconds(loss.backward, idx.device)
            if i:
                times.append(elapsed)
        backward = statistics.median(times)
    model.zero_grad(set_to_none=True)
    return backward


def _time_rest(model, idx: torch.Tensor, last_input: torch.Tensor, last_unit, ctx,
               time: Callable[[Callable[[], object]], float]) -> float:
    """Embedding, final norm, head and loss, forward + backward (not partitioned; from no
    gradient, `drop_gradients`)."""
    with ctx(), torch.no_grad():
        final = last_unit(last_input)
    targets = idx

    params = [p for module in (model.tok_emb, model.norm, model.head) for p in module.parameters()]

    def run():
        drop_gradients(params)
        with ctx():
            x = model.tok_emb(idx)
            logits = model.head(model.norm(final.detach() + 0 * x))
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()

    return time(run)
