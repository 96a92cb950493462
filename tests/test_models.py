"""weft.models: GPT shapes, losses, causality, MoE placement, init, configs and presets, and
expert parallelism (2 gloo ranks) computing the same logits as one process holding every expert."""
from __future__ import annotations

import json
import math

import pytest
import tomllib
import torch
import torch.distributed as dist
import torch.nn.functional as F

from weft import MoE
from weft.graphs import live_gradient_accumulators
from weft.models import GPT, PRESETS, GPTConfig, get_preset
from weft.models.presets import TWINS, dense_twin
from weft.testing import run_distributed

SEED = 1234


def small(**overrides) -> GPTConfig:
    fields = dict(
        block_size=16, n_layer=4, n_head=2, dim=32, moe_every=2, num_experts=4, top_k=2, moe_hidden_dim=48
    )
    return GPTConfig(**{**fields, **overrides})


def build(config: GPTConfig, seed: int = SEED) -> GPT:
    torch.manual_seed(seed)
    return GPT(config)


def tokens(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


def expected_parameters(c: GPTConfig, active_only: bool = False) -> int:
    """Counted by hand from the architecture: embedding (tied head), per block two norms,
    qkv + out projections, then a dense MLP or router + experts; final norm."""
    per_expert = (3 if c.activation == "swiglu" else 2) * c.dim * c.expert_hidden
    total = c.vocab_size * c.dim + c.dim
    for i in range(c.n_layer):
        total += 2 * c.dim + 4 * c.dim * c.dim
        if c.is_moe_block(i):
            total += c.num_experts * c.dim + (c.top_k if active_only else c.num_experts) * per_expert
        else:
            total += 2 * c.dim * c.dense_hidden
    return total


# -- forward ----------------------------------------------------------------------------------
def test_output_shapes_and_no_loss_without_targets():
    model = build(small())
    logits, loss = model(tokens(3, 10))
    assert logits.shape == (3, 10, 256) and logits.dtype == torch.float32
    assert loss is None


def test_initial_loss_is_close_to_uniform():
    model = build(get_preset("tiny"))
    _, loss = model(tokens(4, 128, seed=1), tokens(4, 128, seed=2))
    assert abs(loss.item() - math.log(256)) < 0.3


@pytest.mark.parametrize("moe_every,capacity_factor", [(0, 1.25), (1, None), (2, 0)])
def test_causal(moe_every, capacity_factor):
    # Capacity-limited routing is not causal (a later token's slot can outrank an earlier
    # token's second choice), so MoE blocks are checked with modes that drop nothing.
    model = build(small(moe_every=moe_every, capacity_factor=capacity_factor))
    idx = tokens(2, 16)
    changed = idx.clone()
    p = 9
    changed[:, p] = (changed[:, p] + 1) % 256
    before, _ = model(idx)
    after, _ = model(changed)
    torch.testing.assert_close(after[:, :p], before[:, :p], rtol=0, atol=1e-6)
    assert not torch.allclose(after[:, p], before[:, p])


def test_head_is_tied_to_embedding():
    model = build(small())
    assert model.head.weight is model.tok_emb.weight
    assert sum(p is model.tok_emb.weight for p in model.parameters()) == 1


@pytest.mark.parametrize("moe_every,moe_blocks", [(0, []), (1, [0, 1, 2, 3]), (2, [1, 3]), (4, [3])])
def test_moe_placement(moe_every, moe_blocks):
    model = build(small(moe_every=moe_every))
    assert [i for i, b in enumerate(model.blocks) if isinstance(b.ffn, MoE)] == moe_blocks
    assert model.moe_layers() == [model.blocks[i].ffn for i in moe_blocks]


def test_loss_is_cross_entropy_plus_weighted_router_losses():
    model = build(small(aux_loss_coef=0.05, z_loss_coef=0.1))
    idx, targets = tokens(2, 16, seed=3), tokens(2, 16, seed=4)
    logits, loss = model(idx, targets)
    ce = F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))
    aux = sum(m.aux_loss for m in model.moe_layers())
    z = sum(m.z_loss for m in model.moe_layers())
    torch.testing.assert_close(loss, ce + 0.05 * aux + 0.1 * z)
    torch.testing.assert_close(model.last_ce_loss, ce)
    torch.testing.assert_close(model.last_aux_loss, aux)
    assert aux > 0 and z > 0


def test_a_finished_step_leaves_no_autograd_graph_alive():
    # the MoE layers keep their routing losses' values, not the graph the model's loss holds: a
    # kept graph holds every earlier parameter's gradient accumulator, bound to the call's CUDA
    # stream, and the next CUDA graph capture cannot synchronise with it (weft.graphs)
    model = build(small(aux_loss_coef=0.05, z_loss_coef=0.1))
    loss = model(tokens(2, 16, seed=3), tokens(2, 16, seed=4))[1]
    loss.backward()
    params = list(model.parameters())
    assert len(live_gradient_accumulators(params)) == len(params)  # the loss still holds its graph
    del loss
    assert live_gradient_accumulators(params) == []
    assert all(m.aux_loss > 0 and m.aux_loss.grad_fn is None for m in model.moe_layers())


