"""A GPT-style decoder whose feed-forward blocks can be weft.MoE layers.

    token embedding -> n_layer x [RMSNorm -> causal self-attention (rotary q, k) -> +residual,
                                  RMSNorm -> dense MLP or MoE -> +residual]
                    -> RMSNorm -> head (tied to the embedding) -> logits

No dropout and no randomness in the forward (except gate="random"), so training is exactly
reproducible. With expert parallelism each rank holds num_experts / W experts; everything else
is replicated and initialised identically on every rank from the same torch.manual_seed.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from weft.distributed import group_size
from weft.kernels.rmsnorm import rms_norm_cast
from weft.kernels.rotary import qkv_heads, rotary_reference
from weft.kernels.rows import KERNELS, use_triton
from weft.moe import ACTIVATIONS, GATES, MoE
from weft.moe.config import check_router_settings
from weft.moe.exchange import Transfer
from weft.moe.gates import EXPERT_BIAS_GATES
from weft.ops.wgrad import Linear
from weft.profiling import stage
from weft.tp import Sequential, TPBlock, reduce_from_tp, run_blocks, sharded_parameters

Unit = Callable[[torch.Tensor], torch.Tensor]
# Runs a model's sub-layers in order on x (e.g. Lancet's partitioned pipeline, weft.overlap).
UnitRunner = Callable[[Sequence[Unit], torch.Tensor], torch.Tensor]


@dataclass
class GPTConfig:
    """Shape and MoE settings of a GPT. `moe_every` = 0 is a dense model; otherwise block i is
    an MoE block iff i % moe_every == moe_every - 1 (2: every other block, as in Lancet's GPT-2 MoE)."""

    vocab_size: int = 256
    block_size: int = 128  # longest sequence the model accepts
    n_layer: int = 4
    n_head: int = 4
    dim: int = 128
    mlp_hidden_dim: int | None = None  # dense MLP width; None = 4 * dim
    moe_every: int = 0
    num_experts: int = 8
    top_k: int = 2
    moe_hidden_dim: int | None = None  # expert FFN width; None = the dense MLP width
    gate: str = "topk"
    capacity_factor: float | None = 1.25  # see weft.MoE; None = dropless
    activation: str = "gelu"  # expert activation
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    # > 0: each MoE layer keeps an expert-selection bias moved by this much per training step
    # towards balance (DeepSeek-V3's auxiliary-loss-free balancing; weft.MoE's expert_bias)
    expert_bias_rate: float = 0.0
    # > 0: training routes each token to experts sampled from softmax(logits / T) instead of the
    # top-k (weft.MoE's routing_temperature; evaluation and generation stay argmax)
    routing_temperature: float = 0.0
    # the routers' initial logit scale (weft.MoE's router_init_scale; 0.1: nearly uniform at start)
    router_init_scale: float = 1.0
    # > 0: a fixed Zipf(S) prior on the routers' logits (weft.MoE's routing_skew): a model whose
    # load stays skewed, to measure load balancing on (a different model, not a transform)
    routing_skew: float = 0.0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def dense_hidden(self) -> int:
        return self.mlp_hidden_dim if self.mlp_hidden_dim is not None else 4 * self.dim

    @property
    def expert_hidden(self) -> int:
        return self.moe_hidden_dim if self.moe_hidden_dim is not None else self.dense_hidden

    def is_moe_block(self, i: int) -> bool:
        return self.moe_every > 0 and i % self.moe_every == self.moe_every - 1

    def validate(self) -> None:
        """Raise ValueError naming the first field that is out of range."""
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "dim", "num_experts", "top_k"):
            _check_positive_int(name, getattr(self, name))
        for name in ("mlp_hidden_dim", "moe_hidden_dim"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        if self.dim % self.n_head != 0:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_head ({self.n_head})")
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"head_dim = dim / n_head ({self.head_dim}) must be even: rotary embeddings rotate pairs"
            )
        if not isinstance(self.moe_every, int) or isinstance(self.moe_every, bool) or self.moe_every < 0:
            raise ValueError(f"moe_every must be an integer >= 0 (0 = dense), got {self.moe_every!r}")
        if self.moe_every > self.n_layer:
            raise ValueError(
                f"moe_every ({self.moe_every}) exceeds n_layer ({self.n_layer}): no block would be MoE; "
                "use moe_every=0 for a dense model"
            )
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must not exceed num_experts ({self.num_experts})")
        if self.gate not in GATES:
            raise ValueError(f"unknown gate {self.gate!r}; choose one of {', '.join(GATES)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}; choose one of {', '.join(ACTIVATIONS)}")
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float))):
            raise ValueError(f"capacity_factor must be a number or None (dropless), got {cf!r}")
        if self.expert_bias_rate and self.moe_every and self.gate not in EXPERT_BIAS_GATES:
            raise ValueError(f"expert_bias_rate needs a gate that ranks experts by probability "
                             f"({', '.join(EXPERT_BIAS_GATES)}), not {self.gate!r}")
        if self.moe_every:
            check_router_settings(self.gate, self.expert_bias_rate > 0, self.routing_temperature,
                                  self.router_init_scale, self.routing_skew)
        for name in ("aux_loss_coef", "z_loss_coef", "expert_bias_rate", "routing_temperature", "routing_skew"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        for name in ("rope_theta", "norm_eps"):
            if not _is_number(getattr(self, name)) or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a number > 0, got {getattr(self, name)!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GPTConfig:
        """Build from a dict (e.g. parsed JSON/TOML); missing keys keep their defaults."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"unknown GPTConfig field(s): {', '.join(unknown)}; valid fields: {', '.join(sorted(known))}"
            )
        config = cls(**values)
        config.validate()
        return config


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


# -- rotary position embeddings (RoFormer), half-split pairing ---------------------------------
def rotary_tables(
    seq_len: int, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, each (seq_len, head_dim / 2), float32.

    Recomputed per forward (cheap next to attention) rather than cached in a buffer, so the
    model can be built on the meta device and materialised later without stale tables.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (..., seq, head_dim) by position; the math runs in float32 (the PyTorch reference
    of `weft.kernels.rotary`)."""
    return rotary_reference(x, cos, sin)


@dataclass(frozen=True)
class MoEUnit:
    """A residual MoE sub-layer, x + moe(norm(x), **overrides): the unit an overlap engine can cut
    along the batch around its MoE layer (weft.overlap.forward)."""

    norm: nn.Module
    moe: MoE
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __call__(self, x: torch.Tensor, transfer: Transfer | None = None) -> torch.Tensor:
        with stage("norm"):
            h = self.norm(x)
        return x + self.moe(h, transfer=transfer, **self.overrides)


BALANCE_SCHEDULES = ("blockwise", "inline", "off")


def run_units(units: Sequence[Unit], x: torch.Tensor, balance_schedule: str = "blockwise") -> torch.Tensor:
    """Run the residual sub-layers in order. Where MoE layers balance (Pro-Prophet), by
    `balance_schedule`:

    - "blockwise", Pro-Prophet's block-wise schedule (sec. V-B, Alg. 2): each balanced layer's
      Trans (`MoE.start_transfer`) is launched as the preceding balanced layer's sub-layer begins
      (the first one's before the first sub-layer), so it flies under that layer's experts and the
      attention after it. Its Agg is launched when the copies' gradients are complete and waited
      for where the Trans was launched, so it flies under the preceding layer's backward. Trans
      and Agg use the layers' side communicator, beside the all-to-alls rather than between them
      (where the paper splits them into two parts timed to fit the gaps);
    - "inline": each layer copies its experts at its own call (Trans and Agg in the layer's path);
    - "off": no layer copies (the plain layer's work; the loads are still recorded and planned).

    Layers whose calls place their copies in replica slots on Comet's path (`MoE.copies_in_slots`)
    copy inside their calls under "blockwise" too. The same function in every case: the copies
    compute exactly what their owners would."""
    if balance_schedule not in BALANCE_SCHEDULES:
        raise ValueError(f"unknown balance_schedule {balance_schedule!r}; choose from {', '.join(BALANCE_SCHEDULES)}")

    def scheduled(unit: Unit) -> bool:
        if not (isinstance(unit, MoEUnit) and unit.moe.balancer is not None):
            return False
        return balance_schedule == "off" or not unit.moe.copies_in_slots(unit.moe.call_with(**unit.overrides))

    balanced = [u for u in units if scheduled(u)]
    if balance_schedule == "inline" or not balanced:
        for unit in units:
            x = unit(x)
        return x
    start = (lambda unit: unit.moe.start_transfer()) if balance_schedule == "blockwise" else (
        lambda unit: Transfer.none())
    following = {id(a): b for a, b in zip(balanced, balanced[1:])}
    transfer = start(balanced[0])
    for unit in units:
        if not scheduled(unit):
            x = unit(x)
            continue
        after = following.get(id(unit))
        upcoming = start(after) if after is not None else None  # launched before this layer's work
        x = unit(x, transfer)
        transfer = upcoming
    return x


# -- the blocks -------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, kernels: str = "auto"):
        super().__init__()
        self.n_head, self.head_dim, self.kernels = config.n_head, config.head_dim, kernels
        self.qkv = Linear(config.dim, 3 * config.dim, bias=False)
        self.out_proj = Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = qkv_heads(self.qkv(x), self.n_head, *rope, self.kernels)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(batch, seq, dim))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.fc = Linear(dim, hidden_dim, bias=False)
        self.out_proj = Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(F.gelu(self.fc(x)))


class MatmulInputNorm(nn.RMSNorm):
    """`nn.RMSNorm` (the same parameter and state) for a norm whose only reader is a matmul under
    autocast: with weft's Triton kernels (`kernels`) and autocast on, its kernel writes the
    output in autocast's dtype, the values autocast's cast of the float32 output would give (to
    float32 rounding), without that cast's passes either way (`weft.kernels.rmsnorm`).
    Otherwise, and on the CPU, `nn.RMSNorm` itself."""

    def __init__(self, dim: int, eps: float | None, kernels: str = "auto"):
        super().__init__(dim, eps=eps)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else torch.float32
        if (self.weight is not None and x.dtype == torch.float32 and dtype != torch.float32 and x.is_contiguous()
                and use_triton(self.kernels, x)):
            return rms_norm_cast(x, self.weight, self.eps, dtype)
        return super().forward(x)


class Block(nn.Module):
    def __init__(self, config: GPTConfig, moe: bool, group: dist.ProcessGroup | None, kernels: str = "auto",
                 balance: str | None = None, balance_n: int = 1, balance_rounds: int = 1):
        super().__init__()
        self.attn_norm = MatmulInputNorm(config.dim, config.norm_eps, kernels)  # read by the qkv projection only
        self.attn = CausalSelfAttention(config, kernels)
        # a dense MLP's input norm is read by its first linear only; an MoE layer's also by its router
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps) if moe else \
            MatmulInputNorm(config.dim, config.norm_eps, kernels)
        if moe:
            self.ffn = MoE(
                config.dim, config.expert_hidden, config.num_experts, config.top_k, config.gate,
                config.capacity_factor, config.activation, group=group, kernels=kernels,
                expert_bias=config.expert_bias_rate > 0, routing_temperature=config.routing_temperature,
                router_init_scale=config.router_init_scale, routing_skew=config.routing_skew, balance=balance,
                balance_n=balance_n, balance_rounds=balance_rounds,
            )
        else:
            self.ffn = MLP(config.dim, config.dense_hidden)

    @property
    def is_moe(self) -> bool:
        return isinstance(self.ffn, MoE)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                moe_overrides: Mapping[str, Any] | None = None) -> torch.Tensor:
        for unit in self.units(rope, moe_overrides):
            x = unit(x)
        return x

    def units(self, rope: tuple[torch.Tensor, torch.Tensor], moe_overrides: Mapping[str, Any] | None = None) -> list:
        """The block as two residual sub-layers, x -> x (attention, then the FFN or MoE), the
        granularity at which Lancet's forward pass partitions (weft.overlap)."""
        attn = functools.partial(self._attention, rope=rope)
        if self.is_moe:
            return [attn, MoEUnit(self.ffn_norm, self.ffn, dict(moe_overrides or {}))]
        return [attn, self._mlp]

    def _attention(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        with stage("attention"):
            return x + self.attn(self.attn_norm(x), rope)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        with stage("mlp"):
            return x + self.ffn(self.ffn_norm(x))


# -- the model --------------------------------------------------------------------------------
class GPT(nn.Module):
    """GPT with optional MoE blocks; `group` is the expert-parallel group of every MoE layer
    (None = the default group if initialised, as for weft.MoE). `kernels`: "auto" (Triton's
    rotary and MoE dispatch/combine on CUDA), "triton" or "torch" (PyTorch ops only); the same
    function either way. `balance`: None, or "pro-prophet" for every MoE layer (weft.MoE's
    balance, `balance_n` and `balance_rounds`; dropless models only); the same function either
    way. `tp_group`: the blocks are split over this tensor-parallel group (weft.tp, Megatron's
    split: attention and dense MLPs cut, MoE layers expert-parallel over `group` and fed 1 / tp
    of the tokens by each rank) and run by `tp_schedule` (weft.tp.Sequential by default,
    weft.tp.Domino to overlap the all-reduces); every rank of the group gets the same tokens.
    The weights are those of the unsplit model (the same seed gives the same model for any TP
    size). With MoE layers, the aux and z losses are the mean over the TP group of each rank's
    share's, as in data parallelism over the shares. Balanced layers of a tensor-parallel model
    plan and copy their experts in each call (inline: the block-wise schedule runs over
    sub-layer units, which TP blocks run as one stack)."""

    def __init__(self, config: GPTConfig, group: dist.ProcessGroup | None = None, kernels: str = "auto",
                 balance: str | None = None, tp_group: dist.ProcessGroup | None = None, tp_schedule=None,
                 balance_n: int = 1, balance_rounds: int = 1):
        super().__init__()
        config.validate()
        if kernels not in KERNELS:
            raise ValueError(f"unknown kernels {kernels!r}; choose one of {', '.join(KERNELS)}")
        if balance is not None and config.moe_every and config.capacity_factor is not None:
            raise ValueError(f"balance={balance!r} balances dropless MoE layers; this model's capacity_factor is "
                             f"{config.capacity_factor} (set capacity_factor = \"dropless\" in the [model] table)")
        self.config = config
        self.balanced = balance is not None and config.moe_every > 0
        self.tok_emb = nn.Embedding(config.vocab_size, config.dim)
        self.blocks = nn.ModuleList(Block(config, config.is_moe_block(i), group, kernels, balance, balance_n,
                                          balance_rounds) for i in range(config.n_layer))
        self.norm = MatmulInputNorm(config.dim, config.norm_eps, kernels)  # read by the head only
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied, as in GPT-2
        self.tp = None
        self._init_weights()
        # Tensor parallelism: each block cut from its initialised dense self (so any TP size starts
        # from the same weights), run as one stack by the schedule.
        if group_size(tp_group) > 1:
            self.blocks = nn.ModuleList(TPBlock.from_dense(block, config.n_head, tp_group, kernels)
                                        for block in self.blocks)
            self.tp = (tp_group, tp_schedule if tp_schedule is not None else Sequential())
        # How the sub-layers of self.units() run: None in order; weft.overlap.optimize installs
        # Lancet's partitioned pipeline here.
        self.unit_runner: UnitRunner | None = None
        # Detached parts of the last loss, for logging: aux and z are sums over the MoE layers
        # before their coefficients are applied.
        self.last_ce_loss: torch.Tensor | None = None
        self.last_aux_loss: torch.Tensor | None = None
        self.last_z_loss: torch.Tensor | None = None

    def use_tp_schedule(self, schedule) -> None:
        """Run the tensor-parallel blocks by `schedule` from now on (e.g. the one a measured
        search chose, weft.tp.search)."""
        if self.tp is None:
            raise ValueError("use_tp_schedule: this model is not tensor-parallel")
        self.tp = (self.tp[0], schedule)

    def _init_weights(self) -> None:
        # nanoGPT / GPT-2 init; residual projections scaled by 1/sqrt(2 * n_layer) because each
        # block adds two of them to the residual stream. weft.MoE initialises itself (its expert
        # init is EP-size invariant), so modules inside an MoE are left alone.
        inside_moe = {id(m) for moe in self.moe_layers() for m in moe.modules()}
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if id(module) in inside_moe or not isinstance(module, (nn.Linear, nn.Embedding)):
                continue
            std = residual_std if name.endswith("out_proj") else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)

    def units(self, rope: tuple[torch.Tensor, torch.Tensor], moe_overrides: Mapping[str, Any] | None = None) -> list:
        """All blocks' sub-layers in order: unit 2i is block i's attention, 2i + 1 its FFN."""
        if self.tp is not None:
            raise ValueError("tensor-parallel blocks run as one stack (weft.tp); they have no sub-layer units for "
                             "Lancet's partitioned forward")
        return [unit for block in self.blocks for unit in block.units(rope, moe_overrides)]

    def moe_layers(self) -> list[MoE]:
        """The MoE layers in block order."""
        return [block.ffn for block in self.blocks if isinstance(block.ffn, MoE)]

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, moe_overrides: Mapping[str, Any] | None = None,
        tp_schedule=None, balance_schedule: str = "blockwise",
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx (B, S) token ids -> logits (B, S, vocab) and, with targets (B, S), the training loss
        cross_entropy + aux_loss_coef * sum(aux_loss) + z_loss_coef * sum(z_loss).

        `moe_overrides` are per-call settings of every MoE layer (`weft.MoE.forward`'s keywords,
        e.g. `{"capacity_factor": None}` to run dropless for this call only). `tp_schedule` runs a
        tensor-parallel model's blocks by another weft.tp schedule for this call.
        `balance_schedule` (balanced models): when Pro-Prophet's copies move ("blockwise",
        "inline" or "off"; see `run_units`); Lancet's pipeline (`unit_runner`) and tensor-parallel
        blocks copy inline."""
        self._check_input(idx, targets)
        with stage("embedding"):
            x = self.tok_emb(idx)
        rope = rotary_tables(idx.shape[1], self.config.head_dim, self.config.rope_theta, idx.device)
        if self.tp is not None:
            group, schedule = self.tp
            x = run_blocks(self.blocks, x, rope, group, tp_schedule or schedule)
        elif self.unit_runner is not None:
            x = self.unit_runner(self.units(rope, moe_overrides), x)
        else:
            x = run_units(self.units(rope, moe_overrides), x, balance_schedule)
        with stage("head"):
            logits = self.head(self.norm(x))
        if targets is None:
            return logits, None
        with stage("loss"):
            ce = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        zero = ce.new_zeros(())
        aux = sum((moe.aux_loss for moe in self.moe_layers()), zero)
        z = sum((moe.z_loss for moe in self.moe_layers()), zero)
        for moe in self.moe_layers():
            # the returned loss holds the routing losses' graph now; a layer's record would keep
            # it (and every earlier parameter's gradient accumulator, bound to this call's CUDA
            # stream) alive after backward, which breaks the next CUDA graph capture (weft.graphs)
            moe.record(moe.last_routing.detached())
        if self.tp is not None and self.moe_layers():
            # Each rank of the TP group routed its own share of the tokens: the mean of the ranks'
            # losses, as data parallelism over those shares would average them (the router's
            # gradients are then summed over the group: weft.moe.grads).
            group = self.tp[0]
            aux, z = (reduce_from_tp(t, group) / group_size(group) for t in (aux, z))
        self.last_ce_loss, self.last_aux_loss, self.last_z_loss = ce.detach(), aux.detach(), z.detach()
        return logits, ce + self.config.aux_loss_coef * aux + self.config.z_loss_coef * z

    def _check_input(self, idx: torch.Tensor, targets: torch.Tensor | None) -> None:
        if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int64, torch.int32):
            kind = idx.dtype if isinstance(idx, torch.Tensor) else type(idx).__name__
            raise TypeError(f"idx must be an int64 (or int32) tensor of token ids, got {kind}")
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (batch, seq), got {tuple(idx.shape)}")
        if not 1 <= idx.shape[1] <= self.config.block_size:
            raise ValueError(
                f"sequence length {idx.shape[1]} must be in [1, block_size={self.config.block_size}]"
            )
        if targets is not None and targets.shape != idx.shape:
            raise ValueError(f"targets shape {tuple(targets.shape)} must equal idx shape {tuple(idx.shape)}")

    def num_parameters(self, active_only: bool = False) -> int:
        """Parameters of the whole model, counting all E experts of each MoE layer even when this
        rank holds a shard; `active_only` counts top_k experts per MoE layer (what a token uses)."""
        expert_params: set[int] = set()
        total = 0
        for moe in self.moe_layers():
            params = list(moe.experts.parameters())
            expert_params.update(id(p) for p in params)
            per_expert = sum(p.numel() for p in params) // moe.num_local_experts
            total += per_expert * (moe.top_k if active_only else moe.num_experts)
        total += sum(p.numel() for p in self.parameters() if id(p) not in expert_params)
        if self.tp is not None:  # each rank holds 1/tp of the split parameters
            total += sum(p.numel() for p in sharded_parameters(self)) * (group_size(self.tp[0]) - 1)
        return total

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward), the PaLM / nanoGPT MFU estimate:
        6 * active parameters + 12 * n_layer * dim * seq_len for attention scores and values."""
        seq_len = self.config.block_size if seq_len is None else seq_len
        return 6 * self.num_parameters(active_only=True) + 12 * self.config.n_layer * self.config.dim * seq_len
