"""Tutel's tuning dictionary (Tutel 3.3): per capacity bucket floor(C / R), the fastest of several
mathematically identical settings of the expert exchange (pipelining degree d, all-to-all
algorithm, parallelism r), measured the first times the bucket is seen and reused afterwards.

Every candidate computes the same outputs and gradients, so tuning changes only speed. The
measuring calls run in the same order on every rank (the capacity, and so the bucket, is the
same across the EP group). Measuring goes in rounds: all of a round's candidates are timed, then
the group's rank 0 decides from its own times what the next round measures (Tutel's ternary
search of r) or, after the last round, which setting wins, and broadcasts it, so all ranks always
run the same setting. Decisions can be persisted as JSON and reloaded.

Beside the exchange settings it keeps kernel parameters that change speed only, such as the
number of copy programs in Comet's layer0 kernel (Comet 3.2.2, adaptive workload assignment):
`pick` times each candidate the first time a key is seen, on this rank alone (no collective:
a kernel parameter may differ between ranks without changing what they compute), and reuses the
fastest afterwards.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from weft.distributed import group_rank, group_size
from weft.profiling import interleaved_samples, seconds_per_call, slowest_rank, time_candidates

DEGREES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Setting:
    overlap_degree: int
    a2a_algo: str
    parallel: int = 1  # Tutel's r: 1 expert parallel, 0 data parallel (weights gathered)
    comet: bool = False  # Comet's fused kernels exchange instead of the all-to-alls (d = 1, linear, r = 1)

    @property
    def name(self) -> str:
        return (f"d{self.overlap_degree}-{self.a2a_algo}" + ("" if self.parallel == 1 else f"-r{self.parallel}")
                + ("-comet" if self.comet else ""))

    def to_json(self) -> list:
        """As the tuning file keeps it ([d, algo, r], plus true for comet; files written before
        comet have three entries, which `Setting(*entry)` still reads)."""
        return [self.overlap_degree, self.a2a_algo, self.parallel] + ([True] if self.comet else [])


def next_round(rs: list[int], best_ms: dict[int, float]) -> list[int]:
    """Tutel's ternary search of r, replayed from scratch: the values of `rs` (ascending) to time
    next, given the fastest time so far of each r already timed (`best_ms`); [] when done.

    Up to 3 values are timed at once. Longer lists: rs[0] and rs[-1] first, then [lo, hi]
    (indices) narrows by its two third points, and what is left once hi - lo < 3 is timed whole.
    For a time unimodal in r's index, the fastest r is always among those timed.
    """
    lo, hi = 0, len(rs) - 1
    if hi - lo >= 3:
        ends = [r for r in (rs[lo], rs[hi]) if r not in best_ms]
        if ends:
            return ends
    while hi - lo >= 3:
        m1, m2 = lo + (hi - lo) // 3, hi - (hi - lo) // 3
        probes = [rs[i] for i in (m1, m2) if rs[i] not in best_ms]
        if probes:
            return probes
        if best_ms[rs[m1]] < best_ms[rs[m2]]:
            hi = m2 - 1  # a minimum at m2 or right of it would make f(m1) > f(m2)
        else:
            lo = m1 + 1  # a minimum at m1 or left of it would make f(m1) < f(m2)
    return [r for r in rs[lo:hi + 1] if r not in best_ms]


def first_round(candidates: list[Setting]) -> list[int]:
    """The r values whose settings are timed first: r = 0 if it is a candidate, and the ends of
    the search over the others (all of them when they are at most 3)."""
    zero = [0] if any(c.parallel == 0 for c in candidates) else []
    return zero + next_round(_searched(candidates), {})


def _searched(candidates: list[Setting]) -> list[int]:
    return sorted({c.parallel for c in candidates if c.parallel > 0})


class TuningDictionary:
    """Fastest setting per (layer shape, capacity bucket); optionally persisted at `path`."""

    def __init__(self, path: str | Path | None = None, bucket_size: int = 128, trials: int = 2):
        if bucket_size < 1 or trials < 1:
            raise ValueError(f"bucket_size ({bucket_size}) and trials ({trials}) must be positive")
        self.path = Path(path) if path else None
        self.bucket_size, self.trials = bucket_size, trials
        self.table: dict[str, dict[str, dict]] = {}
        self.kernels: dict[str, dict] = {}  # key -> {"times_ms": {candidate: [ms, ...]}, "best": candidate}
        self.measurements = 0  # candidate runs timed by this process (for tests and logs)
        self._pending: dict[tuple[Hashable, str, str], _Trial] = {}  # per caller: trials awaiting backward
        if self.path is not None and self.path.exists():
            self.table, self.kernels = _load(self.path)

    def bucket(self, capacity: int) -> int:
        return capacity // self.bucket_size

    def best(self, key: str, capacity: int) -> Setting | None:
        entry = self.table.get(key, {}).get(str(self.bucket(capacity)))
        return Setting(*entry["best"]) if entry and entry.get("best") else None

    def run(self, key: str, capacity: int, candidates: list[Setting], group: dist.ProcessGroup | None,
            execute: Callable[[Setting, torch.Tensor], torch.Tensor], buffer: torch.Tensor,
            caller: Hashable = None):
        """`execute(setting, buffer)` with the best setting for (`key`, `capacity`'s bucket), or with
        the next candidate while tuning. `key` names everything but the capacity that decides which
        setting is fastest; `group`'s rank 0 decides and broadcasts, so every rank of the group
        must make the same calls. `caller` tells apart the pending trials of several layers that
        share the dictionary (their forwards all run before any backward).

        A candidate's time is its forward plus, when autograd runs it, its backward: the exchange
        is bracketed by two marks whose backward hooks read the clock, so the choice weighs the
        backward all-to-alls and expert gradients too. A trial whose backward has not run by the
        next call of the same bucket counts its forward alone.
        """
        bucket = str(self.bucket(capacity))
        if len(candidates) == 1:
            return execute(candidates[0], buffer)
        entry = self.table.setdefault(key, {}).setdefault(bucket, {"times_ms": {}, "best": None})
        pending = self._pending.pop((caller, key, bucket), None)
        if pending is not None:
            pending.finish()
        times = entry["times_ms"]
        if not entry.get("best"):
            # The r values timed so far and now (files without this key start the search anew).
            searched = entry.setdefault("r_searched", first_round(candidates))
            active = [c for c in candidates if c.parallel in searched]
            if all(len(times.get(c.name, [])) >= self.trials for c in active):
                more, best = _next_step(candidates, active, times, group)
                if more:
                    entry["r_searched"] = sorted(searched + more)
                    active = [c for c in candidates if c.parallel in entry["r_searched"]]
                else:
                    entry["best"] = best.to_json()
                    if self.path is not None and group_rank(group) == 0:
                        self._save()
        if entry.get("best"):
            return execute(Setting(*entry["best"]), buffer)
        # Round robin, so warm-up effects and drifts hit every candidate alike.
        candidate = min(active, key=lambda c: len(times.get(c.name, [])))
        trial = _Trial(buffer.is_cuda, times.setdefault(candidate.name, []))
        if torch.is_grad_enabled():
            anchor = torch.zeros((), requires_grad=True)  # the end mark runs even if buffer needs no grad
            buffer = _Mark.apply(buffer, anchor, trial.stop)
        out = trial.forward(lambda: execute(candidate, buffer))
        self.measurements += 1
        if out.requires_grad:
            self._pending[(caller, key, bucket)] = trial
            return _Mark.apply(out, None, trial.start)
        trial.finish()
        return out

    def picked(self, key: str) -> int | None:
        """The choice `pick` made for `key`, or None (e.g. for a call that must not time anything,
        such as one captured into a CUDA graph)."""
        entry = self.kernels.get(key)
        return None if entry is None else entry["best"]

    def pick(self, key: str, candidates: Sequence[int], run: Callable[[int], object], device: torch.device,
             group: dist.ProcessGroup | None = None) -> int:
        """The fastest of `candidates` for `key`: on the first call `run(candidate)` runs once per
        candidate to warm up, then `trials` rounds time every candidate in turn (interleaved, so a
        drift of the clocks spreads over all of them), each time per call over back-to-back runs
        (`seconds_per_call`; so `run` must have no effect but its time); the fastest by its best
        round is kept (and saved by `group`'s rank 0 when the dictionary has a path); later
        calls, and dictionaries loaded from that file, return it without running."""
        entry = self.kernels.get(key)
        if entry is not None and entry["best"] in candidates:
            return entry["best"]
        if len(candidates) == 1:
            return candidates[0]
        samples = interleaved_samples(run, candidates, device, self.trials, warmup=1, timer=seconds_per_call)
        self.measurements += self.trials * len(candidates)
        times = {str(c): [t * 1e3 for t in ts] for c, ts in zip(candidates, samples)}
        best = min(candidates, key=lambda c: min(times[str(c)]))
        self.kernels[key] = {"times_ms": times, "best": best}
        if self.path is not None and group_rank(group) == 0:
            self._save()
        return best

    def _save(self) -> None:
        """Atomic: EP groups sharing the file cannot tear it."""
        _save(self.path, self.table, self.kernels)

    def chosen(self) -> list[str]:
        """The settings decided so far (one name per layer key and capacity bucket, e.g. "d2-linear")."""
        return [Setting(*entry["best"]).name for _, buckets in sorted(self.table.items())
                for _, entry in sorted(buckets.items(), key=lambda kv: int(kv[0])) if entry.get("best")]

    def summary(self) -> str:
        lines = []
        for key, buckets in sorted(self.table.items()):
            for bucket, entry in sorted(buckets.items(), key=lambda kv: int(kv[0])):
                times = ", ".join(f"{n} {min(v):.3f}" for n, v in entry["times_ms"].items())
                best = Setting(*entry["best"]).name if entry.get("best") else "(tuning)"
                lines.append(f"{key} capacity bucket {bucket}: best {best}; fastest ms: {times}")
        for key, entry in sorted(self.kernels.items()):
            times = ", ".join(f"{n} {min(v):.3f}" for n, v in entry["times_ms"].items())
            lines.append(f"{key}: best {entry['best']}; fastest ms: {times}")
        return "\n".join(lines)


class _Trial:
    """One timed run of a candidate: forward, then (if autograd reaches it) the backward between
    the two marks; autograd runs the exchange's nodes, created between the marks, after the
    output mark and before the input mark (reverse creation order)."""

    def __init__(self, cuda: bool, times: list[float]):
        self.cuda, self.times = cuda, times
        self.forward_ms, self.began, self.done = 0.0, None, False

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def forward(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        began = self._now()
        out = fn()
        self.forward_ms = (self._now() - began) * 1e3
        return out

    def start(self) -> None:
        self.began = self._now()

    def stop(self) -> None:
        if self.began is not None and not self.done:
            self.done = True
            self.times.append(self.forward_ms + (self._now() - self.began) * 1e3)

    def finish(self) -> None:
        """Record the forward alone, unless the backward was already recorded."""
        if not self.done:
            self.done = True
            self.times.append(self.forward_ms)


class _Mark(torch.autograd.Function):
    """Identity on x whose backward calls `hook` first."""

    @staticmethod
    def forward(ctx, x, anchor, hook):
        ctx.hook = hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.hook()
        return grad, None, None


def _next_step(candidates: list[Setting], active: list[Setting], times: dict[str, list[float]],
               group) -> tuple[list[int], Setting]:
    """After a round: the r values to time next ([] when done) and the fastest timed setting (best
    of its trials), both as rank 0 of the group sees them and broadcast, so all ranks agree (their
    times differ, and ranks running different candidates would hang in mismatched collectives)."""
    best_ms = {c: min(times[c.name]) for c in active}
    by_r: dict[int, float] = {}
    for c, ms in best_ms.items():
        by_r[c.parallel] = min(ms, by_r.get(c.parallel, ms))
    more = next_round(_searched(candidates), by_r)
    fastest = min(active, key=best_ms.__getitem__)
    plan = torch.tensor([candidates.index(fastest)] + [int(c.parallel in more) for c in candidates])
    if group_size(group) > 1:
        if dist.get_backend(group) == "nccl":
            plan = plan.cuda()
        dist.broadcast(plan, src=dist.get_global_rank(group, 0), group=group)
    plan = plan.tolist()
    return sorted({c.parallel for c, chosen in zip(candidates, plan[1:]) if chosen}), candidates[plan[0]]


def _save(path: Path, table: dict, kernels: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({"format": "weft.tuning/1", "table": table, "kernels": kernels}, f, indent=2)
    os.replace(tmp, path)


def _load(path: Path) -> tuple[dict, dict]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"tuning dictionary {path} is not readable JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != "weft.tuning/1" or not isinstance(doc.get("table"), dict):
        raise ValueError(f"tuning dictionary {path} is not a weft tuning file (format weft.tuning/1)")
    kernels = doc.get("kernels", {})  # files written before kernel parameters were kept have none
    if not isinstance(kernels, dict) or not all(isinstance(e, dict) and "best" in e for e in kernels.values()):
        raise ValueError(f"tuning dictionary {path}: its 'kernels' section is not a table of choices")
    return doc["table"], kernels


def run_until_tuned(step: Callable[[int], None], measurements: Callable[[], int], device: torch.device,
                    max_steps: int = 100) -> int:
    """Run `step(i)` until one adds no tuning measurement on any rank (all ranks stop together, as
    every step is a collective); returns the steps run. Tuning calls synchronise and try slow
    settings, so they must not fall into timed steps, nor into a CUDA graph's capture (which
    cannot time anything)."""
    for i in range(max_steps):
        before = measurements()
        step(i)
        if slowest_rank([float(measurements() - before)], device)[0] == 0:
            return i + 1
    raise RuntimeError(f"the tuning dictionaries were still measuring after {max_steps} steps")


def tuned_seconds(run: Callable[[], object], measurements: Callable[[], int], device: torch.device) -> float:
    """Wall seconds of `run()` as it runs once the tuning dictionaries have decided: run until they
    measure nothing more (`run_until_tuned`), then the slowest rank's median of 3 after one untimed
    (`weft.profiling.time_candidates`). What an eager step costs, to weigh against a graphed one."""
    run_until_tuned(lambda i: run(), measurements, device)
    return time_candidates(lambda _: run(), [None], device)[0]
