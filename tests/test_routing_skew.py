"""`routing_skew` (weft.MoE, GPTConfig): a fixed Zipf(S) prior on the router's logits, so that a
model's load stays skewed (what Pro-Prophet's training runs measure on); not saved in the state
dict (it follows from the setting); bad settings refused."""
from __future__ import annotations

import pytest
import torch

from weft import MoE
from weft.models import GPT, GPTConfig
from weft.moe.gates import zipf_bias


@pytest.mark.parametrize("gate", ["topk", "cosine"])
def test_the_prior_is_added_to_the_logits(gate):
    torch.manual_seed(0)
    plain = MoE(16, 32, 8, gate=gate)
    torch.manual_seed(0)
    skewed = MoE(16, 32, 8, gate=gate, routing_skew=1.5)
    x = torch.randn(64, 16)
    expected = plain.router(x) + zipf_bias(8, 1.5).float()
    torch.testing.assert_close(skewed.router(x), expected, rtol=0, atol=1e-6)


def test_a_skewed_router_sends_most_slots_to_the_favourite():
    torch.manual_seed(0)
    loads = []
    for skew in (0.0, 2.0):
        moe = MoE(16, 32, 8, top_k=2, capacity_factor=None, routing_skew=skew)
        moe(torch.randn(512, 16))
        loads.append(moe.stats.expert_counts.float())
    favourite = int(zipf_bias(8, 2.0).argmax())
    plain, skewed = loads
    assert int(skewed.argmax()) == favourite
    assert skewed.max() / skewed.mean() > 1.5 * (plain.max() / plain.mean())


def test_the_prior_is_not_saved_and_a_model_loads_either_way():
    skewed = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, dim=32, num_experts=4, moe_every=1,
                           routing_skew=1.0))
    state = skewed.state_dict()
    assert not any("prior" in k for k in state)
    plain = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, dim=32, num_experts=4, moe_every=1))
    plain.load_state_dict(state)  # strict: the same keys
    assert all(m.router.prior_E is not None for m in skewed.moe_layers())
    assert all(m.router.prior_E is None for m in plain.moe_layers())


@pytest.mark.parametrize("kwargs, message", [
    (dict(routing_skew=-1.0), "routing_skew must be a finite number >= 0"),
    (dict(routing_skew=float("inf")), "routing_skew must be a finite number >= 0"),
    (dict(routing_skew=1.0, gate="random"), "not 'random'"),
    (dict(routing_skew=1.0, gate="expert_choice"), "not 'expert_choice'"),
])
def test_bad_skews_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MoE(16, 32, 4, **kwargs)


def test_the_model_config_checks_the_skew():
    with pytest.raises(ValueError, match="routing_skew must be a finite number >= 0"):
        GPTConfig(moe_every=2, routing_skew=-0.5).validate()
    with pytest.raises(ValueError, match="not 'random'"):
        GPTConfig(moe_every=2, gate="random", routing_skew=0.5).validate()
    with pytest.raises(ValueError, match="routing_skew must be a finite number >= 0"):
        GPTConfig(moe_every=0, routing_skew=-0.5).validate()  # dense: still a number
