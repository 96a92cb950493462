"""Pro-Prophet's planner: its performance model of an MoE layer under a lightweight expert
placement (sec. IV-B, eqs. 1-8) and its greedy placement search (sec. IV-C, Alg. 1).

A lightweight placement keeps every expert's parameters and optimizer state on its owner and
copies the parameters of a few heavy experts to other devices for one iteration (Trans); a device
holding a copy computes its own tokens for that expert locally instead of sending them to the
owner, and the copies' gradients are summed back into the owner's (Agg) before the optimizer
step. The load is described by `tokens_DE`: how many routed slots device d sends to expert e in an
iteration (the gate's output, "gating" in Alg. 1). Everything here is host arithmetic on that
(D, E) matrix, done in plain Python floats (`host_counts`): a plan is made in the middle of a
layer's call, where every microsecond of host time is GPU time lost, and torch's CPU ops cost a
dispatch each. The tensor-valued functions (`loads`, `computing_device`) are for callers and tests.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from weft.balance.load import Counts, host_counts


def _floats(values: torch.Tensor | Sequence[float]) -> list[float]:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


@dataclass(frozen=True)
class Placement:
    """Where each expert is computed: `owner_E[e]` holds expert e (parameters, gradients,
    optimizer state); `copies[e]` are the devices that receive its parameters this iteration and
    compute their own tokens for it."""

    owner_E: tuple[int, ...]
    copies: dict[int, frozenset[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for e, devices in self.copies.items():
            if self.owner_E[e] in devices:
                raise ValueError(f"expert {e}: its owner {self.owner_E[e]} cannot also hold a copy")

    @property
    def replicated(self) -> list[int]:
        """The experts with at least one copy, in ascending id order."""
        return sorted(e for e, devices in self.copies.items() if devices)

    def where(self, num_devices: int) -> list[list[int]]:
        """(D, E) the device that computes device d's tokens for expert e: d itself where it
        holds e (as owner or copy), e's owner otherwise."""
        where_DE = [list(self.owner_E) for _ in range(num_devices)]
        for e, devices in self.copies.items():
            for d in devices:
                where_DE[d][e] = d
        return where_DE

    def computing_device(self, num_devices: int) -> torch.Tensor:
        """`where` as a tensor."""
        return torch.tensor(self.where(num_devices))


def host_loads(tokens: Counts, placement: Placement) -> tuple[list[float], list[float]]:
    """`loads` on host counts, as lists."""
    num_devices = len(tokens)
    h_D, local_D = [0.0] * num_devices, [0.0] * num_devices
    for d, (row, where) in enumerate(zip(tokens, placement.where(num_devices))):
        for count, device in zip(row, where):
            h_D[device] += count
            if device == d:
                local_D[d] += count
    return h_D, [h - local for h, local in zip(h_D, local_D)]


def host_slot_rows(tokens: Counts, placement: Placement) -> list[float]:
    """The inputs each device computes for experts it holds a copy of (not owns): its own tokens
    of them, as each token goes to its nearest copy. Part of `host_loads`'s H."""
    num_devices = len(tokens)
    slot_D = [0.0] * num_devices
    for e, devices in placement.copies.items():
        for d in devices:
            slot_D[d] += tokens[d][e]
    return slot_D


def busiest_weighed(own_D: Sequence[float], slot_D: Sequence[float], expert_scale: float, slot_scale: float) -> float:
    """max over the devices of `expert_scale` x own rows + `slot_scale` x copied rows (eq. 2's
    busiest device, `LayerCostModel`'s weighing)."""
    return max(expert_scale * own + slot_scale * held for own, held in zip(own_D, slot_D))


def loads(tokens_DE: torch.Tensor, placement: Placement) -> tuple[torch.Tensor, torch.Tensor]:
    """(H, R) of Pro-Prophet's Table II under `placement`: H[d] the inputs device d computes, R[d]
    the inputs it receives from the other devices."""
    h_D, r_D = host_loads(host_counts(tokens_DE), placement)
    return torch.tensor(h_D, dtype=torch.float64), torch.tensor(r_D, dtype=torch.float64)


