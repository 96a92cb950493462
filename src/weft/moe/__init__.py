"""The MoE layer (Tutel core): routing, capacity, index-based dispatch, exchange strategies, experts."""
from weft.kernels.activation import ACTIVATIONS
from weft.moe.config import MoECall
from weft.moe.experts import Experts
from weft.moe.gates import GATES
from weft.moe.layer import MoE
from weft.moe.routing import MoEStats, Router, Routing, RoutingSummary

__all__ = ["MoE", "MoECall", "MoEStats", "Experts", "GATES", "ACTIVATIONS", "Router", "Routing", "RoutingSummary"]
