"""Time decomposition of a profiled step (Lancet fig. 13): how much communication is hidden.

GPU kernels from a PyTorch profiler trace are split into communication (NCCL and other
collective kernels; copies between GPUs, "Memcpy PtoP" and the replica slots' link kernels
(`weft.kernels.replica`), and symmetric memory's device barrier, which carry and wait for the
peer-memory collectives of weft.tp's `copy_all_reduce_`) and
computation (everything else). With C the union of communication
intervals and K the union of computation intervals:
    overlapped = |C n K|, non-overlapped comm = |C| - overlapped,
    non-overlapped compute = |K| - overlapped, hidden share = overlapped / |C|.
"""
from __future__ import annotations

import bisect
import json
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

Interval = tuple[float, float]
COMM_KERNEL_MARKERS = ("nccl", "all_to_all", "alltoall", "allreduce", "all_reduce", "reduce_scatter", "allgather",
                       "memcpy ptop", "_link_kernel", "symmetric_memory::barrier")


@dataclass
class Decomposition:
    """Per-step milliseconds of each part, and the share of communication hidden under compute."""

    comm_ms: float
    compute_ms: float
    comm_only_ms: float
    overlap_ms: float
    compute_only_ms: float
    hidden_share: float | None  # None when there was no communication

    def to_dict(self) -> dict:
        return asdict(self)


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Union of intervals as sorted, disjoint intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def length(merged: list[Interval]) -> float:
    return sum(e - s for s, e in merged)


