"""`weft.overlap.optimize`: profile a model, plan Lancet's two passes and apply them.

    plan = weft.overlap.optimize(model, idx)      # every rank of the EP group, same batch shape
    print(plan.summary())                         # the plan, and what measuring it kept
    loss = model(idx, targets)[1]
    plan.backward(loss)                           # loss.backward() with dW scheduling

What a model must provide to be optimised (weft's GPT does):
- `units(rope)`: its blocks as residual sub-layers `x -> x` in order, MoE sub-layers as
  `weft.models.gpt.MoEUnit(norm, moe)`; every other unit must be row-wise in the batch
  (attention inside a sequence is), so a batch partition can run through it alone;
- `unit_runner`: None, or a callable `(units, x) -> x` its forward runs the units with (set here to a
  `weft.overlap.forward.PartitionedRunner`);
- `tok_emb`, `norm`, `head`, `config.head_dim`, `config.rope_theta` (for profiling);
- linear layers whose weight gradient may be deferred as `weft.ops.wgrad.Linear`, and
  `weft.MoE` layers (their experts and all-to-alls take the scheduler).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from weft.comm.cost_model import CommCostModel
from weft.distributed import group_size
from weft.moe.experts import Experts
from weft.moe.layer import MoE
from weft.ops.wgrad import Linear, WGradScheduler
from weft.overlap import planner
from weft.overlap.forward import PartitionedRunner, Range
from weft.overlap.profile import ModelProfile, profile_model
from weft.overlap.profile import in_step as with_in_step_corrections
from weft.precision import training_autocast
from weft.profiling import time_candidates

DEFAULT_PARTITIONS = (1, 2, 4, 8)
# Share of a layer's backward that is the weight gradient (dX and dW are matmuls of equal size).
DW_SHARE = 0.5
# A pass is kept only if the measured iteration with it is this much faster than without it: a
# smaller difference is within the noise of a few timed iterations, and plain costs nothing.
MIN_MEASURED_GAIN = 0.01
# The same for candidates timed as CUDA graph replays (`weft.graphs.time_graphed`): a replay has no
# host cost for the margin to cover, so it only breaks near-ties (0.3%, about the spread of a
# graphed step's replays); the 1% margin dropped a dW schedule timed 0.6% faster on gpt2-l-moe,
# which the session before had kept and run 1.4% faster (docs/benchmarks.md, forty-first session).
GRAPHED_MIN_GAIN = 0.003


@dataclass
class OverlapPlan:
    """What `optimize` chose, and its predicted times (seconds, forward + backward). `profile` is
    what was measured; every price is built from `priced`, the same with a graphed profile's
    in-step corrections applied where it measured them (`weft.overlap.profile.in_step`)."""

    ranges: list[Range]
    scheduler: WGradScheduler | None
    forward_plan: planner.Plan | None
    profile: ModelProfile = field(repr=False)
    predicted: float  # iteration (forward + backward) with the plan
    baseline: float  # the same without Lancet: unpartitioned forward, every all-to-all exposed
    parts: dict[str, float] = field(default_factory=dict)  # predicted forward, backward, rest
    # Measured forward + backward seconds of each combination of the passes on the sample batch
    # ("none", "backward", "forward", "both"; empty when not measured), and the one applied.
    measured: dict[str, float] = field(default_factory=dict)
    chosen: str = "none"

    @functools.cached_property
    def priced(self) -> ModelProfile:
        """The profile the prices come from: `profile` with its in-step corrections (itself where
        none were measured: eager profiles, and graphed ones not asked for them). Computed once."""
        return with_in_step_corrections(self.profile)

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, with deferred weight gradients scheduled under the all-to-alls."""
        with self.scheduler.backward() if self.scheduler is not None else contextlib.nullcontext():
            loss.backward()

    def summary(self) -> str:
        lines = []
        if self.forward_plan is not None:
            lines.append("forward pipelines (Lancet sec. 5):")
            lines.append(self.forward_plan.summary(self.profile.names))
        else:
            lines.append("forward: unpartitioned")
        lines.append(f"backward: weight-gradient scheduling {'on' if self.scheduler is not None else 'off'}")
        gain = 1 - self.predicted / self.baseline if self.baseline > 0 else 0.0
        lines.append(f"predicted forward+backward: {self.predicted * 1e3:.3f} ms vs {self.baseline * 1e3:.3f} ms "
                     f"without Lancet ({gain:+.1%})")
        if _corrected(self.profile):
            lines.append("priced with the graphed profile's in-step corrections (each padded MoE layer's weight cast "
                         "once per call, its all-to-alls at their time in its graphed forward)")
        if self.profile.overlap_efficiency < 1.0:
            lines.append(f"overlap efficiency {self.profile.overlap_efficiency:.2f} (the share of an all-to-all's "
                         f"overlap with computation that is saved, measured)")
        if self.profile.dw_efficiency is not None:
            lines.append(f"the same for a weight-gradient matmul beside an all-to-all: "
                         f"{self.profile.dw_efficiency:.2f} (measured; the price applies the experts' η to the "
                         f"dW schedule)")
        if self.profile.graph_replays is not None:
            replayed, eager = self.profile.graph_replays
            lines.append(f"profiled as CUDA graph replays: {replayed} of {replayed + eager} calls"
                         + (f" ({eager} could not be captured: timed eagerly)" if eager else ""))
        if self.measured:
            times = ", ".join(f"{name} {t * 1e3:.3f}" for name, t in self.measured.items())
            lines.append(f"measured forward+backward ms: {times}; kept: {self.chosen}")
        return "\n".join(lines)

    def predicted_pipelined(self, degrees: Sequence[int], scheduling: bool) -> float | None:
        """Predicted forward + backward seconds of the unpartitioned step with MoE layer i
        pipelined at `degrees[i]` (Tutel's chunks, as a graphed `--overlap lancet` step runs them)
        and the dW schedule on or off: `predict_forward` + `predict_backward` + the rest. None
        where the plan partitions the forward (its ranges replace those layers) or a degree
        above 1 was not profiled (`optimize(degrees=...)`)."""
        if self.ranges and any(d > 1 for d in degrees):
            return None
        return _price(self.priced, degrees, scheduling)

    def to_dict(self) -> dict:
        priced = self.priced
        return {
            "ranges": [dataclasses.asdict(r) for r in self.ranges],
            "wgrad_scheduling": self.scheduler is not None,
            "forward_plan": None if self.forward_plan is None else self.forward_plan.to_dict(),
            "predicted_s": self.predicted,
            "baseline_s": self.baseline,
            "predicted_parts_s": dict(self.parts),
            "measured_s": dict(self.measured),
            "chosen": self.chosen,
            "graph_replays": self.profile.graph_replays,
            "overlap_efficiency": self.profile.overlap_efficiency,
            "dw_efficiency": self.profile.dw_efficiency,
            "profile_s": {  # per sub-layer, unpartitioned: what the prediction is built from (`priced`)
                "names": list(priced.names),
                "forward": [planner.serial_time(u) for u in priced.units],
                "backward": list(priced.backward),
                "backward_comm": list(priced.backward_comm),
                "rest": priced.rest,
                # MoE sub-layers: Tutel's degree -> [experts on one chunk, one chunk's all-to-all]
                "chunks": {name: {d: list(c) for d, c in chunks.items()}
                           for name, chunks in zip(priced.names, priced.chunks) if chunks},
                # graphed profiles: what `profile.in_step` corrected the measured profile by (per sub-layer)
                "weight_cast": list(self.profile.weight_cast),
                "forward_in_step": list(self.profile.forward_in_step),
            },
        }


