"""Time Comet's row map built from counts on the GPU: the one-launch Triton kernel against its
PyTorch reference's ops, eagerly (host time per map) and replayed in a CUDA graph (GPU time).

    python3 scripts/comet_map_time.py [--experts 64] [--world 2] [--max-rows 32768] [--max-count 200]

Defaults: qwen2's layer on 2 ranks (64 experts, 32 per rank, top-4 of 4096 tokens: at most 32768
rows a rank can receive), random counts below 200 per (source, expert). Needs one CUDA GPU.
docs/benchmarks.md quotes it.
"""
from __future__ import annotations

import argparse
import time

import torch

import weft.kernels.comet as comet


def per_map_us(build, graphed: bool, repeats: int = 100) -> float:
    """Microseconds per map: `repeats` eager builds, or a graph of 20 builds replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            build()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if not graphed:
        start = time.perf_counter()
        for _ in range(repeats):
            build()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e6 / repeats
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            build()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats // 5):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6 / (repeats // 5 * 20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--max-rows", type=int, default=32768)
    parser.add_argument("--block-m", type=int, default=128)
    parser.add_argument("--max-count", type=int, default=200)
    args = parser.parse_args()
    counts = torch.randint(0, args.max_count, (args.world, args.experts), device="cuda")
    local = args.experts // args.world

    def build():
        return comet.RowMap.on_device(counts, 0, local, args.block_m, args.max_rows)

    rows = {}
    for name, usable in (("kernel", comet.triton_usable), ("reference ops", lambda x: False)):
        comet.triton_usable = usable
        rows[name] = (per_map_us(build, graphed=False), per_map_us(build, graphed=True))
    print(f"{'map built by':<14} {'eager us/map':>13} {'graphed us/map':>15}")
    for name, (eager, graphed) in rows.items():
        print(f"{name:<14} {eager:>13.1f} {graphed:>15.1f}")


if __name__ == "__main__":
    main()
