"""Process groups, gradient reduction and EP-size-invariant expert initialisation."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import moe_reference as ref
from weft import MoE, build_moe_groups, init_distributed, reduce_gradients
from weft.comm import all_to_all
from weft.testing import run_distributed

DIM, HIDDEN, EXPERTS = 8, 12, 4
CFG = {"gate": "topk", "top_k": 2, "num_experts": EXPERTS, "activation": "gelu", "normalize_gates": True}


def full_moe_state(seed: int = 3) -> dict[str, torch.Tensor]:
    """A single process holding every expert (built in the parent, before any process group)."""
    torch.manual_seed(seed)
    return dict(MoE(DIM, HIDDEN, EXPERTS, top_k=2, capacity_factor=None).state_dict())


def rank_tokens(rank: int) -> torch.Tensor:
    return torch.randn(6 + rank, DIM, generator=torch.Generator().manual_seed(50 + rank))


def reduce_worker(ep_size: int, full: dict[str, torch.Tensor]) -> dict:
    """Train-step gradients after reduce_gradients == gradient of the mean loss over all ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = build_moe_groups(ep_size)
    torch.manual_seed(3)
    moe = MoE(DIM, HIDDEN, EXPERTS, top_k=2, capacity_factor=None, group=groups.ep)
    assert torch.equal(moe.router.weight, full["router.weight"])
    first = moe.experts.first_expert
    assert torch.equal(moe.experts.w1, full["experts.w1"][first : first + moe.num_local_experts])

    moe(rank_tokens(rank)).square().mean().backward()
    reduce_gradients(moe, groups)

    params = {n: v.clone().requires_grad_() for n, v in full.items()}
    mean_loss = sum(ref.moe_forward(rank_tokens(r), params, CFG)[0].square().mean() for r in range(world)) / world
    grads = dict(zip(params, torch.autograd.grad(mean_loss, list(params.values()))))
    torch.testing.assert_close(moe.router.weight.grad, grads["router.weight"], rtol=1e-5, atol=1e-7)
    for name in ("w1", "w2"):
        expected = grads[f"experts.{name}"][first : first + moe.num_local_experts]
        torch.testing.assert_close(getattr(moe.experts, name).grad, expected, rtol=1e-5, atol=1e-7)
    return {"ep": groups.ep_size, "edp": groups.edp_size, "first": first}


@pytest.mark.parametrize("world_size, ep_size", [(2, 2), (4, 2), (4, 4), (4, 1)])
def test_reduce_gradients_gives_the_gradient_of_the_global_mean_loss(world_size, ep_size):
    info = run_distributed(reduce_worker, world_size, args=(ep_size, full_moe_state()))
    assert [i["ep"] for i in info] == [ep_size] * world_size
    assert [i["edp"] for i in info] == [world_size // ep_size] * world_size
    local = EXPERTS // ep_size
    assert [i["first"] for i in info] == [(r % ep_size) * local for r in range(world_size)]


def mesh_worker(ep_size: int) -> dict:
    groups = build_moe_groups(ep_size)
    ranks = dist.get_process_group_ranks
    return {"mesh_shape": tuple(groups.mesh.shape), "names": groups.mesh.mesh_dim_names,
            "ep_same": ranks(groups.mesh.get_group("ep")) == ranks(groups.ep),
            "edp_same": ranks(groups.mesh.get_group("edp")) == ranks(groups.edp),
            "ep_ranks": ranks(groups.ep)}


@pytest.mark.parametrize("world_size, ep_size", [(2, 2), (4, 2)])
def test_groups_keep_their_device_mesh(world_size, ep_size):
    """The DeviceMesh the groups come from stays in MoEGroups (DTensor, FSDP2 and TP need it)."""
    info = run_distributed(mesh_worker, world_size, args=(ep_size,))
    assert all(i["mesh_shape"] == (world_size // ep_size, ep_size) and i["names"] == ("edp", "ep") for i in info)
    assert all(i["ep_same"] and i["edp_same"] for i in info)
    assert [i["ep_ranks"] for i in info] == [list(range(r - r % ep_size, r - r % ep_size + ep_size))
                                             for r in range(world_size)]


def bad_ep_worker() -> list[str]:
    messages = []
    for call in (lambda: MoE(DIM, HIDDEN, 3), lambda: build_moe_groups(3)):
        try:
            call()
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_world_size_that_does_not_divide_the_experts_is_refused():
    messages = run_distributed(bad_ep_worker, 2)[0]
    assert "num_experts (3) must be divisible by the expert-parallel size (2)" in messages[0]
    assert "ep_size (3) must be a positive divisor of the world size (2)" in messages[1]


def all_to_all_worker() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    # Fixed size: chunk i of rank r carries r*10 + i and lands on rank i.
    x = torch.tensor([[rank * 10.0 + i] for i in range(world)], requires_grad=True)
    y = all_to_all(x, dist.group.WORLD)
    assert y.flatten().tolist() == [r * 10.0 + rank for r in range(world)]
    (y * (rank + 1)).sum().backward()
    assert x.grad.flatten().tolist() == [i + 1.0 for i in range(world)]
    # Irregular: rank r sends i+1 rows to rank i.
    send = [i + 1 for i in range(world)]
    recv = [rank + 1] * world
    x = torch.cat([torch.full((i + 1, 2), float(rank)) for i in range(world)]).requires_grad_()
    y = all_to_all(x, dist.group.WORLD, recv, send)
    assert y[:, 0].tolist() == [float(r) for r in range(world) for _ in range(rank + 1)]
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_to_all_and_its_backward(world_size):
    run_distributed(all_to_all_worker, world_size)


def test_single_process_context_without_torchrun(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    ctx = init_distributed()
    assert (ctx.rank, ctx.world_size, ctx.backend) == (0, 1, None)
    groups = build_moe_groups()
    assert groups.ep is None and groups.ep_size == 1 and groups.mesh is None
    with pytest.raises(ValueError, match="ep_size=2 needs an initialised process group"):
        build_moe_groups(2)
