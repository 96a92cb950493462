"""Routing: router logits -> the routed slots of a batch, with the losses and statistics.

One place for the gate rule, slot priority and capacity of every execution path: the layer routes
a whole batch with `route`; Lancet's partitioned forward routes partition by partition with
`CarriedRouting`, whose capacity is carried from the earlier partitions so its kept and dropped
slots are those of the whole batch (Lancet sec. 5.2). Both return values; nothing is written
onto a layer.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from weft.kernels.routing import expert_order, topk_positions
from weft.kernels.token_choice import route_topk
from weft.moe.capacity import (
    SlotPositions,
    capacity_bound,
    capacity_for,
    expert_choice_capacity,
    slot_positions,
)
from weft.moe.dispatch import SlotRows
from weft.moe.gates import (
    TokenChoice,
    choice_scores,
    expert_choice,
    gates_of,
    load_balancing_loss,
    priority_order,
    router_z_loss,
    sampling_offsets,
    token_choice,
)

# The gates whose slots the fused routing kernels compute: every token-choice gate (expert choice
# lets each expert pick its tokens instead).
FUSED_ROUTING_GATES = ("topk", "cosine", "bpr", "random")
# The gates routed in one pass from the logits (`weft.kernels.token_choice`): those that rank the
# experts by probability in token order, when no sampling offsets are drawn.
ONE_PASS_GATES = ("topk", "cosine")


@dataclass(frozen=True)
class MoEStats:
    """Routing statistics of one forward on this rank (tensors stay on the device)."""

    expert_counts: torch.Tensor  # (E,) slots routed to each expert, before dropping
    dropped: torch.Tensor  # () dropped slots (expert choice: tokens no expert took)
    capacity: int | None  # C per expert per source rank; None when dropless


@dataclass(frozen=True)
class RoutingSummary:
    """What a forward's routing reports: the load-balancing loss (`E * sum_e f_e * P_e`), the
    router z-loss (`mean_t logsumexp(logits_t)^2`) and the statistics."""

    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    stats: MoEStats

    def detached(self) -> RoutingSummary:
        """The same values, cut from the autograd graph (which the losses would keep alive)."""
        return RoutingSummary(self.aux_loss.detach(), self.z_loss.detach(), self.stats)


@dataclass(frozen=True)
class Routing:
    """The routed slots of a batch: slot i sends token `token_ids_S[i]` to expert `experts_S[i]` at
    capacity position `positions_S[i]` with gate `gates_S[i]` (0 where dropped). Token choice: slot
    ids t*k + j, so slot i is token i // k (`chosen_tokens_S` None; the ids are made only where a
    path reads them); expert choice: slot e*C + position, its token in `chosen_tokens_S`."""

    top_k: int
    experts_S: torch.Tensor  # global expert ids
    positions_S: torch.Tensor
    gates_S: torch.Tensor
    kept_S: torch.Tensor | None  # bool; None: every slot is kept
    capacity: int | None  # C per expert per source rank; None: dropless (or a partition)
    counts_E: torch.Tensor  # slots routed to each expert before dropping
    order_S: torch.Tensor | None  # dropless: slot ids grouped by expert (stable); may be None otherwise
    summary: RoutingSummary | None  # None for a partition (see CarriedRouting.finish)
    slot_rows: SlotRows | None = None  # the padded layout's rows of the slots, where routing made them
    chosen_tokens_S: torch.Tensor | None = None  # expert choice: the token of each slot

    @functools.cached_property
    def token_ids_S(self) -> torch.Tensor:
        """(S,) the token of each slot (made at the first read for token choice: the Triton paths
        never read it)."""
        if self.chosen_tokens_S is not None:
            return self.chosen_tokens_S
        num_tokens = self.experts_S.shape[0] // self.top_k
        return torch.arange(num_tokens, device=self.experts_S.device).repeat_interleave(self.top_k)

    def sent_experts(self, num_experts: int) -> torch.Tensor:
        """(S,) the expert of each slot, `num_experts` where the slot was dropped."""
        return self.experts_S if self.kept_S is None else torch.where(self.kept_S, self.experts_S, num_experts)


@dataclass(frozen=True)
class Router:
    """The gate rule of a layer: `gate` ("topk", "bpr", "cosine", "random", "expert_choice") over
    `num_experts`; `group` is the expert-parallel group no-drop capacities are agreed over;
    `temperature` > 0: routing in training samples each token's experts from softmax(logits / T)
    (topk, bpr, cosine; Switch Transformer's "sample softmax" exploration), argmax otherwise."""

    gate: str
    num_experts: int
    normalize_gates: bool
    group: dist.ProcessGroup | None
    temperature: float = 0.0

    def draw(self, num_tokens: int, device, sample: bool) -> torch.Tensor | None:
        """The batch's random draw from torch's RNG, taken once per batch (before any partition is
        routed, so routing in parts picks what routing it whole picks): the random gate's scores,
        or, when `sample` and a temperature is set, the sampling offsets; None for argmax routing."""
        if self.gate == "random":
            return torch.rand((num_tokens, self.num_experts), device=device)
        if sample and self.temperature > 0:
            return sampling_offsets(num_tokens, self.num_experts, self.temperature, device)
        return None

    def route(self, logits_TE: torch.Tensor, top_k: int, capacity_factor: float | None,
              bias_E: torch.Tensor | None = None, fused: bool = False, sample: bool = False) -> Routing:
        """The routed slots of a whole batch (docs/moe.md: slot priority and capacity); `bias_E`:
        the layer's expert-selection bias (see `token_choice`), or None. `fused`: the experts and
        slot positions of the FUSED_ROUTING_GATES by the Triton kernels of weft.kernels.routing
        (the same integers as the PyTorch path). `sample`: a training call (see `temperature`)."""
        if self.gate == "expert_choice":
            return self._expert_choice(F.softmax(logits_TE, dim=-1), top_k, capacity_factor, router_z_loss(logits_TE))
        num_tokens, device = logits_TE.shape[0], logits_TE.device
        noise_TE = self.draw(num_tokens, device, sample)
        if fused and self.gate in ONE_PASS_GATES and noise_TE is None and (capacity_factor is None
                                                                            or capacity_factor > 0):
            return self._one_pass(logits_TE, top_k, capacity_factor, bias_E)
        probs_TE = F.softmax(logits_TE, dim=-1)
        z_loss = router_z_loss(logits_TE)
        # The order of slots by expert is needed by the dropless layout only.
        dropless = capacity_factor is None
        if fused and self.gate in FUSED_ROUTING_GATES:
            scores_TE = choice_scores(self.gate, probs_TE, noise_TE, bias_E).detach()
            order = priority_order(self.gate, probs_TE)
            experts_TK, positions_TK, counts_E = topk_positions(scores_TE, top_k, order)
            choice = TokenChoice(experts_TK, gates_of(probs_TE, experts_TK, self.normalize_gates), order)
            slots = SlotPositions(positions_TK, counts_E,
                                  expert_order(experts_TK, positions_TK, counts_E) if dropless else None)
        else:
            choice = token_choice(self.gate, probs_TE, top_k, self.normalize_gates, noise_TE, bias_E)
            slots = slot_positions(choice.experts, self.num_experts, choice.order, dropless)
        aux_loss = load_balancing_loss(probs_TE, slots.counts, num_tokens * top_k)
        experts, positions, gates = choice.experts.reshape(-1), slots.positions.reshape(-1), choice.gates.reshape(-1)
        if capacity_factor is None:
            summary = RoutingSummary(aux_loss, z_loss, MoEStats(slots.counts, slots.counts.new_zeros(()), None))
            return Routing(top_k, experts, positions, gates, None, None, slots.counts, slots.sort_index, summary)
        cap = capacity_for(capacity_factor, top_k, num_tokens, self.num_experts, slots.counts, self.group)
        kept = positions < cap
        summary = RoutingSummary(aux_loss, z_loss, MoEStats(slots.counts, (~kept).sum(), cap))
        return Routing(top_k, experts, positions, gates * kept, kept, cap, slots.counts, slots.sort_index, summary)

    def _one_pass(self, logits_TE: torch.Tensor, top_k: int, capacity_factor: float | None,
                  bias_E: torch.Tensor | None) -> Routing:
        """`route`'s Routing by the one-pass kernels (`weft.kernels.token_choice.route_topk`): the
        same slots, drops and integers as the PyTorch path, its gates, losses and logit gradient
        to rounding, and the padded layout's slot rows made on the way."""
        num_tokens = logits_TE.shape[0]
        cap = None if capacity_factor is None else capacity_bound(top_k, capacity_factor, num_tokens,
                                                                  self.num_experts)
        r = route_topk(logits_TE, top_k, self.normalize_gates, cap, bias_E)
        experts, positions, gates = r.experts_TK.reshape(-1), r.positions_TK.reshape(-1), r.gates_TK.reshape(-1)
        summary = RoutingSummary(r.aux_loss, r.z_loss, MoEStats(r.counts_E, r.dropped, cap))
        if cap is None:
            return Routing(top_k, experts, positions, gates, None, None, r.counts_E, r.order_S, summary)
        return Routing(top_k, experts, positions, gates, r.kept_TK.reshape(-1), cap, r.counts_E, None, summary,
                       SlotRows(r.rows_TK, r.slot_of_row_R))

    def _expert_choice(self, probs_TE, top_k, capacity_factor, z_loss) -> Routing:
        num_tokens, num_experts, device = probs_TE.shape[0], self.num_experts, probs_TE.device
        cap = expert_choice_capacity(top_k, capacity_factor, num_tokens, num_experts)
        chosen_EC, gates_EC = expert_choice(probs_TE, cap)
        taken = torch.zeros(num_tokens, dtype=torch.long, device=device)
        taken.index_add_(0, chosen_EC.reshape(-1), torch.ones_like(chosen_EC.reshape(-1)))
        counts = torch.full((num_experts,), cap, dtype=torch.long, device=device)
        # Balanced by construction: no load-balancing loss.
        summary = RoutingSummary(probs_TE.new_zeros(()), z_loss, MoEStats(counts, (taken == 0).sum(), cap))
        experts = torch.arange(num_experts, device=device).repeat_interleave(cap)
        positions = torch.arange(cap, device=device).repeat(num_experts)
        return Routing(top_k, experts, positions, gates_EC.reshape(-1), None, cap, counts, None, summary,
                       chosen_tokens_S=chosen_EC.reshape(-1))

    def can_route_in_parts(self, top_k: int, capacity_factor: float | None) -> bool:
        """True when routing a batch partition by partition (capacity carried) keeps and drops the
        same slots as routing it whole: gates that decide per token in token order (topk, cosine,
        random) with top-1, or with nothing to drop (dropless, capacity_factor 0). bpr ranks the
        whole batch and expert choice lets each expert pick from it (Lancet 2.3, challenge 2)."""
        if self.gate not in ("topk", "cosine", "random"):
            return False
        return top_k == 1 or capacity_factor is None or capacity_factor == 0

    def in_parts(self, num_tokens: int, top_k: int, capacity_factor: float | None,
                 bias_E: torch.Tensor | None = None, sample: bool = False) -> CarriedRouting:
        """Routing of a batch of `num_tokens` tokens that arrives in partitions (see CarriedRouting)."""
        if not self.can_route_in_parts(top_k, capacity_factor):
            raise ValueError(f"gate {self.gate!r} with top_k={top_k}, capacity_factor={capacity_factor} cannot route "
                             "a batch partition by partition")
        return CarriedRouting(self, num_tokens, top_k, capacity_factor, bias_E, sample)


class CarriedRouting:
    """Routes a batch of `num_tokens` tokens partition by partition, in order (Lancet sec. 5.2):
    each partition's slot positions start where the earlier partitions left each expert, so a slot
    is kept iff it is kept when the whole batch is routed at once (for the gates of
    `Router.can_route_in_parts`). `finish()` gives the whole batch's losses and statistics."""

    def __init__(self, router: Router, num_tokens: int, top_k: int, capacity_factor: float | None,
                 bias_E: torch.Tensor | None = None, sample: bool = False):
        self.router, self.num_tokens, self.top_k, self.capacity_factor = router, num_tokens, top_k, capacity_factor
        self.bias_E, self.sample = bias_E, sample
        experts = router.num_experts
        # Kept iff position < capacity_bound for cf != 0: for cf < 0 the no-drop bound never binds
        # first, since a slot's position is below its expert's count.
        cf = capacity_factor
        self._limit = None if cf is None or cf == 0 else capacity_bound(top_k, cf, num_tokens, experts)
        self._carry_E: torch.Tensor | None = None  # slots routed to each expert by earlier parts
        self._probs_sum = self._z_sum = self._dropped = None
        self._noise: torch.Tensor | None = None
        self._offset = 0

    def route(self, logits_TE: torch.Tensor) -> Routing:
        """The next partition's slots (token ids local to the partition); `summary` is None."""
        router, k = self.router, self.top_k
        probs_TE = F.softmax(logits_TE, dim=-1)
        if self._carry_E is None:
            self._carry_E = torch.zeros(router.num_experts, dtype=torch.long, device=logits_TE.device)
            self._probs_sum = probs_TE.new_zeros(router.num_experts)
            self._z_sum = logits_TE.new_zeros(())
            self._dropped = self._carry_E.new_zeros(())
            # the whole batch's draw, as the unpartitioned layer makes it
            self._noise = router.draw(self.num_tokens, logits_TE.device, self.sample)
        size = logits_TE.shape[0]
        noise = None if self._noise is None else self._noise[self._offset:self._offset + size]
        self._offset += size
        self._probs_sum = self._probs_sum + probs_TE.sum(0)
        self._z_sum = self._z_sum + torch.logsumexp(logits_TE, dim=-1).square().sum()
        choice = token_choice(router.gate, probs_TE, k, router.normalize_gates, noise, self.bias_E)
        slots = slot_positions(choice.experts, router.num_experts, with_sort_index=False)
        experts = choice.experts.reshape(-1)
        positions = slots.positions.reshape(-1) + self._carry_E[experts]
        self._carry_E = self._carry_E + slots.counts
        gates, kept = choice.gates.reshape(-1), None
        if self._limit is not None:
            kept = positions < self._limit
            self._dropped = self._dropped + (~kept).sum()
            gates = gates * kept
        return Routing(k, experts, positions, gates, kept, None, slots.counts, None, None)

    def finish(self) -> RoutingSummary:
        """After the last partition: the losses and statistics of the whole batch."""
        if self._carry_E is None:
            raise RuntimeError("finish() before any partition was routed")
        total, router = self.num_tokens, self.router
        if total == 0:
            aux_loss = z_loss = self._z_sum
        else:
            mean_probs = (self._probs_sum / total).unsqueeze(0)
            aux_loss = load_balancing_loss(mean_probs, self._carry_E, total * self.top_k)
            z_loss = self._z_sum / total
        cap = None
        if self.capacity_factor is not None:
            cap = capacity_for(self.capacity_factor, self.top_k, total, router.num_experts, self._carry_E,
                               router.group)
        return RoutingSummary(aux_loss, z_loss, MoEStats(self._carry_E, self._dropped, cap))
