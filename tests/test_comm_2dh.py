"""2DH all-to-all (Tutel appendix A, Alg. 2) == the linear all-to-all, values and gradients."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from weft import build_moe_groups
from weft.comm import all_to_all, all_to_all_2dh
from weft.distributed import HierarchicalGroups, group_rank, hierarchical_groups
from weft.testing import run_distributed

# Rows per chunk; the 3-d case keeps every value of every rank below 256, exact in bfloat16.
CASES = [((2,), torch.float32), ((2,), torch.bfloat16), ((1, 3, 5), torch.float32), ((1, 3, 5), torch.bfloat16)]


def labelled(source: int, world: int, chunk_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Rank `source`'s input: every element of every rank's input carries a distinct integer."""
    shape = (world * chunk_shape[0],) + chunk_shape[1:]
    numel = torch.Size(shape).numel()
    return torch.arange(source * numel, (source + 1) * numel, dtype=torch.float32).reshape(shape).to(dtype)


def check_against_linear(group: dist.ProcessGroup, groups: HierarchicalGroups) -> None:
    rank, world = group_rank(group), dist.get_world_size(group)
    for chunk_shape, dtype in CASES:
        x = labelled(rank, world, chunk_shape, dtype).requires_grad_()
        x_linear = x.detach().clone().requires_grad_()
        y = all_to_all_2dh(x, groups)
        y_linear = all_to_all(x_linear, group)
        # Output chunk j is chunk `rank` of group rank j's input.
        rows = chunk_shape[0]
        sources = [labelled(j, world, chunk_shape, dtype) for j in range(world)]
        expected = torch.cat([source[rank * rows : (rank + 1) * rows] for source in sources])
        assert torch.equal(y, expected), (chunk_shape, dtype)
        assert torch.equal(y, y_linear)
        assert torch.equal(all_to_all(x, group, algo="2dh", groups_2dh=groups), expected)

        grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(7 + rank)).to(dtype)
        y.backward(grad)
        y_linear.backward(grad)
        assert torch.equal(x.grad, x_linear.grad), (chunk_shape, dtype)


def equivalence_worker(local_sizes: list[int | None]) -> list[dict]:
    info = []
    for local_size in local_sizes:  # one world for several layouts: spawning is the slow part
        groups = hierarchical_groups(None, local_size)
        assert hierarchical_groups(None, groups.local_size) is groups  # cached: no second collective
        check_against_linear(dist.group.WORLD, groups)
        info.append({
            "local_size": groups.local_size,
            "num_nodes": groups.num_nodes,
            "intra": dist.get_process_group_ranks(groups.intra),
            "inter": dist.get_process_group_ranks(groups.inter),
        })
    return info


@pytest.mark.parametrize(
    "world, local_sizes, expected_local",
    [
        # None: 2 nodes x 2 from LOCAL_WORLD_SIZE=2; 1: only the inter-node level; 4: only intra.
        (4, [None, 1, 4], [2, 1, 4]),
        (2, [None, 1, 2], [2, 1, 2]),
    ],
)
def test_2dh_equals_linear_all_to_all(world, local_sizes, expected_local):
    info = run_distributed(equivalence_worker, world, args=(local_sizes,), env={"LOCAL_WORLD_SIZE": 2})
    for rank, per_rank in enumerate(info):
        for got, local_size in zip(per_rank, expected_local):
            node, local = divmod(rank, local_size)
            assert (got["local_size"], got["num_nodes"]) == (local_size, world // local_size)
            assert got["intra"] == [node * local_size + i for i in range(local_size)]
            assert got["inter"] == list(range(local, world, local_size))


def ep_groups_worker() -> dict:
    rank = dist.get_rank()
    ep = build_moe_groups(2).ep  # ranks {0, 1} and {2, 3}: each rank passes its own EP group
    two_nodes = hierarchical_groups(ep, local_size=1)
    check_against_linear(ep, two_nodes)
    one_node = hierarchical_groups(ep)  # LOCAL_WORLD_SIZE=2: the EP group fits in one node
    check_against_linear(ep, one_node)
    # Group-rank order, not global order, defines the nodes: reversed ranks, nodes {3, 2}, {1, 0}.
    reverse = dist.new_group([3, 2, 1, 0], sort_ranks=False)
    reversed_nodes = hierarchical_groups(reverse, local_size=2)
    check_against_linear(reverse, reversed_nodes)
    return {
        "two_nodes": (two_nodes.num_nodes, dist.get_process_group_ranks(two_nodes.inter)),
        "one_node": (one_node.num_nodes, dist.get_process_group_ranks(one_node.intra)),
        "reversed_intra_rank": dist.get_rank(reversed_nodes.intra),
        "rank": rank,
    }


def test_2dh_inside_expert_parallel_groups():
    info = run_distributed(ep_groups_worker, 4, env={"LOCAL_WORLD_SIZE": 2})
    for got in info:
        ep_ranks = [0, 1] if got["rank"] < 2 else [2, 3]
        assert got["two_nodes"] == (2, ep_ranks)
        assert got["one_node"] == (1, ep_ranks)
        assert got["reversed_intra_rank"] == {3: 0, 2: 1, 1: 0, 0: 1}[got["rank"]]


def errors_worker() -> list[str]:
    messages = []
    wrong_size = HierarchicalGroups(None, None, 1, 2)
    for call in (
        lambda: hierarchical_groups(None, 3),
        lambda: hierarchical_groups(None, 0),
        lambda: all_to_all_2dh(torch.zeros(6), hierarchical_groups(None, 2)),
        lambda: all_to_all(torch.zeros(4), dist.group.WORLD, [1] * 4, [1] * 4, algo="2dh"),
        lambda: all_to_all(torch.zeros(4), dist.group.WORLD, algo="ring"),
        lambda: all_to_all(torch.zeros(4), dist.group.WORLD, algo="2dh", groups_2dh=wrong_size),
    ):
        try:
            call()
        except ValueError as e:
            messages.append(str(e))
    # Every rank raised together, so the world is still in step.
    y = all_to_all(torch.arange(4.0), dist.group.WORLD, algo="2dh")
    assert torch.equal(y, torch.full((4,), float(dist.get_rank())))
    return messages


def test_bad_arguments_are_refused_on_every_rank():
    for messages in run_distributed(errors_worker, 4):
        assert len(messages) == 6
        assert "local_size (3) must be a positive divisor of the group size (4)" in messages[0]
        assert "local_size (0) must be a positive divisor of the group size (4)" in messages[1]
        assert "dim 0 of x (shape (6,)) must be divisible by the all-to-all group size (4)" in messages[2]
        assert "equal splits" in messages[3]
        assert "'linear'" in messages[4] and "'2dh'" in messages[4] and "'ring'" in messages[4]
        assert "groups_2dh spans 2 x 1 ranks, but the group has 4" in messages[5]


def test_single_process():
    groups = hierarchical_groups()
    assert groups == HierarchicalGroups(None, None, 1, 1)
    x = torch.randn(3, 2)
    assert all_to_all_2dh(x, groups) is x
    assert all_to_all(x, None, algo="2dh") is x
    with pytest.raises(ValueError, match=r"local_size \(2\)"):
        hierarchical_groups(None, 2)