@dataclass(frozen=True)
class LayerCostModel:
    """The performance model (eqs. 1-8) with this machine's constants: `bandwidth` B (bytes/s,
    the average all-to-all bandwidth per device), `throughput` t (token rows per second of the
    experts' forward on one device), `row_bytes` (one token row on the wire), the bytes of one
    expert's parameters and gradients, and the non-MoE forward and backward time of a block, which
    hides Trans and Agg in the scheduled form (eq. 8).

    Four terms extend the paper's model, measured on the layer's own call
    (`weft.overlap.measure_unpriced_time`; 0, 0, 1 and 1 in the paper's model): `copy_overhead_s`,
    the seconds a call spends per copied expert beyond what eqs. 1-5 price (its rows cut out of
    the exchange and computed apart, the replicated exchange's extra kernels and host work), which
    no schedule hides; `rest_s`, the call's time outside the experts and the all-to-alls
    (routing, dispatch, combine, the host's share of an eager call), the same under every
    placement, so it moves every plan's time alike and changes no choice, but makes the
    predicted time the layer's; and `expert_scale`, how much of eqs. 2-3's time the call gains
    per row taken off its busiest device (1: all of it, as the paper assumes; a fused call whose
    time is set by more than its busiest device's rows, such as Comet's graph on many small
    experts, gains less, so copies that move rows save less than eq. 2 says); and `slot_scale`,
    what a row a device computes in a copy costs against eq. 2's rate (a copy's rows computed
    apart from the owner's fused kernel, as on Comet's path, cost more). With them eq. 2 prices
    device d at `expert_scale` H_own[d] + `slot_scale` H_slot[d] (`host_slot_rows`), the busiest
    device setting the time: the paper's max(H) when both are 1."""

    num_devices: int
    bandwidth: float
    throughput: float
    row_bytes: float
    expert_param_bytes: float
    expert_grad_bytes: float
    forward_non_moe_s: float = 0.0
    backward_non_moe_s: float = 0.0
    copy_overhead_s: float = 0.0
    rest_s: float = 0.0
    expert_scale: float = 1.0
    slot_scale: float = 1.0

    def all_to_all_s(self, r_D: torch.Tensor | Sequence[float]) -> float:
        """Eq. 1: the slowest device's receive time."""
        return max(_floats(r_D)) * self.row_bytes / self.bandwidth

    def forward_experts_s(self, h_D: torch.Tensor | Sequence[float],
                          slot_D: torch.Tensor | Sequence[float] | None = None) -> float:
        """Eq. 2: the most loaded device's forward expert computation, its own experts' rows
        (H - `slot_D`) weighed by `expert_scale` and its copies' rows (`slot_D`, none if not given)
        by `slot_scale`."""
        h = _floats(h_D)
        slot = _floats(slot_D) if slot_D is not None else [0.0] * len(h)
        own = [rows - held for rows, held in zip(h, slot)]
        return busiest_weighed(own, slot, self.expert_scale, self.slot_scale) / self.throughput

    def backward_experts_s(self, h_D: torch.Tensor | Sequence[float],
                           slot_D: torch.Tensor | Sequence[float] | None = None) -> float:
        """Eq. 3: twice the forward."""
        return 2 * self.forward_experts_s(h_D, slot_D)

    def trans_s(self, s: int, n: int) -> float:
        """Eq. 4: `s` experts' parameters to the D - n devices without them."""
        return s * (self.num_devices - n) * self.expert_param_bytes / (self.num_devices * self.bandwidth)

    def agg_s(self, s: int, n: int) -> float:
        """Eq. 5: their gradients back."""
        return s * (self.num_devices - n) * self.expert_grad_bytes / (self.num_devices * self.bandwidth)

    def layer_s(self, r_D: torch.Tensor | Sequence[float], h_D: torch.Tensor | Sequence[float], s: int, n: int,
                scheduled: bool = True, slot_D: torch.Tensor | Sequence[float] | None = None) -> float:
        """The MoE layer's forward and backward time: eq. 8 with `scheduled` (Trans hidden behind the
        forward experts and the block's non-MoE forward, Agg behind the backward ones, Alg. 2), eq. 6
        without (a call that copies its experts itself waits for them); plus `copy_overhead_s` per
        copied expert and `rest_s` in both. `slot_D`: the rows of H computed in copies (eq. 2)."""
        trans, agg = self.trans_s(s, n), self.agg_s(s, n)
        fec, bec = self.forward_experts_s(h_D, slot_D), self.backward_experts_s(h_D, slot_D)
        if scheduled:
            trans = max(0.0, trans - fec - self.forward_non_moe_s)
            agg = max(0.0, agg - bec - self.backward_non_moe_s)
        return 4 * self.all_to_all_s(r_D) + fec + bec + trans + agg + s * self.copy_overhead_s + self.rest_s


