"""Two Chrome traces' GPU kernels side by side by name: where one mode's extra time goes.

    python3 scripts/trace_diff.py BASE.json OTHER.json [--top 25]

For `weft bench layer --profile-steps N --trace DIR` (one file per mode and rank), e.g. the plain
graph against the balanced one with nothing copied. Prints each trace's GPU span (first kernel's
start to last kernel's end), its busy time (the union of its kernels, all streams) and the kernels'
summed time; then per kernel name (cut to 70 characters) the summed ms and count in each and the
difference, largest difference first. Kernels only in OTHER are the ones to look at first.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

from weft.bench.trace import kernel_intervals, length, merge

CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def by_name(trace: dict) -> dict[str, tuple[float, int]]:
    """Summed microseconds and count of the trace's GPU events per (cut) name."""
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for event in trace.get("traceEvents", []):
        if event.get("ph") == "X" and event.get("cat") in CATEGORIES:
            entry = totals[event.get("name", "")[:70]]
            entry[0] += float(event.get("dur", 0.0))
            entry[1] += 1
    return {name: (us, count) for name, (us, count) in totals.items()}


def summary(path: str, trace: dict) -> str:
    comm, compute = kernel_intervals(trace)
    intervals = comm + compute
    if not intervals:
        return f"{path}: no GPU events"
    span = max(end for _, end in intervals) - min(start for start, _ in intervals)
    summed = sum(end - start for start, end in intervals)
    return (f"{path}: span {span / 1e3:.3f} ms, busy {length(merge(intervals)) / 1e3:.3f} ms, "
            f"summed {summed / 1e3:.3f} ms, {len(intervals)} events")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base")
    parser.add_argument("other")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    base, other = (json.load(open(p)) for p in (args.base, args.other))
    print(summary(args.base, base))
    print(summary(args.other, other))
    a, b = by_name(base), by_name(other)
    rows = sorted(((b.get(n, (0.0, 0))[0] - a.get(n, (0.0, 0))[0], n) for n in set(a) | set(b)),
                  key=lambda r: -abs(r[0]))
    print(f"  {'kernel':<70} {'base ms':>8} {'n':>5} {'other ms':>8} {'n':>5} {'diff ms':>8}")
    for diff, name in rows[:args.top]:
        (ua, na), (ub, nb) = a.get(name, (0.0, 0)), b.get(name, (0.0, 0))
        print(f"  {name:<70} {ua / 1e3:>8.3f} {na:>5} {ub / 1e3:>8.3f} {nb:>5} {diff / 1e3:>+8.3f}")
    print(f"  {'all':<70} {sum(v[0] for v in a.values()) / 1e3:>8.3f} {sum(v[1] for v in a.values()):>5} "
          f"{sum(v[0] for v in b.values()) / 1e3:>8.3f} {sum(v[1] for v in b.values()):>5}")


if __name__ == "__main__":
    main()
