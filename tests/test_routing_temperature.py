"""`routing_temperature` (weft.MoE, GPTConfig): training calls draw each token's experts from
softmax(logits / T) by the Gumbel top-k trick; evaluation routes by argmax; a batch routed in
parts picks what it picks whole; bad settings are refused. (The layer against the dense
reference with sampling, on 1, 2 and 4 ranks: tests/test_moe_equivalence.py; the fused Triton
routing with sampling: tests/test_routing_kernel.py.)"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from weft import MoE
from weft.models import GPTConfig
from weft.moe.routing import Router


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_top1_samples_the_tempered_softmax(temperature):
    """Many tokens with the same logits: the share of each expert is softmax(logits / T), within
    5 binomial standard deviations."""
    num_tokens = 40_000
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0]).expand(num_tokens, -1).contiguous()
    torch.manual_seed(0)
    routing = Router("topk", 4, True, None, temperature).route(logits, 1, None, sample=True)
    share = torch.bincount(routing.experts_S, minlength=4).double() / num_tokens
    expected = F.softmax(logits[0].double() / temperature, dim=0)
    sigma = (expected * (1 - expected) / num_tokens).sqrt()
    assert ((share - expected).abs() < 5 * sigma).all(), (share, expected)
    assert torch.equal(routing.gates_S, F.softmax(logits, -1).gather(1, routing.experts_S[:, None]).squeeze(1))


def test_top2_draws_two_distinct_experts_and_argmax_without_sampling():
    logits = torch.randn(500, 8, generator=torch.Generator().manual_seed(1))
    router = Router("topk", 8, True, None, 0.5)
    sampled = router.route(logits, 2, None, sample=True).experts_S.view(-1, 2)
    assert (sampled[:, 0] != sampled[:, 1]).all()
    argmax = router.route(logits, 2, None, sample=False).experts_S.view(-1, 2)
    assert torch.equal(argmax, logits.topk(2, dim=1).indices)
    assert not torch.equal(sampled, argmax)


def test_the_layer_samples_in_training_and_routes_by_argmax_in_evaluation():
    torch.manual_seed(0)
    moe = MoE(16, 32, 8, top_k=1, capacity_factor=None, routing_temperature=1.0)
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(2))
    argmax = moe.router(x).argmax(1)
    moe.eval()
    moe(x)
    assert torch.equal(moe.stats.expert_counts, torch.bincount(argmax, minlength=8))
    moe.train()
    moe(x)
    assert not torch.equal(moe.stats.expert_counts, torch.bincount(argmax, minlength=8))


@pytest.mark.parametrize("capacity_factor", [1.0, None])
def test_a_sampled_batch_routes_in_parts_as_whole(capacity_factor):
    """Lancet's partitions (CarriedRouting) draw the whole batch's offsets once: the same experts,
    positions and kept slots as the batch routed at once with the same RNG state."""
    router = Router("topk", 8, True, None, 0.8)
    logits = torch.randn(40, 8, generator=torch.Generator().manual_seed(0))
    logits[:, 0] += 1.0
    torch.manual_seed(5)
    whole = router.route(logits, 1, capacity_factor, sample=True)
    assert not torch.equal(whole.experts_S, router.route(logits, 1, capacity_factor).experts_S)
    torch.manual_seed(5)
    parts = router.in_parts(40, 1, capacity_factor, sample=True)
    routed = [parts.route(chunk) for chunk in logits.split([13, 17, 10])]
    assert torch.equal(torch.cat([r.experts_S for r in routed]), whole.experts_S)
    assert torch.equal(torch.cat([r.positions_S for r in routed]), whole.positions_S)
    if capacity_factor is not None:
        assert torch.equal(torch.cat([r.kept_S for r in routed]), whole.kept_S)


@pytest.mark.parametrize("kwargs, message", [
    (dict(routing_temperature=-0.5), "routing_temperature must be a finite number >= 0"),
    (dict(routing_temperature=float("nan")), "routing_temperature must be a finite number >= 0"),
    (dict(routing_temperature=1.0, gate="expert_choice"), "not 'expert_choice'"),
    (dict(routing_temperature=1.0, gate="random"), "not 'random'"),
    (dict(routing_temperature=1.0, expert_bias=True), "use one"),
])
def test_bad_temperatures_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MoE(16, 32, 4, **kwargs)


def test_the_model_config_checks_and_passes_the_temperature():
    with pytest.raises(ValueError, match="not 'expert_choice'"):
        GPTConfig(moe_every=2, gate="expert_choice", routing_temperature=0.5).validate()
    with pytest.raises(ValueError, match="use one"):
        GPTConfig(moe_every=2, expert_bias_rate=0.001, routing_temperature=0.5).validate()
    GPTConfig(moe_every=0, gate="expert_choice", routing_temperature=0.5).validate()  # dense: no router
    from weft.models import GPT
    model = GPT(GPTConfig(moe_every=2, routing_temperature=0.5))
    assert all(moe.gate_rule.temperature == 0.5 for moe in model.moe_layers())


def test_a_gate_override_that_cannot_sample_routes_by_argmax():
    from weft.models.presets import PresetChoice, get_preset
    assert get_preset("gpt2-s-moe").routing_temperature > 0  # the preset samples in training
    for gate in ("expert_choice", "random"):
        config = PresetChoice(preset="gpt2-s-moe", gate=gate).model_config()
        assert (config.gate, config.routing_temperature) == (gate, 0.0)
    assert PresetChoice(preset="gpt2-s-moe", gate="bpr").model_config().routing_temperature == 1.0
