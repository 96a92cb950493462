"""Which blocks are live at the peak of one `weft bench layer` run, grouped by their weft frames.

Runs `weft bench layer` in this process under `torch.cuda.memory._record_memory_history`, replays
the allocator's trace to its highest point and prints the live blocks there, summed by the first
three weft frames that allocated them (blocks autograd allocates in C++ show as "?"). One GPU.
    torchrun --standalone --nproc_per_node=1 scripts/peak_blocks.py --top 22 -- \
        --config qwen2 --modes comet+graph --baseline comet+graph --capacity 1.0 --activation swiglu
"""
from __future__ import annotations

import argparse
import collections
import runpy
import sys

import torch


def live_at_peak(events: list[dict]) -> tuple[int, int, list[dict]]:
    """(peak bytes, index of the event that reached it, the blocks live there) of an allocator trace."""
    live, total, peak, peak_i = {}, 0, 0, -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
        if total > peak:
            peak, peak_i = total, i
    live = {}
    for e in events[:peak_i + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    return peak, peak_i, list(live.values())


def weft_frames(block: dict, depth: int = 3) -> str:
    frames = [f for f in block.get("frames", []) if "weft" in f["filename"]]
    return " < ".join(f"{f['filename'].split('weft/')[-1]}:{f['line']}:{f['name']}" for f in frames[:depth]) or "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=20, help="groups to print")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: `weft bench layer`'s arguments")
    args = parser.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    sys.argv = ["weft", "bench", "layer", *bench_args]
    try:
        runpy.run_module("weft", run_name="__main__")
    except SystemExit as e:
        if e.code:
            raise
    events = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    peak, peak_i, live = live_at_peak(events)
    groups = collections.defaultdict(lambda: [0, 0])
    for block in live:
        group = groups[weft_frames(block)]
        group[0] += block["size"]
        group[1] += 1
    print(f"peak of the trace {peak / 2**20:.0f} MiB, at event {peak_i} of {len(events)}: {' '.join(bench_args)}")
    for where, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{size / 2**20:9.1f} MiB x{count:4d}  {where}")


if __name__ == "__main__":
    main()
