"""Lancet: whole-graph overlap of the MoE all-to-alls in training.

- backward: `weft.ops.wgrad` defers weight gradients and runs them while all-to-alls are in flight (sec. 4);
- forward: `forward` runs ranges of sub-layers cut along the batch and pipelined around their MoE
  layer, with capacity-carrying routing (`moe_partition`) (sec. 5);
- `planner` picks the ranges (pipeline simulator + dynamic programme over profiled costs);
- `optimize(model, sample_batch)` profiles a weft GPT, plans and applies both passes.

Pro-Prophet's performance model is measured from the same profile (`balance_model`:
`fit_balance_models(model, sample_batch)`, `measure_layer_cost_model(moe, x)`, and what a call
spends beyond that model: `measure_unpriced_time(moe, x)`).
"""
from weft.ops.wgrad import (
    WGradScheduler,
    WGradStats,
    best_fit,
    bmm,
    grouped_mm,
    linear,
)
from weft.overlap.balance_model import (
    fit_balance_models,
    install_unpriced_time,
    layer_cost_model,
    measure_layer_cost_model,
    measure_unpriced_time,
    with_unpriced_time,
)
from weft.overlap.forward import PartitionedRunner, Range
from weft.overlap.passes import OverlapPlan, optimize
from weft.overlap.planner import Plan, Segment, plan, simulate

__all__ = ["OverlapPlan", "PartitionedRunner", "Plan", "Range", "Segment", "WGradScheduler", "WGradStats", "best_fit",
           "bmm", "fit_balance_models", "grouped_mm", "install_unpriced_time", "layer_cost_model", "linear",
           "measure_layer_cost_model", "measure_unpriced_time", "with_unpriced_time",
           "optimize", "plan", "simulate"]