def overlap_length(a: list[Interval], b: list[Interval]) -> float:
    """|A n B| for two merged interval lists (two-pointer sweep)."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def decompose(comm: Iterable[Interval], compute: Iterable[Interval], steps: int = 1,
              unit_ms: float = 1e-3) -> Decomposition:
    """Decompose kernel intervals (in microseconds by default) into per-step milliseconds."""
    c, k = merge(comm), merge(compute)
    comm_t, comp_t, both = length(c), length(k), overlap_length(c, k)
    scale = unit_ms / max(steps, 1)
    return Decomposition(
        comm_ms=comm_t * scale,
        compute_ms=comp_t * scale,
        comm_only_ms=(comm_t - both) * scale,
        overlap_ms=both * scale,
        compute_only_ms=(comp_t - both) * scale,
        hidden_share=(both / comm_t) if comm_t > 0 else None,
    )


GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # a Chrome trace's GPU event categories


@dataclass(frozen=True)
class Launch:
    """What the host was running when it launched a kernel: the innermost op open around the
    launch call, the innermost `weft.*` stage range (`weft.profiling.stage`; "-" for none), and
    the innermost autograd node ("-" outside the backward)."""

    op: str
    stage: str
    node: str


def launches(trace: dict) -> dict[int, Launch]:
    """Correlation id of each kernel launch of an eager step's Chrome trace -> its `Launch` (the
    host ranges open on the launching thread at the launch call). A replayed CUDA graph's
    kernels have no launch of their own: profile the step eagerly to attribute them."""
    ranges_by_thread: dict[int, list[dict]] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation"):
            ranges_by_thread.setdefault(e["tid"], []).append(e)
    starts = {}
    for tid, ranges in ranges_by_thread.items():
        ranges.sort(key=lambda e: e["ts"])
        starts[tid] = [e["ts"] for e in ranges]
    found = {}
    for e in trace.get("traceEvents", []):
        if e.get("cat") != "cuda_runtime" or "correlation" not in e.get("args", {}):
            continue
        ranges, t = ranges_by_thread.get(e["tid"], []), e["ts"]
        i = bisect.bisect_right(starts.get(e["tid"], []), t)
        around = sorted((r for r in ranges[max(0, i - 400):i] if r["ts"] + r["dur"] >= t), key=lambda r: -r["dur"])
        if not around:
            continue
        names = [r["name"] for r in around]  # outermost first
        found[e["args"]["correlation"]] = Launch(names[-1], _innermost(names, lambda n: n.startswith("weft.")),
                                                 _innermost(names, lambda n: "Backward" in n))
    return found


def _innermost(names: list[str], picks: Callable[[str], bool]) -> str:
    """The last of `names` (outermost first) that `picks` takes, "-" if none."""
    return next((n for n in reversed(names) if picks(n)), "-")


def is_comm_kernel(name: str) -> bool:
    lowered = name.lower()
    return any(marker in lowered for marker in COMM_KERNEL_MARKERS)


def gpu_events(trace: dict) -> list[dict]:
    """The complete events of a Chrome trace that ran on the GPU: kernels, copies and memsets."""
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]


def kernel_intervals(trace: dict, picks: Callable[[dict], bool] | None = None,
                     ) -> tuple[list[Interval], list[Interval]]:
    """(communication, computation) GPU intervals of a Chrome trace exported by torch.profiler.
    `picks(event)` chooses the communication kernels to count (e.g. Pro-Prophet's Trans and Agg:
    `weft.bench.breakdown.transfer_intervals`; all by default); communication kernels it does not
    pick are in neither list."""
    comm, compute = [], []
    for event in gpu_events(trace):
        interval = (float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0.0)))
        if not is_comm_kernel(event.get("name", "")):
            compute.append(interval)
        elif picks is None or picks(event):
            comm.append(interval)
    return comm, compute


@dataclass
class KernelRun:
    """Kernels back to back on one stream (gaps under `stream_timeline`'s `gap_us`), all
    communication or all computation: start and end (us, trace time), busy us, the kernel count,
    and the longest kernel's length, name and grid (for NCCL, the blocks: SMs it holds)."""

    stream: int | None
    comm: bool
    start: float
    end: float
    busy: float = 0.0
    count: int = 0
    longest: float = -1.0
    name: str = ""
    grid: list | None = None

    def add(self, event: dict) -> None:
        start, dur = float(event["ts"]), float(event.get("dur", 0.0))
        self.end = max(self.end, start + dur)
        self.busy += dur
        self.count += 1
        if dur > self.longest:
            self.longest, self.name, self.grid = dur, event.get("name", ""), event.get("args", {}).get("grid")


def stream_timeline(trace: dict, gap_us: float = 30.0) -> list[KernelRun]:
    """The GPU kernels of a Chrome trace as runs per stream, in start order: how the streams'
    work interleaves (e.g. a pipelined exchange: which GEMMs ran beside which NCCL kernel, and
    how long each took there). `scripts/trace_timeline.py` prints them."""
    kernels = sorted(gpu_events(trace), key=lambda e: float(e["ts"]))
    runs: list[KernelRun] = []
    latest: dict[tuple, KernelRun] = {}  # (stream, comm) -> its latest run
    for event in kernels:
        start = float(event["ts"])
        key = (event.get("args", {}).get("stream"), is_comm_kernel(event.get("name", "")))
        run = latest.get(key)
        if run is None or start - run.end >= gap_us:
            run = latest[key] = KernelRun(key[0], key[1], start, start)
            runs.append(run)
        run.add(event)
    return runs


@dataclass
class CommIdle:
    """A stretch (us, trace time) of a profiled step where no communication kernel runs, and how
    much of it computation kernels fill: in a link-bound step (an exchange pipelined with the
    experts) these stretches, not the kernels, are what the step could still lose."""

    start: float
    end: float
    compute: float


def comm_idle(trace: dict, min_us: float = 50.0) -> list[CommIdle]:
    """The stretches of at least `min_us` between the first and the last GPU kernel of `trace`
    where no communication kernel runs (`is_comm_kernel`), in time order, with the computation in
    each: the routing before the first exchange, a gap between two exchanges, the tail after the
    last. Empty when there is no communication."""
    comm, compute = kernel_intervals(trace)
    if not comm:
        return []
    c, k = merge(comm), merge(compute)
    first = min(c[0][0], k[0][0]) if k else c[0][0]
    last = max(c[-1][1], k[-1][1]) if k else c[-1][1]
    edges = [first] + [t for interval in c for t in interval] + [last]
    gaps = [(a, b) for a, b in zip(edges[::2], edges[1::2]) if b - a >= min_us]
    return [CommIdle(a, b, overlap_length([(a, b)], k)) for a, b in gaps]


def _idle_and_together() -> None:
    """Every rank's GPU idle and every rank at the same point (a barrier where torch.distributed runs)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        if torch.cuda.is_available():
            torch.cuda.synchronize()


def profile_trace(step: Callable[[], None], steps: int = 5, trace_path: str | Path | None = None) -> dict:
    """Run `step` `steps` times under the torch profiler (CPU and, where present, CUDA activity) and
    return the Chrome trace as a dict (also written to `trace_path` when given).

    Under torch.distributed every rank must call it alike: the ranks meet at a barrier, with their
    GPUs idle, before the recorded steps (after one unrecorded warm-up step under the profiler),
    so the first collective does not time how much later one rank arrived from what it did before
    (e.g. writing the previous trace: an NCCL kernel's time includes its wait for the other ranks;
    a qwen2 layer's first all-gather read 40 ms without this)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule) as prof:
        step()
        _idle_and_together()
        prof.step()
        for _ in range(steps):
            step()
            prof.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(trace_path) if trace_path else Path(tmp) / "trace.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())


@dataclass
class CommExposed:
    """A stretch (us, trace time) where a communication kernel runs and no computation kernel
    does: exposed communication, `decompose`'s `comm_only` in pieces. `before` / `after`: the
    names of the computation kernels that ended last before it and started first after it (where
    in the step it sits: e.g. a pipelined exchange's first chunk after the router, or the
    backward's last exchange before the next layer's kernels)."""

    start: float
    end: float
    before: str
    after: str


def comm_exposed(trace: dict, min_us: float = 5.0) -> list[CommExposed]:
    """The stretches of at least `min_us` of `trace` where communication runs and computation
    does not, in time order (their sum over stretches of any length is `decompose`'s comm_only)."""
    comm, compute = kernel_intervals(trace)
    c, k = merge(comm), merge(compute)
    named = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e.get("name", ""))
                   for e in gpu_events(trace) if not is_comm_kernel(e.get("name", "")))
    stretches, j = [], 0
    for a, b in c:  # minus the computation intervals inside [a, b)
        while j < len(k) and k[j][1] <= a:
            j += 1
        t, i = a, j
        while i < len(k) and k[i][0] < b:
            if k[i][0] > t:
                stretches.append((t, k[i][0]))
            t = max(t, k[i][1])
            i += 1
        if t < b:
            stretches.append((t, b))
    by_end = sorted(named, key=lambda n: n[1])
    ends, starts = [n[1] for n in by_end], [n[0] for n in named]
    out = []
    for a, b in stretches:
        if b - a < min_us:
            continue
        before = bisect.bisect_right(ends, a + 1e-3) - 1  # the last to end by a
        after = bisect.bisect_left(starts, b - 1e-3)  # the first to start from b
        out.append(CommExposed(a, b, by_end[before][2] if before >= 0 else "",
                               named[after][2] if after < len(named) else ""))
    return out
