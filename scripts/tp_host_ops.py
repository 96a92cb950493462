"""The host's share of a tensor-parallel step, on the CPU: aten ops per forward + backward of 4
small dense blocks (weft.tp, one rank) and the step's time, per schedule. A GPU step whose host
time exceeds its kernels' is host-bound; the op count says how much host work each schedule adds.

    python scripts/tp_host_ops.py
"""
from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

from weft.models.gpt import Block, GPTConfig, rotary_tables
from weft.tp import TPBlock, TPStack, make_schedule


def main() -> None:
    torch.set_num_threads(1)
    config = GPTConfig(n_layer=4, n_head=4, dim=64, mlp_hidden_dim=256, block_size=32, moe_every=0)
    torch.manual_seed(0)
    stack = TPStack([TPBlock.from_dense(Block(config, moe=False, group=None), 4, None) for _ in range(4)], None)
    rope = rotary_tables(32, config.head_dim, config.rope_theta, torch.device("cpu"))
    x = torch.randn(4, 32, 64)
    for mode, p1 in (("none", 1), ("domino", 2)):
        schedule = make_schedule(mode, p1)

        def step():
            stack(x.detach().requires_grad_(), rope, schedule=schedule).backward(torch.ones_like(x))
            stack.zero_grad(set_to_none=True)

        for _ in range(5):
            step()
        start = time.perf_counter()
        for _ in range(50):
            step()
        ms = (time.perf_counter() - start) / 50 * 1e3
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        ops = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
        print(f"{mode} p1 {p1}: {ops} aten ops per step, {ms:.2f} ms per step")


if __name__ == "__main__":
    main()
