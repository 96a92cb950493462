"""`weft plan --preset NAME`: profile a preset on this machine and print Lancet's plan."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from weft.cliargs import arg, non_negative_int, positive_int
from weft.comm.cost_model import CommCostModel
from weft.distributed import init_distributed
from weft.jsonfile import write_json
from weft.models import GPT
from weft.models.presets import PresetChoice
from weft.overlap.passes import optimize, pipelined_predictions
from weft.tune.dictionary import DEGREES


@dataclass
class PlanConfig(PresetChoice):
    """`weft plan`: profile a preset here and print Lancet's plan."""

    max_partitions: int = arg(8, "Lancet's K: the most batch partitions of a pipeline", parse=positive_int)
    max_range: int | None = arg(None, "most sub-layers one pipeline spans", parse=positive_int)
    comm_model: str | None = arg(None, "cost model JSON from `weft bench comm` (default: measure)")
    measure: int = arg(5, "iterations each combination of the passes is timed to keep only what pays (0: keep "
                          "the plan as planned)", parse=non_negative_int)
    json: str | None = arg(None, "write the plan here")

    def validate(self) -> None:
        super().validate()
        if self.comm_model:
            CommCostModel.from_json(self.comm_model)  # ValueError naming the file if it is not a cost model


def plan_preset(plan_cfg: PlanConfig) -> dict:
    """Build the preset on every rank, plan it for `batch_size` sequences per rank; rank 0 prints
    the plan (and writes it to `json`)."""
    plan_cfg.validate()
    ctx = init_distributed()
    preset, batch_size, json_path = plan_cfg.preset, plan_cfg.batch_size, plan_cfg.json
    cfg = plan_cfg.model_config()
    cost_model = CommCostModel.from_json(plan_cfg.comm_model) if plan_cfg.comm_model else None
    torch.manual_seed(0)
    model = GPT(cfg, group=dist.group.WORLD if dist.is_initialized() else None).to(ctx.device)
    gen = torch.Generator().manual_seed(ctx.rank)
    idx = torch.randint(0, cfg.vocab_size, (batch_size, cfg.block_size), generator=gen).to(ctx.device)
    plan = optimize(model, idx, max_partitions=plan_cfg.max_partitions, max_range=plan_cfg.max_range,
                    cost_model=cost_model, measure=plan_cfg.measure, degrees=DEGREES)
    pipelined = pipelined_predictions(plan, DEGREES)
    report = {"preset": preset, "gate": cfg.gate, "capacity_factor": cfg.capacity_factor, "batch_size": batch_size,
              "world_size": ctx.world_size, **plan.to_dict(),
              "pipelined_predicted_s": {str(d): times for d, times in pipelined.items()}}
    if ctx.rank == 0:
        print(f"weft plan: {preset} (gate {cfg.gate}, cf {cfg.capacity_factor}), batch {batch_size} x "
              f"{cfg.block_size} per rank, {ctx.world_size} x {ctx.device.type}")
        print(plan.summary())
        if pipelined:
            print(pipelined_summary(pipelined))
        if json_path:
            write_json(json_path, report)
            print(f"wrote {json_path}")
    return report


def pipelined_summary(pipelined: dict[int, dict]) -> str:
    """The table of `pipelined_predictions`: one row per pipelining degree."""
    lines = ["Tutel's chunks in Lancet's model: every MoE layer pipelined at degree d, forward unpartitioned "
             "(predicted forward+backward ms)", "degree   plain  dW scheduled"]
    for degree, times in pipelined.items():
        lines.append(f"{degree:>6}  {times['plain'] * 1e3:6.3f}  {times['scheduled'] * 1e3:12.3f}")
    return "\n".join(lines)
