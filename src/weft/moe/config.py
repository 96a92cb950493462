"""The settings of an MoE call and the checks of a layer's configuration.

`MoECall` is what one forward runs with: the layer's settings with the call's overrides applied
(Tutel's dynamic top-ANY, capacity, pipelining degree and parallelism r). It is an immutable
value passed down to the router and the exchange: nothing is written onto the layer for a call.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from weft.kernels.activation import ACTIVATIONS
from weft.kernels.rows import KERNELS
from weft.moe.backward_sgd import BackwardSGD
from weft.moe.gates import EXPERT_BIAS_GATES, GATES, SAMPLING_GATES

BALANCE_CHOICES = (None, "pro-prophet")  # weft.MoE's balance: off, or Pro-Prophet's replicated experts
# weft.MoE's graph_placement: what a CUDA graph of a balanced call on Comet's path replays
GRAPH_PLACEMENTS = ("captured", "updated")

A2A_ALGOS = ("linear", "2dh", "dedup", "dedup-fixed", "dedup-fixed-own", "auto")
# dropless dedup in exchanges of a fixed size (T rows, T * k records per rank pair): nothing read on
# the host, so the call can be captured as a CUDA graph (weft.moe.dedup.dropless_fixed)
FIXED_SIZE_ALGO = "dedup-fixed"
# the same with a rank's own pairs left out of the exchanges and computed under the return of the
# others' sums (weft.moe.dedup._dropless_fixed_own_apart)
OWN_APART_ALGO = "dedup-fixed-own"
FIXED_SIZE_ALGOS = (FIXED_SIZE_ALGO, OWN_APART_ALGO)
# the forms `auto` times dropless layers in as CUDA graphs: dedup-fixed, pipelined at overlap_degree
# 2 (each chunk's exchange under the other's experts, weft.moe.dedup; the name's "-d2" is the
# degree), and with the own pairs apart. None wins everywhere (docs/benchmarks.md)
FIXED_SIZE_FORMS = (FIXED_SIZE_ALGO, f"{FIXED_SIZE_ALGO}-d2", OWN_APART_ALGO)
# the deduplicating all-to-alls (weft.moe.dedup); the fixed-size ones differ from "dedup" in dropless calls only
DEDUP_ALGOS = ("dedup", *FIXED_SIZE_ALGOS)


@dataclass(frozen=True)
class MoECall:
    """One forward's settings.

    top_k: experts per token (expert choice: the capacity multiplier).
    capacity_factor: > 0 fixed, 0 no-drop, < 0 bounded no-drop, None dropless (docs/moe.md).
    overlap_degree: Tutel's pipelining degree d, or "auto" (the tuning dictionary decides).
    a2a_algo: "linear", "2dh", "dedup" (each token sent to a rank once: `weft.moe.dedup`),
        "dedup-fixed" (dedup; dropless calls in fixed-size exchanges, nothing read on the host),
        "dedup-fixed-own" (the same, a rank's own pairs left out of the exchanges) or "auto".
    parallel_r: Tutel's r fixed by the call; None lets an "adaptive" layer tune it (r = 1 otherwise).
    communicate: False keeps every row on its rank while the local experts do the same work (the
        no-communication bound benchmarks measure); the output is then NOT the layer's function.
    kernels: dispatch and combine by "torch" index ops or the "triton" kernels (deterministic);
        "auto": Triton where it can run (CUDA tensors), torch elsewhere; "comet": as "auto", and
        plain calls (padded or dropless) run Comet's fused expert kernels where the ranks can address each
        other's memory (`weft.moe.exchange.Comet`). Same function every way.
    expert_step: a `weft.BackwardSGD` whose update of the expert weights runs in the backward's
        weight-gradient GEMMs where the call's path can fuse it (Comet's exchange, the plain
        exchange's dropless calls and Flexible-layout padded ones); None: the weights get their
        gradients (`weft.moe.backward_sgd`).
    """

    top_k: int
    capacity_factor: float | None
    overlap_degree: int | str = 1
    a2a_algo: str = "linear"
    parallel_r: int | None = None
    communicate: bool = True
    kernels: str = "auto"
    expert_step: BackwardSGD | None = None

    @property
    def dropless(self) -> bool:
        return self.capacity_factor is None

    def with_overrides(self, **overrides) -> MoECall:
        """This call with the given fields replaced; `...` (Ellipsis) or None keeps a field, except
        capacity_factor, where None means dropless and only `...` keeps it."""
        keep = {k: v for k, v in overrides.items() if v is ... or (v is None and k != "capacity_factor")}
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if k not in keep})


def check_layer(dim: int, hidden_dim: int, num_experts: int, gate: str, activation: str, ep_size: int) -> None:
    """ValueError naming the first bad argument of a layer's shape, gate or activation."""
    for name, value in (("dim", dim), ("hidden_dim", hidden_dim), ("num_experts", num_experts)):
        _check_positive(name, value)
    if gate not in GATES:
        raise ValueError(f"unknown gate {gate!r}; choose one of {', '.join(GATES)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")
    if num_experts % ep_size != 0 and ep_size % num_experts != 0:
        raise ValueError(
            f"num_experts ({num_experts}) must be divisible by the expert-parallel size ({ep_size}), or divide it "
            f"(with parallel='adaptive')"
        )


def check_router_settings(gate: str, expert_bias: bool, temperature: float, init_scale: float,
                          skew: float = 0.0) -> None:
    """ValueError naming what is wrong with a layer's `routing_temperature`, `router_init_scale` or
    `routing_skew`."""
    if isinstance(skew, bool) or not isinstance(skew, (int, float)) or not math.isfinite(skew) or skew < 0:
        raise ValueError(f"routing_skew must be a finite number >= 0, got {skew!r}")
    if skew and gate not in EXPERT_BIAS_GATES:
        raise ValueError(f"routing_skew biases the router's logits: gate {', '.join(EXPERT_BIAS_GATES)}, not {gate!r}")
    if isinstance(init_scale, bool) or not isinstance(init_scale, (int, float)) or not math.isfinite(init_scale) \
            or init_scale <= 0:
        raise ValueError(f"router_init_scale must be a finite number > 0, got {init_scale!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise ValueError(f"routing_temperature must be a finite number >= 0, got {temperature!r}")
    if temperature > 0 and gate not in SAMPLING_GATES:
        raise ValueError(f"routing_temperature samples experts by probability: gate {', '.join(SAMPLING_GATES)}, "
                         f"not {gate!r} (set routing_temperature = 0 for it)")
    if temperature > 0 and expert_bias:
        raise ValueError("routing_temperature and expert_bias (expert_bias_rate) are two ways to balance the experts; "
                         "use one (routing_temperature = 0 for the bias)")


def check_call(call: MoECall, num_experts: int, gate: str, hidden_dim: int, expert_shards: int,
               parallel: str) -> None:
    """ValueError/TypeError naming the first setting of `call` this layer cannot run."""
    _check_positive("top_k", call.top_k)
    if call.top_k > num_experts:
        raise ValueError(f"top_k ({call.top_k}) must not exceed num_experts ({num_experts})")
    cf = call.capacity_factor
    if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float))):
        raise TypeError(f"capacity_factor must be a number or None, got {cf!r}")
    if cf is not None and not math.isfinite(cf):
        raise ValueError(f"capacity_factor must be finite, got {cf!r}")
    if gate == "expert_choice" and (cf is None or cf <= 0):
        raise ValueError(
            f"gate 'expert_choice' needs capacity_factor > 0 (each expert takes ceil(k*cf*T/E) tokens), got {cf!r}")
    degree = call.overlap_degree
    if degree != "auto" and (isinstance(degree, bool) or not isinstance(degree, int) or degree < 1):
        raise ValueError(f"overlap_degree must be a positive integer or 'auto', got {degree!r}")
    if call.kernels not in KERNELS:
        raise ValueError(f"unknown kernels {call.kernels!r}; choose one of {', '.join(KERNELS)}")
    if call.a2a_algo not in A2A_ALGOS:
        raise ValueError(f"unknown a2a_algo {call.a2a_algo!r}; choose one of {', '.join(A2A_ALGOS)}")
    if call.a2a_algo == "2dh" and cf is None:
        raise ValueError("a2a_algo='2dh' needs a padded capacity mode: dropless exchanges uneven splits")
    if call.a2a_algo in DEDUP_ALGOS:
        check_dedup(call, gate, expert_shards)
    if expert_shards > 1:
        ep_size = expert_shards * num_experts
        if parallel != "adaptive":
            raise ValueError(f"num_experts ({num_experts}) < the expert-parallel size ({ep_size}) needs "
                             f"parallel='adaptive' (each expert is then shared by {expert_shards} ranks)")
        if hidden_dim % expert_shards:
            raise ValueError(f"hidden_dim ({hidden_dim}) must be divisible by the ranks per expert ({expert_shards})")
        if degree not in (1, "auto") and cf is None:
            raise ValueError(f"overlap_degree > 1 with fewer experts ({num_experts}) than ranks ({ep_size}) needs a "
                             f"padded capacity mode (capacity_factor not None); dropless runs degree 1 there")


