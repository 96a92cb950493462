"""Pro-Prophet's block-wise schedule (Alg. 2): the split all-gather it rests on, and a balanced
GPT whose copies move a layer early ("blockwise") or at each layer ("inline") computing the plain
model's losses and gradients over training steps whose hot expert moves (so the placements
change), on gloo with 1, 2 and 4 ranks; and the order the Trans launches in."""
from __future__ import annotations

import json
import re

import pytest
import torch
import torch.distributed as dist

from weft.balance import LayerCostModel
from weft.comm import all_gather, all_to_all, start_all_gather, wait_all_gather
from weft.distributed import side_group
from weft.models import GPT, GPTConfig
from weft.models.gpt import run_units
from weft.testing import Checks, run_checks


def gather_worker() -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    checks = Checks(f"rank {rank}")
    side = side_group(None)
    checks.expect((side is not dist.group.WORLD or world == 1) and dist.get_world_size(side) == world,
                  "the side group is not a separate group over the same ranks (one rank: the group itself)")
    checks.expect(side_group(None) is side, "the side group was built twice")
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(3, 5, generator=gen)
    grad = torch.randn(3 * world, 5, generator=torch.Generator().manual_seed(50 + rank))
    a = x.clone().requires_grad_()
    out, pending = start_all_gather(a * 2, side)
    # A collective on the main group while the transfer is in flight (as the all-to-alls do).
    mixed = all_to_all(torch.full((world, 2), float(rank)), dist.group.WORLD)
    y = wait_all_gather(out, pending)
    b = x.clone().requires_grad_()
    expected = all_gather(b * 2, dist.group.WORLD)
    checks.expect(torch.equal(y, expected), "the split all-gather's output differs from all_gather's")
    checks.expect(torch.equal(mixed[:, 0], torch.arange(world, dtype=torch.float)),
                  "the main group's all-to-all went wrong beside the transfer")
    (y * grad).sum().backward()
    (expected * grad).sum().backward()
    checks.expect(torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-6),
                  "the split all-gather's gradient is not the sum of every rank's")
    return checks.failures


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_split_all_gather_equals_all_gather(world_size):
    failures = run_checks(gather_worker, world_size, timeout=120)
    assert not failures, "\n".join(failures)


def _config(world: int) -> GPTConfig:
    return GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, dim=16, moe_every=1,
                     num_experts=2 * world, top_k=2, capacity_factor=None, activation="swiglu",
                     expert_bias_rate=1e-3)


def schedule_worker(steps: int = 4, device: str = "cpu") -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    checks = Checks(f"rank {rank}")
    cfg = _config(world)
    # Slow experts, cheap weights: copying a hot expert always pays in this model.
    cost = LayerCostModel(num_devices=world, bandwidth=1e12, throughput=1e3, row_bytes=64,
                          expert_param_bytes=1.0, expert_grad_bytes=1.0)
    runs = {"plain": None, "blockwise": "pro-prophet", "inline": "pro-prophet"}
    models, optimizers = {}, {}
    for name, balance in runs.items():
        torch.manual_seed(0)
        models[name] = GPT(cfg, balance=balance).to(device)
        for moe in models[name].moe_layers():
            if moe.balancer is not None:
                moe.balancer.model = cost
        optimizers[name] = torch.optim.AdamW(models[name].parameters(), lr=1e-2)
    # The order the blockwise run's Trans launch and its MoE layers run in.
    events: list[tuple[str, int]] = []
    for i, moe in enumerate(models["blockwise"].moe_layers()):
        launch = moe.start_transfer
        moe.start_transfer = lambda launch=launch, i=i: events.append(("trans", i)) or launch()
        moe.register_forward_pre_hook(lambda module, args, i=i: events.append(("layer", i)))
    copied: list[list[int]] = []
    for step in range(steps):
        hot = (step // 2) % cfg.num_experts  # the hot expert moves: the plans differ over the steps
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.block_size + 1),
                               generator=torch.Generator().manual_seed(10 * step + rank)).to(device)
        results = {}
        for name, model in models.items():
            for moe in model.moe_layers():
                moe.expert_bias.zero_()[hot] = 3.0  # skew the selection towards `hot`
            events.clear()
            _, loss = model(tokens[:, :-1], tokens[:, 1:],
                            balance_schedule="inline" if name == "inline" else "blockwise")
            loss.backward()
            results[name] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
            if name == "blockwise":
                copied.append([c for moe in model.moe_layers() for c in moe.balancer.last_copied])
                order = [("trans", 0), ("trans", 1), ("layer", 0), ("trans", 2), ("layer", 1), ("layer", 2)]
                checks.expect(events == order, f"step {step}: Trans and layers ran in the order {events}")
            optimizers[name].step()
            optimizers[name].zero_grad()
        ref_loss, ref_grads = results["plain"]
        for name in ("blockwise", "inline"):
            loss, grads = results[name]
            checks.expect(abs(loss - ref_loss) <= 1e-5 * abs(ref_loss),
                          f"step {step}: {name} loss {loss} != plain {ref_loss}")
            for n, g in grads.items():
                error = float((g - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-12))
                checks.expect(error < 1e-4, f"step {step}: {name} gradient of {n} differs (relative {error:.1e})")
    if world > 1:
        checks.expect(any(copied), f"no expert was copied over the steps ({copied}): nothing was tested")
        checks.expect(len({tuple(c) for c in copied if c}) > 1, f"the placement never changed: {copied}")
    return checks.failures


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_blockwise_schedule_computes_the_plain_model(world_size):
    failures = run_checks(schedule_worker, world_size, timeout=300)
    assert not failures, "\n".join(failures[:15])


