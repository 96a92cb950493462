"""Lancet's forward partition planner (Lancet sections 3, 5.1, 5.3), on profiled cost tables.

The forward pass is a sequence of units: `ComputeUnit`s and `MoEUnit`s, each with its time per
partition for every number of partitions k that was profiled. A range of consecutive units that
holds one MoE unit may be cut into k partitions along the batch and run as a
computation-communication pipeline (Lancet fig. 9); `simulate` predicts its time P. `plan` picks
the ranges and k's with the dynamic programme of Lancet 5.1:

    T(n) = min over i <= n of T(i-1) + min over k of P(i..n, k)

    units = [ComputeUnit("attn", {1: 2e-3, 2: 1.1e-3}),
             MoEUnit("moe", gate={1: ...}, dispatch={...}, experts={...}, combine={...},
                     partition_before=True),
             ComputeUnit("attn2", {1: 2e-3, 2: 1.1e-3})]
    print(plan(units, max_partitions=4).summary())
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

__all__ = [
    "ComputeUnit", "Interval", "MoEUnit", "Plan", "Segment", "Unit",
    "chunked_exchange", "overlap_seconds", "plan", "serial_time", "simulate", "simulate_timeline",
]

FORMAT = "weft.overlap_plan/1"
COMPUTE, COMM = "compute", "comm"


def _check_times(owner: str, what: str, times: Mapping[int, float]) -> None:
    if not times:
        raise ValueError(f"{owner}: {what} has no times; give at least k=1 (the whole batch)")
    for k, t in times.items():
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"{owner}: {what} keys are partition counts k >= 1, got {k!r}")
        if not (math.isfinite(t) and t >= 0):
            raise ValueError(f"{owner}: {what}[{k}] must be a finite time >= 0 seconds, got {t!r}")


@dataclass(frozen=True)
class ComputeUnit:
    """A group of computation ops; `time[k]` is the seconds of ONE of k partitions."""

    name: str
    time: Mapping[int, float]

    def __post_init__(self) -> None:
        _check_times(self.name, "time", self.time)

    def ks(self) -> set[int]:
        return set(self.time)


@dataclass(frozen=True)
class MoEUnit:
    """An MoE layer split into its four pipeline stages; each maps k to seconds per partition."""

    name: str
    gate: Mapping[int, float]      # router + routing + building the send buffer (compute)
    dispatch: Mapping[int, float]  # dispatch all-to-all (communication)
    experts: Mapping[int, float]   # expert FFN (compute)
    combine: Mapping[int, float]   # combine all-to-all (communication)
    partition_before: bool         # False for batch-dependent gates (bpr): no pre ops in the pipeline

    def __post_init__(self) -> None:
        for what in ("gate", "dispatch", "experts", "combine"):
            _check_times(self.name, what, getattr(self, what))

    def ks(self) -> set[int]:
        return set(self.gate) & set(self.dispatch) & set(self.experts) & set(self.combine)


Unit = ComputeUnit | MoEUnit


def serial_time(unit: Unit) -> float:
    """Seconds of the unit on the whole batch (k=1), every stage one after another."""
    if 1 not in unit.ks():
        raise ValueError(f"unit {unit.name!r} has no k=1 time; the unpartitioned time is the baseline")
    if isinstance(unit, ComputeUnit):
        return unit.time[1]
    return unit.gate[1] + unit.dispatch[1] + unit.experts[1] + unit.combine[1]


@dataclass(frozen=True)
class Interval:
    """One instruction of the simulated pipeline, in seconds from the pipeline start."""

    stream: str     # "compute" or "comm"
    stage: str      # "pre", "dispatch", "experts", "combine", "post"; "serial" for a range without MoE
    partition: int
    start: float
    end: float


def _invalid(units: Sequence[Unit], k: int) -> str | None:
    """Why the range cannot run as k partitions, or None if it can (Lancet 5.1: then P = inf)."""
    if not units:
        return "the range is empty"
    if not isinstance(k, int) or k < 1:
        return f"the number of partitions must be an int >= 1, got {k!r}"
    moes = [i for i, u in enumerate(units) if isinstance(u, MoEUnit)]
    if len(moes) > 1:
        names = ", ".join(units[i].name for i in moes)
        return f"a pipeline holds exactly one MoE unit, the range has {len(moes)} ({names})"
    if not moes and k > 1:
        return f"a range without an MoE unit has no communication to overlap; k must be 1, got {k}"
    if moes and moes[0] > 0 and not units[moes[0]].partition_before:
        return (f"MoE unit {units[moes[0]].name!r} has partition_before=False (batch-dependent gate), "
                f"so the ops before it ({units[0].name!r}...) cannot join its pipeline")
    missing = [u.name for u in units if k not in u.ks()]
    if missing:
        return f"no time profiled for k={k} for unit(s) {', '.join(missing)}"
    return None


def simulate_timeline(units: Sequence[Unit], k: int) -> list[Interval]:
    """Every instruction of the range cut into k partitions, scheduled as in Lancet fig. 9."""
    reason = _invalid(units, k)
    if reason:
        raise ValueError(reason)
    moes = [i for i, u in enumerate(units) if isinstance(u, MoEUnit)]
    if not moes:
        return [Interval(COMPUTE, "serial", 0, 0.0, sum(u.time[1] for u in units))]
    m = moes[0]
    moe = units[m]
    stages = [
        (COMPUTE, "pre", sum(u.time[k] for u in units[:m]) + moe.gate[k]),
        (COMM, "dispatch", moe.dispatch[k]),
        (COMPUTE, "experts", moe.experts[k]),
        (COMM, "combine", moe.combine[k]),
        (COMPUTE, "post", sum(u.time[k] for u in units[m + 1:])),
    ]
    # Lancet 5.3: start = max(end of what it depends on, end of the previous instruction on its
    # stream). Issuing stage by stage, partition by partition, is the order both streams use.
    stage_end = [0.0] * k
    stream_end = {COMPUTE: 0.0, COMM: 0.0}
    timeline = []
    for stream, stage, seconds in stages:
        for p in range(k):
            start = max(stage_end[p], stream_end[stream])
            stage_end[p] = stream_end[stream] = start + seconds
            timeline.append(Interval(stream, stage, p, start, start + seconds))
    return timeline


def overlap_seconds(timeline: Sequence[Interval]) -> float:
    """Seconds during which a computation and a communication instruction of `timeline` run at
    once (each stream's instructions follow one another, so pairs across the streams add up)."""
    compute = [iv for iv in timeline if iv.stream == COMPUTE]
    comm = [iv for iv in timeline if iv.stream == COMM]
    return sum(max(0.0, min(a.end, b.end) - max(a.start, b.start)) for a in compute for b in comm)


def simulate(units: Sequence[Unit], k: int, efficiency: float = 1.0) -> float:
    """P: seconds of the range cut into k partitions and pipelined: the end of the last
    instruction, plus (1 - efficiency) of the time computation and communication overlap.
    `efficiency` (η, measured: `weft.overlap.profile.measure_overlap_efficiency`) is the share of
    an overlap that is saved; Lancet's timeline takes it as 1 (the two streams run side by side for
    free), while on GPUs an all-to-all slows the computation beside it (and is slowed by it)."""
    if not 0.0 <= efficiency <= 1.0:
        raise ValueError(f"efficiency must be in [0, 1], got {efficiency!r}")
    timeline = simulate_timeline(units, k)
    end = max(iv.end for iv in timeline)
    return end if efficiency == 1.0 else end + (1.0 - efficiency) * overlap_seconds(timeline)


def chunked_exchange(send: float, compute: float, receive: float, degree: int, tail: float = 0.0,
                     efficiency: float = 1.0) -> float:
    """Seconds of Tutel's pipelined exchange (Tutel sec. 3.2; `weft.moe.pipeline.PipelinedExchange`)
    cut into `degree` chunks, each chunk's `send` all-to-all, `compute` and `receive` all-to-all
    given in seconds: every send is issued first, chunk i's compute waits for its send and its
    receive for its compute (the order `simulate_timeline` gives a one-unit range, as Lancet's
    fig. 9 pipeline with nothing before or after the MoE stages). `tail`: computation that follows
    the last chunk's compute beside the receives still in flight (the backward's weight
    gradients, one matmul per weight over every chunk). As in `simulate`, (1 - efficiency) of the
    time computation and communication overlap is added back.

    Forward: send = dispatch, compute = the experts, receive = combine. Backward: send = the
    combine's gradient, compute = the experts' input gradient, receive = the dispatch's
    gradient, tail = the weight gradients."""
    if not 0.0 <= efficiency <= 1.0:
        raise ValueError(f"efficiency must be in [0, 1], got {efficiency!r}")
    if not (math.isfinite(tail) and tail >= 0):
        raise ValueError(f"tail must be a finite time >= 0 seconds, got {tail!r}")
    chain = MoEUnit("chunks", {degree: 0.0}, {degree: send}, {degree: compute}, {degree: receive}, True)
    timeline = [iv for iv in simulate_timeline([chain], degree) if iv.stage in ("dispatch", "experts", "combine")]
    compute_end = max(iv.end for iv in timeline if iv.stage == "experts")
    timeline.append(Interval(COMPUTE, "tail", degree - 1, compute_end, compute_end + tail))
    end = max(iv.end for iv in timeline)
    return end + (1.0 - efficiency) * overlap_seconds(timeline)


@dataclass
class Segment:
    """A range of the plan: units start..end (inclusive, original indices) run as k partitions."""

    start: int
    end: int
    partitions: int
    moe: int | None   # index of its MoE unit
    time: float       # simulated P
    serial: float     # the same units unpartitioned (k=1), for comparison


@dataclass
class Plan:
    """The ranges covering the forward pass in order, and the predicted forward time T(N)."""

    segments: list[Segment]
    predicted: float
    unpartitioned: float
    names: list[str] = field(default_factory=list)

    def pipelines(self) -> list[Segment]:
        return [s for s in self.segments if s.partitions > 1 or s.moe is not None]

    def summary(self, names: Sequence[str] | None = None) -> str:
        """A table with one row per MoE unit, then predicted vs unpartitioned time."""
        names = list(names if names is not None else self.names)

        def name(i: int) -> str:
            return names[i] if i < len(names) else f"#{i}"

        rows = [("MoE unit", "range", "k", "P ms", "serial ms")]
        for s in self.pipelines():
            rows.append((name(s.moe) if s.moe is not None else "-", f"{name(s.start)}..{name(s.end)}",
                         str(s.partitions), f"{s.time * 1e3:.3f}", f"{s.serial * 1e3:.3f}"))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) if c < 2 else cell.rjust(w)
                           for c, (cell, w) in enumerate(zip(row, widths))) for row in rows]
        gain = 100.0 * (1.0 - self.predicted / self.unpartitioned) if self.unpartitioned > 0 else 0.0
        lines.append(f"predicted {self.predicted * 1e3:.3f} ms vs unpartitioned "
                     f"{self.unpartitioned * 1e3:.3f} ms: gain {gain:.1f}%")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"format": FORMAT, "segments": [asdict(s) for s in self.segments],
                "predicted": self.predicted, "unpartitioned": self.unpartitioned,
                "names": list(self.names)}

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        if d.get("format") != FORMAT:
            raise ValueError(f"not a weft overlap plan: format {d.get('format')!r}, expected {FORMAT!r}")
        return cls([Segment(**s) for s in d["segments"]], d["predicted"], d["unpartitioned"],
                   list(d.get("names", [])))


