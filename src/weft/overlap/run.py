"""`weft plan --preset NAME`: profile a preset on this machine and print Lancet's plan."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from weft.comm.cost_model import CommCostModel
from weft.distributed import init_distributed
from weft.models import GPT, get_preset
from weft.overlap.passes import optimize


def plan_preset(preset: str, batch_size: int, gate: str | None, capacity, max_partitions: int,
                max_range: int | None, comm_model: str | None, json_path: str | None) -> dict:
    """Build `preset` on every rank, plan it for `batch_size` sequences per rank; rank 0 prints
    the plan (and writes it to `json_path`)."""
    ctx = init_distributed()
    overrides = {} if gate is None else {"gate": gate}
    if capacity != "preset":
        overrides["capacity_factor"] = capacity
    base = get_preset(preset)
    cfg = type(base).from_dict({**base.to_dict(), **overrides})
    cost_model = CommCostModel.from_json(comm_model) if comm_model else None
    torch.manual_seed(0)
    model = GPT(cfg, group=dist.group.WORLD if dist.is_initialized() else None).to(ctx.device)
    gen = torch.Generator().manual_seed(ctx.rank)
    idx = torch.randint(0, cfg.vocab_size, (batch_size, cfg.block_size), generator=gen).to(ctx.device)
    plan = optimize(model, idx, max_partitions=max_partitions, max_range=max_range, cost_model=cost_model)
    report = {"preset": preset, "gate": cfg.gate, "capacity_factor": cfg.capacity_factor, "batch_size": batch_size,
              "world_size": ctx.world_size, **plan.to_dict()}
    if ctx.rank == 0:
        print(f"weft plan: {preset} (gate {cfg.gate}, cf {cfg.capacity_factor}), batch {batch_size} x "
              f"{cfg.block_size} per rank, {ctx.world_size} x {ctx.device.type}")
        print(plan.summary())
        if json_path:
            Path(json_path).parent.mkdir(parents=True, exist_ok=True)
            Path(json_path).write_text(json.dumps(report, indent=2))
            print(f"wrote {json_path}")
    return report
