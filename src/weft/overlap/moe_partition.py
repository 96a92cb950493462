"""One MoE layer run over k batch partitions, in stages a pipeline can interleave (Lancet 5, fig. 5c).

Each partition sends exactly the kept slots of its own tokens, so the per-partition exchange is an
all-to-allv (counts first, then rows; fig. 10) and nothing padded travels. The kept slots are those
of the unpartitioned layer:

- routed on the whole batch (`route_whole`): any gate; the partitions just split its slots;
- routed per partition (`route_part`, when the ops before the layer join the pipeline): the
  layer's router in its carried-capacity mode (`weft.moe.routing.CarriedRouting`), so slot
  positions, and hence drops, are the unpartitioned ones. Exact when a partition's routing is
  independent of later tokens (`can_route_in_parts`): token-order priority with one choice per
  token, or nothing dropped.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from weft.comm.all_to_all import all_to_all_counts
from weft.comm.async_all_to_all import Pending, start_all_to_all, wait_all_to_all
from weft.kernels.rows import use_triton
from weft.moe.dispatch import combine
from weft.moe.exchange.all_to_all import experts_on_received
from weft.moe.layer import MoE
from weft.moe.routing import CarriedRouting


def can_route_in_parts(moe: MoE) -> bool:
    """True when `moe`'s batch can be routed partition by partition with the same kept slots
    (`weft.moe.routing.Router.can_route_in_parts`)."""
    return moe.gate_rule.can_route_in_parts(moe.top_k, moe.capacity_factor)


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
        self.scheduler = moe.wgrad_scheduler
        self._parts: CarriedRouting | None = None

    # -- routing ----------------------------------------------------------------------------
    def route_whole(self, tokens: torch.Tensor, sizes: list[int]) -> list[Part]:
        """Route the whole batch (T, dim) as the layer does, then split its slots by token
        ranges of `sizes` tokens each."""
        moe = self.moe
        routing = moe.route(tokens)
        moe.record(routing.summary)
        tokens = tokens.to(moe.experts.compute_dtype(tokens))
        sent = routing.sent_experts(moe.num_experts)
        parts, start = [], 0
        for size in sizes:
            if moe.gate == "expert_choice":  # slots e*C + position: any token anywhere
                inside = (routing.token_ids_S >= start) & (routing.token_ids_S < start + size)
                key = torch.where(inside, sent, moe.num_experts)
                slot_tokens, gates = routing.token_ids_S - start, routing.gates_S
            else:  # slots t*k + j: the partition's slots are one contiguous range
                a, b = start * moe.top_k, (start + size) * moe.top_k
                key, slot_tokens, gates = sent[a:b], routing.token_ids_S[a:b] - start, routing.gates_S[a:b]
            parts.append(Part(tokens[start:start + size], key, slot_tokens, gates))
            start += size
        return parts

    def route_part(self, tokens: torch.Tensor) -> Part:
        """Route the next partition (T_p, dim) with the capacity left by the earlier ones."""
        moe = self.moe
        if self._parts is None:
            self._parts = moe.gate_rule.in_parts(self.num_tokens, moe.top_k, moe.capacity_factor, moe.expert_bias,
                                                 sample=moe.training)
        routing = self._parts.route(moe.router(tokens, fused=use_triton(moe.default_call().kernels, tokens)))
        key = routing.sent_experts(moe.num_experts)
        return Part(tokens.to(moe.experts.compute_dtype(tokens)), key, routing.token_ids_S, routing.gates_S)

    def finish_routing(self) -> None:
        """After the last `route_part`: the layer records the whole batch's losses and stats."""
        if self._parts is None:
            raise RuntimeError("finish_routing() before any route_part()")
        self.moe.record(self._parts.finish())

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
            part.received = [host_recv[(r * len(parts) + p) * local:(r * len(parts) + p + 1) * local]
                             for r in range(ep)]
            part.recv_counts = received[:, p].reshape(-1)
            part.order = part.order[:sum(map(sum, part.sent))]
            rows = part.tokens.index_select(0, part.slot_tokens.index_select(0, part.order))
            part.buffer, part.pending = start_all_to_all(
                rows, moe.group, [sum(r) for r in part.received], [sum(r) for r in part.sent], self.scheduler)

    def run_experts(self, part: Part) -> None:
        """Wait for the part's rows, run the local experts, launch the rows back."""
        recv = wait_all_to_all(part.buffer, part.pending)
        out = experts_on_received(self.moe.experts, recv, part.recv_counts, part.received)
        part.buffer, part.pending = start_all_to_all(
            out, self.moe.group, [sum(r) for r in part.sent], [sum(r) for r in part.received], self.scheduler)

    def combine(self, part: Part) -> torch.Tensor:
        """Wait for the expert outputs and sum them per token: (T_p, dim) in float32."""
        back = wait_all_to_all(part.buffer, part.pending)
        token_ids = part.slot_tokens.index_select(0, part.order)
        gates = part.slot_gates.index_select(0, part.order)
        part.buffer = part.pending = None
        return combine(back, None, token_ids, gates, part.tokens.shape[0])