def _merge(members: Sequence[ComputeUnit]) -> ComputeUnit:
    if len(members) == 1:
        return members[0]
    ks = set.intersection(*(u.ks() for u in members))
    return ComputeUnit(f"{members[0].name}..{members[-1].name}",
                       {k: sum(u.time[k] for u in members) for k in sorted(ks)})


def _group(units: Sequence[Unit], group_time: float) -> tuple[list[Unit], list[int]]:
    """Lancet 5.1: merge consecutive compute units until their k=1 time reaches group_time, to
    shrink the DP. MoE units stay alone. Returns the groups and each group's first unit index."""
    groups: list[Unit] = []
    firsts: list[int] = []
    pending: list[ComputeUnit] = []

    def close() -> None:
        if pending:
            groups.append(_merge(pending))
            pending.clear()

    for i, u in enumerate(units):
        if isinstance(u, MoEUnit):
            close()
            firsts.append(i)
            groups.append(u)
            continue
        if not pending:
            firsts.append(i)
        pending.append(u)
        if sum(v.time[1] for v in pending) >= group_time:
            close()
    close()
    return groups, firsts


def _better(cand: tuple[float, int, int], best: tuple[float, int, int] | None) -> bool:
    """Lower time wins; on a tie (to rounding), fewer partitions, then the shorter range."""
    if best is None:
        return True
    tol = 1e-12 * max(1.0, abs(best[0]))
    if abs(cand[0] - best[0]) > tol:
        return cand[0] < best[0]
    return cand[1:] < best[1:]


