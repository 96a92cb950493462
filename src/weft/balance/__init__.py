"""Pro-Prophet's load balancing by expert replication: load history and prediction, the
performance model and the greedy placement planner (the exchange that carries a placement out
is still to come)."""
from weft.balance.load import LoadHistory
from weft.balance.planner import LayerCostModel, Placement, Plan, greedy_placement, is_balanced, loads

__all__ = ["LayerCostModel", "LoadHistory", "Placement", "Plan", "greedy_placement", "is_balanced", "loads"]
