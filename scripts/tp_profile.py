"""Where a tensor-parallel step's time goes, per schedule: torch.profiler's kernel table (GPU
time by kernel, top 15), the kernel time by kind (GEMMs, attention, NCCL, copies, the rest) and
the step's wall time, for `weft bench tp`'s stack. A mode with `+graph` replays its forward and
backward as one CUDA graph (as `weft bench tp` does); the profiler still sees every kernel of a
replay, so an overlapped GEMM that runs slower beside an all-reduce shows up here. One process
per GPU under torchrun, or one GPU alone:

    torchrun --nproc_per_node=2 scripts/tp_profile.py --config gpt3-2.7b --modes none+graph,domino+graph,no-comm+graph

(`domino-copy` is Domino with its all-reduces copied through peer memory: kind `peer`.)
"""
from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from weft.bench.tp import GRAPH_SUFFIX, SHAPES
from weft.distributed import init_distributed
from weft.graphs import GraphedStep
from weft.models.gpt import Block, GPTConfig, rotary_tables
from weft.tp import TPBlock, TPStack, make_schedule
from weft.tp import schedule as schedule_module

KINDS = (("nccl", re.compile(r"nccl", re.I)), ("peer", re.compile(r"memcpy ptop|symmetric_memory", re.I)),
         ("attention", re.compile(r"flash|fmha|attention", re.I)),
         ("gemm", re.compile(r"gemm|cutlass|nvjet|xmma|sm90_|sm80_", re.I)),
         ("copy", re.compile(r"copy|cat|memcpy|memset", re.I)))


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="gpt3-2.7b", choices=list(SHAPES))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--p1", type=int, default=2)
    parser.add_argument("--p2", type=int, default=1)
    parser.add_argument("--modes", default="none,domino")
    parser.add_argument("--carveout", type=int, default=None,
                        help="SMs cuBLASLt's matmuls leave free (torch._C._set_sm_carveout_experimental), e.g. for "
                             "NCCL's kernels beside them; with --blas cublaslt for every matmul")
    parser.add_argument("--blas", default=None, choices=["cublas", "cublaslt"],
                        help="torch.backends.cuda.preferred_blas_library")
    parser.add_argument("--timed", type=int, default=20, help="steps timed without the profiler, per mode")
    parser.add_argument("--split-only", action="store_true",
                        help="Domino's schedule with its all-reduces left out: what the split costs without the "
                             "communication beside it (not the model's function)")
    parser.add_argument("--trace", default=None,
                        help="a folder for rank 0's chrome trace of each mode's profiled steps")
    args = parser.parse_args()
    if args.split_only:  # every Domino reduce (NCCL's or the copies) made a no-op
        for name in schedule_module.REDUCES:
            schedule_module.REDUCES[name] = lambda t, group, async_op=False: None
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    if args.carveout is not None:
        torch._C._set_sm_carveout_experimental(args.carveout)
    ctx = init_distributed()
    shape = SHAPES[args.config]
    seq = args.seq_len or shape.seq_len
    group = dist.group.WORLD if ctx.world_size > 1 else None
    config = GPTConfig(n_layer=args.layers, n_head=shape.n_head, dim=shape.dim, mlp_hidden_dim=shape.hidden_dim,
                       block_size=seq, moe_every=0)
    torch.manual_seed(0)
    stack = TPStack([TPBlock.from_dense(Block(config, moe=False, group=None).to(ctx.device, torch.bfloat16),
                                        shape.n_head, group) for _ in range(args.layers)], group)
    rope = rotary_tables(seq, config.head_dim, config.rope_theta, ctx.device)
    x = torch.randn(args.batch_size, seq, shape.dim, device=ctx.device, dtype=torch.bfloat16)
    reference = None  # the first mode's input gradient
    for mode in args.modes.split(","):
        schedule = make_schedule(mode.removesuffix(GRAPH_SUFFIX), args.p1, args.p2)

        def fwd_bwd(x_in: torch.Tensor, schedule=schedule) -> torch.Tensor:
            stack(x_in, rope, schedule=schedule).backward(torch.ones_like(x))
            return x_in.grad

        if mode.endswith(GRAPH_SUFFIX):
            graphed = GraphedStep(fwd_bwd, [x.detach().requires_grad_()], grads_of=list(stack.parameters()),
                                  accumulate=False)

            def step(graphed=graphed):
                graphed(x)
        else:
            def step(fwd_bwd=fwd_bwd):
                fwd_bwd(x.detach().requires_grad_())
                stack.zero_grad(set_to_none=True)

        for _ in range(3):
            step()
        check = fwd_bwd(x.detach().requires_grad_()).clone()  # this mode's input gradient, eagerly
        stack.zero_grad(set_to_none=True)
        reference = check if reference is None else reference
        error = float((check.float() - reference.float()).abs().max())
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.timed):
            step()
        torch.cuda.synchronize()
        timed_ms = (time.perf_counter() - start) / args.timed * 1e3
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - start) / 3 * 1e3
        if ctx.rank == 0 and args.trace:
            Path(args.trace).mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(Path(args.trace) / f"{mode.replace('+', '_')}.json"))
        if ctx.rank == 0:
            events = prof.key_averages()
            kernels = [e for e in events if e.self_device_time_total > 0 and e.device_type.name == "CUDA"]
            by_kind: dict[str, float] = {}
            for e in kernels:
                by_kind[kind_of(e.key)] = by_kind.get(kind_of(e.key), 0.0) + e.self_device_time_total / 3 / 1e3
            gpu_ms = sum(by_kind.values())
            print(f"\n== {mode} (p1 {args.p1}, p2 {args.p2}, carveout {args.carveout}, blas {args.blas}"
                  f"{', split only' if args.split_only else ''}): "
                  f"{timed_ms:.3f} ms per step ({args.timed} steps), max error vs the first mode {error:.1e}, "
                  f"profiled {wall_ms:.2f} ms, GPU kernel time "
                  f"{gpu_ms:.2f} ms (" + ", ".join(f"{k} {v:.2f}" for k, v in sorted(by_kind.items())) + ")")
            print(events.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
