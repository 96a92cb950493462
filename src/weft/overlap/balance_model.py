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
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from weft.balance import LayerCostModel
from weft.balance.planner import Placement, host_loads
from weft.comm.cost_model import CommCostModel
from weft.distributed import group_size
from weft.graphs import time_graphed
from weft.models.gpt import MoEUnit
from weft.moe.exchange import Transfer
from weft.moe.layer import MoE
from weft.overlap import planner
from weft.overlap.profile import (
    compute_dtype,
    expert_call,
    measure_all_to_all,
    profile_model,
    routed_rows,
    time_call,
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
    shape. Each layer's `copy_overhead_s` and `rest_s` are then measured on its own call
    (`measure_unpriced_time`; with `graphed`, for layers whose copies go into replica slots on
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
        # what a copy costs beyond its bytes, on the layer's own call (random rows of the batch's size)
        rows = torch.randn(tokens, unit.moe.dim, device=idx.device)
        in_graphs = graphed and rows.is_cuda and unit.moe.copies_in_slots(unit.moe.call_with(**unit.overrides))
        fitted.append(with_unpriced_time(unit.moe, rows, autocast, overrides=unit.overrides, graphed=in_graphs))
        since = u
    return fitted


@dataclass(frozen=True)
class UnpricedTime:
    """What a balanced layer's call spends beyond the paper's model (`LayerCostModel.rest_s` and
    `copy_overhead_s`), in seconds."""

    rest_s: float
    copy_overhead_s: float


def measure_unpriced_time(moe: MoE, x: torch.Tensor, autocast: Callable[[], object] | None = None,
                          trials: int = 5, overrides: Mapping[str, object] | None = None,
                          graphed: bool = False) -> UnpricedTime:
    """What a balanced call of `moe` (built with balance="pro-prophet", its planner's model
    already fitted) spends beyond what the paper's model prices: the layer's forward and backward
    on `x` (..., dim), with the call settings `overrides` (e.g. kernels="comet": the copies in
    replica slots, `MoE.copies_in_slots`), timed with no copy and with expert 0 copied to every
    other rank (the call copying it itself, as a call not launched ahead does), interleaved, wall
    time, the slowest rank's median. Eager calls pay the host's launches too, which a CUDA graph
    does not: `graphed` (calls in replica slots, on CUDA) times each placement's step captured as
    a graph instead (`weft.graphs.time_graphed`), as a graphed call will pay it. `rest_s`: the
    call with no copy less the model's time for it on the input's own load (eqs. 1-3: the
    all-to-alls and the experts); `copy_overhead_s`: the difference of the two calls less the
    model's difference between the placements (eqs. 1-6: the moved rows, Trans and Agg
    unhidden). Neither below 0. A collective over every rank (the timing agrees over the default
    group)."""
    if moe.balancer is None:
        raise ValueError("measure_unpriced_time: the layer does not balance (build it with balance='pro-prophet')")
    overrides = dict(overrides or {})
    in_slots = moe.copies_in_slots(moe.call_with(**overrides))
    if graphed and not (in_slots and x.is_cuda):
        raise ValueError("measure_unpriced_time(graphed=True) times calls in replica slots on CUDA "
                         "(kernels='comet' on GPUs that map each other's memory)")
    world, model = moe.ep_size, moe.balancer.model
    if world < 2:
        return UnpricedTime(0.0, 0.0)
    ctx = autocast or contextlib.nullcontext
    with ctx():
        dtype = moe.experts.compute_dtype(x)
    copies = {0: frozenset(range(1, world))}
    grad = torch.randn_like(x)

    def forward_backward(x_in: torch.Tensor, grad_in: torch.Tensor, copied: dict) -> None:
        with ctx():
            if in_slots:
                y = moe(x_in, copies=copied, **overrides)
            else:
                transfer = Transfer(moe.experts, moe.placement, copied, moe.group, dtype) if copied else Transfer.none()
                y = moe(x_in, transfer=transfer, **overrides)
        y.backward(grad_in)

    def call(copied: dict) -> None:
        forward_backward(x.detach().requires_grad_(), grad, copied)
        moe.zero_grad(set_to_none=True)

    def graph_step(copied: dict) -> Callable[[torch.Tensor, torch.Tensor], None]:
        def step(x_in: torch.Tensor, grad_in: torch.Tensor) -> None:
            forward_backward(x_in, grad_in, copied)
            moe.record(None)  # its aux loss would keep an eager warm-up call's autograd graph alive
        return step

    if graphed:
        plain_s, copy_s = time_graphed(graph_step, [{}, copies], [x.detach().requires_grad_(), grad], moe.parameters(),
                                       trials, warmup=2, accumulate=False)
    else:
        plain_s, copy_s = time_candidates(call, [{}, copies], x.device, trials, warmup=2)
    # the model's own difference between the two placements, on this input's load (every rank's
    # counts, recorded by the calls just timed), without any overhead term
    tokens, owner_E, n = moe.balancer.history.predict_counts(), moe.balancer.owner_E, moe.balancer.n
    paper = dataclasses.replace(model, copy_overhead_s=0.0, rest_s=0.0)
    h_D, r_D = host_loads(tokens, Placement(owner_E))
    plain_model_s = paper.layer_s(r_D, h_D, 0, n, scheduled=False)
    h_D, r_D = host_loads(tokens, Placement(owner_E, copies))
    copy_model_s = paper.layer_s(r_D, h_D, 1, n, scheduled=False)
    return UnpricedTime(max(0.0, plain_s - plain_model_s),
                        max(0.0, (copy_s - plain_s) - (copy_model_s - plain_model_s)))


def with_unpriced_time(moe: MoE, x: torch.Tensor, autocast: Callable[[], object] | None = None,
                       trials: int = 5, overrides: Mapping[str, object] | None = None,
                       graphed: bool = False) -> LayerCostModel:
    """Give the balanced layer `moe`'s planner its measured `rest_s` and `copy_overhead_s`
    (`measure_unpriced_time` on `x`, calls with `overrides`, `graphed`); returns the model."""
    unpriced = measure_unpriced_time(moe, x, autocast, trials, overrides, graphed)
    moe.balancer.model = dataclasses.replace(moe.balancer.model, rest_s=unpriced.rest_s,
                                             copy_overhead_s=unpriced.copy_overhead_s)
    return moe.balancer.model
