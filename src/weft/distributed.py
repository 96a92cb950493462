"""Process groups for expert parallelism (a DeviceMesh and its groups) and launch helpers.

The only global state weft relies on is process groups: torch.distributed's own registry, and
the caches of hierarchical (2DH) groups, side groups and host (gloo) groups below, which exist
because building them is a collective that must not be repeated per call. Every module takes its
group explicitly, and `None` means "the default group if one is initialised, else a single
process".
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = [
    "DistContext",
    "MoEGroups",
    "HierarchicalGroups",
    "init_distributed",
    "build_moe_groups",
    "hierarchical_groups",
    "side_group",
    "host_group",
    "own_group",
    "resolve_group",
    "group_rank",
    "group_size",
]


@dataclass(frozen=True)
class DistContext:
    """Where this process sits: its rank, the world, and the device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str | None


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> DistContext:
    """Initialise torch.distributed from torchrun's environment (RANK, WORLD_SIZE, ...).

    NCCL with one GPU per process when CUDA is available, gloo on the CPU otherwise. Without
    torchrun's variables this is a single process and no group is created. Calling it again
    after initialisation just describes the existing world.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        backend = backend or ("nccl" if use_cuda else "gloo")
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    if not dist.is_initialized():
        return DistContext(0, 1, 0, 1, device, None)
    world = dist.get_world_size()
    return DistContext(
        rank=dist.get_rank(),
        world_size=world,
        local_rank=local_rank,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
        device=device,
        backend=dist.get_backend(),
    )


def resolve_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group a layer communicates over: the one given, else the default group if any."""
    if group is not None:
        return group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def global_rank(group: dist.ProcessGroup | None, rank: int) -> int:
    """The default group's rank of `group`'s rank `rank` (what torch.distributed's `src`/`dst` take)."""
    return rank if group is None else dist.get_global_rank(group, rank)


@dataclass(frozen=True)
class MoEGroups:
    """The groups of expert-parallel training.

    `ep`: ranks that together hold one copy of every expert (tokens are exchanged inside it).
    `edp`: expert-data-parallel ranks holding the same experts (expert gradients are averaged here).
    `dp`: all data-parallel ranks (non-expert gradients are averaged here).
    `mesh`: the (edp, ep) DeviceMesh these groups come from (for DTensor, FSDP2), or the (dp, tp)
    one of tensor-parallel training. In a distributed run every group is a real process group
    (possibly of one rank, e.g. `ep` with ep_size=1 keeps all experts local); without
    torch.distributed all are None.
    `tp`: the tensor-parallel group (consecutive ranks; a model's blocks are split over it,
    weft.tp), None without tensor parallelism; `dp` is then the ranks with this rank's TP index,
    and `ep` the whole world (an MoE model's experts) or None (a dense model).
    """

    ep: dist.ProcessGroup | None
    edp: dist.ProcessGroup | None
    dp: dist.ProcessGroup | None
    ep_size: int
    edp_size: int
    mesh: DeviceMesh | None = None
    tp: dist.ProcessGroup | None = None
    tp_size: int = 1


