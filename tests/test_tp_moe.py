"""Tensor parallelism for MoE models (weft.tp.TokenSplit): the attention and dense MLPs split over
each TP group, the experts expert-parallel over the whole world, each TP rank routing its share
of the group's tokens. On gloo with 2 and 4 ranks (TP 2 and 4, with data parallelism over TP
groups), Megatron's and Domino's schedules, padded capacity and dropless: the losses and every
gradient (after `reduce_gradients`) equal those of plain expert and data parallelism in which
rank r holds the rows that are rank r's share under TP, over two SGD steps."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from weft.distributed import build_moe_groups, group_rank
from weft.models import GPT, GPTConfig
from weft.moe.grads import reduce_gradients
from weft.testing import Checks, run_checks
from weft.tp import dense_tensor, make_schedule, sharded_entries
from weft.tp.block import TokenSplit

BATCH = 8  # global sequences per step


def _config(world: int, capacity_factor) -> GPTConfig:
    return GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=4, dim=32, moe_every=2, num_experts=2 * world,
                     top_k=2, capacity_factor=capacity_factor, aux_loss_coef=0.1, z_loss_coef=0.01)


def step_like_plain(checks: Checks, step: int, models: tuple, groups: tuple, optimizers: list, device) -> None:
    """One SGD step of `models` = (plain, split) on step `step`'s batch: the plain model (plain
    expert and data parallelism) on this rank's rows, the tensor-parallel one on its TP group's
    rows; the losses (averaged over data parallelism) and every gradient (after
    `reduce_gradients`; split tensors made dense) must agree."""
    plain, split = models
    plain_groups, tp_groups = groups
    rank, world = dist.get_rank(), dist.get_world_size()
    vocab, block = plain.config.vocab_size, plain.config.block_size
    tokens = torch.randint(0, vocab, (BATCH, block + 1), generator=torch.Generator().manual_seed(step)).to(device)
    per_group = BATCH // dist.get_world_size(tp_groups.dp)
    dp_rank = group_rank(tp_groups.dp)
    mine = tokens[rank * BATCH // world:(rank + 1) * BATCH // world]  # plain: this rank's rows
    group_rows = tokens[dp_rank * per_group:(dp_rank + 1) * per_group]  # TP: its group's rows
    losses = []
    for model, model_groups, batch in ((plain, plain_groups, mine), (split, tp_groups, group_rows)):
        _, loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        reduce_gradients(model, model_groups)
        total = loss.detach().clone()
        dist.all_reduce(total, group=model_groups.dp)
        losses.append(float(total) / dist.get_world_size(model_groups.dp))
    # float64 weights; the loss is taken in float32 (weft.models.gpt): equal to its rounding
    checks.expect(abs(losses[0] - losses[1]) < 1e-6 * abs(losses[0]),
                  f"step {step}: loss {losses[1]} != plain {losses[0]}")
    sliced, split_params = sharded_entries(split), dict(split.named_parameters())
    for name, p in plain.named_parameters():
        q = split_params[name]
        grad = dense_tensor(*sliced[name], q.grad) if name in sliced else q.grad
        error = float((grad - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-30))
        checks.expect(error < 1e-6, f"step {step}: gradient of {name} differs (relative {error:.1e})")
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()


def tp_moe_worker(tp: int, schedule: str, capacity_factor, device: str = "cpu") -> list[str]:
    """`device` "cuda": each rank on its own GPU (NCCL), float64 as on the CPU."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    checks = Checks(f"rank {rank}, tp {tp} {schedule} cf {capacity_factor}")
    cfg = _config(world, capacity_factor)
    plain_groups = build_moe_groups()
    tp_groups = build_moe_groups(tp_size=tp, experts=True)
    torch.manual_seed(0)
    plain = GPT(cfg, group=plain_groups.ep, kernels="torch").double().to(device)
    torch.manual_seed(0)
    split = GPT(cfg, group=tp_groups.ep, kernels="torch", tp_group=tp_groups.tp,
                tp_schedule=make_schedule(schedule, 2)).double().to(device)
    checks.expect(len(split.moe_layers()) == 1 and split.moe_layers()[0].ep_size == world,
                  "the TP model's MoE layer is not expert-parallel over the world")
    checks.expect(any(isinstance(s, TokenSplit) for b in split.blocks for s in b.stages((None, None))),
                  "no MoE sub-layer runs on a share of the tokens")
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (plain, split)]
    for step in range(2):
        step_like_plain(checks, step, (plain, split), (plain_groups, tp_groups), optimizers, device)
    # Training on a token count the group cannot share evenly: refused on every rank, before any
    # collective of the MoE sub-layer (domino needs 2 sequences, whose tokens always share by 2).
    try:
        if schedule == "none":
            split(torch.zeros(1, 3, dtype=torch.long, device=device))
            checks.expect(False, "3 tokens were split over the TP group in training")
    except ValueError as e:
        checks.expect(f"3 rows cannot be split evenly over {tp}" in str(e), f"unexpected error: {e}")
    # Sampling one sequence of a length the group cannot share: every rank routes all its tokens.
    with torch.no_grad():
        odd = torch.randint(0, cfg.vocab_size, (1, 3), generator=torch.Generator().manual_seed(7)).to(device)
        checks.expect(torch.allclose(split(odd)[0], plain(odd)[0], atol=1e-10), "an odd-length forward differs")
    return checks.failures


