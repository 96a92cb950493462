"""Lancet's forward pass: run a model's sub-layers with the ranges of a plan partitioned along the
batch and pipelined around their MoE layer (sec. 5, fig. 4d and 9).

A model exposes its forward as a list of units (`x -> x` callables with their residual) and says
which are MoE units (`MoEUnit`: the layer plus the norm before it, `x + moe(norm(x))`). A
pipelined range [start, end] holding MoE unit m runs as fig. 9's stages, each for partition
0..k-1 before the next stage starts:

    S1 compute: units start..m-1, norm, routing, counts exchange   S2: dispatch all-to-allv (async)
    S3 compute: wait, local experts                                 S4: combine all-to-allv (async)
    S5 compute: wait, combine + residual, units m+1..end

so the exchange of partition i overlaps the computation of partition i+1. Everything except the
exchange is row-wise in the batch (attention stays inside a sequence), and routing keeps the
unpartitioned slots (see moe_partition), so the result equals the unpartitioned forward.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weft.models.gpt import MoEUnit, Unit
from weft.overlap.moe_partition import PartitionedMoE, can_route_in_parts


@dataclass(frozen=True)
class Range:
    """Units start..end (inclusive) cut into `partitions` batch parts around MoE unit `moe`."""

    start: int
    end: int
    partitions: int
    moe: int


def check_range(units: Sequence[Unit], r: Range) -> None:
    """ValueError unless `r` is a range the pipeline can run exactly."""
    if not 0 <= r.start <= r.moe <= r.end < len(units):
        raise ValueError(f"range {r.start}..{r.end} around unit {r.moe} is outside the model's {len(units)} units")
    if not isinstance(units[r.moe], MoEUnit):
        raise ValueError(f"unit {r.moe} of range {r.start}..{r.end} is not an MoE layer")
    others = [u for u in range(r.start, r.end + 1) if u != r.moe and isinstance(units[u], MoEUnit)]
    if others:
        raise ValueError(f"range {r.start}..{r.end} holds more than one MoE layer (units {r.moe} and {others})")
    if r.partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {r.partitions}")
    moe = units[r.moe].moe
    if r.start < r.moe and not can_route_in_parts(moe):
        raise ValueError(
            f"range {r.start}..{r.end} starts before MoE unit {r.moe}, but its gate {moe.gate!r} "
            f"(top_k={moe.top_k}, capacity_factor={moe.capacity_factor}) routes a partition depending on the "
            "rest of the batch: only ops after it can join its pipeline")


@dataclass(frozen=True)
class PartitionedRunner:
    """A model's unit runner (`GPT.unit_runner`) that pipelines the units of `ranges`."""

    ranges: tuple[Range, ...]

    def __call__(self, units: Sequence[Unit], x: torch.Tensor) -> torch.Tensor:
        return run_units(units, x, self.ranges)


def run_units(units: Sequence[Unit], x: torch.Tensor, ranges: Sequence[Range]) -> torch.Tensor:
    """Run every unit in order on x (batch, ...); units inside a range run pipelined."""
    by_start = {r.start: r for r in ranges}
    u = 0
    while u < len(units):
        r = by_start.get(u)
        if r is None or r.partitions == 1:
            end = u if r is None else r.end
            for i in range(u, end + 1):
                x = units[i](x)
            u = end + 1
        else:
            x = run_pipeline(units, x, r)
            u = r.end + 1
    return x


def run_pipeline(units: Sequence[Unit], x: torch.Tensor, r: Range) -> torch.Tensor:
    """Units r.start..r.end on x (batch, seq, dim) in fig. 9's stage order over the partitions."""
    check_range(units, r)
    unit: MoEUnit = units[r.moe]
    pre, post = units[r.start:r.moe], units[r.moe + 1:r.end + 1]
    xs = list(x.tensor_split(min(r.partitions, x.shape[0]), dim=0))
    tokens_per_row = x[0].numel() // x.shape[-1]
    num_tokens = x.shape[0] * tokens_per_row
    layer = PartitionedMoE(unit.moe, num_tokens)
    if not pre:  # route the whole batch once: any gate
        h = unit.norm(x).reshape(num_tokens, -1)
        parts = layer.route_whole(h, [part.shape[0] * tokens_per_row for part in xs])
        layer.dispatch(parts)
    else:
        parts = []
        for p in range(len(xs)):  # S1 of partition p, then its exchange starts (S2)
            for f in pre:
                xs[p] = f(xs[p])
            part = layer.route_part(unit.norm(xs[p]).reshape(-1, x.shape[-1]))
            layer.dispatch([part])
            parts.append(part)
        layer.finish_routing()
    for part in parts:  # S3 (S4 starts as each part's experts finish)
        layer.run_experts(part)
    for p, part in enumerate(parts):  # S5
        xs[p] = xs[p] + layer.combine(part).to(xs[p].dtype).view_as(xs[p])
        for f in post:
            xs[p] = f(xs[p])
    return torch.cat(xs, dim=0)
