"""Routers (token -> expert logits) and the gate rules that turn logits into routed slots.

Every gate yields slots: (token, expert, gate value) triples. Token-choice gates (topk, bpr,
cosine, random) produce k slots per token and a priority order for capacity; expert choice
produces C slots per expert. Routing math runs in float32 whatever the input dtype.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from weft.kernels.router_matmul import fused_router_matmul_on, router_matmul, router_matmul_reference

GATES = ("topk", "bpr", "cosine", "expert_choice", "random")
# The gates that rank experts by probability, where an expert-selection bias applies.
EXPERT_BIAS_GATES = ("topk", "bpr", "cosine")
# The gates that can sample their experts in training (`routing_temperature`): the same ones.
SAMPLING_GATES = EXPERT_BIAS_GATES


def float32_region(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """Autocast switched off where it is on (it would route in bf16); else nothing to enter (an
    autocast region costs the host tens of microseconds a call)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.autocast(x.device.type, enabled=False)
    return contextlib.nullcontext()


def zipf_bias(num_experts: int, skew: float, seed: int = 0) -> torch.Tensor:
    """(E,) float64 logit bias b_e = -skew * ln(rank_e), ranks 1..E of a random permutation drawn
    from `seed` (the same on every rank): routing prefers expert e by the factor rank_e^-skew,
    Zipf(skew) shaped, hot experts spread over the ranks."""
    ranks = torch.randperm(num_experts, generator=torch.Generator().manual_seed(seed)) + 1
    return -skew * torch.log(ranks.to(torch.float64))


def router_product(x_TD: torch.Tensor, weight_ND: torch.Tensor, fused: bool) -> torch.Tensor:
    """x @ weight^T in float32 (`weft.kernels.router_matmul`): with `fused`, by the Triton kernels
    where they take x (bf16 rows; no float32 copy of x), else by the reference."""
    if fused and fused_router_matmul_on(x_TD, weight_ND):
        return router_matmul(x_TD, weight_ND)
    return router_matmul_reference(x_TD, weight_ND)


def logit_shift(router_weight_ED: torch.Tensor, bias_XE: torch.Tensor) -> torch.Tensor:
    """(..., dim) the input shifts u with W u = b for the router weight W (E, dim) and each logit
    bias b of `bias_XE` (..., E): a linear router's logits move by b. Least squares in float64
    (exact for E <= dim), on `router_weight_ED`'s device."""
    weight = router_weight_ED.detach().to("cpu", torch.float64)
    return (bias_XE.to(torch.float64) @ torch.linalg.pinv(weight).T).to(router_weight_ED.device)


class LinearRouter(nn.Module):
    """`logits = x.float() @ weight.T`; `weight` is (E, dim) and always kept in float32, initialised
    N(0, init_scale^2 / dim): logits of standard deviation ~init_scale for unit-RMS inputs (0.1:
    nearly uniform probabilities at the start, Switch Transformer sec. 2.4's smaller router init).

    `skew` > 0 adds a fixed Zipf prior to the logits (`zipf_bias`; buffer `prior_E`, not saved: it
    follows from the setting): a router skewed on purpose, so that load balancing can be studied
    on a model whose load stays skewed. It is part of the model (it changes routing and gates)."""

    def __init__(self, dim: int, num_experts: int, init_scale: float = 1.0, skew: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, dim, dtype=torch.float32))
        nn.init.normal_(self.weight, std=init_scale * dim**-0.5)
        self._register_prior(num_experts, skew)

    def _register_prior(self, num_experts: int, skew: float) -> None:
        prior = zipf_bias(num_experts, skew).float() if skew else None
        self.register_buffer("prior_E", prior, persistent=False)

    def _with_prior(self, logits_TE: torch.Tensor) -> torch.Tensor:
        return logits_TE if self.prior_E is None else logits_TE + self.prior_E

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """(T, E) float32 logits of x (T, dim); `fused`: the product by Triton's kernels where they
        run (`router_product`; the layer's `kernels` setting decides)."""
        with float32_region(x):
            return self._with_prior(router_product(x, self.weight, fused))

    def _apply(self, fn, recurse=True):
        # Routing decisions are discrete: keep them in float32 even when the model is cast.
        super()._apply(fn, recurse)
        for p in self.parameters(recurse=False):
            if p.dtype != torch.float32:
                p.data = p.data.float()
        return self


class CosineRouter(LinearRouter):
    """Tutel's cosine router: learned projection, cosine similarity to expert embeddings,
    scaled by a learned temperature clamped at 1/0.01.

    `proj.weight` is (proj_dim, dim); `weight` (the expert embeddings) is (E, proj_dim);
    `init_scale` multiplies the initial logit scale 1 / init_temperature.
    """

    max_log_scale = math.log(1.0 / 0.01)

    def __init__(self, dim: int, num_experts: int, proj_dim: int = 256, init_temperature: float = 0.5,
                 init_scale: float = 1.0, skew: float = 0.0):
        nn.Module.__init__(self)
        self.proj = nn.Linear(dim, proj_dim, bias=False, dtype=torch.float32)
        self.weight = nn.Parameter(torch.empty(num_experts, proj_dim, dtype=torch.float32))
        nn.init.normal_(self.weight, std=proj_dim**-0.5)
        self.log_scale = nn.Parameter(torch.tensor([math.log(init_scale / init_temperature)]))
        self._register_prior(num_experts, skew)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        with float32_region(x):
            h = F.normalize(router_product(x, self.proj.weight, fused), dim=-1)
            emb = F.normalize(self.weight.float(), dim=-1)
            return self._with_prior((h @ emb.t()) * self.log_scale.clamp(max=self.max_log_scale).exp())

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for p in self.proj.parameters():
            if p.dtype != torch.float32:
                p.data = p.data.float()
        return self