def optimize(
    model: nn.Module,
    sample_batch: torch.Tensor | tuple[torch.Tensor, ...],
    *,
    forward: bool = True,
    backward: bool = True,
    max_partitions: int = 8,
    max_range: int | None = None,
    group_time: float | None = None,
    partitions: tuple[int, ...] | None = None,
    cost_model: CommCostModel | None = None,
    repeats: int = 5,
    measure: int = 5,
    graphed: bool = False,
    degrees: Sequence[int] = (),
    in_step: bool = False,
) -> OverlapPlan:
    """Profile `model` on `sample_batch` (token ids (batch, seq), or (ids, targets)), plan the
    forward ranges by Lancet's DP and turn on dW scheduling; applies the plan to the model and
    returns it. A collective: call on every rank with the same batch shape. `forward=False` /
    `backward=False` leave that pass off (ablations); dW scheduling is also left off when no MoE
    layer communicates (expert-parallel size 1). `partitions`: the counts k to consider
    (default 1, 2, 4, 8 up to `max_partitions`); `cost_model`: all-to-all costs from
    `weft bench comm` (default: measured here at the sizes the plan needs).

    `measure` (default 5; 0: off): the plan is then timed against the model without it, and with
    each pass alone, on the sample batch (`measure` forward + backward iterations each,
    interleaved, the slowest rank's median; `keep_what_pays`). A pass is kept only where an
    iteration with it measured at least `MIN_MEASURED_GAIN` faster than the best without it: the
    planner's model does not price what its passes cost the host (deferring dW runs each weight
    gradient through a hook and a queue; a partitioned forward launches every op once per
    partition), and where that cost exceeds what they hide, plain is faster. Every combination
    computes the same losses and gradients, so measuring picks speed only.

    `graphed`: the steps replay as one CUDA graph, so the profile times its calls as graph
    replays (`weft.overlap.profile`), without the host costs a replay does not pay. `degrees`:
    Tutel's pipelining degrees to price the MoE layers at too (`OverlapPlan.predicted_pipelined`;
    a graphed step times each layer's degree and may pick one above 1). `in_step` (graphed): also
    measure the profile's in-step corrections, and price every plan with them
    (`OverlapPlan.priced`; `predicted_uncorrected` keeps the price without them)."""
    idx = sample_batch[0] if isinstance(sample_batch, (tuple, list)) else sample_batch
    if not isinstance(max_partitions, int) or max_partitions < 1:
        raise ValueError(f"max_partitions must be a positive integer, got {max_partitions!r}")
    ks = tuple(k for k in (partitions or DEFAULT_PARTITIONS) if k <= max_partitions)
    if not ks or any(not isinstance(k, int) or k < 1 for k in ks):
        raise ValueError(f"partitions must be positive integers <= max_partitions, got {partitions!r}")
    apply(model, [], None)
    was_training = model.training
    model.train()
    autocast = functools.partial(training_autocast, idx.device)  # profile as the training loop runs
    measured_profile, cost_model = profile_model(model, idx, ks, cost_model, repeats, autocast, graphed, degrees,
                                                 in_step)
    profile = with_in_step_corrections(measured_profile)  # the prices (`OverlapPlan.priced`)
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    forward_plan = planner.plan(profile.units, max_partitions, max_range, group_time,
                                profile.overlap_efficiency) if forward else None
    ranges = [] if forward_plan is None else [
        Range(s.start, s.end, s.partitions, s.moe) for s in forward_plan.pipelines() if s.partitions > 1]
    scheduler = None
    # With no all-to-all (every MoE layer on one rank) deferring dW hides nothing and only costs.
    communicating = any(group_size(m.group) > 1 for m in model.modules() if isinstance(m, MoE))
    if backward and communicating:
        comm_time = None if cost_model is None else functools.partial(cost_model.predict, "all_to_all")
        scheduler = WGradScheduler(comm_time=comm_time)
    measured = {}
    if measure and (ranges or scheduler is not None):
        model.train()
        measured, (ranges, scheduler) = keep_what_pays(model, sample_batch, ranges, scheduler, autocast, measure)
        model.train(was_training)
    apply(model, ranges, scheduler)
    serial_forward = predict_forward(profile)
    forward_time = forward_plan.predicted if ranges else serial_forward
    backward_time = predict_backward(profile, scheduler is not None)
    predicted = forward_time + backward_time + profile.rest
    baseline = serial_forward + predict_backward(profile, False) + profile.rest
    parts = {"forward": forward_time, "backward": backward_time, "rest": profile.rest}
    return OverlapPlan(ranges, scheduler, forward_plan, measured_profile, predicted, baseline, parts, measured,
                       combination(ranges, scheduler))