def check_dedup(call: MoECall, gate: str, expert_shards: int) -> None:
    """ValueError naming what a2a_algo='dedup', 'dedup-fixed' or 'dedup-fixed-own' (`weft.moe.dedup`) cannot
    run with."""
    name = f"a2a_algo={call.a2a_algo!r}"
    if gate == "expert_choice":
        raise ValueError(f"{name} needs a token-choice gate: with expert choice a token takes a varying "
                         "number of slots")
    if expert_shards > 1:
        raise ValueError(f"{name} needs whole experts on each rank (num_experts >= the expert-parallel size)")
    if call.a2a_algo in FIXED_SIZE_ALGOS and call.dropless:
        if call.overlap_degree == "auto":
            raise ValueError(f"{name} on a dropless call runs a given overlap_degree (1, or d > 1: Tutel's "
                             "pipelining over its fixed-size exchanges), got 'auto'")
    elif call.overlap_degree not in (1, 2):
        raise ValueError(f"{name} runs overlap_degree 1, or 2 (a rank's own pairs computed while the "
                         f"others' rows travel in), got {call.overlap_degree!r}")
    elif call.overlap_degree == 2 and call.dropless:
        raise ValueError(f"{name} with overlap_degree=2 needs a padded capacity mode (capacity_factor "
                         f"not None; a2a_algo={FIXED_SIZE_ALGO!r} pipelines dropless calls)")
    if call.kernels == "comet":
        raise ValueError(f"{name} and kernels='comet' are two exchanges; choose one")
    if call.parallel_r not in (None, 1):
        raise ValueError(f"{name} is expert parallelism (r = 1), got parallel={call.parallel_r!r}")