def test_balance_schedule_is_checked():
    model = GPT(_config(1), balance="pro-prophet")
    with pytest.raises(ValueError, match="unknown balance_schedule 'early'"):
        run_units([], torch.zeros(1), "early")
    with pytest.raises(ValueError, match="unknown balance_schedule"):
        model(torch.zeros(1, 4, dtype=torch.long), balance_schedule="sometimes")


def test_model_benchmark_times_the_balance_schedules(tmp_path):
    """`weft bench model --modes none,balance,balance-inline --skew 1 --balance-model nominal` on 4
    gloo ranks: the hot experts land on ranks 0 and 3, the block-wise schedule copies them in every
    layer, the inline one where waiting for the copy still pays (eq. 6), and both compute the plain
    model's loss and gradients on the same weights and batch."""
    from weft.bench import model
    from weft.bench.model import ModelBenchConfig
    from weft.testing import run_distributed
    out = tmp_path / "model.json"
    cfg = ModelBenchConfig(preset="tiny", batch_size=1, capacity=None, skew=1.0,
                           modes=("none", "balance", "balance-inline"), steps=1, warmup=1, json=str(out),
                           profile_steps=0, balance_model="nominal")  # measured, tiny CPU experts stay home
    run_distributed(model.run, 4, args=(cfg,), timeout=300)
    report = json.loads(out.read_text())
    assert report["meta"]["skew"] == 1.0 and min(report["meta"]["expert_load_max_over_mean"]) > 1.5
    rows = {r["mode"]: r for r in report["results"]}
    assert rows["none"]["max_error"] == 0.0 and "copied_experts" not in rows["none"]
    for mode in ("balance", "balance-inline"):
        assert rows[mode]["max_error"] < 1e-6, rows[mode]
    assert all(rows["balance"]["copied_experts"]), rows["balance"]["copied_experts"]  # every layer copied
    # a call that copies its experts itself waits for them (eq. 6): fewer copies pay, but some do
    inline = rows["balance-inline"]["copied_experts"]
    assert any(inline) and sum(map(len, inline)) <= sum(map(len, rows["balance"]["copied_experts"])), inline


@pytest.mark.parametrize("kw, message", [
    (dict(preset="tiny", modes=("none", "balance")), "balances dropless MoE layers; add --capacity dropless"),
    (dict(preset="tiny", capacity=None, modes=("balance", "lancet")), "the balance modes run beside none and tutel"),
    (dict(preset="tiny-dense", skew=1.0, modes=("none",)), "--skew 1: needs an MoE preset"),
    (dict(preset="tiny", gate="expert_choice", skew=1.0, modes=("none",)), "token-choice gates"),
])
def test_model_benchmark_refuses_balance_settings_it_cannot_run(kw, message):
    from weft.bench.model import ModelBenchConfig
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelBenchConfig(**kw).validate()
