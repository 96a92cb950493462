"""weft: Mixture-of-Experts training with communication woven through computation."""
from weft.distributed import MoEGroups, build_moe_groups, hierarchical_groups, init_distributed
from weft.moe import MoE, MoEStats
from weft.moe.backward_sgd import BackwardSGD
from weft.moe.grads import reduce_gradients

__version__ = "0.1.0"
__all__ = [
    "MoE", "MoEStats", "BackwardSGD", "MoEGroups", "init_distributed", "build_moe_groups", "hierarchical_groups",
    "reduce_gradients",
]
