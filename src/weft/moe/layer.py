"""The MoE layer: gate -> dispatch -> all-to-all -> experts -> all-to-all -> combine.

Semantics are those of DESIGN.md ("The MoE layer contract"); every faster path in weft is
checked against this layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import EllipsisType

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from weft.comm import all_gather, all_to_all, all_to_all_counts
from weft.distributed import group_rank, group_size, hierarchical_groups, resolve_group
from weft.moe.capacity import capacity_for, slot_positions
from weft.moe.dispatch import combine, dispatch_padded
from weft.moe.experts import ACTIVATIONS, Experts
from weft.moe.pipeline import dropless_pipelined_exchange, pipelined_exchange
from weft.tune.dictionary import Setting, TuningDictionary, candidates_for
from weft.moe.gates import (
    GATES,
    CosineRouter,
    LinearRouter,
    expert_choice,
    expert_choice_capacity,
    load_balancing_loss,
    router_z_loss,
    token_choice,
)


@dataclass
class Routing:
    """The routed slots of a batch: slot i sends token `token_ids[i]` to expert `experts[i]` at
    capacity position `positions[i]` with gate `gates[i]` (0 where dropped). Token choice: slot
    ids t*k + j; expert choice: e*C + position."""

    token_ids: torch.Tensor  # (S,)
    experts: torch.Tensor  # (S,) global expert ids
    positions: torch.Tensor  # (S,)
    gates: torch.Tensor  # (S,)
    kept: torch.Tensor | None  # (S,) bool; None: every slot is kept
    capacity: int | None  # C per expert per source rank; None: dropless
    counts: torch.Tensor  # (E,) slots routed to each expert before dropping
    order: torch.Tensor | None  # token choice: slot ids grouped by expert (stable)


@dataclass
class MoEStats:
    """Routing statistics of the last forward on this rank (tensors stay on the device)."""

    expert_counts: torch.Tensor  # (E,) slots routed to each expert, before dropping
    dropped: torch.Tensor  # () dropped slots (expert choice: tokens no expert took)
    capacity: int | None  # C per expert per source rank; None when dropless


class MoE(nn.Module):
    """Mixture-of-Experts FFN with expert parallelism over `group`.

    Args:
        dim: model width; `x` has shape (..., dim).
        hidden_dim: expert FFN width.
        num_experts: experts in total, E; each of the W ranks of `group` holds E / W of them
            (with `parallel="adaptive"`, E may also divide W: each rank then holds a 1 / (W / E)
            shard of one expert's hidden dimension).
        top_k: experts per token (k = 1 with gate "topk" is the Switch gate); for
            "expert_choice" it sets the capacity ceil(k * cf * T / E) instead.
        gate: "topk", "bpr", "cosine", "expert_choice" or "random".
        capacity_factor: > 0 fixed capacity; 0 smallest capacity that drops nothing; < 0 like 0
            with |cf| as upper bound; None dropless (exact counts, all-to-allv, grouped GEMM).
        activation: "relu", "gelu", "silu" or "swiglu".
        normalize_gates: divide the k gates of a token by their sum (k > 1).
        group: expert-parallel process group; None = the default group if initialised.
        overlap_degree: d > 1 cuts the capacity (dropless: each rank-to-expert segment) into d
            chunks so the all-to-all of one chunk overlaps the experts of another (Tutel 3.2);
            same result as 1.
            "auto": the tuning dictionary picks d per capacity bucket (Tutel 3.3).
        a2a_algo: "linear" (one all_to_all_single) or "2dh" (Tutel's two-level hierarchical
            all-to-all over nodes of LOCAL_WORLD_SIZE ranks, appendix A; padded modes, any
            overlap_degree: each pipelined chunk is exchanged via 2DH); same result; "auto"
            lets the tuning dictionary choose. "2dh"/"auto" build process groups here, a
            collective: construct the layer on every rank.
        tuning: the `weft.tune.TuningDictionary` used by "auto" settings (shared between layers,
            persisted if it has a path); default: a fresh in-memory one.
        parallel: "ep" (expert parallel) or "adaptive" (Tutel 3.1's switchable parallelism: the
            same sharded weights serve r = 1, expert parallel, and r = 0, data parallel for
            experts: all-gather the expert weights, compute local tokens, reduce-scatter the
            gradients; no parameter moves between calls, results identical). With fewer experts
            than ranks (m = W / E ranks per expert), r may be any divisor of m (fig. 7): the m
            ranks of an expert form r model-parallel slices of its hidden dimension, each
            served by m / r data-parallel ranks that all-gather their shards; every token goes
            to all r slices (local repeat) and the r partial outputs are summed (local sum).
            r = 1 is EP+DP, r = m is EP+MP. The tuning dictionary picks r per capacity bucket
            unless a call fixes it, `moe(x, parallel=r)`.
        cosine_proj_dim: projection width of the cosine router.

    In the padded modes (capacity_factor not None) with cf > 0 and for expert choice, every rank
    of the EP group must pass the same number of tokens: the capacity, and so the size of the
    fixed all-to-all, comes from the local token count (as in Tutel). Dropless and cf <= 0 agree
    on sizes across the group and accept uneven token counts.

    `moe(x, top_k=..., capacity_factor=..., overlap_degree=...)` overrides those settings for
    one call (Tutel's dynamic top-ANY and capacity). After each forward: `aux_loss`, `z_loss`
    (scalars) and `stats` (`MoEStats`).
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int = 2,
        gate: str = "topk",
        capacity_factor: float | None = 1.25,
        activation: str = "gelu",
        normalize_gates: bool = True,
        group: dist.ProcessGroup | None = None,
        *,
        overlap_degree: int | str = 1,
        a2a_algo: str = "linear",
        tuning: TuningDictionary | None = None,
        parallel: str = "ep",
        cosine_proj_dim: int = 256,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.group = resolve_group(group)
        ep_size = group_size(self.group)
        _check_config(dim, hidden_dim, num_experts, top_k, gate, capacity_factor, activation, ep_size)
        if parallel not in ("ep", "adaptive"):
            raise ValueError(f"unknown parallel {parallel!r}; choose 'ep' or 'adaptive'")
        # m ranks per expert when there are fewer experts than ranks (Tutel's EP+DP+MP, fig. 7).
        self.expert_shards = ep_size // num_experts if num_experts < ep_size else 1
        _check_shards(self.expert_shards, hidden_dim, parallel, overlap_degree, num_experts, ep_size, capacity_factor)
        _check_overlap(overlap_degree)
        _check_algo(a2a_algo, capacity_factor)
        self.dim, self.hidden_dim, self.num_experts = dim, hidden_dim, num_experts
        self.top_k, self.gate, self.capacity_factor = top_k, gate, capacity_factor
        self.normalize_gates, self.ep_size = normalize_gates, ep_size
        self.overlap_degree = overlap_degree
        self.a2a_algo = a2a_algo
        self.groups_2dh = hierarchical_groups(self.group) if a2a_algo in ("2dh", "auto") else None
        self.tuning = tuning if tuning is not None else TuningDictionary()
        self.parallel = parallel
        self.parallel_r: int | None = None  # r of this call (None: 1, or tuned when "auto")
        self.num_local_experts = max(1, num_experts // ep_size)
        # The data-parallel groups of each r (m / r consecutive ranks sharing one slice): built
        # here because creating process groups is a collective every rank must reach.
        self.slice_groups = {r: hierarchical_groups(self.group, self.expert_shards // r).intra
                             for r in self.parallel_choices() if r > 0 and self.expert_shards // r > 1}
        if gate == "cosine":
            self.router = CosineRouter(dim, num_experts, proj_dim=cosine_proj_dim).to(device)
        else:
            self.router = LinearRouter(dim, num_experts).to(device)
        rank, shards = group_rank(self.group), self.expert_shards
        first = rank // shards if shards > 1 else rank * self.num_local_experts
        self.experts = Experts(dim, hidden_dim, self.num_local_experts, activation, first, dtype, device,
                               shard=(rank % shards, shards))
        self.aux_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None
        self.stats: MoEStats | None = None
        # Benchmarks only: False keeps every token on its rank (no all-to-all) while the local
        # experts do the same amount of work: the no-communication optimum that overlap can
        # reach. The output is then NOT the layer's function.
        self.communicate = True
        # Lancet's backward pass (weft.overlap.optimize sets it): a WGradScheduler that runs
        # deferred weight gradients while this layer's backward all-to-alls are in flight.
        self.wgrad_scheduler = None

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, hidden_dim={self.hidden_dim}, num_experts={self.num_experts}, "
            f"top_k={self.top_k}, gate={self.gate!r}, capacity_factor={self.capacity_factor}, "
            f"ep_size={self.ep_size}"
        )

    def forward(
        self,
        x: torch.Tensor,
        *,
        top_k: int | None = None,
        capacity_factor: float | None | EllipsisType = ...,
        overlap_degree: int | str | None = None,
        parallel: int | None = None,
    ) -> torch.Tensor:
        """y = MoE(x); keyword arguments override the layer's settings for this call only."""
        if parallel is not None and parallel != 1:
            if self.parallel != "adaptive":
                raise ValueError(f"parallel={parallel!r} needs MoE(..., parallel='adaptive')")
            if isinstance(parallel, bool) or parallel not in self.parallel_choices():
                raise ValueError(f"parallel (r) must be one of {self.parallel_choices()} with {self.num_experts} "
                                 f"experts on {self.ep_size} ranks (0, or a divisor of ranks per expert "
                                 f"{self.expert_shards}), got {parallel!r}")
        saved = (self.top_k, self.capacity_factor, self.overlap_degree)
        top_k = self.top_k if top_k is None else top_k
        capacity_factor = self.capacity_factor if capacity_factor is ... else capacity_factor
        overlap_degree = self.overlap_degree if overlap_degree is None else overlap_degree
        if (top_k, capacity_factor, overlap_degree) != saved:
            _check_config(self.dim, self.hidden_dim, self.num_experts, top_k, self.gate, capacity_factor,
                          self.experts.activation, self.ep_size)
            _check_overlap(overlap_degree)
            _check_shards(self.expert_shards, self.hidden_dim, self.parallel, overlap_degree, self.num_experts,
                          self.ep_size, capacity_factor)
            _check_algo(self.a2a_algo, capacity_factor)
        self.top_k, self.capacity_factor, self.overlap_degree = top_k, capacity_factor, overlap_degree
        self.parallel_r = parallel
        try:
            return self._forward(x)
        finally:
            self.top_k, self.capacity_factor, self.overlap_degree = saved
            self.parallel_r = None

    def parallel_choices(self) -> list[int]:
        """The r this layer can run: 0 (data parallel) and the divisors of W / E (1 when E >= W)."""
        return [0] + [r for r in range(1, self.expert_shards + 1) if self.expert_shards % r == 0]

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        tokens = x.reshape(-1, self.dim)
        routing = self.route(tokens)
        # Dispatch in the experts' compute dtype (bf16 under autocast): half the all-to-all bytes.
        tokens = tokens.to(self.experts.compute_dtype(tokens))
        if routing.capacity is None:
            y = self._dropless(tokens, routing)
        else:
            cap, num_rows = routing.capacity, self.num_experts * routing.capacity
            rows = routing.experts * cap + routing.positions
            if routing.kept is not None:
                rows = torch.where(routing.kept, rows, num_rows)
            y = self._padded(tokens, routing.token_ids, rows, routing.gates, cap, routing.kept)
        return y.to(x.dtype).reshape(x.shape)

    def route(self, tokens: torch.Tensor) -> Routing:
        """Router, gate rule and capacity for tokens (T, dim): the routed slots of the batch.

        Sets `z_loss`, `aux_loss` and `stats`. Every execution path (plain, pipelined, Lancet's
        partitioned forward) dispatches exactly these slots.
        """
        logits = self.router(tokens)
        probs = F.softmax(logits, dim=-1)
        self.z_loss = router_z_loss(logits)
        num_tokens, num_experts, device = tokens.shape[0], self.num_experts, tokens.device
        if self.gate == "expert_choice":
            cap = expert_choice_capacity(self.top_k, self.capacity_factor, num_tokens, num_experts)
            chosen, gates = expert_choice(probs, cap)
            self.aux_loss = probs.new_zeros(())  # balanced by construction
            taken = torch.zeros(num_tokens, dtype=torch.long, device=device)
            taken.index_add_(0, chosen.reshape(-1), torch.ones_like(chosen.reshape(-1)))
            counts = torch.full((num_experts,), cap, dtype=torch.long, device=device)
            self.stats = MoEStats(counts, (taken == 0).sum(), cap)
            experts = torch.arange(num_experts, device=device).repeat_interleave(cap)
            positions = torch.arange(cap, device=device).repeat(num_experts)
            return Routing(chosen.reshape(-1), experts, positions, gates.reshape(-1), None, cap, counts, None)
        choice = token_choice(self.gate, probs, self.top_k, self.normalize_gates)
        slots = slot_positions(choice.experts, num_experts, choice.order)
        self.aux_loss = load_balancing_loss(probs, slots.counts, num_tokens * self.top_k)
        token_ids = torch.arange(num_tokens, device=device).repeat_interleave(self.top_k)
        experts, positions = choice.experts.reshape(-1), slots.positions.reshape(-1)
        if self.capacity_factor is None:
            self.stats = MoEStats(slots.counts, slots.counts.new_zeros(()), None)
            return Routing(token_ids, experts, positions, choice.gates.reshape(-1), None, None, slots.counts,
                           slots.sort_index)
        cap = capacity_for(self.capacity_factor, self.top_k, num_tokens, num_experts, slots.counts, self.group)
        kept = positions < cap
        self.stats = MoEStats(slots.counts, (~kept).sum(), cap)
        return Routing(token_ids, experts, positions, choice.gates.reshape(-1) * kept, kept, cap, slots.counts,
                       slots.sort_index)

    # -- padded modes: fixed-size all-to-all, Flexible layout (El, W*C, dim) ------------------
    def _padded(self, tokens, token_ids, rows, gates, cap: int, kept: torch.Tensor | None = None) -> torch.Tensor:
        num_rows = self.num_experts * cap
        buffer = dispatch_padded(tokens, token_ids, rows, num_rows)
        expert_out = self._exchange_and_compute(buffer, cap)
        return combine(expert_out, rows.clamp(max=num_rows - 1), token_ids, gates, tokens.shape[0], kept)

    def _exchange_and_compute(self, buffer: torch.Tensor, cap: int) -> torch.Tensor:
        """(E*C, dim) per source -> experts on their owners -> back; Tutel's Flexible layout."""
        free_r = self.parallel == "adaptive" and self.parallel_r is None and self.ep_size > 1
        if self.communicate and ("auto" in (self.overlap_degree, self.a2a_algo) or free_r):
            run = lambda setting, rows: self._exchange_with(rows, cap, setting)  # noqa: E731
            return self.tuning.run(self, cap, candidates_for(self), run, buffer)
        return self._exchange_with(buffer, cap, self._untuned_setting())

    def _untuned_setting(self) -> Setting:
        """The setting of a call the tuning dictionary does not decide: "auto" parts at their
        plain values (d = 1, linear), r = 1 unless the call fixed it."""
        return Setting(1 if self.overlap_degree == "auto" else self.overlap_degree,
                       "linear" if self.a2a_algo == "auto" else self.a2a_algo,
                       1 if self.parallel_r is None else self.parallel_r)

    def _exchange_with(self, buffer: torch.Tensor, cap: int, setting: Setting) -> torch.Tensor:
        ep, local, dim = self.ep_size, self.num_local_experts, self.dim
        if setting.parallel == 0:  # Tutel's r = 0: keep the tokens, bring the weights
            by_expert = buffer.view(self.num_experts, cap, dim)
            return self.experts(by_expert, self._all_expert_weights()).reshape(-1, dim)
        if self.expert_shards > 1:
            return self._exchange_sliced(buffer, cap, setting)
        if setting.overlap_degree > 1 and self.communicate:
            return pipelined_exchange(buffer, self.experts, self.group, ep, local, cap, setting.overlap_degree,
                                      algo=setting.a2a_algo, groups_2dh=self.groups_2dh)
        received = self._all_to_all(buffer, algo=setting.a2a_algo)  # (W * El * C, dim), source-major
        flexible = received.view(ep, local, cap, dim).transpose(0, 1).reshape(local, ep * cap, dim)
        out = self.experts(flexible)
        out = out.view(local, ep, cap, dim).transpose(0, 1).reshape(ep * local * cap, dim)
        return self._all_to_all(out, algo=setting.a2a_algo)

    # -- dropless: counts first, then exactly the routed rows (all-to-allv), grouped GEMM --------
    def _dropless(self, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        order = routing.order  # slot ids (t*k + j) grouped by expert
        token_ids = routing.token_ids.index_select(0, order)
        gates = routing.gates.index_select(0, order)
        send = tokens.index_select(0, token_ids)
        counts = routing.counts
        free_r = self.parallel == "adaptive" and self.parallel_r is None
        tuned = self.communicate and self.ep_size > 1 and (self.overlap_degree == "auto" or free_r)
        candidates = candidates_for(self) if tuned else [self._untuned_setting()]
        if len(candidates) == 1:  # nothing to tune: no bucket, whose capacity costs an all-reduce
            out = self._dropless_with(send, counts, candidates[0])
        else:
            run = lambda setting, rows: self._dropless_with(rows, counts, setting)  # noqa: E731
            cap = self._dropless_capacity(tokens.shape[0], counts.device)
            out = self.tuning.run(self, cap, candidates, run, send)
        return combine(out, None, token_ids, gates, tokens.shape[0])

    def _dropless_with(self, send: torch.Tensor, counts: torch.Tensor, setting: Setting) -> torch.Tensor:
        """Rows sorted by expert (`counts` per expert) -> their expert outputs, in `setting`'s way."""
        if setting.parallel == 0 and self.ep_size > 1:  # Tutel's r = 0: keep the rows, bring the weights
            return self.experts.forward_grouped(send, counts.tolist(), self._all_expert_weights())
        if self.expert_shards > 1:
            return self._exchange_sliced_dropless(send, counts, setting.parallel)
        if self.ep_size == 1:
            return self.experts.forward_grouped(send, counts.tolist())
        return self._exchange_dropless(send, counts, setting.overlap_degree)

    def _dropless_capacity(self, num_tokens: int, device: torch.device) -> int:
        """The tuning bucket's capacity for a dropless call: ceil(T_max * k / E), T_max the largest
        token count of the EP group, so that every rank (token counts differ) keys the same
        entry. Costs one one-element all-reduce per call, in tuned ("auto") dropless calls only."""
        most = torch.tensor([num_tokens], device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group)
        return -(-int(most.item()) * self.top_k // self.num_experts)

    def _exchange_dropless(self, send: torch.Tensor, counts: torch.Tensor, degree: int) -> torch.Tensor:
        ep, local = self.ep_size, self.num_local_experts
        recv_counts = all_to_all_counts(counts, self.group) if self.communicate else counts
        sent, received = torch.stack([counts, recv_counts]).view(2, ep, local).tolist()
        if degree > 1 and self.communicate:
            return dropless_pipelined_exchange(send, self.experts, self.group, sent, received, degree)
        send_splits = [sum(r) for r in sent]
        recv_splits = [sum(r) for r in received]
        recv = self._all_to_all(send, recv_splits, send_splits)  # rows by [source][local expert]
        out = self.experts_on_received(recv, recv_counts, received)
        return self._all_to_all(out, send_splits, recv_splits)

    def experts_on_received(self, recv: torch.Tensor, recv_counts: torch.Tensor,
                            received: list[list[int]]) -> torch.Tensor:
        """Run the local experts on rows that arrived grouped [source rank][local expert]
        (`received[s][i]` rows from source s for local expert i; `recv_counts` the same as a
        flat tensor); the output rows come back in the same order."""
        ep, local = self.ep_size, self.num_local_experts
        per_expert = [sum(r[i] for r in received) for i in range(local)]
        # Rows arrive grouped by source rank; the experts want them grouped by local expert.
        expert_of_row = torch.arange(local, device=recv.device).repeat(ep)
        expert_of_row = expert_of_row.repeat_interleave(recv_counts, output_size=recv.shape[0])
        by_expert = torch.sort(expert_of_row, stable=True).indices
        out = self.experts.forward_grouped(recv.index_select(0, by_expert), per_expert)
        return torch.zeros_like(out).index_copy(0, by_expert, out)

    def _all_expert_weights(self) -> tuple:
        """Tutel's r = 0: every expert's weights on every rank, gathered from their owners (the
        backward reduce-scatters the gradients back, summed over ranks as in expert parallelism)."""
        return self._gathered_weights(self.group, self.expert_shards)

    def _expert_slice(self, r: int) -> tuple:
        """Slice s = (rank % m) // (m / r) of this rank's expert (hidden / r wide), all-gathered over
        the m / r ranks that share it; their gradients are reduce-scattered back (summed)."""
        group = self.slice_groups.get(r)
        if group is None:  # r = m: the slice is this rank's own shard
            return self.experts.weights()
        return self._gathered_weights(group, self.expert_shards // r)

    def _gathered_weights(self, group, shards: int) -> tuple:
        """This rank's expert weights all-gathered over `group`, every `shards` consecutive
        hidden-dimension shards joined into one expert (slice)."""
        return tuple(None if w is None else _join_shards(all_gather(w, group), shards, rows=i == 1)
                     for i, w in enumerate(self.experts.weights()))

    # -- fewer experts than ranks (Tutel fig. 7): r slices x m / r replicas of each expert -------
    def _exchange_sliced(self, buffer: torch.Tensor, cap: int, setting: Setting) -> torch.Tensor:
        """Destination rank q = e*m + s*g + i (g = m / r) gets, from every source, part i of the
        source's capacity block for expert e (local repeat over the r slices s); the r partial
        outputs that come back are summed (local sum)."""
        r, dim, experts = setting.parallel, self.dim, self.num_experts
        peers = self.expert_shards // r
        part = -(-cap // peers)
        padded = F.pad(buffer.view(experts, cap, dim), (0, 0, 0, part * peers - cap))
        send = padded.view(experts, 1, peers, part, dim).expand(experts, r, peers, part, dim).reshape(-1, dim)
        if setting.overlap_degree > 1 and self.communicate:
            # The send buffer is a padded exchange with one "local expert" (this rank's slice)
            # and capacity `part` per destination: Tutel's pipelining applies unchanged.
            back = pipelined_exchange(send, self.experts, self.group, self.ep_size, 1, part, setting.overlap_degree,
                                      algo=setting.a2a_algo, groups_2dh=self.groups_2dh, weights=self._expert_slice(r))
        else:
            received = self._all_to_all(send, algo=setting.a2a_algo)
            out = self.experts(received.view(1, -1, dim), self._expert_slice(r))
            back = self._all_to_all(out.view(-1, dim), algo=setting.a2a_algo)
        summed = back.view(experts, r, part * peers, dim).float().sum(1).to(back.dtype)
        return summed[:, :cap].reshape(experts * cap, dim)

    def _exchange_sliced_dropless(self, send: torch.Tensor, counts: torch.Tensor, r: int) -> torch.Tensor:
        """The dropless form of `_exchange_sliced` (r > 0 slices): expert e's rows are cut into g
        near-equal parts, part i going to every slice's replica i (all-to-allv)."""
        peers = self.expert_shards // r
        # The g parts of expert e's segment, in order, are the segment itself: destinations
        # (e, s, i) in rank order get the segment r times. A stable sort of r copies of the rows by
        # expert gives that order (copy 0 of e, then copy 1 of e, ...).
        rows = send.shape[0]
        expert_of_row = torch.repeat_interleave(torch.arange(self.num_experts, device=counts.device), counts,
                                                output_size=rows)
        index = torch.sort(expert_of_row.repeat(r), stable=True).indices % max(rows, 1)
        send_splits = [b - a for n in counts.tolist() for _ in range(r)
                       for a, b in ((n * i // peers, n * (i + 1) // peers) for i in range(peers))]
        splits = torch.tensor(send_splits, device=counts.device)
        recv_splits = (all_to_all_counts(splits, self.group) if self.communicate else splits).tolist()
        received = self._all_to_all(send.index_select(0, index), recv_splits, send_splits)
        out = self.experts(received.unsqueeze(0), self._expert_slice(r)).squeeze(0)
        back = self._all_to_all(out, send_splits, recv_splits)
        summed = back.new_zeros(send.shape[0], self.dim, dtype=torch.float32).index_add_(0, index, back.float())
        return summed.to(back.dtype)

    def _all_to_all(self, x: torch.Tensor, output_splits=None, input_splits=None, algo="linear") -> torch.Tensor:
        if not self.communicate:
            return x
        if output_splits is None and algo == "2dh":
            return all_to_all(x, self.group, algo="2dh", groups_2dh=self.groups_2dh)
        return all_to_all(x, self.group, output_splits, input_splits, scheduler=self.wgrad_scheduler)

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"MoE input must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"MoE input must be a floating-point tensor, got dtype {x.dtype}")
        if x.dim() == 0 or x.shape[-1] != self.dim:
            raise ValueError(f"MoE input's last dimension must be dim={self.dim}, got shape {tuple(x.shape)}")


def _check_shards(shards: int, hidden_dim: int, parallel: str, overlap_degree, num_experts: int, ep_size: int,
                  capacity_factor) -> None:
    if shards == 1:
        return
    if parallel != "adaptive":
        raise ValueError(f"num_experts ({num_experts}) < the expert-parallel size ({ep_size}) needs "
                         f"parallel='adaptive' (each expert is then shared by {shards} ranks)")
    if hidden_dim % shards:
        raise ValueError(f"hidden_dim ({hidden_dim}) must be divisible by the ranks per expert ({shards})")
    if overlap_degree not in (1, "auto") and capacity_factor is None:
        raise ValueError(f"overlap_degree > 1 with fewer experts ({num_experts}) than ranks ({ep_size}) needs a "
                         f"padded capacity mode (capacity_factor not None); dropless runs degree 1 there")


def _join_shards(gathered: torch.Tensor, shards: int, rows: bool) -> torch.Tensor:
    """(G * shards, ...) hidden-dimension shards in rank order -> (G, ...) whole slices: w2-like
    weights (rows=True) join along dim 1, w1/w3-like along dim 2."""
    if shards == 1:
        return gathered
    n, a, b = gathered.shape
    if rows:
        return gathered.reshape(n // shards, shards * a, b)
    return gathered.view(n // shards, shards, a, b).permute(0, 2, 1, 3).reshape(n // shards, a, shards * b)


def _check_overlap(overlap_degree) -> None:
    if overlap_degree == "auto":
        return
    if isinstance(overlap_degree, bool) or not isinstance(overlap_degree, int) or overlap_degree < 1:
        raise ValueError(f"overlap_degree must be a positive integer or 'auto', got {overlap_degree!r}")


def _check_algo(a2a_algo, capacity_factor) -> None:
    if a2a_algo not in ("linear", "2dh", "auto"):
        raise ValueError(f"unknown a2a_algo {a2a_algo!r}; choose 'linear', '2dh' or 'auto'")
    if a2a_algo == "2dh" and capacity_factor is None:
        raise ValueError("a2a_algo='2dh' needs a padded capacity mode: dropless exchanges uneven splits")


def _check_config(dim, hidden_dim, num_experts, top_k, gate, capacity_factor, activation, ep_size) -> None:
    for name, value in (("dim", dim), ("hidden_dim", hidden_dim), ("num_experts", num_experts), ("top_k", top_k)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if gate not in GATES:
        raise ValueError(f"unknown gate {gate!r}; choose one of {', '.join(GATES)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")
    if top_k > num_experts:
        raise ValueError(f"top_k ({top_k}) must not exceed num_experts ({num_experts})")
    if num_experts % ep_size != 0 and ep_size % num_experts != 0:
        raise ValueError(
            f"num_experts ({num_experts}) must be divisible by the expert-parallel size ({ep_size}), or divide it "
            f"(with parallel='adaptive')"
        )
    if capacity_factor is not None and (
        isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float))
    ):
        raise TypeError(f"capacity_factor must be a number or None, got {capacity_factor!r}")
    if capacity_factor is not None and not math.isfinite(capacity_factor):
        raise ValueError(f"capacity_factor must be finite, got {capacity_factor!r}")
    if gate == "expert_choice" and (capacity_factor is None or capacity_factor <= 0):
        raise ValueError(
            f"gate 'expert_choice' needs capacity_factor > 0 (each expert takes ceil(k*cf*T/E) tokens), "
            f"got {capacity_factor!r}"
        )
