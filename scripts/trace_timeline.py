"""Print Chrome traces' GPU kernels as a timeline per stream (`weft.bench.trace.stream_timeline`).

    python3 scripts/trace_timeline.py TRACE.json [...]

For `weft bench layer --profile-steps 1 --trace DIR` (one file per mode and rank): per stream,
its busy milliseconds; then each run of kernels on one stream (gaps under 30 us merged, NCCL
kernels apart from the rest) with its start, length, busy time, kernel count, its longest
kernel's name and, for NCCL kernels, their grid (the SMs they hold). This is how the pipelined
fixed-size exchange's overlap was read (docs/benchmarks.md, tenth session).
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict

from weft.bench.trace import stream_timeline


def timeline(path: str) -> list[str]:
    runs = stream_timeline(json.load(open(path)))
    if not runs:
        return [f"== {path}: no kernels"]
    t0, t1 = runs[0].start, max(r.end for r in runs)
    busy: dict = defaultdict(float)
    for r in runs:
        busy[r.stream] += r.busy
    lines = [f"== {path}: {sum(r.count for r in runs)} kernels, span {(t1 - t0) / 1e3:.2f} ms",
             "  busy per stream (ms): " + ", ".join(f"{s}: {v / 1e3:.2f}" for s, v in busy.items())]
    for r in runs:
        if r.end - r.start < 40 and r.count < 3:
            continue  # a stray small kernel
        grid = r.grid if r.comm and r.grid else ""
        lines.append(f"  s{r.stream!s:>4} {(r.start - t0) / 1e3:8.3f} +{(r.end - r.start) / 1e3:7.3f} ms "
                     f"busy {r.busy / 1e3:6.3f} n{r.count:4d}  {r.name[:60]} {grid}")
    return lines


if __name__ == "__main__":
    for trace in sys.argv[1:]:
        print("\n".join(timeline(trace)))