def layer_degrees(model: nn.Module) -> tuple[int, ...]:
    """Each MoE layer's pipelining degree, in order (one not yet tuned, "auto", counts as 1)."""
    return tuple(d if isinstance(d, int) else 1 for d in (m.overlap_degree for m in model.modules()
                                                         if isinstance(m, MoE)))


def predicted_as_run(plan: OverlapPlan, wgrad_scheduled: bool,
                     degrees: tuple[int, ...] = ()) -> tuple[float | None, str]:
    """Lancet's predicted forward + backward seconds of the step as it ran, and which form that
    is: the plan's own (`plan.predicted`) where its dW schedule ran or it had none; where a graphed
    step dropped the schedule (`build_micro_step` keeps it only if it replays faster) and the
    forward is unpartitioned, the step is the plain one (`plan.baseline`); with a partitioned
    forward and no dW schedule the planner priced no such form (None). A graphed step whose MoE
    layers run pipelined (`degrees`, one per layer, some above 1) is priced with Tutel's chunks
    (`OverlapPlan.predicted_pipelined`), or None where the plan did not profile those degrees."""
    if any(d > 1 for d in degrees):
        shown = "/".join(str(d) for d in sorted(set(degrees)))
        predicted = plan.predicted_pipelined(degrees, wgrad_scheduled)
        if predicted is None:
            return None, f"MoE layers pipelined at degree {shown} (not priced)"
        schedule = "lancet" if wgrad_scheduled and plan.scheduler is not None else "its dW schedule dropped"
        return predicted, f"{schedule}, MoE layers pipelined at degree {shown}"
    if wgrad_scheduled or plan.scheduler is None:
        return plan.predicted, "lancet"
    if plan.forward_plan is None:
        return plan.baseline, "without Lancet (its dW schedule dropped)"
    return None, "partitioned forward without the dW schedule (not priced)"