def plan(
    units: Sequence[Unit],
    max_partitions: int = 8,
    max_range: int | None = None,
    group_time: float | None = None,
    efficiency: float = 1.0,
) -> Plan:
    """The fastest cover of `units` by ranges, each run as k <= max_partitions pipelined parts.

    `max_range` caps how many units (groups, when `group_time` is set: Lancet's G) a range spans.
    `group_time` (seconds) merges consecutive compute units first, which restricts the choices.
    `efficiency`: the share of an overlap of computation and communication that is saved
    (`simulate`; 1 in Lancet's model).
    Every unit must have its k=1 time: it is the baseline, and it keeps a plan always possible.
    """
    if not units:
        raise ValueError("plan needs at least one unit")
    if not isinstance(max_partitions, int) or max_partitions < 1:
        raise ValueError(f"max_partitions must be an int >= 1, got {max_partitions!r}")
    if max_range is not None and (not isinstance(max_range, int) or max_range < 1):
        raise ValueError(f"max_range must be None or an int >= 1, got {max_range!r}")
    if group_time is not None and not group_time > 0:
        raise ValueError(f"group_time must be None or > 0 seconds, got {group_time!r}")
    unpartitioned = sum(serial_time(u) for u in units)

    if group_time is None:
        items, firsts = list(units), list(range(len(units)))
    else:
        items, firsts = _group(units, group_time)
    bounds = firsts + [len(units)]   # item j covers original units bounds[j]..bounds[j+1]-1
    n_items = len(items)
    limit = n_items if max_range is None else max_range

    # Lancet 5.1: T(n) = min_i T(i-1) + min_k P(i..n, k); best[n] holds (T, k, length, P).
    T = [0.0] + [math.inf] * n_items
    choice: list[tuple[int, int, float] | None] = [None] * (n_items + 1)
    for n in range(1, n_items + 1):
        best: tuple[float, int, int] | None = None
        n_moe, moe_at = 0, -1
        for i in range(n, max(0, n - limit), -1):   # range = items i-1 .. n-1
            item = items[i - 1]
            if isinstance(item, MoEUnit):
                n_moe, moe_at = n_moe + 1, i - 1
            # Both conditions only get worse as the range grows to the left: stop.
            if n_moe > 1 or (n_moe == 1 and moe_at > i - 1 and not items[moe_at].partition_before):
                break
            rng = items[i - 1:n]
            for k in range(1, max_partitions + 1):
                if _invalid(rng, k):
                    continue
                p = simulate(rng, k, efficiency)
                cand = (T[i - 1] + p, k, n - i + 1)
                if _better(cand, best):
                    best, choice[n] = cand, (i, k, p)
        T[n] = best[0]   # k=1 alone is always valid for a single item, so best is set

    segments = []
    n = n_items
    while n > 0:
        i, k, p = choice[n]
        start, end = bounds[i - 1], bounds[n] - 1
        moe = next((j for j in range(start, end + 1) if isinstance(units[j], MoEUnit)), None)
        serial = sum(serial_time(u) for u in units[start:end + 1])
        segments.append(Segment(start, end, k, moe, p, serial))
        n = i - 1
    segments.reverse()
    return Plan(segments, T[n_items], unpartitioned, [u.name for u in units])