def test_dense_model_loss_is_cross_entropy():
    model = build(small(moe_every=0))
    idx, targets = tokens(2, 16, seed=3), tokens(2, 16, seed=4)
    logits, loss = model(idx, targets)
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1)))
    assert model.last_aux_loss.item() == 0.0


def test_backward_reaches_every_parameter():
    model = build(small(moe_every=1))
    _, loss = model(tokens(4, 16, seed=5), tokens(4, 16, seed=6))
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("gate", ["topk", "bpr", "cosine", "expert_choice", "random"])
def test_every_gate_trains(gate):
    model = build(small(gate=gate))
    _, loss = model(tokens(2, 16), tokens(2, 16, seed=1))
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())


# -- initialisation -----------------------------------------------------------------------------
def test_init_is_nanogpt_outside_moe_and_leaves_moe_alone():
    config = get_preset("tiny")
    model = build(config)
    assert model.blocks[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    residual = 0.02 / math.sqrt(2 * config.n_layer)
    assert model.blocks[0].ffn.out_proj.weight.std().item() == pytest.approx(residual, rel=0.05)
    moe = model.moe_layers()[0]
    assert moe.router.weight.std().item() == pytest.approx(config.dim**-0.5, rel=0.05)  # router's own init
    bound = config.dim**-0.5  # experts: uniform(+-1/sqrt(fan_in))
    assert moe.experts.w1.abs().max().item() == pytest.approx(bound, rel=0.01)


def test_construction_is_deterministic_given_the_seed():
    a, b = build(small()), build(small())
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name


def test_num_parameters_and_flops():
    model = build(get_preset("tiny"))
    # tiny by hand: embedding 256*128; 4 blocks of norms 2*128 + attention 4*128^2; 2 dense MLPs
    # 2*128*512; 2 MoE layers of router 8*128 + experts 8 (or top-2) * 2*128*256; final norm 128.
    shared = 32768 + 4 * (256 + 65536) + 2 * 131072 + 128
    assert model.num_parameters() == shared + 2 * (1024 + 8 * 65536)
    assert model.num_parameters(active_only=True) == shared + 2 * (1024 + 2 * 65536)
    assert model.flops_per_token(128) == 6 * model.num_parameters(active_only=True) + 12 * 4 * 128 * 128
    assert model.flops_per_token() == model.flops_per_token(128)


# -- bad input --------------------------------------------------------------------------------
def test_bad_inputs_raise():
    model = build(small())
    with pytest.raises(ValueError, match="block_size"):
        model(tokens(1, 17))
    with pytest.raises(TypeError, match="idx"):
        model(tokens(1, 8).float())
    with pytest.raises(ValueError, match="shape"):
        model(tokens(1, 8)[0])
    with pytest.raises(ValueError, match="targets"):
        model(tokens(1, 8), tokens(1, 7))


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(dim=30, n_head=4), "dim"),
        (dict(dim=12, n_head=4), "head_dim"),
        (dict(moe_every=-1), "moe_every"),
        (dict(moe_every=5), "moe_every"),
        (dict(top_k=5), "top_k"),
        (dict(n_layer=0), "n_layer"),
        (dict(gate="nope"), "gate"),
        (dict(activation="tanh"), "activation"),
        (dict(capacity_factor="1.0"), "capacity_factor"),
        (dict(aux_loss_coef=-0.1), "aux_loss_coef"),
        (dict(moe_hidden_dim=0), "moe_hidden_dim"),
        (dict(rope_theta=0.0), "rope_theta"),
    ],
)
def test_bad_config_raises_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        GPT(small(**overrides))


# -- configs and presets ------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_config_round_trips_through_json(name):
    config = get_preset(name)
    assert GPTConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_config_from_toml_and_unknown_keys():
    config = GPTConfig.from_dict(tomllib.loads("n_layer = 2\ndim = 64\nmoe_every = 1\ncapacity_factor = 2\n"))
    assert (config.n_layer, config.dim, config.moe_every, config.capacity_factor) == (2, 64, 1, 2)
    with pytest.raises(ValueError, match="n_layers.*num_expert"):
        GPTConfig.from_dict({"n_layers": 2, "num_expert": 4, "dim": 64})


def test_get_preset_returns_a_copy_and_rejects_unknown_names():
    config = get_preset("tiny")
    config.n_layer = 1
    assert PRESETS["tiny"].n_layer == 4
    with pytest.raises(ValueError, match="tiny.*gpt2-s-moe"):
        get_preset("gpt5")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_on_meta(name):
    config = get_preset(name)
    with torch.device("meta"):
        model = GPT(config)
    assert len(model.moe_layers()) == sum(config.is_moe_block(i) for i in range(config.n_layer))
    assert bool(model.moe_layers()) == (config.moe_every > 0)
    assert model.num_parameters() == expected_parameters(config)
    assert model.num_parameters(active_only=True) == expected_parameters(config, active_only=True)