def predicted_uncorrected(plan: OverlapPlan, wgrad_scheduled: bool, degrees: tuple[int, ...] = ()) -> float | None:
    """`predicted_as_run`'s step priced from the measured profile without its in-step corrections
    (`weft.overlap.profile.in_step`), the price before they were measured: kept beside the
    planner's to show what they change (docs/overlap.md). None where the forward is partitioned, a
    degree was not profiled, or the profile measured no correction (the two prices are one)."""
    if plan.ranges or not _corrected(plan.profile):
        return None
    return _price(plan.profile, degrees, wgrad_scheduled and plan.scheduler is not None)


def _corrected(profile: ModelProfile) -> bool:
    """Whether `in_step` changes `profile`'s prices: some MoE layer's in-step forward was measured."""
    return any(t is not None for t in profile.forward_in_step)


def predicted_with_dw_efficiency(plan: OverlapPlan, wgrad_scheduled: bool,
                                 degrees: tuple[int, ...] = ()) -> float | None:
    """`predicted_as_run`'s step with the dW items' own measured η (`ModelProfile.dw_efficiency`)
    in place of the experts' for what the schedule hides: beside the plan's price until measured
    tables show which is nearer (docs/overlap.md). None where the schedule did not run, the
    forward is partitioned, a degree was not profiled, or it was not measured."""
    if not wgrad_scheduled or plan.scheduler is None or plan.ranges or plan.profile.dw_efficiency is None:
        return None
    return _price(plan.priced, degrees, True, plan.profile.dw_efficiency)


def _price(profile: ModelProfile, degrees: Sequence[int], scheduling: bool,
           dw_efficiency: float | None = None) -> float | None:
    """`predict_unpartitioned`, or None where a degree above 1 was not profiled."""
    try:
        return predict_unpartitioned(profile, degrees, scheduling, dw_efficiency)
    except KeyError:
        return None


def pipelined_predictions(plan: OverlapPlan, degrees: Sequence[int]) -> dict[int, dict]:
    """Lancet's model of the step with its forward unpartitioned and every MoE layer pipelined at
    each of `degrees` (Tutel's chunks, which the profile must have priced: `optimize(degrees=)`):
    degree -> {"plain": seconds without the dW schedule, "scheduled": with it, whether or not the
    plan kept it}. A degree the profile did not price is left out; with no MoE layer, every one."""
    priced = plan.priced
    moe_layers = sum(isinstance(unit, planner.MoEUnit) for unit in priced.units)
    table = {}
    for degree in degrees if moe_layers else ():
        layers = (degree,) * moe_layers
        plain, scheduled = _price(priced, layers, False), _price(priced, layers, True)
        if plain is not None:
            table[degree] = {"plain": plain, "scheduled": scheduled}
    return table