def check_parallel_r(r, parallel: str, choices: list[int], num_experts: int, ep_size: int, shards: int) -> None:
    """ValueError unless r (a call's Tutel r) is one this layer can run."""
    if r is None or r == 1:
        return
    if parallel != "adaptive":
        raise ValueError(f"parallel={r!r} needs MoE(..., parallel='adaptive')")
    if isinstance(r, bool) or r not in choices:
        raise ValueError(f"parallel (r) must be one of {choices} with {num_experts} experts on {ep_size} ranks "
                         f"(0, or a divisor of ranks per expert {shards}), got {r!r}")


def _check_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def parallel_choices(expert_shards: int) -> list[int]:
    """The r a layer can run: 0 (data parallel) and the divisors of m = W / E (1 when E >= W)."""
    return [0] + [r for r in range(1, expert_shards + 1) if expert_shards % r == 0]


def check_settings(call: MoECall, num_experts: int, gate: str, hidden_dim: int, shards: int, parallel: str,
                   ep_size: int) -> None:
    """Every check of a call's settings against the layer's shape (`MoE._shape()`)."""
    check_call(call, num_experts, gate, hidden_dim, shards, parallel)
    check_parallel_r(call.parallel_r, parallel, parallel_choices(shards), num_experts, ep_size, shards)


def resolve_call(defaults: MoECall, overrides: tuple, shape: tuple) -> MoECall:
    """A call's settings from the layer's and the overrides (top_k, capacity_factor, overlap_degree,
    a2a_algo, parallel, communicate, kernels), checked against the layer's `shape`. Pure, so cached: a model
    or benchmark passing the same overrides every step resolves and checks them once."""
    try:
        return _resolve_cached(defaults, overrides, shape)
    except TypeError as e:  # an unhashable value (e.g. a list): resolve uncached, naming the field
        if "unhashable" not in str(e):
            raise
        return _resolve(defaults, overrides, shape)


def _resolve(defaults: MoECall, overrides: tuple, shape: tuple) -> MoECall:
    top_k, capacity_factor, overlap_degree, a2a_algo, parallel, communicate, kernels = overrides
    call = defaults.with_overrides(top_k=top_k, capacity_factor=capacity_factor, overlap_degree=overlap_degree,
                                   a2a_algo=a2a_algo, parallel_r=parallel, communicate=communicate, kernels=kernels)
    if call != defaults:
        check_settings(call, *shape)
    return call


_resolve_cached = functools.lru_cache(maxsize=1024)(_resolve)
