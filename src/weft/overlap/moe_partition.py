"""One MoE layer run over k batch partitions, in stages a pipeline can interleave (Lancet 5, fig. 5c).

Each partition sends exactly the kept slots of its own tokens, so the per-partition exchange is an
all-to-allv (counts first, then rows; fig. 10) and nothing padded travels. The kept slots are those
of the unpartitioned layer:

- routed on the whole batch (`route_whole`): any gate; the partitions just split its slots;
- routed per partition (`route_part`, when the ops before the layer join the pipeline): the
  expert capacity is carried from the earlier partitions, so slot positions, and hence drops,
  are the unpartitioned ones. Exact when a partition's routing is independent of later tokens
  (`can_route_in_parts`): token-order priority with one choice per token, or nothing dropped.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from weft.comm.all_to_all import all_to_all_counts
from weft.comm.async_all_to_all import Pending, start_all_to_all, wait_all_to_all
from weft.moe.capacity import capacity_for, slot_positions
from weft.moe.dispatch import combine
from weft.moe.gates import ceil_exact, load_balancing_loss, token_choice
from weft.moe.layer import MoE, MoEStats


def can_route_in_parts(moe: MoE) -> bool:
    """True when routing a batch partition by partition (capacity carried) keeps and drops the
    same slots as routing it whole: gates that decide per token in token order (topk, cosine,
    random) with top-1, or with nothing to drop (dropless, capacity_factor 0). bpr ranks the
    whole batch and expert choice lets each expert pick from it (Lancet 2.3, challenge 2)."""
    if moe.gate not in ("topk", "cosine", "random"):
        return False
    return moe.top_k == 1 or moe.capacity_factor is None or moe.capacity_factor == 0


@dataclass
class Part:
    """One partition's slots, grouped by expert, and its exchange state between the stages."""

    tokens: torch.Tensor  # (T_p, dim) in the experts' compute dtype
    key: torch.Tensor  # (S_p,) expert of each candidate slot, E where not sent
    slot_tokens: torch.Tensor  # (S_p,) partition-local token of each candidate slot
    slot_gates: torch.Tensor  # (S_p,)
    counts: torch.Tensor | None = None  # (E,) rows sent to each expert
    order: torch.Tensor | None = None
    sent: list[list[int]] = field(default_factory=list)
    received: list[list[int]] = field(default_factory=list)
    recv_counts: torch.Tensor | None = None
    buffer: torch.Tensor | None = None
    pending: Pending | None = None


