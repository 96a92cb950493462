"""Print a Chrome trace's GPU kernels as a timeline per stream, consecutive kernels merged.

    python3 scripts/trace_timeline.py TRACE.json [...]

For `weft bench layer --profile-steps 1 --trace DIR` (one file per mode and rank): per stream,
its busy milliseconds; then each run of kernels on one stream (gaps under 30 us merged, NCCL
kernels kept apart from the rest) with its start, length, busy time, kernel count, its longest
kernel's name and, for NCCL kernels, their grid (the SMs they hold). This is how the pipelined
fixed-size exchange's overlap was read (docs/benchmarks.md, tenth session).
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict

GAP_US = 30  # kernels closer than this on one stream belong to one run


def timeline(path: str) -> list[str]:
    events = json.load(open(path))["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy")), key=lambda e: e["ts"])
    if not kernels:
        return [f"== {path}: no kernels"]
    t0, t1 = kernels[0]["ts"], max(e["ts"] + e["dur"] for e in kernels)
    busy = defaultdict(float)
    for e in kernels:
        busy[e["args"].get("stream")] += e["dur"]
    lines = [f"== {path}: {len(kernels)} kernels, span {(t1 - t0) / 1e3:.2f} ms",
             "  busy per stream (ms): " + ", ".join(f"{s}: {v / 1e3:.2f}" for s, v in busy.items())]
    runs: list[dict] = []
    for e in kernels:
        key = (e["args"].get("stream"), "nccl" in e["name"].lower())
        run = next((r for r in reversed(runs[-6:]) if r["key"] == key and e["ts"] - r["end"] < GAP_US), None)
        if run is None:
            runs.append(dict(key=key, start=e["ts"], end=e["ts"] + e["dur"], n=1, busy=e["dur"], top=e))
            continue
        run["end"] = max(run["end"], e["ts"] + e["dur"])
        run["n"] += 1
        run["busy"] += e["dur"]
        if e["dur"] > run["top"]["dur"]:
            run["top"] = e
    for r in runs:
        if r["end"] - r["start"] < 40 and r["n"] < 3:
            continue  # a stray small kernel
        grid = r["top"]["args"].get("grid") if r["key"][1] else ""
        lines.append(f"  s{r['key'][0]:>4} {(r['start'] - t0) / 1e3:8.3f} +{(r['end'] - r['start']) / 1e3:7.3f} ms "
                     f"busy {r['busy'] / 1e3:6.3f} n{r['n']:4d}  {r['top']['name'][:60]} {grid or ''}")
    return lines


if __name__ == "__main__":
    for trace in sys.argv[1:]:
        print("\n".join(timeline(trace)))
