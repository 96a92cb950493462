"""Pro-Prophet's performance model (sec. IV-B, eqs. 1-8) with this machine's constants, measured
the way Lancet's planner measures its own (`weft.overlap.profile`): the all-to-all's bandwidth
from a communication cost model (measured here, or `weft bench comm`'s), the experts' throughput
from a timed grouped GEMM on the rows a rank computes, and the non-MoE forward and backward that
hide Trans and Agg (eq. 8) from the profiled sub-layers between two balanced layers.

The paper fits one bandwidth B for the all-to-all, Trans and Agg; so does weft (Trans and Agg
run on a side communicator over the same links). Eq. 1 prices the rows a rank receives from the
others, so B is the effective rate of the all-to-all at the layer's own size: the (W - 1) / W of
the rows that cross the wire over the all-to-all's measured time.

Beyond the paper, timed on the layer itself (`measure_unpriced_time`): what a copy costs besides
its bytes, since on 2 x H100 every copy measured slower than the model priced it, and the rest of
the call (routing, dispatch, combine), which eqs. 1-8 leave out: the paper's model alone
predicted 36-74% below the measured layer (docs/balance.md).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from weft.balance import LayerCostModel
from weft.balance.planner import Placement, busiest_weighed, greedy_placement, host_loads, host_slot_rows
from weft.comm.cost_model import CommCostModel
from weft.distributed import group_size
from weft.graphs import time_graphed
from weft.models.gpt import MoEUnit, rotary_tables
from weft.moe.exchange import Transfer
from weft.moe.gates import LinearRouter, logit_shift
from weft.moe.layer import MoE
from weft.overlap import planner
from weft.overlap.profile import (
    compute_dtype,
    expert_call,
    measure_all_to_all,
    profile_model,
    routed_rows,
    time_call,
    unit_inputs,
)
from weft.profiling import time_candidates


def layer_cost_model(moe: MoE, tokens: int, all_to_all: CommCostModel, expert_s: float, dtype: torch.dtype,
                     forward_non_moe_s: float = 0.0, backward_non_moe_s: float = 0.0) -> LayerCostModel:
    """The model of `moe` for calls of `tokens` tokens per rank from measured numbers: the
    all-to-all cost model, `expert_s` the experts' forward on the rows a rank computes for those
    tokens (balanced over the ranks), `dtype` the compute dtype (rows and copies travel in it)."""
    world = moe.ep_size
    if world < 2:
        raise ValueError("a cost model for balancing needs an expert-parallel group of 2 or more ranks")
    if expert_s <= 0:
        raise ValueError(f"expert_s must be > 0, got {expert_s}")
    element = torch.tensor([], dtype=dtype).element_size()
    rows = routed_rows(moe, tokens)
    row_bytes = moe.dim * element
    a2a_s = all_to_all.predict("all_to_all", rows * row_bytes)
    matrices = 3 if moe.experts.activation == "swiglu" else 2
    expert_bytes = matrices * moe.dim * moe.hidden_dim * element
    return LayerCostModel(num_devices=world, bandwidth=rows * (world - 1) / world * row_bytes / a2a_s,
                          throughput=rows / expert_s, row_bytes=row_bytes, expert_param_bytes=expert_bytes,
                          expert_grad_bytes=expert_bytes, forward_non_moe_s=forward_non_moe_s,
                          backward_non_moe_s=backward_non_moe_s)


def measure_layer_cost_model(moe: MoE, x: torch.Tensor, all_to_all: CommCostModel | None = None,
                             autocast: Callable[[], object] | None = None,
                             repeats: int = 5) -> tuple[LayerCostModel, CommCostModel]:
    """Measure the model of one layer called on `x` (..., dim) alone (no block around it: nothing
    else hides Trans and Agg). A collective over the layer's group (the all-to-all, measured
    unless given, and the slowest rank's expert time). Returns it and the all-to-all model."""
    ctx = autocast or contextlib.nullcontext
    tokens_TD = x.reshape(-1, moe.dim)
    dtype = compute_dtype(moe, tokens_TD, ctx)
    if all_to_all is None:
        size = routed_rows(moe, tokens_TD.shape[0]) * moe.dim * torch.tensor([], dtype=dtype).element_size()
        all_to_all = measure_all_to_all([size // 4, size, size * 4], moe.group, x.device, dtype, repeats)
    call, _ = expert_call(moe, tokens_TD.unsqueeze(0), ctx)
    expert_s = torch.tensor([time_call(call, x.device, repeats)], dtype=torch.float64, device=x.device)
    if group_size(moe.group) > 1:
        torch.distributed.all_reduce(expert_s, op=torch.distributed.ReduceOp.MAX, group=moe.group)
    return layer_cost_model(moe, tokens_TD.shape[0], all_to_all, float(expert_s), dtype), all_to_all


def fit_balance_models(model, idx: torch.Tensor, all_to_all: CommCostModel | None = None,
                       autocast: Callable[[], object] | None = None, repeats: int = 5,
                       graphed: bool = False) -> list[LayerCostModel]:
    """Profile `model` (a weft GPT built with balance="pro-prophet") on token ids `idx` (batch,
    seq) and give every balanced layer's planner its measured model; returns them in layer order.
    The non-MoE time that hides a layer's Trans (eq. 8) is the forward computation of the
    sub-layers since the preceding balanced layer (where the block-wise schedule launches it),
    less that layer's experts (eq. 8 adds the experts' time itself); its Agg's, the backward of
    the sub-layers between that are not MoE layers. A collective: every rank, the same batch
    shape. Each layer's `copy_overhead_s`, `rest_s` and scales are then fitted on its own calls
    on its input from this batch (`balanced_layer_inputs`, `measure_unpriced_time`; with `graphed`,
    for layers whose copies go into replica slots on
    CUDA, as CUDA graphs of the layer's `graph_placement`, as a graphed step pays them)."""
    if not model.balanced:
        raise ValueError("fit_balance_models: the model does not balance (build it with balance='pro-prophet')")
    was_training = model.training
    model.train()
    try:
        profile, all_to_all = profile_model(model, idx, [1], all_to_all, repeats, autocast)
    finally:
        model.train(was_training)
    units = model.units(None)
    tokens = idx.numel()
    dtype = compute_dtype(model.moe_layers()[0], model.tok_emb.weight, autocast or contextlib.nullcontext)
    inputs = balanced_layer_inputs(model, idx, autocast)
    fitted, since = [], 0
    for u, unit in enumerate(units):
        if not (isinstance(unit, MoEUnit) and unit.moe.balancer is not None):
            continue
        forward = backward = 0.0
        for i in range(since, u):
            profiled = profile.units[i]
            if isinstance(profiled, planner.MoEUnit):
                forward += profiled.gate[1]
            else:
                forward, backward = forward + profiled.time[1], backward + profile.backward[i]
        expert_s = profile.units[u].experts[1]
        unit.moe.balancer.model = layer_cost_model(unit.moe, tokens, all_to_all, expert_s, dtype, forward, backward)
        # what a copy costs beyond its bytes, on the layer's own call: its input on this batch, whose
        # load the planner plans for (random rows route as no trained router does)
        rows = inputs[id(unit.moe)]
        in_graphs = graphed and rows.is_cuda and unit.moe.copies_in_slots(unit.moe.call_with(**unit.overrides))
        fitted.append(with_unpriced_time(unit.moe, rows, autocast, overrides=unit.overrides, graphed=in_graphs))
        since = u
    return fitted


def balanced_layer_inputs(model, idx: torch.Tensor, autocast: Callable[[], object] | None = None
                          ) -> dict[int, torch.Tensor]:
    """Each balanced MoE layer's input (tokens, dim) on token ids `idx`, by `id` of the layer: the
    normed hidden states its sub-layer hands it, from one forward pass without gradients up to the
    last sub-layer (`unit_inputs`; the balanced layers it runs record their loads, as any call
    does). A collective where the layers are."""
    ctx = autocast or contextlib.nullcontext
    with ctx(), torch.no_grad():
        units = model.units(rotary_tables(idx.shape[1], model.config.head_dim, model.config.rope_theta, idx.device))
        return {id(unit.moe): unit.norm(x).reshape(-1, unit.moe.dim)
                for unit, x in zip(units, unit_inputs(model, units, idx))
                if isinstance(unit, MoEUnit) and unit.moe.balancer is not None}


@dataclass(frozen=True)
class UnpricedTime:
    """What a balanced layer's call spends beyond the paper's model (`LayerCostModel.rest_s` and
    `copy_overhead_s`, in seconds), how much of eqs. 2-3's expert time it follows the busiest
    device's own rows by (`expert_scale`), and what a row computed in a copy costs against them
    (`slot_scale`)."""

    rest_s: float
    copy_overhead_s: float
    expert_scale: float = 1.0
    slot_scale: float = 1.0
    # the calls fitted, in order: (the input they ran on, the experts they copied, seconds timed)
    calls: tuple[tuple[str, int, float], ...] = ()


# How much more a timed call on the planned input weighs in the fit than one on the steered input
STEERED_WEIGHT = 20.0

# `expert_scale` and `slot_scale` are fitted on a grid of this step within these bounds (a
# timing's noise can put them anywhere)
SCALE_BOUNDS = (0.0, 2.0)
SCALE_STEP = 0.01


def hot_experts_input(moe: MoE, x: torch.Tensor, experts: tuple[int, ...] = (0,)) -> torch.Tensor:
    """`x` (..., dim) with its rows shifted so that the router ranks expert `experts[i % len]`
    first for row i: its logit raised by the logits' whole spread (u with W u = b, b the raise at
    that expert, least squares, exact for E <= dim). Where the router is not linear (cosine), `x`
    as it is."""
    router = moe.router
    if type(router) is not LinearRouter:
        return x
    with torch.no_grad():
        rows = x.reshape(-1, moe.dim)
        logits = router(rows)
        raise_XE = torch.zeros(len(experts), moe.num_experts, dtype=torch.float64)
        raise_XE[range(len(experts)), list(experts)] = float(logits.max() - logits.min()) + 1.0
        shift_XD = logit_shift(router.weight, raise_XE).to(x.device, x.dtype)
        pick = torch.arange(rows.shape[0], device=x.device) % len(experts)
        return (rows + shift_XD[pick]).reshape(x.shape)


def measure_unpriced_time(moe: MoE, x: torch.Tensor, autocast: Callable[[], object] | None = None,
                          trials: int = 15, overrides: Mapping[str, object] | None = None,
                          graphed: bool = False) -> UnpricedTime:
    """What a balanced call of `moe` (built with balance="pro-prophet", its planner's model
    already fitted) spends beyond what the paper's model prices, and how its time follows the
    rows: the layer's forward and backward, with the call settings `overrides` (e.g.
    kernels="comet": the copies in replica slots, `MoE.copies_in_slots`), wall time, the slowest
    rank's median, on two inputs:

    - `x` (..., dim) itself, the load the planner will see: with no copy, and with the copies
      Alg. 1 plans for it under the paper's model (none where that plans none). These anchor the
      fit where its predictions are used (docs/balance.md, "The fit on the planned input");
    - `x` with its rows shifted so that half the tokens pick expert 0 first and half the last
      expert (`hot_experts_input`; their owners, rank 0 and the last rank, are hot), under the
      placements of `copy_placements`: no copy; expert 0 on every other rank (its holders compute
      their own rows of it, which stay as heavy as the last expert's owner: a copy's rows'
      cost); expert 0 and the last expert (rows leave both hot ranks: the owners' saving); and,
      where there is one, expert 1 alone (few rows: a copy's fixed cost). These tell the own rows'
      scale from the copied rows' and from a copy's overhead.

    The calls copy their experts themselves, as a call not launched ahead does. Eager calls pay
    the host's launches too, which a CUDA graph does not: `graphed` (calls in replica slots, on
    CUDA) times each placement's step captured as a graph instead (`weft.graphs.time_graphed`),
    as a graphed call will pay it.

    `fit_unpriced_time` then solves for the overhead of a copy and the scales of eq. 2's own and
    copied rows, common to both inputs, and each input's rest (the steered input's per-row rate is
    not the input's: all its rows go to two experts), against the paper model's terms of each call's
    placement on its input's recorded loads (`placement_terms`), each call on `x` weighing
    `STEERED_WEIGHT` times a steered one, so that the fit meets the input's own calls where it can
    and the steered ones settle what those leave open; the rest kept is the input's own. A
    collective over every rank (the timing agrees over the default group)."""
    if moe.balancer is None:
        raise ValueError("measure_unpriced_time: the layer does not balance (build it with balance='pro-prophet')")
    overrides = dict(overrides or {})
    in_slots = moe.copies_in_slots(moe.call_with(**overrides))
    if graphed and not (in_slots and x.is_cuda):
        raise ValueError("measure_unpriced_time(graphed=True) times calls in replica slots on CUDA "
                         "(kernels='comet' on GPUs that map each other's memory)")
    balancer = moe.balancer
    if moe.ep_size < 2:
        return UnpricedTime(0.0, 0.0)
    ctx = autocast or contextlib.nullcontext
    with ctx():
        dtype = moe.experts.compute_dtype(x)

    def forward_backward(x_in: torch.Tensor, grad_in: torch.Tensor, copied: dict) -> None:
        with ctx():
            if in_slots:
                y = moe(x_in, copies=copied, **overrides)
            else:
                transfer = Transfer(moe.experts, moe.placement, copied, moe.group, dtype) if copied else Transfer.none()
                y = moe(x_in, transfer=transfer, **overrides)
        y.backward(grad_in)

    def timed_on(x_in: torch.Tensor, placements: list[dict]) -> tuple[list[float], list]:
        """Each placement's time on `x_in`, and the input's load as the calls recorded it."""
        grad = torch.randn_like(x_in)
        if graphed:
            def graph_step(copied: dict) -> Callable[[torch.Tensor, torch.Tensor], None]:
                def step(x_step: torch.Tensor, grad_step: torch.Tensor) -> None:
                    forward_backward(x_step, grad_step, copied)
                    moe.record(None)  # its aux loss would keep an eager warm-up call's autograd graph alive
                return step

            seconds = time_graphed(graph_step, placements, [x_in.detach().requires_grad_(), grad], moe.parameters(),
                                   trials, warmup=2, accumulate=False)
        else:
            def call(copied: dict) -> None:
                forward_backward(x_in.detach().requires_grad_(), grad, copied)
                moe.zero_grad(set_to_none=True)

            seconds = time_candidates(call, placements, x_in.device, trials, warmup=2)
        return seconds, balancer.history.last_counts()

    paper = dataclasses.replace(balancer.model, copy_overhead_s=0.0, rest_s=0.0, expert_scale=1.0, slot_scale=1.0)
    owner_E, n = balancer.owner_E, balancer.n
    timed, terms, inputs = [], [], []

    def add(seconds: list[float], tokens, placements: list[dict], on: str) -> None:
        timed.extend(seconds)
        terms.extend(placement_terms(paper, tokens, owner_E, copies, n) for copies in placements)
        inputs.extend([on] * len(placements))

    plain_s, tokens = timed_on(x.detach(), [{}])
    add(plain_s, tokens, [{}], "x")
    planned = greedy_placement(tokens, owner_E, paper, n=n, alpha=balancer.alpha, scheduled=False,
                               rounds=balancer.rounds).placement
    copies = {e: ranks for e, ranks in planned.copies.items() if ranks}
    if copies:
        add(timed_on(x.detach(), [copies])[0], tokens, [copies], "x")
    hot = copy_placements(owner_E, moe.ep_size)
    add(*timed_on(hot_experts_input(moe, x.detach(), (0, moe.num_experts - 1)), hot), hot, "hot")
    # the input's own calls weigh STEERED_WEIGHT times a steered one: the fit meets them where it can
    return fit_unpriced_time(timed, terms, [1.0 if on == "x" else 1 / STEERED_WEIGHT for on in inputs], inputs)


def copy_placements(owner_E: tuple[int, ...], world: int) -> list[dict[int, frozenset[int]]]:
    """The placements `measure_unpriced_time` times: none; expert 0 on every rank; expert 0 and
    the last expert; and where there are more than two experts, expert 1 alone (each copy on
    every rank but its owner)."""
    last = len(owner_E) - 1
    others = {e: frozenset(r for r in range(world) if r != owner_E[e]) for e in {0, 1, last}}
    placements = [{}, {0: others[0]}, {0: others[0], last: others[last]}]
    return placements + ([{1: others[1]}] if last > 1 else [])


@dataclass(frozen=True)
class PlacementTerms:
    """The paper model's terms of one placement (eq. 6: the call copying its experts itself):
    each device's forward and backward expert seconds (eqs. 2-3) for its own experts' rows
    (`own_D`) and for its copies' rows (`slot_D`), the rest of the model's time (`rest_s`), and
    the experts copied."""

    own_D: tuple[float, ...]
    slot_D: tuple[float, ...]
    rest_s: float
    copies: int

    def experts_s(self, expert_scale: float = 1.0, slot_scale: float = 1.0) -> float:
        """Eqs. 2-3 with the rows weighed as `LayerCostModel.forward_experts_s` weighs them."""
        return busiest_weighed(self.own_D, self.slot_D, expert_scale, slot_scale)


def placement_terms(paper: LayerCostModel, tokens, owner_E: tuple[int, ...], copies: dict, n: int) -> PlacementTerms:
    """`PlacementTerms` of `paper` (both scales 1) on `tokens` (the ranks' counts) under `copies`."""
    placement = Placement(owner_E, copies)
    h_D, r_D = host_loads(tokens, placement)
    slot_D = host_slot_rows(tokens, placement)
    per_row = 3 / paper.throughput  # eq. 2 and eq. 3's twice it
    experts_s = paper.forward_experts_s(h_D) + paper.backward_experts_s(h_D)
    rest_s = paper.layer_s(r_D, h_D, len(copies), n, scheduled=False, slot_D=slot_D) - experts_s
    return PlacementTerms(tuple(per_row * (h - held) for h, held in zip(h_D, slot_D)),
                          tuple(per_row * held for held in slot_D), rest_s, len(copies))


def fit_unpriced_time(timed: list[float], terms: list[PlacementTerms], weights: list[float] | None = None,
                      inputs: list[object] | None = None) -> UnpricedTime:
    """`UnpricedTime` from the timed calls (the first a plain one) and each call's `terms` (its
    placement on its input's load): t_i = r_g + E_i(s, k) + O_i + c_i c (E the experts' time with
    own rows weighed by s and copied rows by k, O the model's other terms, c_i the experts copied,
    g the input call i ran on, `inputs[i]`; default all one), solved for s and k on a grid within
    `SCALE_BOUNDS` and, at each (s, k), for the rests r_g >= 0 and the overhead c >= 0 by least
    squares, call i weighed by `weights[i]` (default alike). The rest returned is the first
    call's input's: the input the planner plans for, whose per-row rate another input (one that
    sends every row to two experts) does not share, so each input has its own level while the
    scales and the overhead are the calls' common slopes. Where the calls cannot tell the scales
    apart (a router the input cannot steer, cosine; copies that move no rows), of the best fits
    the one nearest the paper's s = k = 1. A copy that was not timed (inf or nan) gets an infinite
    overhead."""
    if not all(math.isfinite(t) for t in timed):
        plain_s, plain = timed[0], terms[0]
        return UnpricedTime(max(0.0, plain_s - plain.rest_s - plain.experts_s()), math.inf,
                            calls=_calls(timed, terms, inputs))
    low, high = SCALE_BOUNDS
    grid = torch.arange(low, high + SCALE_STEP / 2, SCALE_STEP, dtype=torch.float64)
    own_PD = torch.tensor([t.own_D for t in terms], dtype=torch.float64)
    slot_PD = torch.tensor([t.slot_D for t in terms], dtype=torch.float64)
    experts_SKP = (grid[:, None, None, None] * own_PD + grid[None, :, None, None] * slot_PD).amax(-1)
    left_SKP = torch.tensor([t - term.rest_s for t, term in zip(timed, terms)], dtype=torch.float64) - experts_SKP
    labels = [0] * len(timed) if inputs is None else inputs
    group_GP = torch.tensor([[label == g for label in labels] for g in dict.fromkeys(labels)], dtype=torch.float64)
    weight_P = torch.tensor([1.0] * len(timed) if weights is None else weights, dtype=torch.float64)
    rest_SKG, overhead_SK, error_SK = _rests_and_overhead(
        left_SKP, torch.tensor([float(term.copies) for term in terms], dtype=torch.float64), weight_P, group_GP)
    ties = error_SK <= error_SK.min() + 1e-9 * sum(t * t for t in timed) + 1e-30
    distance_SK = (grid[:, None] - 1.0).square() + (grid[None, :] - 1.0).square()
    best = int(torch.where(ties, distance_SK, math.inf).argmin())
    i, j = divmod(best, grid.numel())
    return UnpricedTime(float(rest_SKG[i, j, 0]), float(overhead_SK[i, j]), float(grid[i]), float(grid[j]),
                        _calls(timed, terms, inputs))


def _calls(timed: list[float], terms: list[PlacementTerms], inputs: list[object] | None
           ) -> tuple[tuple[str, int, float], ...]:
    return tuple((str(0 if inputs is None else inputs[i]), terms[i].copies, t) for i, t in enumerate(timed))


def _rests_and_overhead(left_SKP: torch.Tensor, copies_P: torch.Tensor, weight_P: torch.Tensor,
                        group_GP: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted least squares of left_i = r_g(i) + c copies_i (one rest per group of calls,
    `group_GP` their 0/1 membership) at every grid point: c from the calls' spread about their
    groups' means, clamped at 0, then each r_g the group's mean left less c times its mean
    copies, clamped at 0. Returns (r (..., G), c, the weighted squared error)."""
    weight_GP = group_GP * weight_P
    total_G = weight_GP.sum(-1)
    mean_copies_G = (weight_GP * copies_P).sum(-1) / total_G
    mean_left_SKG = (left_SKP[..., None, :] * weight_GP).sum(-1) / total_G
    copies_spread_P = copies_P - (group_GP * mean_copies_G[:, None]).sum(0)
    left_spread_SKP = left_SKP - (mean_left_SKG[..., :, None] * group_GP).sum(-2)
    spread = (weight_P * copies_spread_P.square()).sum()
    overhead_SK = ((weight_P * copies_spread_P * left_spread_SKP).sum(-1) / spread).clamp(min=0.0) if spread > 0 \
        else torch.zeros_like(left_SKP[..., 0])
    rest_SKG = (mean_left_SKG - overhead_SK[..., None] * mean_copies_G).clamp(min=0.0)
    fitted_SKP = (rest_SKG[..., :, None] * group_GP).sum(-2) + overhead_SK[..., None] * copies_P
    return rest_SKG, overhead_SK, (weight_P * (left_SKP - fitted_SKP).square()).sum(-1)


def with_unpriced_time(moe: MoE, x: torch.Tensor, autocast: Callable[[], object] | None = None,
                       trials: int = 15, overrides: Mapping[str, object] | None = None,
                       graphed: bool = False) -> LayerCostModel:
    """Give the balanced layer `moe`'s planner its measured `rest_s`, `copy_overhead_s`, `expert_scale` and `slot_scale`
    (`measure_unpriced_time` on `x`, calls with `overrides`, `graphed`); returns the model."""
    return install_unpriced_time(moe, measure_unpriced_time(moe, x, autocast, trials, overrides, graphed))


def install_unpriced_time(moe: MoE, unpriced: UnpricedTime) -> LayerCostModel:
    """Give the balanced layer `moe`'s planner `unpriced`'s rest, copy overhead and scales; returns the model."""
    moe.balancer.model = dataclasses.replace(moe.balancer.model, rest_s=unpriced.rest_s,
                                             copy_overhead_s=unpriced.copy_overhead_s,
                                             expert_scale=unpriced.expert_scale, slot_scale=unpriced.slot_scale)
    return moe.balancer.model