@dataclass(frozen=True)
class Plan:
    """A placement with the model's time for it and for the plain placement, and the busiest
    device's inputs over the mean (`rank_load`) under each, on the counts the plan was made from:
    what the placement evens out of the load (with each token sent to its nearest copy, a copy
    takes only its holder's own tokens of the expert)."""

    placement: Placement
    predicted_s: float
    plain_s: float
    rank_load: float = 1.0
    plain_rank_load: float = 1.0


def max_over_mean(h_D: Sequence[float]) -> float:
    """max / mean of the devices' computed inputs (1.0 where there are none)."""
    total = sum(h_D)
    return max(h_D) * len(h_D) / total if total > 0 else 1.0


def is_balanced(h_D: torch.Tensor | Sequence[float], total_inputs: float, num_experts: int, alpha: float) -> bool:
    """Eq. 7: max(H) - min(H) < alpha * I / E."""
    h = _floats(h_D)
    return max(h) - min(h) < alpha * total_inputs / num_experts


def greedy_placement(tokens_DE: torch.Tensor | Counts, owner_E: tuple[int, ...], model: LayerCostModel, n: int = 1,
                     alpha: float = 1.0, scheduled: bool = True, rounds: int = 1) -> Plan:
    """Alg. 1: while the load is not balanced (eq. 7), take the most loaded device, copy its
    heaviest expert (most routed inputs) to the D - n devices that send it the most inputs (the
    owner and the n - 1 devices sending the fewest keep none: BottomK), and evaluate the model;
    stop when a device comes up a second time or has no expert left to copy. Returns the prefix of
    those copies with the lowest predicted time (none when nothing beats the plain placement).

    `n` is the paper's "devices a selected expert is not transferred to", counting the owner
    (which has it): 1 <= n <= D - 1. `rounds` (not in the paper, which stops at the second
    coming: 1): the times a device may come up, so that a hot device can give away several of
    its experts (on 2 devices Alg. 1 copies at most one expert each way)."""
    tokens = host_counts(tokens_DE)
    num_devices, num_experts = len(tokens), len(tokens[0])
    if len(owner_E) != num_experts or not all(0 <= o < num_devices for o in owner_E):
        raise ValueError(f"owner_E must give one device in [0, {num_devices}) per expert ({num_experts})")
    if not 1 <= n <= num_devices - 1:
        raise ValueError(f"n must be in [1, {num_devices - 1}] for {num_devices} devices, got {n}")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive int, got {rounds!r}")
    per_expert_E = [sum(column) for column in zip(*tokens)]
    total = sum(per_expert_E)
    plain = Placement(tuple(owner_E))
    h_D, r_D = host_loads(tokens, plain)
    plain_s = best_s = model.layer_s(r_D, h_D, 0, n, scheduled)
    plain_load = best_load = max_over_mean(h_D)
    chosen: list[tuple[int, frozenset[int]]] = []
    best_count = 0
    comings = [0] * num_devices
    while not is_balanced(h_D, total, num_experts, alpha):
        device = max(range(num_devices), key=lambda d: (h_D[d], -d))  # the first of the most loaded
        if comings[device] == rounds:
            break
        comings[device] += 1
        taken = {e for e, _ in chosen}
        candidates = [e for e in range(num_experts) if owner_E[e] == device and e not in taken]
        if not candidates:
            break
        expert = max(candidates, key=lambda e: (per_expert_E[e], -e))
        others = sorted((d for d in range(num_devices) if d != owner_E[expert]),
                        key=lambda d: (-tokens[d][expert], d))
        chosen.append((expert, frozenset(others[: num_devices - n])))
        placement = Placement(plain.owner_E, dict(chosen))
        h_D, r_D = host_loads(tokens, placement)
        changed_s = model.layer_s(r_D, h_D, len(chosen), n, scheduled, host_slot_rows(tokens, placement))
        if changed_s < best_s:
            best_s, best_count, best_load = changed_s, len(chosen), max_over_mean(h_D)
    return Plan(Placement(plain.owner_E, dict(chosen[:best_count])), best_s, plain_s, best_load, plain_load)
