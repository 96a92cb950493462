"""A tensor-parallel model's tensors in the dense layout and back: checkpoints hold dense tensors
(the layout of the same model with tp = 1), so a run can continue with another TP size. Rank r's
tensor of a split parameter is `module.shard_of(name, dense)`; `module.unshard(name, shards)`
assembles the dense one from every rank's. The same rule applies to anything shaped like the
parameter (gradients, Adam's moments)."""
from __future__ import annotations

import torch
from torch import nn

from weft.comm import all_gather
from weft.distributed import group_size
from weft.tp.layers import TPMLP, TPAttention


def sharded_entries(model: nn.Module) -> dict[str, tuple[TPAttention | TPMLP, str]]:
    """state_dict key of every split parameter -> (its module, its name inside the module)."""
    return {f"{prefix}.{name}": (module, name) for prefix, module in model.named_modules()
            if isinstance(module, (TPAttention, TPMLP)) for name, _ in module.named_parameters()}


def sharded_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters split over the tensor-parallel group (each rank holds a slice)."""
    return [p for m in model.modules() if isinstance(m, (TPAttention, TPMLP)) for p in m.parameters()]


def dense_tensor(module: TPAttention | TPMLP, name: str, local: torch.Tensor) -> torch.Tensor:
    """The dense tensor from every rank's `local` slice (a collective over the module's group)."""
    if group_size(module.group) == 1:
        return local
    with torch.no_grad():
        shards = all_gather(local, module.group).chunk(group_size(module.group))
    return module.unshard(name, list(shards))


def local_tensor(module: TPAttention | TPMLP, name: str, dense: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a dense tensor, contiguous."""
    return module.shard_of(name, dense).contiguous()
