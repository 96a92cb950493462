"""Where a `weft train` step waits: profile a few steps of a real run and print the GPU's idle gaps
with what the host was doing in each.

Run under torchrun (one process per GPU; rank 0 reports), with `weft train`'s own flags:
    torchrun --standalone --nproc_per_node=1 scripts/profile_train.py --first-step 8 --num-steps 3 -- \
        --preset gpt2-l-moe --batch-size 8 --steps 12 --sample-tokens 0 --ckpt-interval 0 --out /tmp/run
Profiles the training steps [start, start + steps) whole (data, micro-steps, clipping,
optimizer, metrics: everything between one step's start and the next's), writes the Chrome trace
next to the run (trace.json) and prints: GPU window, busy and idle per step, the GPU time of the
largest kernel families, the same by what launched them (host op, weft stage, autograd node:
with --cuda-graphs off, since a graph replay's kernels have no launch of their own), and the
largest idle gaps with the innermost host op open across each.
A diagnostic script, not part of the package: it wraps `weft.train.loop._train_step`. The run
needs more than start + steps steps (the profiler stops at the start of the next one).
"""
from __future__ import annotations

import argparse
import json
import os
import re
from collections import Counter

import torch

from weft.bench.trace import Launch, launches, length, merge
from weft.cli import main as weft_main
from weft.train import loop


def _profiled_steps(start: int, steps: int, trace_path: str):
    """Wrap loop._train_step so calls [start, start + steps) run under the profiler; returns a
    function that says whether the trace was written (the run may end too early)."""
    inner, calls = loop._train_step, [0]
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    prof = torch.profiler.profile(activities=activities)

    def train_step(*args, **kwargs):
        if calls[0] == start:
            torch.cuda.synchronize()
            prof.start()
        if calls[0] == start + steps:
            torch.cuda.synchronize()
            prof.stop()
            prof.export_chrome_trace(trace_path)
        calls[0] += 1
        return inner(*args, **kwargs)

    def written() -> bool:
        if start <= calls[0] < start + steps:
            prof.stop()  # a profiler left running crashes the interpreter at exit
        return calls[0] > start + steps

    loop._train_step = train_step
    return written


def _short(kernel: str) -> str:
    """A kernel name without template arguments but with the functor that says what it computes."""
    functor = re.search(r"(\w+(?:Functor|_kernel_cuda|Kernel\w*))", kernel[kernel.find("<"):] if "<" in kernel else "")
    return re.sub(r"<.*", "", kernel)[:60] + (f" [{functor.group(1)}]" if functor else "")


def report(trace_path: str, steps: int, top: int = 12) -> None:
    trace = json.load(open(trace_path))
    events = trace["traceEvents"]
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "cuda_runtime", "python_function",
                                                                            "user_annotation")]
    busy = merge((e["ts"], e["ts"] + e["dur"]) for e in gpu)
    window = busy[-1][1] - busy[0][0]
    print(f"{steps} steps: GPU window {window / 1e3 / steps:.2f} ms/step, busy {length(busy) / 1e3 / steps:.2f}, "
          f"idle {(window - length(busy)) / 1e3 / steps:.2f}")
    launcher = launches(trace)
    unknown = Launch("-", "-", "-")
    kernels, sources = Counter(), Counter()
    for e in gpu:
        kernels[e["name"]] += e["dur"]
        launch = launcher.get(e.get("args", {}).get("correlation"), unknown)
        sources[launch.op, launch.stage, launch.node, _short(e["name"])[:40]] += e["dur"]
    print("largest kernels (ms/step; name shortened):")
    for name, us in kernels.most_common(top):
        print(f"  {us / 1e3 / steps:8.2f}  {_short(name)}")
    print("largest kernels by what launched them (ms/step; innermost host op | weft stage | autograd node | kernel;"
          " '-': none, or inside a CUDA graph replay: profile with --cuda-graphs off to attribute those):")
    for key, us in sources.most_common(2 * top):
        print(f"  {us / 1e3 / steps:8.2f}  " + " | ".join(part[:48] for part in key))
    gaps = sorted(((b[0] - a[1], a[1], b[0]) for a, b in zip(busy, busy[1:])), reverse=True)[:top]
    print("largest GPU idle gaps, with the innermost host op open across the gap:")
    for dur, lo, hi in gaps:
        mid = (lo + hi) / 2
        open_ops = [e for e in host if e["ts"] <= mid <= e["ts"] + e["dur"]]
        inner = min(open_ops, key=lambda e: e["dur"])["name"] if open_ops else "-"
        outer = [e["name"] for e in sorted(open_ops, key=lambda e: -e["dur"])][:3]
        print(f"  {dur / 1e3:7.2f} ms  inner {inner[:60]!r}  in {outer}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--first-step", type=int, default=8, help="first profiled step (after warm-up and capture)")
    parser.add_argument("--num-steps", type=int, default=3)
    parser.add_argument("--trace", default="trace.json")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then `weft train` flags")
    ns = parser.parse_args()
    train_args = [a for a in ns.train_args if a != "--"]
    rank = int(os.environ.get("RANK", "0"))
    trace = ns.trace if rank == 0 else f"{ns.trace}.rank{rank}"
    written = _profiled_steps(ns.first_step, ns.num_steps, trace)
    weft_main(["train", *train_args])
    if not written():
        raise SystemExit(f"profile_train: the run ended before step {ns.first_step + ns.num_steps + 1}; give `weft "
                         "train` more --steps")
    if rank == 0:
        report(ns.trace, ns.num_steps)
