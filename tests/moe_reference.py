"""A straightforward dense MoE written from the rules in docs/moe.md: the oracle for the tests.

Deliberately slow and obvious: python loops for slot positions, every expert applied to every
token, masks instead of indices.
"""
from __future__ import annotations

import math
from fractions import Fraction

import torch
import torch.nn.functional as F


def router_logits(x, params, gate):
    """The router's logits, plus `routing_skew`'s fixed prior where `params` hold one
    ("router.prior_E")."""
    x = x.float()
    if gate == "cosine":
        h = F.normalize(x @ params["router.proj.weight"].t(), dim=-1)
        emb = F.normalize(params["router.weight"], dim=-1)
        logits = (h @ emb.t()) * params["router.log_scale"].clamp(max=math.log(100.0)).exp()
    else:
        logits = x @ params["router.weight"].t()
    prior = params.get("router.prior_E")
    return logits if prior is None else logits + prior


def expert_fn(x, w1, w2, w3, activation):
    h = x @ w1
    if activation == "swiglu":
        h = F.silu(h) * (x @ w3)
    else:
        h = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}[activation](h)
    return h @ w2


def route(x, params, gate, k, normalize, random_scores=None, bias=None, offsets=None):
    """Experts (T, k) and gates (T, k) per docs/moe.md, plus the priority order of tokens; `bias`
    (E,) is added to the probabilities for choosing experts only; `offsets` (T, E), a sampling
    layer's Gumbel draws: experts chosen by log-probability plus offset."""
    logits = router_logits(x, params, gate)
    probs = F.softmax(logits, dim=-1)
    T, E = probs.shape
    if gate == "random":
        scores = random_scores
    elif offsets is not None:
        scores = probs.log() + offsets
    else:
        scores = probs if bias is None else probs + bias
    experts = torch.tensor([sorted(range(E), key=lambda e: (-scores[t, e].item(), e))[:k] for t in range(T)],
                           dtype=torch.long).reshape(T, k)
    gates = probs.gather(1, experts)
    if normalize and k > 1:
        gates = gates / gates.sum(1, keepdim=True)
    if gate == "bpr":
        importance = probs.max(1).values
        order = sorted(range(T), key=lambda t: (-importance[t].item(), t))
    else:
        order = list(range(T))
    return logits, probs, experts, gates, order


def positions(experts, order, E):
    T, k = experts.shape
    pos = torch.zeros(T, k, dtype=torch.long)
    seen = [0] * E
    for j in range(k):
        for t in order:
            e = int(experts[t, j])
            pos[t, j] = seen[e]
            seen[e] += 1
    return pos, torch.tensor(seen)


def no_drop_capacity(counts):
    return max(1, int(counts.max()))


def exact_ceil(k, cf, T, E):
    """ceil(k * cf * T / E) with cf taken as the decimal it was written as."""
    return math.ceil(Fraction(k) * abs(Fraction(str(cf))) * T / E)


def capacity(cf, k, T, E, group_no_drop):
    """docs/moe.md's C per expert per source rank. cf > 0: at most T (a token routes to an expert
    once, so a slot's position is always below T)."""
    bound = exact_ceil(k, cf, T, E)
    if cf > 0:
        return max(1, min(T, bound))
    if cf == 0:
        return group_no_drop
    return max(1, min(group_no_drop, bound))


def moe_forward(x, params, cfg, C=None, random_scores=None, bias=None, offsets=None):
    """Returns y (T, dim) float32, aux, z, expert counts, dropped. `C` None = dropless."""
    gate, k, E, act = cfg["gate"], cfg["top_k"], cfg["num_experts"], cfg["activation"]
    xf = x.float()
    T = xf.shape[0]
    w1, w2, w3 = params["experts.w1"], params["experts.w2"], params.get("experts.w3")
    outs = [expert_fn(xf, w1[e], w2[e], None if w3 is None else w3[e], act) for e in range(E)]
    if gate == "expert_choice":
        logits = router_logits(x, params, gate)
        probs = F.softmax(logits, -1)
        weight = torch.zeros(T, E)
        taken = torch.zeros(T, dtype=torch.bool)
        for e in range(E):
            chosen = sorted(range(T), key=lambda t: (-probs[t, e].item(), t))[:C]
            mask = torch.zeros(T)
            mask[chosen] = 1.0
            taken[chosen] = True
            weight = weight + F.one_hot(torch.tensor(e), E).float() * (mask * probs[:, e]).unsqueeze(1)
        y = sum(weight[:, e : e + 1] * outs[e] for e in range(E))
        z = torch.logsumexp(logits, -1).square().mean()
        return y, torch.zeros(()), z, torch.full((E,), C), int((~taken).sum())
    logits, probs, experts, gates, order = route(x, params, gate, k, cfg["normalize_gates"], random_scores, bias,
                                                 offsets)
    pos, counts = positions(experts, order, E)
    kept = torch.ones_like(pos, dtype=torch.bool) if C is None else pos < C
    y = torch.zeros_like(xf)
    for e in range(E):
        g = ((experts == e) & kept).float().mul(gates).sum(1, keepdim=True)
        y = y + g * outs[e]
    f = counts.float() / (T * k)
    aux = E * (f * probs.mean(0)).sum()
    z = torch.logsumexp(logits, -1).square().mean()
    return y, aux, z, counts, int((~kept).sum())