def keep_what_pays(model: nn.Module, sample_batch: torch.Tensor | tuple[torch.Tensor, ...], ranges: list[Range],
                   scheduler: WGradScheduler | None, autocast, trials: int
                   ) -> tuple[dict[str, float], tuple[list[Range], WGradScheduler | None]]:
    """Time forward + backward of `model` on the sample batch with each combination of the planned
    passes (forward `ranges`, dW scheduling like `scheduler`): "none", "backward", "forward",
    "both" (those the plan has), interleaved, `trials` timed iterations after two untimed ones (a
    scheduler plans from its previous backward), the slowest rank's median. Returns the times and
    the (ranges, scheduler) of the kept combination (`choose_passes`). Leaves the model plain; the
    caller applies the choice."""
    idx, targets = (sample_batch[0], sample_batch[1]) if isinstance(sample_batch, (tuple, list)) else (
        sample_batch, sample_batch)
    scheduling = scheduler is not None
    names = ["none"] + (["backward"] if scheduling else []) + (["forward"] if ranges else []) + (
        ["both"] if scheduling and ranges else [])
    # One scheduler per combination: each follows the trace of its own previous backward.
    settings = {name: (ranges if name in ("forward", "both") else [],
                       WGradScheduler(scheduler.comm_time, scheduler.in_place) if name in ("backward", "both")
                       else None) for name in names}

    def step(name: str) -> None:
        step_ranges, step_scheduler = settings[name]
        apply(model, step_ranges, step_scheduler)
        with autocast():
            loss = model(idx, targets)[1]
        with step_scheduler.backward() if step_scheduler is not None else contextlib.nullcontext():
            loss.backward()
        model.zero_grad(set_to_none=True)

    times = dict(zip(names, time_candidates(step, names, idx.device, trials, warmup=2)))
    apply(model, [], None)
    return times, settings[choose_passes(times)]


def combination(ranges: list[Range], scheduler: WGradScheduler | None) -> str:
    """The name of the passes applied: "none", "backward" (dW scheduling), "forward" (ranges), "both"."""
    return ("both" if scheduler is not None else "forward") if ranges else (
        "backward" if scheduler is not None else "none")


def choose_passes(times: dict[str, float], min_gain: float = MIN_MEASURED_GAIN) -> str:
    """The combination of passes to keep from measured times: more passes only where they pay.
    A combination is kept over every one it extends ("both" extends "forward" and "backward",
    each of those extends "none") only if it is faster than the best of them by `min_gain`."""
    extends = {"none": (), "backward": ("none",), "forward": ("none",), "both": ("none", "backward", "forward")}
    best = "none"
    for name in ("backward", "forward", "both"):
        if name not in times:
            continue
        simpler = min(times[s] for s in extends[name] if s in times)
        if times[name] < simpler * (1 - min_gain) and times[name] < times[best]:
            best = name
    return best


def apply(model: nn.Module, ranges: list[Range], scheduler: WGradScheduler | None) -> None:
    """Set the forward ranges and the dW scheduler on `model` (empty / None: plain model)."""
    model.unit_runner = PartitionedRunner(tuple(ranges)) if ranges else None
    for module in model.modules():
        if isinstance(module, (Linear, Experts, MoE)):
            module.wgrad_scheduler = scheduler


def forget_wgrad_plans(model: nn.Module) -> None:
    """Every dW scheduler set on `model` plans afresh from its next backward
    (`WGradScheduler.forget`): for a change of the step's configuration."""
    schedulers = {id(s): s for s in (getattr(m, "wgrad_scheduler", None) for m in model.modules()) if s is not None}
    for scheduler in schedulers.values():
        scheduler.forget()


def _degree(degrees: Sequence[int], moe_index: int) -> int:
    return degrees[moe_index] if moe_index < len(degrees) else 1