def build_moe_groups(ep_size: int | None = None, device_type: str | None = None, tp_size: int = 1,
                     experts: bool = True) -> MoEGroups:
    """Split the world into a (edp, ep) DeviceMesh: ranks [i*ep, (i+1)*ep) form EP group i.

    `ep_size` defaults to the whole world. It must divide the world size; with fewer experts
    than ranks choose `ep_size <= num_experts` so every EP group holds all experts. `tp_size` > 1:
    a (dp, tp) mesh instead, ranks [i*tp, (i+1)*tp) forming TP group i; a model with `experts`
    then keeps them expert-parallel over the whole world (`ep_size` None or the world size): the
    ranks of a TP group feed their MoE layers different tokens (weft.tp.TokenSplit), so every
    rank's experts serve, and the all-to-all spans the world as without TP.
    """
    if tp_size > 1:
        return _build_tp_groups(ep_size, device_type, tp_size, experts)
    if not dist.is_initialized():
        if ep_size not in (None, 1):
            raise ValueError(f"ep_size={ep_size} needs an initialised process group (world size is 1)")
        return MoEGroups(None, None, None, 1, 1, None)
    world = dist.get_world_size()
    ep_size = world if ep_size is None else ep_size
    if ep_size < 1 or world % ep_size != 0:
        raise ValueError(f"ep_size ({ep_size}) must be a positive divisor of the world size ({world})")
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, (world // ep_size, ep_size), mesh_dim_names=("edp", "ep"))
    ep, edp = mesh.get_group("ep"), mesh.get_group("edp")
    return MoEGroups(ep, edp, dist.group.WORLD, ep_size, world // ep_size, mesh)


def _build_tp_groups(ep_size: int | None, device_type: str | None, tp_size: int, experts: bool) -> MoEGroups:
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world % tp_size:
        raise ValueError(f"tensor-parallel size {tp_size} must divide the world size ({world})")
    if not experts and ep_size not in (None, 1):
        raise ValueError(f"ep_size={ep_size}: this model is dense, it has no experts to split")
    if experts and ep_size not in (None, world):
        raise ValueError(f"ep_size={ep_size}: with tensor parallelism the experts are split over the whole world "
                         f"({world} ranks); leave ep_size unset")
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, (world // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
    ep, size = (dist.group.WORLD, world) if experts else (None, 1)
    return MoEGroups(ep, None, mesh.get_group("dp"), size, 1, mesh, mesh.get_group("tp"), tp_size)


@dataclass(frozen=True)
class HierarchicalGroups:
    """An EP group seen as `num_nodes` nodes of `local_size` consecutive group ranks (for 2DH).

    Group rank `r` is local index `r % local_size` on node `r // local_size`. `intra`: the ranks
    of this rank's node, in local-index order; `inter`: the ranks with this rank's local index,
    in node order. Both are None only for a single process or a group of one rank.
    """

    intra: dist.ProcessGroup | None
    inter: dist.ProcessGroup | None
    local_size: int
    num_nodes: int

    @property
    def size(self) -> int:
        """The size of the EP group the two levels together span."""
        return self.local_size * self.num_nodes


# The one weft-owned registry of process groups (see the module docstring): the hierarchical
# groups of (EP group, local size), since building them is a world-wide collective.
_HIERARCHICAL_GROUPS: dict[tuple[dist.ProcessGroup, int], HierarchicalGroups] = {}
# ... and the side group of each group (`side_group`), and its gloo twin (`host_group`).
_SIDE_GROUPS: dict[dist.ProcessGroup, dist.ProcessGroup] = {}
_HOST_GROUPS: dict[dist.ProcessGroup, dist.ProcessGroup] = {}


def _ranks_in_group_order(group: dist.ProcessGroup) -> list[int]:
    """Global ranks of `group`, ordered by their rank inside it."""
    return sorted(dist.get_process_group_ranks(group), key=lambda g: dist.get_group_rank(group, g))


def _default_local_size(ranks: list[int]) -> int:
    """How many ranks of the group share this rank's node (LOCAL_WORLD_SIZE ranks per node)."""
    if "LOCAL_WORLD_SIZE" not in os.environ:
        return len(ranks)
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    node = dist.get_rank() // per_node
    return sum(1 for r in ranks if r // per_node == node)


def _check_layout(ranks: tuple[int, ...], local_size: int, seen: dict[tuple[int, ...], int]) -> None:
    size = len(ranks)
    if local_size < 1 or size % local_size != 0:
        raise ValueError(f"local_size ({local_size}) must be a positive divisor of the group size ({size})")
    if seen.setdefault(ranks, local_size) != local_size:
        raise ValueError(
            f"the ranks of group {list(ranks)} disagree on local_size ({seen[ranks]} vs {local_size}); "
            "pass the same local_size on every rank"
        )


def _new_group(ranks: list[int], backend: str | None = None) -> dist.ProcessGroup:
    # Keep the given order: a subgroup's rank must equal the local index (intra) or node (inter).
    if ranks == sorted(ranks):
        return dist.new_group(ranks, backend=backend)
    return dist.new_group(ranks, backend=backend, sort_ranks=False)


def hierarchical_groups(
    group: dist.ProcessGroup | None = None, local_size: int | None = None
) -> HierarchicalGroups:
    """Split `group` (None: the default group) into node-local and cross-node groups for 2DH.

    The group's ranks, in group-rank order, form nodes of `local_size` consecutive ranks.
    `local_size` defaults to the number of the group's ranks on this rank's node, nodes being
    `LOCAL_WORLD_SIZE` consecutive global ranks (so `LOCAL_WORLD_SIZE` for node-aligned groups
    spanning whole nodes; the group size when the variable is unset). It must divide the
    group size.

    Collective over the whole world: every rank of the default group calls it, in the same
    order, each with its own EP group (they may differ). Results are cached per
    (group, local_size), so build them once, e.g. when a layer is constructed.
    """
    if not dist.is_initialized():
        if local_size not in (None, 1):
            raise ValueError(f"local_size ({local_size}) must be a positive divisor of the group size (1)")
        return HierarchicalGroups(None, None, 1, 1)
    group = resolve_group(group)
    ranks = _ranks_in_group_order(group)
    local_size = _default_local_size(ranks) if local_size is None else local_size
    key = (group, local_size)
    if key in _HIERARCHICAL_GROUPS:
        return _HIERARCHICAL_GROUPS[key]

    # Every rank learns every EP group's layout, so all create the same subgroups in the same
    # order (new_group is a world collective). Checking all layouts on every rank makes a bad
    # local_size raise everywhere instead of leaving the other ranks waiting.
    layouts: list[tuple[tuple[int, ...], int]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(layouts, (tuple(ranks), local_size))
    seen: dict[tuple[int, ...], int] = {}
    _check_layout(tuple(ranks), local_size, seen)
    for layout in layouts:
        _check_layout(*layout, seen)

    created: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for members, size in sorted(set(layouts)):
        if len(members) == 1:
            continue
        nodes = [members[i : i + size] for i in range(0, len(members), size)]
        same_local = [members[i::size] for i in range(size)]
        for sub in nodes + same_local:
            if sub not in created:
                created[sub] = _new_group(list(sub))
    intra = inter = None
    if len(ranks) > 1:
        pos = ranks.index(dist.get_rank())
        node_start = pos - pos % local_size
        intra = created[tuple(ranks[node_start : node_start + local_size])]
        inter = created[tuple(ranks[pos % local_size :: local_size])]
    result = HierarchicalGroups(intra, inter, local_size, len(ranks) // local_size)
    _HIERARCHICAL_GROUPS[key] = result
    return result


def side_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup | None:
    """A second process group over the ranks of `group` (None: the default group), in the same
    rank order. A communicator runs its collectives one after another, so a transfer that must not
    wait behind the group's all-to-alls, nor hold them up (Pro-Prophet's Trans and Agg), goes
    over this one instead. A one-rank group is its own side group; None without a process group.

    Collective over the whole world, like `hierarchical_groups`: every rank calls it, in the same
    order, with its own group. Cached per group, so build it once, e.g. with the layer."""
    if not dist.is_initialized():
        return None
    group = resolve_group(group)
    if group not in _SIDE_GROUPS:
        _SIDE_GROUPS[group] = own_group(group)
    return _SIDE_GROUPS[group]


def host_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup | None:
    """A gloo process group over the ranks of `group` (None: the default group), in the same rank
    order, for small collectives of CPU tensors between the hosts (what a rank holds on the host,
    e.g. which parameters have a gradient): no device work, nothing for a CUDA stream to wait on.
    A one-rank group is returned itself (whatever its backend: nothing to exchange); None without
    a process group. Collective over the whole world on its first call for a group, like
    `side_group`, and cached per group."""
    if not dist.is_initialized():
        return None
    group = resolve_group(group)
    if group not in _HOST_GROUPS:
        _HOST_GROUPS[group] = own_group(group, backend="gloo")
    return _HOST_GROUPS[group]


def own_group(group: dist.ProcessGroup | None = None, backend: str | None = None) -> dist.ProcessGroup | None:
    """A new process group over the ranks of `group` (None: the default group), in the same rank
    order: a communicator of its own, not shared with anything else (`side_group` caches one per
    group; this makes a new one per call, e.g. for an object that keeps it for its lifetime).
    `backend`: the new group's ("gloo" for collectives of CPU tensors between the hosts; default:
    the default group's). A one-rank group is returned itself; None without a process group.
    Collective over the whole world: every rank calls it, in the same order, with its own group."""
    if not dist.is_initialized():
        return None
    group = resolve_group(group)
    ranks = tuple(_ranks_in_group_order(group))
    layouts: list[tuple[int, ...]] = [()] * dist.get_world_size()
    dist.all_gather_object(layouts, ranks)
    created = {members: _new_group(list(members), backend) for members in sorted(set(layouts)) if len(members) > 1}
    return created.get(ranks, group)