@dataclass
class TokenChoice:
    """k slots per token: `experts` (T, k) and `gates` (T, k); `order` ranks tokens for capacity
    (None = token order)."""

    experts: torch.Tensor
    gates: torch.Tensor
    order: torch.Tensor | None


def topk_desc(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores along the last dim, descending, ties to the lower index."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def token_choice(
    gate: str, probs: torch.Tensor, k: int, normalize: bool, noise: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> TokenChoice:
    """Route each token to k experts by the rule of `gate` (topk, bpr, cosine, random).

    `noise` (T, E) is the batch's random draw (`Router.draw`): the random gate's scores (default:
    drawn here from torch's RNG), or the other gates' sampling offsets (see `choice_scores`), so a
    batch routed in parts can draw it once for the whole batch. `bias` (E,) is added to the
    probabilities for choosing the experts only; the gates stay the unbiased probabilities
    (DeepSeek-V3 sec. 2.1.2, auxiliary-loss-free load balancing)."""
    experts = topk_desc(choice_scores(gate, probs, noise, bias), k)
    return TokenChoice(experts, gates_of(probs, experts, normalize), priority_order(gate, probs))


def choice_scores(gate: str, probs: torch.Tensor, noise: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """(T, E) what `gate` ranks each token's experts by: uniform noise for random (drawn here from
    torch's RNG when not given); for the other gates with sampling offsets `noise` (Gumbel(0, tau),
    `sampling_offsets`) the log-probabilities plus those offsets, whose top k are k experts drawn
    without replacement from softmax(logits / tau); else the probabilities plus the selection bias."""
    if gate == "random":  # benchmark/ablation gate: experts drawn uniformly, gates still learned
        return torch.rand(probs.shape, device=probs.device) if noise is None else noise
    if noise is not None:
        return probs.detach().clamp_min(1e-30).log() + noise
    return selection_scores(probs, bias)


def sampling_offsets(num_tokens: int, num_experts: int, temperature: float, device) -> torch.Tensor:
    """(T, E) Gumbel(0, temperature) draws from torch's RNG (one `exponential_` call: -log of an
    Exp(1) variable is Gumbel(0, 1)). The Gumbel-max trick: argmax(log p + G) is distributed as p,
    and argmax(log p + tau G) as p^(1/tau) renormalised, i.e. softmax(logits / tau)."""
    exp1 = torch.empty(num_tokens, num_experts, device=device).exponential_()
    return exp1.log().mul_(-temperature)


def priority_order(gate: str, probs: torch.Tensor) -> torch.Tensor | None:
    """The tokens' rank for capacity: bpr (batch-prioritized routing) by descending top
    probability, stable; None (token order) for the other gates."""
    if gate != "bpr":
        return None
    return torch.sort(probs.max(dim=1).values, descending=True, stable=True).indices


def selection_scores(probs: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What token choice ranks experts by: the probabilities, plus the expert-selection bias if any
    (the bias never reaches the gates)."""
    return probs if bias is None else probs.detach() + bias


def gates_of(probs: torch.Tensor, experts: torch.Tensor, normalize: bool) -> torch.Tensor:
    """(T, k) gates of the chosen experts: their probabilities, renormalised over the k if asked."""
    gates = probs.gather(1, experts)
    if normalize and experts.shape[1] > 1:
        gates = gates / gates.sum(dim=1, keepdim=True)
    return gates


def expert_bias_step(bias_E: torch.Tensor, counts_E: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's update of the selection bias after a training step, in place: each expert's
    bias rises by `rate` if it took fewer slots than the mean, falls by `rate` if more
    (`counts_E`: the step's slots per expert, the same on every rank)."""
    bias_E.add_(torch.sign(counts_E.float().mean() - counts_E.float()), alpha=rate)


def expert_choice(probs: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert takes its top-`capacity` tokens by probability: token ids (E, C), gates (E, C)."""
    tokens = topk_desc(probs.t(), capacity)
    gates = probs.t().gather(1, tokens)
    return tokens, gates


def load_balancing_loss(probs: torch.Tensor, counts: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Switch/GShard auxiliary loss `E * sum_e f_e * P_e` (f_e: share of slots routed to e
    before dropping, P_e: mean router probability of e)."""
    num_experts = probs.shape[1]
    if probs.shape[0] == 0:
        return probs.new_zeros(())
    f = counts.float() / max(num_slots, 1)
    p = probs.mean(dim=0)
    return num_experts * (f * p).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE z-loss: mean over tokens of logsumexp(logits)^2."""
    if logits.shape[0] == 0:
        return logits.new_zeros(())
    return torch.logsumexp(logits, dim=-1).square().mean()