def predict_forward(profile: ModelProfile, degrees: Sequence[int] = ()) -> float:
    """The unpartitioned forward: every sub-layer's time on the whole batch, MoE layer i (in
    order) pipelined in `degrees[i]` chunks (1 where not given): its gate on the whole batch,
    then Tutel's chunked exchange (`planner.chunked_exchange`) of the profiled chunk times.
    Raises KeyError for a degree above 1 that was not profiled."""
    total, moe_index = 0.0, 0
    for unit, chunks in zip(profile.units, profile.chunks or [{}] * len(profile.units)):
        degree = 1
        if isinstance(unit, planner.MoEUnit):
            degree, moe_index = _degree(degrees, moe_index), moe_index + 1
        if degree == 1:
            total += planner.serial_time(unit)
            continue
        experts, comm = chunks[degree]
        total += unit.gate[1] + planner.chunked_exchange(comm, experts, comm, degree,
                                                         efficiency=profile.overlap_efficiency)
    return total


def predict_unpartitioned(profile: ModelProfile, degrees: Sequence[int], scheduling: bool,
                          dw_efficiency: float | None = None) -> float:
    """Forward + backward + the rest, the forward unpartitioned, MoE layer i at `degrees[i]`."""
    return (predict_forward(profile, degrees) + predict_backward(profile, scheduling, degrees, dw_efficiency)
            + profile.rest)


def predict_backward(profile: ModelProfile, scheduling: bool, degrees: Sequence[int] = (),
                     dw_efficiency: float | None = None) -> float:
    """Backward compute plus the all-to-all time left exposed. Walking the sub-layers in backward
    order, the weight-gradient share of each finished layer joins a pool that the next all-to-alls
    draw from (Lancet Alg. 1 hides at most the pool, at most the all-to-all); of the time they
    overlap, `dw_efficiency` is saved (default `profile.overlap_efficiency`, the experts' η; all
    of it in Lancet's model).

    MoE layer i (in forward order) pipelined at `degrees[i]` > 1 runs its experts' backward as
    Tutel's chunked exchange (`planner.chunked_exchange`: each chunk's input gradient the size of
    its forward, then the weight gradients over every chunk, the forward experts' time, beside
    the last exchanges); the rest of its backward (router, gather and scatter) stays serial, and
    of what the chain leaves exposed the pool may hide the first chunk's exchange (the scheduler
    runs its items there alone: `weft.moe.pipeline`). Raises KeyError for a degree above 1 that
    was not profiled."""
    pool = exposed = 0.0
    total = 0.0
    eta_dw = profile.overlap_efficiency if dw_efficiency is None else dw_efficiency
    moes = sum(isinstance(u, planner.MoEUnit) for u in profile.units)
    chunk_list = profile.chunks or [{}] * len(profile.units)
    layers = zip(reversed(profile.units), reversed(profile.backward), reversed(profile.backward_comm),
                 reversed(chunk_list))
    for unit, compute, comm, chunks in layers:
        if not isinstance(unit, planner.MoEUnit):
            total += compute
            pool += DW_SHARE * compute
            continue
        moes -= 1
        degree = _degree(degrees, moes)
        if degree == 1:
            total += compute
            for half in (0, 1):  # combine's backward, the experts, then dispatch's backward
                hidden = min(comm / 2, pool) if scheduling else 0.0
                pool -= hidden
                exposed += comm / 2 - eta_dw * hidden
                if half == 0:
                    pool += DW_SHARE * compute
            continue
        experts, chunk_comm = chunks[degree]
        whole_experts = unit.experts[1]
        other = max(0.0, compute - 2.0 * whole_experts)  # dX and dW each as long as the forward
        chain = planner.chunked_exchange(chunk_comm, experts, chunk_comm, degree, tail=whole_experts,
                                         efficiency=profile.overlap_efficiency)
        chain_compute = degree * experts + whole_experts
        left = max(0.0, chain - chain_compute)
        hidden = min(left, chunk_comm, pool) if scheduling else 0.0  # the first chunk's exchange only
        pool -= hidden
        total += other + chain_compute
        exposed += left - eta_dw * hidden
        pool += DW_SHARE * other
    return total + exposed