@pytest.mark.parametrize("moe_name, dense_name", sorted(TWINS.items()))
def test_a_dense_twin_has_the_moe_presets_active_compute(moe_name, dense_name):
    """Same width and depth, dense everywhere; its parameters are the MoE model's active ones less
    the routers, so its training FLOPs per token equal the MoE model's less the routers'."""
    moe_cfg, dense_cfg = get_preset(moe_name), get_preset(dense_name)
    assert dense_cfg.moe_every == 0
    shape = lambda c: (c.n_layer, c.dim, c.n_head, c.block_size)  # noqa: E731
    assert shape(dense_cfg) == shape(moe_cfg)
    with torch.device("meta"):
        moe, dense = GPT(moe_cfg), GPT(dense_cfg)
    routers = sum(p.numel() for name, p in moe.named_parameters() if "router" in name)
    assert 0 < routers < moe.num_parameters(active_only=True) / 100
    assert dense.num_parameters() == moe.num_parameters(active_only=True) - routers
    assert dense.flops_per_token() == moe.flops_per_token() - 6 * routers


def test_a_dense_twin_is_refused_where_it_would_not_match():
    with pytest.raises(ValueError, match="swiglu"):
        dense_twin(get_preset("mixtral-8x7b-2l"))
    with pytest.raises(ValueError, match="dense already"):
        dense_twin(get_preset("gpt2-s"))


def test_mixtral_shape_parameter_count():
    # 2 blocks of attention 4 * 4096^2 and 8 swiglu experts of 3 * 4096 * 14336: about 2.95 B.
    with torch.device("meta"):
        model = GPT(get_preset("mixtral-8x7b-2l"))
    assert model.num_parameters() / 1e9 == pytest.approx(2.95, abs=0.01)
    assert model.num_parameters(active_only=True) / 1e9 == pytest.approx(0.84, abs=0.01)


# -- expert parallelism ---------------------------------------------------------------------------
EP_CONFIGS = [
    small(n_layer=2, moe_every=1, capacity_factor=1.0),  # drops slots
    small(n_layer=2, moe_every=1, gate="bpr", capacity_factor=1.0, activation="swiglu"),
    small(n_layer=2, moe_every=2, capacity_factor=None),  # dropless: all-to-allv
]


def rank_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return tokens(2, 16, seed=10 + rank), tokens(2, 16, seed=20 + rank)


def _ep_worker(config_dicts: list[dict]) -> list[tuple]:
    rank = dist.get_rank()
    results = []
    for values in config_dicts:
        torch.manual_seed(SEED)
        model = GPT(GPTConfig.from_dict(values), group=dist.group.WORLD)
        logits, loss = model(*rank_batch(rank))
        experts = {n: p.detach().numpy().copy() for n, p in model.named_parameters() if ".experts." in n}
        results.append((logits.detach().numpy(), loss.item(), experts))
    return results


def test_expert_parallel_matches_single_process():
    world = 2
    per_rank = run_distributed(_ep_worker, world, args=([c.to_dict() for c in EP_CONFIGS],), timeout=120)
    for i, config in enumerate(EP_CONFIGS):
        reference = build(config)
        full = reference.state_dict()
        local = config.num_experts // world
        for rank in range(world):
            logits, loss, experts = per_rank[rank][i]
            shard = slice(rank * local, (rank + 1) * local)
            assert experts and all(
                torch.equal(torch.from_numpy(w), full[n][shard]) for n, w in experts.items()
            ), f"config {i} rank {rank}: expert shard differs from the full model's"
            ref_logits, ref_loss = reference(*rank_batch(rank))
            torch.testing.assert_close(torch.from_numpy(logits), ref_logits.detach(), rtol=1e-5, atol=1e-5)
            assert loss == pytest.approx(ref_loss.item(), rel=1e-5)


@pytest.mark.parametrize("fields, message", [
    ({"expert_bias_rate": -0.1}, "expert_bias_rate must be a finite number >= 0"),
    ({"expert_bias_rate": float("inf")}, "expert_bias_rate must be a finite number >= 0"),
    ({"expert_bias_rate": 0.001, "moe_every": 2, "gate": "expert_choice"}, "expert_bias_rate needs a gate"),
])
def test_expert_bias_rate_is_checked(fields, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**fields).validate()


def test_expert_bias_rate_gives_every_moe_layer_a_bias():
    model = GPT(GPTConfig(moe_every=2, expert_bias_rate=0.001))
    assert [tuple(m.expert_bias.shape) for m in model.moe_layers()] == [(8,), (8,)]
    assert all(m.expert_bias is None for m in GPT(GPTConfig(moe_every=2)).moe_layers())
