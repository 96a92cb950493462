"""Print Chrome traces' GPU kernels as a timeline per stream (`weft.bench.trace.stream_timeline`).

    python3 scripts/trace_timeline.py [--exposed] TRACE.json [...]

For `weft bench layer --profile-steps 1 --trace DIR` (one file per mode and rank): per stream,
its busy milliseconds; then each run of kernels on one stream (gaps under 30 us merged, NCCL
kernels apart from the rest) with its start, length, busy time, kernel count, its longest
kernel's name and, for NCCL kernels, their grid (the SMs they hold); last, the stretches where no
communication kernel runs, with the compute in each. `--exposed`: instead, the stretches where
communication runs alone (`weft.bench.trace.comm_exposed`), with the computation kernels on
either side (`weft bench model --profile-steps 1 --trace DIR` writes a model's traces). This is
how the pipelined fixed-size exchange's overlap was read (docs/benchmarks.md, tenth session), and
how the pipelined layer's last exchange was found waiting behind a GEMM (thirtieth session).
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict

from weft.bench.trace import comm_exposed, comm_idle, stream_timeline


def timeline(path: str, runs: list) -> list[str]:
    """Per stream, its busy time, then its runs of kernels (`stream_timeline`'s `runs`)."""
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


def stretch_lines(stretches: list, t0: float, what: str, describe) -> list[str]:
    """A header with the stretches' total, then each stretch's start (from `t0`), length and
    `describe(stretch)`."""
    if not stretches:
        return []
    total = sum(s.end - s.start for s in stretches)
    return [f"  {what} for {total / 1e3:.2f} ms in {len(stretches)} stretches:"] + [
        f"    {(s.start - t0) / 1e3:8.3f} +{(s.end - s.start) / 1e3:7.3f} ms{describe(s)}" for s in stretches]


def idle_link(trace: dict, t0: float) -> list[str]:
    """The stretches where no communication kernel runs (`weft.bench.trace.comm_idle`, 50 us or
    more): in a link-bound step, where its time goes beside the exchanges."""
    return stretch_lines(comm_idle(trace), t0, "no communication",
                         lambda s: f", compute busy {s.compute / 1e3:6.3f} ms")


def exposed_link(trace: dict, t0: float) -> list[str]:
    """The stretches where communication runs and computation does not (`comm_exposed`, 5 us or
    more), each with the computation kernels just before and after it: where the exposed
    all-to-all time of a step sits."""
    return stretch_lines(comm_exposed(trace), t0, "communication alone",
                         lambda s: f"  after {s.before[:50]}  before {s.after[:50]}")


if __name__ == "__main__":
    exposed = "--exposed" in sys.argv[1:]
    for path in (a for a in sys.argv[1:] if a != "--exposed"):
        trace = json.load(open(path))
        runs = stream_timeline(trace)
        if exposed:  # only where the communication is exposed
            print("\n".join([f"== {path}"] + (exposed_link(trace, runs[0].start) if runs else [])))
            continue
        print("\n".join(timeline(path, runs) + (idle_link(trace, runs[0].start) if runs else [])))
