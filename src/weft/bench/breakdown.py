"""Where a step's GPU time goes, stage by stage, forward and backward, from the torch profiler.

Code marks its stages with `weft.profiling.stage` (the MoE layer: router, routing, dispatch,
all_to_all, experts, combine; the model: attention, mlp, head; the benchmarks: loss, optimizer).
From a Chrome trace of the profiled steps, every GPU kernel (and memcpy / memset) is attributed
through its launching op (`External id`) to the innermost stage range around that op; an op run
by the autograd engine inherits the stage of the forward op it differentiates (the two share a
`Sequence number`; of the forward ops carrying a number, the last one made the node), unless a
stage range opened inside the backward is closer. Communication
kernels (NCCL) form their own row, `comm`, whatever launched them.

Host (CPU) time per stage: in forward the time inside the stage's ranges without the stage
ranges nested in them; in backward the time of the autograd nodes that differentiate its ops.
Besides the per-stage kernel time: the GPU window (first kernel start to last kernel end), the
time some kernel ran in it (busy), the rest (idle: host launch gaps and synchronisations), the
host synchronisations (cudaStreamSynchronize & co) per step, and the time per kernel name (the
only split a CUDA graph's replay leaves: its kernels have no launching op, so all land in
"other"; a 385 us scan in the dedup layer's graph was found this way, docs/moe.md).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch.distributed as dist

from weft.bench.trace import (
    GPU_CATEGORIES,
    Interval,
    decompose,
    is_comm_kernel,
    kernel_intervals,
    length,
    merge,
    profile_trace,
)
from weft.moe.exchange.replicated import AGG_STAGE, TRANS_STAGE
from weft.profiling import PREFIX

BACKWARD_PREFIX = "autograd::engine::evaluate_function: "
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
# The rows' order in the table; stages not listed follow in name order.
STAGE_ORDER = ("embedding", "attention", "mlp", "norm", "router", "routing", "dispatch", "exchange", "all_to_all",
               "experts", "combine", TRANS_STAGE, AGG_STAGE, "comm", "head", "loss", "optimizer", "other")


@dataclass
class StageTime:
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    kernels: float = 0.0  # per step
    syncs: float = 0.0  # host synchronisations per step
    host_forward_ms: float = 0.0  # CPU time inside the stage's ranges, nested stages excluded
    host_backward_ms: float = 0.0  # CPU time of the autograd nodes of the stage's ops


@dataclass
class Breakdown:
    """Per-step GPU time by stage, and how busy the GPU was (milliseconds per step)."""

    stages: dict[str, StageTime] = field(default_factory=dict)
    window_ms: float = 0.0
    busy_ms: float = 0.0
    kernel_ms: float = 0.0  # sum over kernels (above busy where streams overlap)
    steps: int = 1
    by_kernel: dict[str, list[float]] = field(default_factory=dict)  # `kernel_label` -> [ms, count] per step

    @property
    def idle_ms(self) -> float:
        return self.window_ms - self.busy_ms

    def to_dict(self) -> dict:
        return {"stages": {name: asdict(s) for name, s in self.ordered()}, "window_ms": self.window_ms,
                "busy_ms": self.busy_ms, "idle_ms": self.idle_ms, "kernel_ms": self.kernel_ms, "steps": self.steps,
                "by_kernel": self.by_kernel}

    @classmethod
    def from_dict(cls, d: dict) -> Breakdown:
        stages = {name: StageTime(**s) for name, s in d["stages"].items()}
        return cls(stages, d["window_ms"], d["busy_ms"], d["kernel_ms"], d["steps"], dict(d.get("by_kernel", {})))

    def top_kernels(self, n: int) -> list[tuple[str, float, float]]:
        """The n kernel names with the most time: (name, ms per step, launches per step)."""
        ranked = sorted(self.by_kernel.items(), key=lambda item: -item[1][0])[:n]
        return [(name, ms, count) for name, (ms, count) in ranked]

    def ordered(self) -> list[tuple[str, StageTime]]:
        rank = {name: i for i, name in enumerate(STAGE_ORDER)}
        return sorted(self.stages.items(), key=lambda item: (rank.get(item[0], len(rank) - 1), item[0]))


@dataclass(frozen=True)
class _Range:
    start: float
    end: float
    stage: str | None  # a weft stage range; None for a backward op's range (see `seq`)
    seq: int | None = None
    owner: tuple[str, bool] = ("other", False)  # the (stage, backward) its host time counts for


def _op_contexts(events: list[dict]) -> tuple[dict[int, tuple[str, bool]], dict[tuple[str, bool], float]]:
    """External id of each CPU op -> (stage, ran in backward); and the host microseconds of each
    (stage, backward), each range's time without the ranges nested in it."""
    by_tid: dict[object, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation"):
            by_tid[e.get("tid")].append(e)
    for ops in by_tid.values():  # outer ranges before the ranges and ops they contain
        ops.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))))
    # Pass 1: forward ops' stages by sequence number. Pass 2: every op's context.
    seq_stage: dict[int, str] = {}
    contexts: dict[int, tuple[str, bool]] = {}
    host: dict[tuple[str, bool], float] = defaultdict(float)
    for pass_ in (1, 2):
        for ops in by_tid.values():
            stack: list[_Range] = []
            for e in ops:
                start, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
                while stack and stack[-1].end <= start:
                    stack.pop()
                name, args = e.get("name", ""), e.get("args", {})
                in_backward = any(r.stage is None for r in stack)
                stage = _innermost(stack, seq_stage)
                seq = args.get("Sequence number")
                if pass_ == 1 and seq is not None and not in_backward and stage is not None:
                    # the last forward op with this number made the node: an op records the number the
                    # next node will take, so ops before it that make none (an integer cumsum) carry it too
                    seq_stage[seq] = stage
                if pass_ == 2 and "External id" in args:
                    contexts[args["External id"]] = (stage or "other", in_backward or name.startswith(BACKWARD_PREFIX))
                if e.get("cat") == "user_annotation" and name.startswith(PREFIX):
                    pushed = _Range(start, end, name[len(PREFIX):], owner=(name[len(PREFIX):], in_backward))
                elif name.startswith(BACKWARD_PREFIX):
                    pushed = _Range(start, end, None, seq, owner=(seq_stage.get(seq, stage or "other"), True))
                else:
                    continue
                if pass_ == 2:
                    host[pushed.owner] += end - start
                    if stack:
                        host[stack[-1].owner] -= end - start
                stack.append(pushed)
    return contexts, host


