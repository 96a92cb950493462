"""The MoE layer (Tutel core): gates, capacity, index-based dispatch, expert parallelism."""
from weft.moe.experts import ACTIVATIONS, Experts
from weft.moe.gates import GATES
from weft.moe.layer import MoE, MoEStats

__all__ = ["MoE", "MoEStats", "Experts", "GATES", "ACTIVATIONS"]
