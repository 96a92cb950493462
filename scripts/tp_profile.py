"""Where a tensor-parallel step's time goes, per schedule: torch.profiler's kernel table (GPU
time by kernel, top 15) and the step's wall time, for `weft bench tp`'s stack. One process per
GPU under torchrun, or one GPU alone:

    python scripts/tp_profile.py --config gpt3-2.7b --modes none,domino --p1 2
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from weft.bench.tp import SHAPES
from weft.distributed import init_distributed
from weft.models.gpt import Block, GPTConfig, rotary_tables
from weft.tp import TPBlock, TPStack, make_schedule


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="gpt3-2.7b", choices=list(SHAPES))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--p1", type=int, default=2)
    parser.add_argument("--modes", default="none,domino")
    args = parser.parse_args()
    ctx = init_distributed()
    shape = SHAPES[args.config]
    group = dist.group.WORLD if ctx.world_size > 1 else None
    config = GPTConfig(n_layer=args.layers, n_head=shape.n_head, dim=shape.dim, mlp_hidden_dim=shape.hidden_dim,
                       block_size=shape.seq_len, moe_every=0)
    torch.manual_seed(0)
    stack = TPStack([TPBlock.from_dense(Block(config, moe=False, group=None).to(ctx.device, torch.bfloat16),
                                        shape.n_head, group) for _ in range(args.layers)], group)
    rope = rotary_tables(shape.seq_len, config.head_dim, config.rope_theta, ctx.device)
    x = torch.randn(args.batch_size, shape.seq_len, shape.dim, device=ctx.device, dtype=torch.bfloat16)
    for mode in args.modes.split(","):
        schedule = make_schedule(mode, args.p1)

        def step():
            x_in = x.detach().requires_grad_()
            stack(x_in, rope, schedule=schedule).backward(torch.ones_like(x))
            stack.zero_grad(set_to_none=True)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - start) / 3 * 1e3
        if ctx.rank == 0:
            events = prof.key_averages()
            gpu_ms = sum(e.self_device_time_total for e in events) / 3 / 1e3
            print(f"\n== {mode} (p1 {args.p1}): wall {wall_ms:.2f} ms per step, GPU kernel time {gpu_ms:.2f} ms")
            print(events.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