def _innermost(stack: list[_Range], seq_stage: dict[int, str]) -> str | None:
    for r in reversed(stack):
        if r.stage is not None:
            return r.stage
        if r.seq is not None and r.seq in seq_stage:
            return seq_stage[r.seq]
    return None


def kernel_label(name: str, width: int = 72) -> str:
    """A GPU kernel's name for a table: its C++ namespaces and argument list dropped, template
    arguments kept (they tell scans over long from int), cut to `width` characters."""
    label = name.removeprefix("void ").replace("at::native::", "").replace("(anonymous namespace)::", "")
    depth = 0
    for i, ch in enumerate(label):
        depth += {"<": 1, ">": -1}.get(ch, 0)
        if ch == "(" and depth == 0 and i > 0:
            label = label[:i]
            break
    return label if len(label) <= width else label[:width - 3] + "..."


def breakdown(trace: dict, steps: int = 1) -> Breakdown:
    """Per-step stage times of a Chrome trace exported by torch.profiler (`steps` steps in it)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    contexts, host = _op_contexts(events)
    result = Breakdown(steps=steps)
    scale = 1e-3 / max(steps, 1)  # trace microseconds -> milliseconds per step
    for (stage, backward), micros in host.items():
        row = result.stages.setdefault(stage, StageTime())
        if backward:
            row.host_backward_ms += micros * scale
        else:
            row.host_forward_ms += micros * scale
    intervals = []
    for e in events:
        cat, args = e.get("cat"), e.get("args", {})
        stage, backward = contexts.get(args.get("External id"), ("other", False))
        if cat == "cuda_runtime" and e.get("name") in SYNC_CALLS:
            result.stages.setdefault(stage, StageTime()).syncs += 1 / max(steps, 1)
        if cat not in GPU_CATEGORIES:
            continue
        start, dur = float(e["ts"]), float(e.get("dur", 0.0))
        intervals.append((start, start + dur))
        if is_comm_kernel(e.get("name", "")):
            stage = "comm"
        row = result.stages.setdefault(stage, StageTime())
        if backward:
            row.backward_ms += dur * scale
        else:
            row.forward_ms += dur * scale
        row.kernels += 1 / max(steps, 1)
        result.kernel_ms += dur * scale
        per_name = result.by_kernel.setdefault(kernel_label(e.get("name", "")), [0.0, 0.0])
        per_name[0] += dur * scale
        per_name[1] += 1 / max(steps, 1)
    if intervals:
        busy = merge(intervals)
        result.busy_ms = length(busy) * scale
        result.window_ms = (busy[-1][1] - busy[0][0]) * scale
    return result


def format_breakdown(b: Breakdown, title: str, top: int = 8) -> str:
    """The table `weft bench layer --breakdown` prints, then the `top` kernels by time."""
    lines = [f"{title}: GPU window {b.window_ms:.3f} ms/step, busy {b.busy_ms:.3f}, idle {b.idle_ms:.3f} "
             f"(host gaps and syncs), kernels {b.kernel_ms:.3f} ms summed",
             f"  {'stage':<12} {'fwd ms':>8} {'bwd ms':>8} {'share':>6} {'kernels':>8} {'syncs':>6} "
             f"{'host fwd':>9} {'host bwd':>9}"]
    total = max(b.kernel_ms, 1e-12)
    for name, s in b.ordered():
        share = (s.forward_ms + s.backward_ms) / total
        lines.append(f"  {name:<12} {s.forward_ms:>8.3f} {s.backward_ms:>8.3f} {share:>6.1%} {s.kernels:>8.1f} "
                     f"{s.syncs:>6.1f} {s.host_forward_ms:>9.3f} {s.host_backward_ms:>9.3f}")
    if top and b.by_kernel:
        lines.append(f"  {'kernel':<72} {'ms':>8} {'count':>6} {'share':>6}")
        for name, ms, count in b.top_kernels(top):
            lines.append(f"  {name:<72} {ms:>8.3f} {count:>6.1f} {ms / total:>6.1%}")
    return "\n".join(lines)



# the replica slots' moves between GPUs: the copy engine's, and the link kernels' (pulls and pushes)
PEER_COPY_MARKERS = ("memcpy ptop", "_link_kernel")


def transfer_intervals(trace: dict, peer_copies: bool = False) -> tuple[list[Interval], list[Interval]]:
    """`kernel_intervals` with Pro-Prophet's Trans and Agg as the communication: the collectives
    launched in their profiler stages (`weft.moe.exchange.replicated`), told by their launching op,
    not by name (the dropless layer's all-gather of the counts is an all-gather too); with
    `peer_copies`, the copies between GPUs, which on Comet's path are the replica slots' Trans and
    Agg and nothing else (`weft.moe.exchange.replica_slots`; a CUDA graph's replay carries no op to
    tell them by): the copy engine's ("Memcpy PtoP", where the placement was fixed at the capture)
    and the link kernels' (`weft.kernels.replica`, where the graph follows the placement)."""
    if peer_copies:
        return kernel_intervals(trace, lambda event: any(mark in event.get("name", "").lower()
                                                         for mark in PEER_COPY_MARKERS))
    contexts, _ = _op_contexts([e for e in trace.get("traceEvents", []) if e.get("ph") == "X"])

    def in_transfer(event: dict) -> bool:
        stage, _ = contexts.get(event.get("args", {}).get("External id"), ("other", False))
        return stage in (TRANS_STAGE, AGG_STAGE)

    return kernel_intervals(trace, in_transfer)


def profile_parts(step: Callable[[], None], steps: int, trace_path: str | Path | None = None,
                  with_breakdown: bool = False, slot_copies: bool = False) -> dict:
    """Profile `steps` runs of `step` once and return the benchmark row's parts: "decomposition"
    (communication hidden or exposed, `weft.bench.trace`), "transfer_decomposition" where the step
    ran Pro-Prophet's Trans and Agg (the same for their kernels alone: `transfer_intervals`, told
    as peer copies where `slot_copies`: the replica slots' path) and, when asked, "breakdown" (this
    rank's) with, where several ranks run, "windows_by_rank_ms": every rank's [GPU window, busy] ms
    a step (a collective then: call on every rank). A timed step is the slowest rank's from launch
    to end, where the breakdown reads rank 0's kernels: the other ranks' windows show whether one
    rank is longer."""
    trace = profile_trace(step, steps, trace_path)
    parts = {"decomposition": decompose(*kernel_intervals(trace), steps=steps).to_dict()}
    transfers, compute = transfer_intervals(trace, peer_copies=slot_copies)
    if transfers:
        parts["transfer_decomposition"] = decompose(transfers, compute, steps=steps).to_dict()
    if with_breakdown:
        parts["breakdown"] = breakdown(trace, steps).to_dict()
        if dist.is_initialized() and dist.get_world_size() > 1:
            windows = [None] * dist.get_world_size()
            dist.all_gather_object(windows, [parts["breakdown"]["window_ms"], parts["breakdown"]["busy_ms"]])
            parts["windows_by_rank_ms"] = windows
    return parts


def print_breakdowns(rows: list[dict], label: Callable[[dict], str]) -> None:
    """The breakdown table of every benchmark row that has one, titled `label(row)`."""
    for row in rows:
        if row.get("breakdown"):
            print(format_breakdown(Breakdown.from_dict(row["breakdown"]), f"\n{label(row)} (rank 0)"))
        if row.get("windows_by_rank_ms"):
            print("  GPU window by rank (busy), ms/step: " + ", ".join(
                f"rank {r} {window:.3f} ({busy:.3f})" for r, (window, busy) in enumerate(row["windows_by_rank_ms"])))


def comm_cells(row: dict) -> tuple[str, str, str]:
    """A benchmark row's communication ms, exposed ms and hidden share as table cells (empty
    without a profiled decomposition)."""
    d = row.get("decomposition") or {}
    if not d:
        return "", "", ""
    hidden = "" if d.get("hidden_share") is None else f"{d['hidden_share']:.0%}"
    return f"{d['comm_ms']:.3f}", f"{d['comm_only_ms']:.3f}", hidden