class PartitionedMoE:
    """Routing, exchange and experts of `moe` for a batch of `num_tokens` tokens cut into
    partitions. Call `route_whole` once (or `route_part` for each partition in order, then
    `finish_routing`), then `dispatch`, `run_experts` and `combine` per partition."""

    def __init__(self, moe: MoE, num_tokens: int):
        self.moe, self.num_tokens = moe, num_tokens
        self.scheduler = getattr(moe, "wgrad_scheduler", None)
        experts, k = moe.num_experts, moe.top_k
        self._carry: torch.Tensor | None = None  # slots routed to each expert by earlier parts
        self._probs_sum = self._z_sum = self._dropped = None
        cf = moe.capacity_factor
        # Kept iff position < max(1, ceil(k*|cf|*T/E)) for cf != 0: for cf < 0 the no-drop bound
        # never binds first, since a slot's position is below its expert's count.
        self._limit = None if cf is None or cf == 0 else max(1, ceil_exact(k * abs(cf) * num_tokens / experts))
        self._noise: torch.Tensor | None = None
        self._offset = 0

    # -- routing ----------------------------------------------------------------------------
    def route_whole(self, tokens: torch.Tensor, sizes: list[int]) -> list[Part]:
        """Route the whole batch (T, dim) as the layer does, then split its slots by token
        ranges of `sizes` tokens each."""
        moe = self.moe
        routing = moe.route(tokens)
        tokens = tokens.to(moe.experts.compute_dtype(tokens))
        sent = routing.experts if routing.kept is None else torch.where(routing.kept, routing.experts, moe.num_experts)
        parts, start = [], 0
        for size in sizes:
            if moe.gate == "expert_choice":  # slots e*C + position: any token anywhere
                inside = (routing.token_ids >= start) & (routing.token_ids < start + size)
                key = torch.where(inside, sent, moe.num_experts)
                slot_tokens, gates = routing.token_ids - start, routing.gates
            else:  # slots t*k + j: the partition's slots are one contiguous range
                a, b = start * moe.top_k, (start + size) * moe.top_k
                key, slot_tokens, gates = sent[a:b], routing.token_ids[a:b] - start, routing.gates[a:b]
            parts.append(Part(tokens[start:start + size], key, slot_tokens, gates))
            start += size
        return parts

    def route_part(self, tokens: torch.Tensor) -> Part:
        """Route the next partition (T_p, dim) with the capacity left by the earlier ones."""
        moe = self.moe
        logits = moe.router(tokens)
        probs = F.softmax(logits, dim=-1)
        if self._carry is None:
            self._carry = torch.zeros(moe.num_experts, dtype=torch.long, device=tokens.device)
            self._probs_sum = probs.new_zeros(moe.num_experts)
            self._z_sum = logits.new_zeros(())
            self._dropped = self._carry.new_zeros(())
            if moe.gate == "random":  # the whole batch's draw, as the unpartitioned layer makes it
                self._noise = torch.rand((self.num_tokens, moe.num_experts), device=tokens.device)
        size = tokens.shape[0]
        noise = None if self._noise is None else self._noise[self._offset:self._offset + size]
        self._offset += size
        self._probs_sum = self._probs_sum + probs.sum(0)
        self._z_sum = self._z_sum + torch.logsumexp(logits, dim=-1).square().sum()
        choice = token_choice(moe.gate, probs, moe.top_k, moe.normalize_gates, noise)
        slots = slot_positions(choice.experts, moe.num_experts)
        experts = choice.experts.reshape(-1)
        positions = slots.positions.reshape(-1) + self._carry[experts]
        self._carry = self._carry + slots.counts
        gates, key = choice.gates.reshape(-1), experts
        if self._limit is not None:
            kept = positions < self._limit
            self._dropped = self._dropped + (~kept).sum()
            gates, key = gates * kept, torch.where(kept, experts, moe.num_experts)
        slot_tokens = torch.arange(size, device=tokens.device).repeat_interleave(moe.top_k)
        return Part(tokens.to(moe.experts.compute_dtype(tokens)), key, slot_tokens, gates)

    def finish_routing(self) -> None:
        """After the last `route_part`: the layer's aux/z losses and stats for the whole batch."""
        moe, total = self.moe, self.num_tokens
        if self._carry is None:
            raise RuntimeError("finish_routing() before any route_part()")
        if total == 0:
            moe.aux_loss = moe.z_loss = self._z_sum
        else:
            mean_probs = (self._probs_sum / total).unsqueeze(0)
            moe.aux_loss = load_balancing_loss(mean_probs, self._carry, total * moe.top_k)
            moe.z_loss = self._z_sum / total
        cap = None
        if moe.capacity_factor is not None:
            cap = capacity_for(moe.capacity_factor, moe.top_k, total, moe.num_experts, self._carry, moe.group)
        moe.stats = MoEStats(self._carry, self._dropped, cap)

    # -- stages -----------------------------------------------------------------------------
    def dispatch(self, parts: list[Part]) -> None:
        """Counts first (one exchange for all `parts`), then launch each part's rows."""
        moe = self.moe
        ep, local, experts = moe.ep_size, moe.num_local_experts, moe.num_experts
        counts = []
        for part in parts:
            part.order = torch.sort(part.key, stable=True).indices
            bounds = torch.searchsorted(part.key.index_select(0, part.order),
                                        torch.arange(experts + 1, device=part.key.device))
            part.counts = bounds.diff()
            counts.append(part.counts)
        sent = torch.stack(counts).view(len(parts), ep, local)
        received = all_to_all_counts(sent.transpose(0, 1).reshape(-1), moe.group).view(ep, len(parts), local)
        host = torch.cat([sent.reshape(-1), received.reshape(-1)]).tolist()
        host_sent, host_recv = host[:sent.numel()], host[sent.numel():]
        for p, part in enumerate(parts):
            part.sent = [host_sent[(p * ep + r) * local:(p * ep + r + 1) * local] for r in range(ep)]
            part.received = [host_recv[(r * len(parts) + p) * local:(r * len(parts) + p + 1) * local] for r in range(ep)]
            part.recv_counts = received[:, p].reshape(-1)
            part.order = part.order[:sum(map(sum, part.sent))]
            rows = part.tokens.index_select(0, part.slot_tokens.index_select(0, part.order))
            part.buffer, part.pending = start_all_to_all(
                rows, moe.group, [sum(r) for r in part.received], [sum(r) for r in part.sent], self.scheduler)

    def run_experts(self, part: Part) -> None:
        """Wait for the part's rows, run the local experts, launch the rows back."""
        recv = wait_all_to_all(part.buffer, part.pending)
        out = self.moe.experts_on_received(recv, part.recv_counts, part.received)
        part.buffer, part.pending = start_all_to_all(
            out, self.moe.group, [sum(r) for r in part.sent], [sum(r) for r in part.received], self.scheduler)

    def combine(self, part: Part) -> torch.Tensor:
        """Wait for the expert outputs and sum them per token: (T_p, dim) in float32."""
        back = wait_all_to_all(part.buffer, part.pending)
        token_ids = part.slot_tokens.index_select(0, part.order)
        gates = part.slot_gates.index_select(0, part.order)
        part.buffer = part.pending = None
        return combine(back, None, token_ids, gates, part.tokens.shape[0])
