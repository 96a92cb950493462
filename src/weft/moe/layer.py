"""The MoE layer as named stages: route -> dispatch -> exchange (experts) -> combine.

Semantics are those of docs/moe.md (the layer contract); every faster path in weft is checked
against this layer. The stages are public seams, as in Megatron-Core's MoELayer:

- `route(tokens, call)`: the router and the gate rule -> a `Routing` value (slots, losses, stats);
- `dispatch_padded` (padded modes) or a sort by expert (dropless) -> the rows this rank sends;
- `exchange(rows, layout, call)`: an `Exchange` strategy takes the rows to their experts and back
  (one all-to-all, Tutel's pipelining, data-parallel or sliced experts), tuned when "auto";
- `combine`: the gate-weighted sum of each token's expert outputs.
"""
from __future__ import annotations

import dataclasses
import hashlib
import warnings
from collections.abc import Collection, Mapping
from types import EllipsisType

import torch
import torch.distributed as dist
from torch import nn

from weft.balance import ExpertBalancer, LayerCostModel, nominal_cost_model
from weft.comm.peers import PeerBuffers, peer_buffers, peers_unavailable
from weft.distributed import group_rank, group_size, hierarchical_groups, resolve_group, side_group
from weft.hostcopy import host_tensor_async
from weft.kernels.rows import use_triton
from weft.moe import dedup
from weft.moe.backward_sgd import BackwardSGD
from weft.moe.config import (
    BALANCE_CHOICES,
    DEDUP_ALGOS,
    FIXED_SIZE_ALGOS,
    GRAPH_PLACEMENTS,
    OWN_APART_ALGO,
    MoECall,
    check_layer,
    check_router_settings,
    check_settings,
    parallel_choices,
    resolve_call,
)
from weft.moe.dispatch import SlotRows, combine, combine_rows, dispatch_padded, dispatch_rows
from weft.moe.exchange import (
    Exchange,
    ExchangeContext,
    ExpertPlacement,
    Layout,
    Padded,
    Staging,
    Transfer,
    candidates,
    gather_counts_on_device,
    offers_comet,
    offers_dedup,
    select,
    tuning_key,
    untuned_setting,
)
from weft.moe.exchange.replica_slots import PendingTransfer, ReplicaCall, ReplicaSlots
from weft.moe.exchange.select import is_tuned, plain_algo
from weft.moe.experts import Experts
from weft.moe.gates import EXPERT_BIAS_GATES, CosineRouter, LinearRouter, expert_bias_step
from weft.moe.routing import MoEStats, Router, Routing, RoutingSummary
from weft.profiling import stage
from weft.tune.dictionary import Setting, TuningDictionary


