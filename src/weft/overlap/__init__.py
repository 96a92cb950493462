"""Lancet: whole-graph overlap of the MoE all-to-alls in training.

- backward: `wgrad` defers weight gradients and runs them while all-to-alls are in flight (sec. 4);
- forward: `forward` runs ranges of sub-layers cut along the batch and pipelined around their MoE
  layer, with capacity-carrying routing (`moe_partition`) (sec. 5);
- `planner` picks the ranges (pipeline simulator + dynamic programme over profiled costs);
- `optimize(model, sample_batch)` profiles a weft GPT, plans and applies both passes.
"""
from weft.overlap.planner import Plan, Segment, plan, simulate
from weft.overlap.wgrad import (
    WGradScheduler,
    WGradStats,
    best_fit,
    bmm,
    grouped_mm,
    linear,
)

__all__ = ["OverlapPlan", "Plan", "Range", "Segment", "WGradScheduler", "WGradStats", "best_fit", "bmm",
           "grouped_mm", "linear", "optimize", "plan", "simulate"]


def __getattr__(name: str):
    # These import the MoE layer, which itself imports `wgrad`: load them on first use.
    if name in ("optimize", "OverlapPlan"):
        from weft.overlap import passes
        return getattr(passes, name)
    if name == "Range":
        from weft.overlap.forward import Range
        return Range
    raise AttributeError(f"module 'weft.overlap' has no attribute {name!r}")