# Every world and TP size, each schedule and capacity mode on 2 and on 4 ranks.
@pytest.mark.parametrize("world, tp, schedule, capacity_factor", [
    (2, 2, "none", 1.0), (2, 2, "domino", None), (4, 2, "domino", 1.0), (4, 4, "none", None)])
def test_tensor_parallel_moe_model_computes_expert_and_data_parallelism(world, tp, schedule, capacity_factor):
    failures = run_checks(tp_moe_worker, world, args=(tp, schedule, capacity_factor), timeout=300)
    assert not failures, "\n".join(failures[:15])


def tp_balance_worker(tp: int, schedule: str, device: str = "cpu") -> list[str]:
    """Pro-Prophet in a tensor-parallel MoE model: each TP rank's share of the tokens routed by a
    balanced dropless layer that copies its hot experts (inline, each call) computes what plain
    expert and data parallelism without copies computes: losses and every gradient, over steps
    whose hot expert moves (so the placements change)."""
    from weft.balance import LayerCostModel

    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    checks = Checks(f"rank {rank}, tp {tp} {schedule}, pro-prophet")
    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=4, dim=32, moe_every=1, num_experts=2 * world,
                    top_k=2, capacity_factor=None, activation="swiglu", expert_bias_rate=1e-3)
    # Slow experts, cheap weights: copying a hot expert always pays in this model.
    cost = LayerCostModel(num_devices=world, bandwidth=1e12, throughput=1e3, row_bytes=8 * cfg.dim,
                          expert_param_bytes=1.0, expert_grad_bytes=1.0)
    plain_groups, tp_groups = build_moe_groups(), build_moe_groups(tp_size=tp, experts=True)
    torch.manual_seed(0)
    plain = GPT(cfg, group=plain_groups.ep, kernels="torch").double().to(device)
    torch.manual_seed(0)
    split = GPT(cfg, group=tp_groups.ep, kernels="torch", balance="pro-prophet", tp_group=tp_groups.tp,
                tp_schedule=make_schedule(schedule, 2)).double().to(device)
    for moe in split.moe_layers():
        moe.balancer.model = cost
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (plain, split)]
    copied = []
    for step in range(4):
        hot = (step // 2) % cfg.num_experts  # the hot expert moves: the plans differ over the steps
        for model in (plain, split):
            for moe in model.moe_layers():
                moe.expert_bias.zero_()[hot] = 3.0  # skew the selection towards `hot`
        step_like_plain(checks, step, (plain, split), (plain_groups, tp_groups), optimizers, device)
        copied.append([c for moe in split.moe_layers() for c in moe.balancer.last_copied])
    checks.expect(any(copied), f"no expert was copied over the steps ({copied}): nothing was tested")
    checks.expect(len({tuple(c) for c in copied if c}) > 1, f"the placement never changed: {copied}")
    return checks.failures


@pytest.mark.parametrize("world, tp, schedule", [(2, 2, "none"), (4, 2, "domino"), (4, 4, "none")])
def test_pro_prophet_in_a_tensor_parallel_moe_model_computes_plain_parallelism(world, tp, schedule):
    failures = run_checks(tp_balance_worker, world, args=(tp, schedule), timeout=300)
    assert not failures, "\n".join(failures[:15])