class MoE(nn.Module):
    """Mixture-of-Experts FFN with expert parallelism over `group`.

    Args:
        dim: model width; `x` has shape (..., dim).
        hidden_dim: expert FFN width.
        num_experts: experts in total, E; each of the W ranks of `group` holds E / W of them
            (`parallel="adaptive"`: E may divide W, each rank holding a hidden-dim shard of one).
        top_k: experts per token (1 with "topk" is Switch); expert choice: capacity ceil(k*cf*T/E).
        gate: "topk", "bpr", "cosine", "expert_choice" or "random".
        capacity_factor: > 0 fixed capacity; 0 smallest capacity that drops nothing; < 0 like 0
            with |cf| as upper bound; None dropless (exact counts, all-to-allv, grouped GEMM).
        activation: "relu", "gelu", "silu" or "swiglu".
        normalize_gates: divide the k gates of a token by their sum (k > 1).
        group: expert-parallel process group; None = the default group if initialised.
        overlap_degree: d > 1 pipelines d chunks, the all-to-all of one under the experts of
            another (Tutel 3.2); with a2a_algo "dedup" (padded) d = 2 computes a rank's own pairs
            while the others' rows travel in; "auto": tuned per capacity bucket (Tutel 3.3). Same
            result as 1.
        a2a_algo: "linear", "2dh" (two-level all-to-all over nodes of LOCAL_WORLD_SIZE ranks,
            Tutel app. A; padded modes), "dedup" (each token sent to a rank once, its outputs summed
            there: `weft.moe.dedup`), "dedup-fixed" (dedup; a dropless call's exchanges then have a
            fixed size, T rows per rank, and nothing is read on the host, so CUDA graphs capture
            it; every rank must route the same number of tokens), "dedup-fixed-own" (the same, a rank's
            own pairs left out of the exchanges and computed while the others' sums return) or "auto"
            (tuned among linear, 2dh and dedup); "2dh" and "auto" build process groups here
            (collective; a layer built otherwise and switched to "auto" later tunes linear and
            dedup only).
        tuning: the `weft.tune.TuningDictionary` of "auto" settings (shared between layers,
            persisted if it has a path); default: a fresh in-memory one.
        parallel: "ep" (expert parallel) or "adaptive" (Tutel 3.1's switchable parallelism: r = 0
            data-parallel experts, r = 1 expert parallel, and with fewer experts than ranks any
            divisor r of W / E; the tuning dictionary picks r unless a call fixes it).
        cosine_proj_dim: projection width of the cosine router.
        kernels: dispatch and combine with the "triton" kernels (deterministic: no atomics) or
            "torch" index ops; "auto" (default): Triton on CUDA where installed, torch elsewhere.
            Expert choice always uses torch's (a token takes a varying number of slots there).
            "comet": as "auto", and plain calls (d = 1, linear, E >= W; padded or dropless) run Comet's fused
            expert GEMMs, which read and write the other ranks' rows tile by tile over peer memory
            (symmetric memory on GPUs, shared files across CPU processes); where the ranks cannot
            address each other's memory (NCCL_P2P_DISABLE=1, several nodes) it says so once and runs
            the NCCL exchange. The first comet call allocates the group's buffers (collective).
        balance: None, or "pro-prophet" (dropless calls: the heaviest experts, planned from the
            earlier calls' loads by Pro-Prophet's model and greedy search, are copied to other
            ranks for the call and computed where their rows are; outputs and gradients unchanged;
            `balancer.last_plan` shows the latest plan). E >= W.
        balance_model: the `weft.balance.LayerCostModel` the plans use (default: nominal
            H200-class constants for this layer's shapes).
        balance_n: Pro-Prophet's n, the ranks (the owner included) that get no copy of a copied
            expert: 1 (default) copies to every other rank (one all-gather), n > 1 to the W - n
            ranks sending the expert the most rows (point-to-point sends). 1 <= n <= W - 1.
        balance_rounds: the times the greedy search may take one rank and copy its heaviest
            expert left (1, default: Pro-Prophet's Alg. 1, at most one copy from each rank; more
            let a hot rank give away several, which pays where copies are cheap: Comet's path,
            whose replica slots hold `balance_rounds * (W - 1)` copies a rank).
        graph_placement: what a CUDA graph of a balanced layer's calls on Comet's path replays:
            "captured" (default) the placement of its capture, its work shaped to it (only the
            ranks holding copies compute slot rows; the copies by the copy engine: the fastest,
            for a steady load); "updated" the placement `update_placement()` writes after each
            replay (every rank runs the slot path; the copies by SM kernels that read the
            placement on the device), so that a graphed training step's copies follow the load.
        expert_bias: keep a per-expert selection bias (buffer `expert_bias`, zeros at start) that
            is added to the router probabilities when choosing experts, never to the gates;
            `update_expert_bias` moves it after each training step (DeepSeek-V3's
            auxiliary-loss-free balancing). Token-choice gates only (topk, bpr, cosine).
        routing_temperature: 0 (default) routes by the top-k probabilities. T > 0: in training
            (`self.training`) each token's k experts are drawn without replacement from
            softmax(logits / T) (Gumbel top-k, one draw from torch's RNG per batch), which keeps
            a flat router's argmax from sending most tokens to a few experts (Switch Transformer
            sec. 2.4 / app. "sample softmax"); gates stay the chosen experts' probabilities, and
            evaluation routes by argmax. topk, bpr and cosine; not with `expert_bias`.
        router_init_scale: the router's initial logits scale (1: standard deviation ~1 for unit-RMS
            inputs; 0.1: nearly uniform probabilities at the start). Argmax routing does not
            depend on it at the start; sampled routing (`routing_temperature`) and learning do.
        routing_skew: S > 0 adds a fixed Zipf(S) prior -S ln(rank_e) to the router's logits (a
            random ranking of the experts, the same on every rank and layer): routing skewed on
            purpose, to study load balancing (Pro-Prophet) on a load that stays skewed. It is a
            different model, not a transform: routing and gates change.

    In the padded modes with cf > 0 and for expert choice, every rank of the EP group must pass
    the same number of tokens (the all-to-all's size comes from the local token count, as in
    Tutel). Dropless and cf <= 0 agree on sizes across the group and accept uneven counts.

    `moe(x, top_k=..., capacity_factor=..., overlap_degree=..., a2a_algo=..., parallel=r)`
    overrides settings for one call (Tutel's dynamic top-ANY and capacity). After each forward:
    `aux_loss`, `z_loss` and `stats` (`MoEStats`) of that forward.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int = 2, gate: str = "topk",
                 capacity_factor: float | None = 1.25, activation: str = "gelu", normalize_gates: bool = True,
                 group: dist.ProcessGroup | None = None, *, overlap_degree: int | str = 1, a2a_algo: str = "linear",
                 tuning: TuningDictionary | None = None, parallel: str = "ep", cosine_proj_dim: int = 256,
                 kernels: str = "auto", expert_bias: bool = False, routing_temperature: float = 0.0,
                 router_init_scale: float = 1.0, routing_skew: float = 0.0, balance: str | None = None,
                 balance_model: LayerCostModel | None = None, balance_n: int = 1, balance_rounds: int = 1,
                 graph_placement: str = "captured", dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        self.group = resolve_group(group)
        ep_size = group_size(self.group)
        check_layer(dim, hidden_dim, num_experts, gate, activation, ep_size)
        if expert_bias and gate not in EXPERT_BIAS_GATES:
            raise ValueError(f"expert_bias needs a token-choice gate that ranks experts by probability "
                             f"({', '.join(EXPERT_BIAS_GATES)}), not {gate!r}")
        check_router_settings(gate, expert_bias, routing_temperature, router_init_scale, routing_skew)
        # The selection bias: a buffer (saved with the model, the same on every rank), or None.
        self.register_buffer("expert_bias", torch.zeros(num_experts, device=device) if expert_bias else None)
        if parallel not in ("ep", "adaptive"):
            raise ValueError(f"unknown parallel {parallel!r}; choose 'ep' or 'adaptive'")
        if balance not in BALANCE_CHOICES:
            raise ValueError(f"unknown balance {balance!r}; choose None or 'pro-prophet'")
        if graph_placement not in GRAPH_PLACEMENTS:
            raise ValueError(f"unknown graph_placement {graph_placement!r}; choose "
                             f"{' or '.join(map(repr, GRAPH_PLACEMENTS))}")
        if balance and num_experts < ep_size:
            raise ValueError(f"balance='pro-prophet' needs whole experts per rank ({num_experts} experts, "
                             f"{ep_size} ranks)")
        # Pro-Prophet: plans each dropless call's copied experts from the earlier calls' loads.
        self.balancer = None if balance is None else ExpertBalancer(
            num_experts, ep_size, balance_model or nominal_cost_model(dim, hidden_dim, activation == "swiglu", ep_size),
            n=balance_n, rounds=balance_rounds)
        # Trans and Agg launched ahead (`start_transfer`) fly on a communicator of their own, beside
        # the all-to-alls (built here: creating a process group is a collective).
        self.transfer_group = side_group(self.group) if balance is not None and ep_size > 1 else None
        self.dim, self.hidden_dim, self.num_experts, self.gate = dim, hidden_dim, num_experts, gate
        self.normalize_gates, self.ep_size, self.parallel = normalize_gates, ep_size, parallel
        # m ranks per expert when there are fewer experts than ranks (Tutel's EP+DP+MP, fig. 7).
        self.expert_shards = ep_size // num_experts if num_experts < ep_size else 1
        self.num_local_experts = max(1, num_experts // ep_size)
        # The layer's settings, one immutable value; a call may override them (`call_with`).
        self._defaults = MoECall(top_k, capacity_factor, overlap_degree, a2a_algo, kernels=kernels)
        self._check(self._defaults)
        self.tuning = tuning if tuning is not None else TuningDictionary()
        groups_2dh = hierarchical_groups(self.group) if a2a_algo in ("2dh", "auto") else None
        # The data-parallel groups of each r (m / r consecutive ranks sharing one slice): built
        # here because creating process groups is a collective every rank must reach.
        slice_groups = {r: hierarchical_groups(self.group, self.expert_shards // r).intra
                        for r in self.parallel_choices() if r > 0 and self.expert_shards // r > 1}
        self.placement = ExpertPlacement(self.group, ep_size, num_experts, self.num_local_experts,
                                         self.expert_shards, groups_2dh, slice_groups)
        self.router = (CosineRouter(dim, num_experts, proj_dim=cosine_proj_dim, init_scale=router_init_scale,
                                    skew=routing_skew)
                       if gate == "cosine" else LinearRouter(dim, num_experts, router_init_scale, routing_skew)
                       ).to(device)
        self.gate_rule = Router(gate, num_experts, normalize_gates, self.group, routing_temperature)
        rank, shards = group_rank(self.group), self.expert_shards
        first = rank // shards if shards > 1 else rank * self.num_local_experts
        self.experts = Experts(dim, hidden_dim, self.num_local_experts, activation, first, dtype, device,
                               shard=(rank % shards, shards))
        self.last_routing: RoutingSummary | None = None
        self._ranks_agree = self.ep_size == 1  # checked at the first forward (`_check_ranks_agree`)
        # Lancet's backward (weft.overlap.optimize installs it): runs deferred weight gradients
        # while this layer's backward all-to-alls are in flight.
        self.wgrad_scheduler = None
        # Pro-Prophet on Comet's path: the replica slots (made at the first such call) and the last
        # call's counts on their way to the host (`_replicas`).
        self._replica_slots: ReplicaSlots | None = None
        self._pending_counts: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        # graph_placement="updated": the counts a captured call leaves on the device at each replay
        self.graph_placement = graph_placement
        self._graph_counts_WE: torch.Tensor | None = None

    @property
    def groups_2dh(self):
        return self.placement.groups_2dh

    @property
    def aux_loss(self) -> torch.Tensor | None:
        return None if self.last_routing is None else self.last_routing.aux_loss

    @property
    def z_loss(self) -> torch.Tensor | None:
        return None if self.last_routing is None else self.last_routing.z_loss

    @property
    def stats(self) -> MoEStats | None:
        return None if self.last_routing is None else self.last_routing.stats

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, hidden_dim={self.hidden_dim}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"gate={self.gate!r}, capacity_factor={self.capacity_factor}, ep_size={self.ep_size}")

    # -- settings --------------------------------------------------------------------------------
    top_k = property(lambda self: self._defaults.top_k, lambda self, v: self._set_default(top_k=v))
    capacity_factor = property(lambda self: self._defaults.capacity_factor,
                               lambda self, v: self._set_default(capacity_factor=v))
    overlap_degree = property(lambda self: self._defaults.overlap_degree,
                              lambda self, v: self._set_default(overlap_degree=v))
    a2a_algo = property(lambda self: self._defaults.a2a_algo, lambda self, v: self._set_default(a2a_algo=v))
    kernels = property(lambda self: self._defaults.kernels, lambda self, v: self._set_default(kernels=v))

    def _set_default(self, **setting) -> None:
        """Change one of the layer's own settings (checked); e.g. `moe.overlap_degree = "auto"`."""
        call = dataclasses.replace(self._defaults, **setting)
        self._check(call)
        self._defaults = self._usable(call)

    def default_call(self) -> MoECall:
        return self._defaults

    def call_with(self, *, top_k: int | None = None, capacity_factor: float | None | EllipsisType = ...,
                  overlap_degree: int | str | None = None, a2a_algo: str | None = None,
                  parallel: int | None = None, communicate: bool = True, kernels: str | None = None,
                  expert_step: BackwardSGD | None = None) -> MoECall:
        """The settings of a call with these overrides (None / ...: the layer's), checked.
        `communicate=False` is for benchmarks only (see `MoECall`)."""
        overrides = (top_k, capacity_factor, overlap_degree, a2a_algo, parallel, communicate, kernels)
        call = self._usable(resolve_call(self._defaults, overrides, self._shape()))
        if expert_step is None:  # kept out of the cached resolution, which would keep the optimizer alive
            return call
        if not isinstance(expert_step, BackwardSGD):
            raise ValueError(f"expert_step must be a weft.BackwardSGD, not {type(expert_step).__name__}")
        if self.balancer is not None:
            raise ValueError("expert_step cannot step a balanced layer's experts in the backward: Pro-Prophet adds "
                             "its copies' gradients after it; use a plain optimizer with balance='pro-prophet'")
        return dataclasses.replace(call, expert_step=expert_step)

    def _usable(self, call: MoECall) -> MoECall:
        """`call`, unless it needs 2DH groups this layer did not build (at construction: a collective;
        a layer without them tunes "auto" among the one-level all-to-alls, linear and dedup)."""
        if call.a2a_algo == "2dh" and self.placement.groups_2dh is None:
            raise ValueError("a2a_algo='2dh' needs a layer built with a2a_algo '2dh' or 'auto'")
        return call

    def _shape(self) -> tuple:
        return self.num_experts, self.gate, self.hidden_dim, self.expert_shards, self.parallel, self.ep_size

    def _check(self, call: MoECall) -> None:
        check_settings(call, *self._shape())
        if call.a2a_algo in DEDUP_ALGOS and self.balancer is not None:
            raise ValueError(f"a2a_algo={call.a2a_algo!r} does not run Pro-Prophet's copied experts; use "
                             "a2a_algo='linear' with balance='pro-prophet'")

    def parallel_choices(self) -> list[int]:
        """The r this layer can run: 0 (data parallel) and the divisors of W / E (1 when E >= W)."""
        return parallel_choices(self.expert_shards)

    def candidates(self, call: MoECall | None = None) -> list[Setting]:
        """The settings the tuning dictionary may choose from for `call` (default: the layer's)."""
        call = call or self.default_call()
        return self._candidates(call, self._offers_comet(call))

    def tuning_key(self, call: MoECall | None = None) -> str:
        call = call or self.default_call()
        return self._tuning_key(call, self._offers_comet(call))

    def _candidates(self, call: MoECall, comet: bool) -> list[Setting]:
        groups = self.placement.groups_2dh
        return candidates(call, self.parallel, self.ep_size, self.expert_shards,
                          groups.num_nodes if groups is not None else 1, comet=comet, dedup=self._offers_dedup(call))

    def _tuning_key(self, call: MoECall, comet: bool) -> str:
        shape = (f"E{self.num_experts}-k{call.top_k}-dim{self.dim}-h{self.hidden_dim}"
                 f"-{self.experts.activation}-W{self.ep_size}-{str(self.experts.w1.dtype).replace('torch.', '')}")
        return tuning_key(shape, call, self.parallel, comet=comet, dedup=self._offers_dedup(call))

    def tunes_dedup(self) -> bool:
        """Whether this layer's own calls time the deduplicating all-to-all (`offers_dedup`)."""
        return self._offers_dedup(self.default_call())

    def _offers_dedup(self, call: MoECall) -> bool:
        """Whether a tuned call of this layer times the deduplicating all-to-all (`offers_dedup`)."""
        return offers_dedup(call, self.gate != "expert_choice", self.ep_size, self.expert_shards,
                            self.balancer is not None)

    def _dedups(self, call: MoECall) -> bool:
        """Whether this call may run the deduplicating all-to-all: asked for, or a tuned candidate."""
        return (call.a2a_algo in DEDUP_ALGOS or self._offers_dedup(call)) and call.communicate and self.ep_size > 1

    def _offers_comet(self, call: MoECall) -> bool:
        """Whether a tuned call of this layer times Comet's exchange as a candidate (`offers_comet`,
        where the ranks map each other's memory; no warning where they do not: "auto" then just
        tunes the other settings)."""
        device = self.experts.w1.device
        return (offers_comet(call, device.type == "cuda", self.ep_size, self.expert_shards)
                and peers_unavailable(self.group, device) is None)

    # -- the stages ------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, transfer: Transfer | None = None,
                copies: Mapping[int, Collection[int]] | None = None, **overrides) -> torch.Tensor:
        """y = MoE(x); keyword arguments (see `call_with`) override the layer's settings for this call.

        `transfer` (balanced layers): the copies this call uses, launched ahead by
        `start_transfer()` (Pro-Prophet's block-wise schedule); `Transfer.none()` runs the call
        unbalanced. Left None, a balanced dropless call plans and copies its experts itself.
        `copies` (balanced calls on Comet's path, `copies_in_slots`): the copies this call places
        in its replica slots (expert -> the ranks that get one; {} none) instead of the plan's."""
        call = self.call_with(**overrides) if overrides else self.default_call()
        self._check_input(x)
        tokens_TD = x.reshape(-1, self.dim)
        if not self._ranks_agree:
            self._check_ranks_agree(call, tokens_TD)
        routing = self.route(tokens_TD, call)
        self.record(routing.summary)
        # Dispatch in the experts' compute dtype (bf16 under autocast): half the all-to-all bytes.
        tokens_TD = tokens_TD.to(self.experts.compute_dtype(tokens_TD))
        if routing.capacity is None:
            y_TD = self._dropless(tokens_TD, routing, call, x.dtype, transfer, copies)
        else:
            y_TD = self._padded(tokens_TD, routing, call, x.dtype)
        return y_TD.to(x.dtype).reshape(x.shape)

    def route(self, tokens_TD: torch.Tensor, call: MoECall | None = None) -> Routing:
        """Router logits and the gate rule for tokens (T, dim): the routed slots, losses and stats."""
        call = call or self.default_call()
        fused = use_triton(call.kernels, tokens_TD)  # the logits live on the tokens' device
        with stage("router"):
            logits_TE = self.router(tokens_TD, fused=fused)
        with stage("routing"):
            return self.gate_rule.route(logits_TE, call.top_k, call.capacity_factor, self.expert_bias,
                                        fused=fused, sample=self.training)

    def start_transfer(self) -> Transfer:
        """Pro-Prophet's Trans for this layer's next call, launched now on the transfer group: the
        experts the plan copies, from the loads of the earlier calls (nothing on one rank, before
        any load is known, or where the plain placement is best). Alg. 2 launches it under the
        preceding block's forward; pass it to the call as `transfer`."""
        if self.balancer is None:
            raise ValueError("start_transfer: this layer does not balance (build it with balance='pro-prophet')")
        copies = self.balancer.next_copies()
        if not copies:
            return Transfer.none()
        weight = self.experts.w1
        dtype = torch.get_autocast_dtype(weight.device.type) if torch.is_autocast_enabled(weight.device.type) else None
        return Transfer(self.experts, self.placement, copies, self.transfer_group, dtype)

    def update_expert_bias(self, counts_E: torch.Tensor, rate: float) -> None:
        """After a training step: move the selection bias by `rate` towards balance, given the
        step's slots per expert summed over every rank (the same tensor on every rank, so the
        bias stays identical across ranks)."""
        if self.expert_bias is None:
            raise ValueError("this layer keeps no expert bias (build it with expert_bias=True)")
        expert_bias_step(self.expert_bias, counts_E.to(self.expert_bias.device), rate)

    def record(self, summary: RoutingSummary | None) -> None:
        """Keep a forward's routing summary as this layer's `aux_loss`, `z_loss` and `stats` (None:
        forget the last one, and the autograd graph its losses keep alive)."""
        self.last_routing = summary

    def exchange_for(self, layout: Layout, call: MoECall, setting: Setting, device: torch.device,
                     transfer: Transfer | None = None) -> Exchange:
        """The exchange that takes the dispatched rows to their experts' outputs by `setting` (a
        call's own, `untuned_setting(call)`, or the tuning dictionary's choice; `transfer`: the
        copies of Pro-Prophet's experts for a dropless call)."""
        offered = setting.comet and is_tuned(call, self.parallel, self.ep_size)
        peers = self._comet_peers(call, device, offered) if setting.comet else None
        ctx = ExchangeContext(self.experts, self.placement, call.communicate, self.wgrad_scheduler, peers, self.tuning,
                              call.expert_step)
        return select(ctx, setting, not isinstance(layout, Padded), transfer)

    def _exchange_rows(self, exchange: Exchange, layout: Layout, tokens_TD: torch.Tensor, slot_rows: SlotRows | None,
                       num_rows: int, rows_of_tokens) -> tuple[torch.Tensor, Staging | None]:
        """The dispatched rows through `exchange`: by the row kernels over `slot_rows`, written
        where the exchange wants them (`Exchange.staging`), else `rows_of_tokens(tokens_TD)`
        (the PyTorch index ops). Returns the experts' outputs and the staging the combine's
        backward writes into."""
        staging = None
        with stage("dispatch"):
            if slot_rows is not None:
                staging = exchange.staging(layout, num_rows, tokens_TD)
                rows_ND = dispatch_rows(tokens_TD, slot_rows, None if staging is None else staging.rows_ND)
            else:
                rows_ND = rows_of_tokens(tokens_TD)
        with stage("exchange"):
            return exchange(rows_ND, layout), staging

    def _run_tuned(self, call: MoECall, run, tokens_TD: torch.Tensor, capacity: int) -> torch.Tensor:
        """`run(setting, tokens)` (dispatch, exchange and combine by one setting) with the call's
        setting, or, when something is "auto", the tuning dictionary's: every candidate runs the
        whole route from tokens to outputs, so a candidate that moves rows differently (the
        deduplicating all-to-all) is timed like the others. `capacity` is the tuning bucket's,
        agreed by every rank of the group."""
        if not is_tuned(call, self.parallel, self.ep_size):
            return run(untuned_setting(call), tokens_TD)
        comet = self._offers_comet(call)  # Comet's exchange among the tuned candidates
        found = self._candidates(call, comet)
        if len(found) == 1:  # nothing to tune
            return run(found[0], tokens_TD)
        return self.tuning.run(self._tuning_key(call, comet), capacity, found, self.group, run, tokens_TD,
                               caller=id(self))

    def _comet_peers(self, call: MoECall, device: torch.device, offered: bool) -> PeerBuffers | None:
        """The group's peer buffers when this call may run Comet's kernels: `kernels="comet"`, or a
        tuned call that `offered` Comet as a candidate (else None; for "comet", said once per
        reason when the ranks cannot address each other's memory)."""
        if offered:
            return peer_buffers(self.group, device)
        if call.kernels != "comet" or not call.communicate or self.expert_shards > 1:
            return None
        reason = peers_unavailable(self.group, device)
        if reason is not None:
            warnings.warn(f"kernels='comet' needs ranks that address each other's memory; {reason}: "
                          f"the MoE layers run the NCCL exchange", stacklevel=4)
            return None
        return peer_buffers(self.group, device)

    def _padded(self, tokens_TD: torch.Tensor, routing: Routing, call: MoECall, out_dtype: torch.dtype) -> torch.Tensor:
        cap = routing.capacity
        num_rows = self.num_experts * cap
        fused = self.gate != "expert_choice" and use_triton(call.kernels, tokens_TD)  # token choice: k slots a token

        def run(setting: Setting, tokens_TD: torch.Tensor) -> torch.Tensor:
            if setting.a2a_algo in DEDUP_ALGOS and self._dedups(call):  # padded: "dedup-fixed" is "dedup"
                return dedup.padded(tokens_TD, routing, self.experts, self.placement, call.top_k, out_dtype, fused,
                                    same_tokens=call.capacity_factor > 0, local_first=setting.overlap_degree == 2)
            layout = Padded(cap)
            with stage("dispatch"):
                slot_rows = routing.slot_rows if fused else None
                if slot_rows is None:
                    rows_S = routing.experts_S * cap + routing.positions_S
                    slot_rows = SlotRows.padded(rows_S, routing.kept_S, num_rows, call.top_k) if fused else None
                    if not fused and routing.kept_S is not None:
                        rows_S = torch.where(routing.kept_S, rows_S, num_rows)
            exchange = self.exchange_for(layout, call, plain_algo(setting), tokens_TD.device)
            out_RD, staging = self._exchange_rows(
                exchange, layout, tokens_TD, slot_rows, num_rows,
                lambda x_TD: dispatch_padded(x_TD, routing.token_ids_S, rows_S, num_rows))
            with stage("combine"):
                if fused:
                    return combine_rows(out_RD, routing.gates_S.view(-1, call.top_k), slot_rows, out_dtype,
                                        None if staging is None else staging.grads_ND,
                                        staging is not None and staging.transient_out)
                return combine(out_RD, rows_S.clamp(max=num_rows - 1), routing.token_ids_S, routing.gates_S,
                               tokens_TD.shape[0], routing.kept_S)

        return self._run_tuned(call, run, tokens_TD, cap)

    def _dropless(self, tokens_TD: torch.Tensor, routing: Routing, call: MoECall,
                  out_dtype: torch.dtype, transfer: Transfer | None,
                  copies: Mapping[int, Collection[int]] | None = None) -> torch.Tensor:
        order_S = routing.order_S  # slot ids (t*k + j) grouped by expert
        fused = use_triton(call.kernels, tokens_TD)
        if call.a2a_algo in FIXED_SIZE_ALGOS and call.communicate:  # fixed-size exchanges: nothing read on the host
            return dedup.dropless_fixed(tokens_TD, routing, self.experts, self.placement, call.top_k, out_dtype, fused,
                                        degree=call.overlap_degree, own_apart=call.a2a_algo == OWN_APART_ALGO)
        on_device = self._counts_stay_on_device(call, transfer, tokens_TD.device)
        scheduled = transfer is not None  # the caller launched the copies ahead (Alg. 2)
        replicas = None
        if copies is not None and not (self.balancer is not None and on_device and call.communicate):
            raise ValueError("copies= applies to a balanced layer's dropless calls on Comet's path (kernels='comet' on "
                             "ranks that map each other's memory); the NCCL path takes a Transfer")
        if self.balancer is not None and transfer is None and call.communicate:
            if on_device:  # Comet's map: the copies in replica slots, through peer memory (no host read)
                replicas = self._replicas(tokens_TD, routing.order_S.numel(), copies)
            else:  # not launched ahead: plan (from the earlier calls' loads) and copy now, on the EP group
                transfer = Transfer(self.experts, self.placement, self.balancer.next_copies(scheduled=False),
                                    self.group, self.experts.compute_dtype(tokens_TD))
        pairs = pairs_WW = None
        if on_device:  # a grouped GEMM, or Comet's map, from the counts on the device: no host read
            slots = routing.order_S.numel()
            layout = gather_counts_on_device(routing.counts_E, self.group if call.communicate else None, slots,
                                             self.ep_size * min(slots, tokens_TD.shape[0] * self.num_local_experts),
                                             replicas)
        else:
            # Every rank's counts on the host (with each rank's token-rank pairs where the call may
            # deduplicate): the call's one read of the device (the splits, the tuning bucket and
            # Pro-Prophet's history all come from it).
            pairs = dedup.Pairs.of(routing, tokens_TD.shape[0], call.top_k, self.num_local_experts, self.ep_size) \
                if self._dedups(call) else None
            layout, pairs_WW = dedup.gather_layout(routing, pairs, self.group if call.communicate else None,
                                                   self.num_experts)

        def run(setting: Setting, tokens_TD: torch.Tensor) -> torch.Tensor:
            if setting.a2a_algo == "dedup" and pairs is not None:
                return dedup.dropless(tokens_TD, routing, self.experts, self.placement, out_dtype, fused, pairs,
                                      layout, pairs_WW)
            with stage("dispatch"):
                slot_rows = SlotRows.grouped(order_S, call.top_k) if fused else None
                token_ids_S = None if fused else routing.token_ids_S.index_select(0, order_S)
            exchange = self.exchange_for(layout, call, plain_algo(setting), tokens_TD.device, transfer)
            out_SD, staging = self._exchange_rows(exchange, layout, tokens_TD, slot_rows, order_S.numel(),
                                                  lambda x_TD: x_TD.index_select(0, token_ids_S))
            with stage("combine"):
                if fused:
                    return combine_rows(out_SD, routing.gates_S.view(-1, call.top_k), slot_rows, out_dtype,
                                        None if staging is None else staging.grads_ND,
                                        staging is not None and staging.transient_out)
                return combine(out_SD, None, token_ids_S, routing.gates_S.index_select(0, order_S),
                               tokens_TD.shape[0])

        if on_device:  # the call's own setting (one rank: the only exchange): no tuning bucket
            out_TD = run(untuned_setting(call), tokens_TD)
            if replicas is not None and not _capturing(tokens_TD):
                # this call's loads, to the host without a wait; the next call records them
                self._pending_counts = host_tensor_async(layout.counts_WE)
            elif replicas is not None and replicas.on_device:
                self._graph_counts_WE = layout.counts_WE  # where each replay leaves its loads (`update_placement`)
            return out_TD
        # the tuning bucket: the most rows any rank dispatches, so that every rank keys the same entry
        out_TD = self._run_tuned(call, run, tokens_TD, -(-layout.most_slots() // self.num_experts))
        if self.balancer is not None and call.communicate:
            # This call's loads join the history, and the next call's plan is made from them, now
            # that this call's experts and exchanges are launched and run on the GPU (Pro-Prophet's
            # Plan under the all-to-all, Alg. 2): between the read of the counts and the launches,
            # and at the next call's start, the host is on the GPU's path.
            self.balancer.record(layout.counts_WE)
            self.balancer.plan_ahead(scheduled)
        return out_TD

    def _replicas(self, tokens_TD: torch.Tensor, rows: int,
                  copies: Mapping[int, Collection[int]] | None = None) -> ReplicaCall:
        """A balanced dropless call on Comet's path: the earlier call's loads (copied to the host
        during that call) join the history, and the plan made from them (or `copies`) places this
        call's copies in the layer's replica slots. While a CUDA graph is captured the placement
        stays as it is: a graph replays the placement it found (`graph_placement="captured"`), or
        the call is shaped for any placement and reads the one `update_placement()` writes after
        each replay ("updated"; see `weft.moe.exchange.replica_slots`)."""
        capturing = _capturing(tokens_TD)
        if self._replica_slots is None:
            peers = peer_buffers(self.group, tokens_TD.device)
            self._replica_slots = ReplicaSlots(peers, str(peers.ordinal("replica-slots", self)), self.num_experts,
                                               tokens_TD.device, self.balancer.rounds)
        slots = self._replica_slots
        if not capturing:
            self._record_pending_counts()
            slots.place(self.balancer.next_copies(scheduled=False) if copies is None else copies,
                        in_place=self.graph_placement == "updated")
            if self.graph_placement == "updated":  # a later capture's buffers (made eagerly: collective)
                slots.make_buffers(self.experts.weights(), self.experts.compute_dtype(tokens_TD))
        on_device = capturing and self.graph_placement == "updated"
        # Trans now, before the dispatch: on CUDA it flies under the dispatch and Comet's layer0
        # (no copies: nothing to move, and the call runs plain Comet)
        transfer = slots.start_transfer(self.experts.weights(), self.experts.compute_dtype(tokens_TD), on_device) \
            if slots.copied or on_device else PendingTransfer((), None)
        return ReplicaCall(slots, min(rows, slots.per_rank * tokens_TD.shape[0]), transfer, on_device)

    def _record_pending_counts(self) -> None:
        """The loads on their way to the host (`_pending_counts`) join Pro-Prophet's history."""
        if self._pending_counts is None:
            return
        counts_WE, ready = self._pending_counts
        if ready is not None:
            ready.synchronize()
        self.balancer.record(counts_WE.tolist())
        self._pending_counts = None

    def update_placement(self, copies: Mapping[int, Collection[int]] | None = None) -> None:
        """After each replay of a CUDA graph that holds this layer's balanced calls on Comet's path
        (built with `graph_placement="updated"`), for the next: the replay's loads go to the host
        without a wait, those of the replay before join Pro-Prophet's history (the planner stays a
        replay behind, so that the host never waits for the GPU), and the plan made from the
        history (or `copies`, expert -> ranks) is written where the graph reads its placement, on
        the current stream (after this replay's reads of it). Call it after a replay only: before
        the first, the graph's loads are not written yet. A no-op for a layer with no such call."""
        if self.graph_placement != "updated":
            raise RuntimeError("update_placement() moves the copies of graphs built with graph_placement='updated'")
        if self._replica_slots is None or self._graph_counts_WE is None:
            return
        self._record_pending_counts()
        self._pending_counts = host_tensor_async(self._graph_counts_WE)
        self._replica_slots.place(self.balancer.next_copies(scheduled=False) if copies is None else copies,
                                  in_place=True)

    def counts_stay_on_device(self, call: MoECall | None = None) -> bool:
        """Whether this layer's dropless calls (`call`, default: its own) read nothing on the host
        (as `_counts_stay_on_device` says), so that a CUDA graph can hold them. Those that run the
        grouped GEMM on the counts left on the device (one rank's; no-comm's) also need it on the
        GPU (bf16 on sm90+; the experts' own dtype, or bf16 under autocast now); Comet's map does
        not."""
        call, weight = call or self.default_call(), self.experts.w1
        if not (call.dropless and self._counts_stay_on_device(call, None, weight.device)):
            return False
        comet_map = self.ep_size > 1 and call.communicate
        return comet_map or self.experts.offsets_stay_on_device(self.experts.compute_dtype(weight))

    def graphs_dropless_comet(self) -> bool:
        """Whether this layer's dropless calls with Comet's kernels at its plain setting (d = 1,
        linear, r = 1) would keep their counts on the GPU, so that a CUDA graph can hold them: the
        form `auto` times beside the fixed-size ones (`weft bench layer`'s auto+graph, `weft train
        --a2a-algo auto`). False off CUDA, where no graph runs."""
        call = self.call_with(kernels="comet", overlap_degree=1, a2a_algo="linear", parallel=1)
        device = self.experts.w1.device
        return device.type == "cuda" and call.dropless and self._counts_stay_on_device(call, None, device)

    def _counts_stay_on_device(self, call: MoECall, transfer: Transfer | None, device: torch.device) -> bool:
        """Whether a dropless call leaves the counts on the device (`GroupedOnDevice`), so that it
        reads nothing on the host and a CUDA graph can hold it. Two cases, neither with Lancet's
        scheduler (its deferred weight gradients read the groups on the host) nor Pro-Prophet:

        - one rank (W = 1) not running Comet's kernels: nothing to exchange, no splits to know; the
          grouped GEMM takes the groups' ends on the device (`Experts.forward_offsets`);
        - a call that does not communicate (`communicate=False`, the benchmarks' no-comm bound) on
          several ranks, whole experts per rank, r = 1: likewise nothing crosses a rank, each
          rank's local experts take its own rows (`AllToAll.grouped_on_device`);
        - Comet's own setting (`kernels="comet"`, not tuned, degree 1, r = 1) on two or more ranks
          that address each other's memory: its exchange builds its map there; every rank must
          route as many tokens (the buffers' size, `_check_ranks_agree`). Pro-Prophet's copies
          (balanced layers whose calls get no `transfer`) go into replica slots there.

        Pro-Prophet's other calls read the counts for its all-to-allv and plan from them."""
        if self.wgrad_scheduler is not None or transfer is not None:
            return False
        setting = untuned_setting(call)
        comet = (setting.comet and self.ep_size > 1 and call.communicate and self.expert_shards == 1
                 and not is_tuned(call, self.parallel, self.ep_size) and peers_unavailable(self.group, device) is None)
        if self.balancer is not None or comet:
            return comet
        if self.ep_size == 1:
            return not setting.comet
        return not call.communicate and self.expert_shards == 1 and setting.parallel == 1 and not setting.comet

    def copies_in_slots(self, call: MoECall | None = None) -> bool:
        """Whether this balanced layer's calls (`call`, default: its own) place their copies in
        replica slots on Comet's path, inside the call (so the block-wise schedule launches no
        `start_transfer` for them)."""
        call, device = call or self.default_call(), self.experts.w1.device
        return self.balancer is not None and call.dropless and self._counts_stay_on_device(call, None, device)

    def _check_ranks_agree(self, call: MoECall, tokens_TD: torch.Tensor) -> None:
        """Once, at the first forward: every rank of the EP group built the same layer and calls it
        with the same settings (and, where the padded all-to-all's size comes from the local token
        count, the same count). Otherwise the all-to-alls would mismatch: wrong results, or a
        failure deep inside the collective library. One small all-gather; ValueError on every
        rank naming the first field that differs."""
        fixed_size = (self.gate == "expert_choice" or (call.capacity_factor is not None and call.capacity_factor > 0)
                      or (call.a2a_algo in FIXED_SIZE_ALGOS and call.dropless)
                      or (call.dropless and self._counts_stay_on_device(call, None, tokens_TD.device)))
        fields = {
            "dim": self.dim, "hidden_dim": self.hidden_dim, "num_experts": self.num_experts, "top_k": call.top_k,
            "gate": self.gate, "capacity_factor": call.capacity_factor, "activation": self.experts.activation,
            "normalize_gates": self.normalize_gates, "parallel": self.parallel,
            "routing_temperature": self.gate_rule.temperature, "expert dtype": str(self.experts.w1.dtype),
            "overlap_degree": call.overlap_degree,
            "a2a_algo": call.a2a_algo, "kernels": call.kernels,
            "tokens per rank (fixed-size all-to-all)": tokens_TD.shape[0] if fixed_size else None,
        }
        codes = [int.from_bytes(hashlib.sha256(repr(v).encode()).digest()[:7], "little") for v in fields.values()]
        mine = torch.tensor(codes, dtype=torch.int64, device=tokens_TD.device)
        gathered = [torch.empty_like(mine) for _ in range(self.ep_size)]
        dist.all_gather(gathered, mine, group=self.group)
        table = torch.stack(gathered).cpu()
        for i, name in enumerate(fields):
            differ = (table[:, i] != codes[i]).nonzero()
            if len(differ):
                other = int(differ[0])
                hint = (" (padded capacity, dropless 'dedup-fixed(-own)' and dropless Comet size the exchange by "
                        "the local token count: give every rank the same number of tokens)") \
                    if name.startswith("tokens") else ""
                raise ValueError(f"MoE layer differs across the expert-parallel group: {name} is {fields[name]!r} "
                                 f"here (group rank {group_rank(self.group)}) but not on group rank {other}{hint}")
        self._ranks_agree = True

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"MoE input must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"MoE input must be a floating-point tensor, got dtype {x.dtype}")
        if x.dim() == 0 or x.shape[-1] != self.dim:
            raise ValueError(f"MoE input's last dimension must be dim={self.dim}, got shape {tuple(x.shape)}")


def _capturing(x: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on x's device's current stream."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()
