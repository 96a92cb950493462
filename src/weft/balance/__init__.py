"""Pro-Prophet's load balancing by expert replication: load history and prediction, the
performance model, the greedy placement planner and the per-layer planning across calls (the
exchange that carries a placement out is `weft.moe.exchange.ReplicatedExperts`)."""
from weft.balance.balancer import ExpertBalancer, nominal_cost_model
from weft.balance.load import LoadHistory
from weft.balance.planner import LayerCostModel, Placement, Plan, greedy_placement, is_balanced, loads

__all__ = ["ExpertBalancer", "LayerCostModel", "LoadHistory", "Placement", "Plan", "greedy_placement", "is_balanced",
           "loads", "nominal_cost_model"]
