"""Tutel's tuning dictionary (Tutel 3.3): per capacity bucket floor(C / R), the fastest of several
mathematically identical settings of the expert exchange (pipelining degree d, all-to-all
algorithm), measured the first times the bucket is seen and reused afterwards.

Every candidate computes the same outputs and gradients, so tuning changes only speed. The
measuring calls run in the same order on every rank (the capacity, and so the bucket, is the
same across the EP group); the decision is taken on the group's rank 0 and broadcast, so all
ranks always run the same setting. Decisions can be persisted as JSON and reloaded.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from weft.distributed import group_rank, group_size

if TYPE_CHECKING:
    from weft.moe.layer import MoE

DEGREES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Setting:
    overlap_degree: int
    a2a_algo: str
    parallel: int = 1  # Tutel's r: 1 expert parallel, 0 data parallel (weights gathered)

    @property
    def name(self) -> str:
        return f"d{self.overlap_degree}-{self.a2a_algo}" + ("" if self.parallel == 1 else f"-r{self.parallel}")


def candidates_for(layer: MoE) -> list[Setting]:
    """The settings to try: every degree if `overlap_degree="auto"` (padded modes only), both
    all-to-all algorithms if `a2a_algo="auto"` and the group spans several nodes, and r = 0 as
    well as r = 1 for `parallel="adaptive"` layers whose call did not fix r. With fewer experts
    than ranks every r in `layer.parallel_choices()` is timed (Tutel ternary-searches r over
    [1, W / E]; W / E is small on one node, so trying each divisor is as cheap and exact)."""
    padded = layer.capacity_factor is not None
    if layer.parallel_r == 0:
        return [Setting(1, "linear", 0)]
    if layer.overlap_degree == "auto":
        degrees = DEGREES if padded else (1,)
    else:
        degrees = (layer.overlap_degree,)
    hierarchy = layer.groups_2dh
    several_nodes = padded and hierarchy is not None and hierarchy.num_nodes > 1
    algos = (["linear", "2dh"] if several_nodes else ["linear"]) if layer.a2a_algo == "auto" else [layer.a2a_algo]
    if layer.expert_shards > 1:  # fewer experts than ranks: no pipelined exchange, every r
        fixed = layer.parallel_r is not None
        choices = [layer.parallel_r] if fixed else [r for r in layer.parallel_choices() if r > 0]
        return [Setting(1, a, r) for r in choices for a in algos] + ([] if fixed else [Setting(1, "linear", 0)])
    # Each pipelined chunk can be exchanged either way, so every degree pairs with every algorithm.
    found = [Setting(d, a) for a in algos for d in degrees]
    if padded and layer.parallel == "adaptive" and layer.parallel_r is None and layer.ep_size > 1:
        found.append(Setting(1, "linear", 0))
    return found


class TuningDictionary:
    """Fastest setting per (layer shape, capacity bucket); optionally persisted at `path`."""

    def __init__(self, path: str | Path | None = None, bucket_size: int = 128, trials: int = 2):
        if bucket_size < 1 or trials < 1:
            raise ValueError(f"bucket_size ({bucket_size}) and trials ({trials}) must be positive")
        self.path = Path(path) if path else None
        self.bucket_size, self.trials = bucket_size, trials
        self.table: dict[str, dict[str, dict]] = {}
        self.measurements = 0  # candidate runs timed by this process (for tests and logs)
        self._pending: dict[tuple[int, str, str], _Trial] = {}  # per layer: trials awaiting backward
        if self.path is not None and self.path.exists():
            self.table = _load(self.path)

    def bucket(self, capacity: int) -> int:
        return capacity // self.bucket_size

    def best(self, key: str, capacity: int) -> Setting | None:
        entry = self.table.get(key, {}).get(str(self.bucket(capacity)))
        return Setting(*entry["best"]) if entry and entry.get("best") else None

    def run(self, layer: MoE, capacity: int, candidates: list[Setting],
            execute: Callable[[Setting, torch.Tensor], torch.Tensor], buffer: torch.Tensor):
        """`execute(setting, buffer)` with the best setting, or with the next candidate while tuning.

        A candidate's time is its forward plus, when autograd runs it, its backward: the exchange
        is bracketed by two marks whose backward hooks read the clock, so the choice weighs the
        backward all-to-alls and expert gradients too. A trial whose backward has not run by the
        next call of the same bucket counts its forward alone.
        """
        key, bucket = layer_key(layer), str(self.bucket(capacity))
        if len(candidates) == 1:
            return execute(candidates[0], buffer)
        entry = self.table.setdefault(key, {}).setdefault(bucket, {"times_ms": {}, "best": None})
        pending = self._pending.pop((id(layer), key, bucket), None)
        if pending is not None:
            pending.finish()
        times = entry["times_ms"]
        if not entry.get("best") and all(len(times.get(c.name, [])) >= self.trials for c in candidates):
            entry["best"] = list(_decide(candidates, times, layer.group).__dict__.values())
            if self.path is not None and group_rank(layer.group) == 0:
                _save(self.path, self.table)  # atomic: EP groups sharing the file cannot tear it
        if entry.get("best"):
            return execute(Setting(*entry["best"]), buffer)
        # Round robin, so warm-up effects and drifts hit every candidate alike.
        candidate = min(candidates, key=lambda c: len(times.get(c.name, [])))
        trial = _Trial(layer.experts.w1.is_cuda, times.setdefault(candidate.name, []))
        if torch.is_grad_enabled():
            anchor = torch.zeros((), requires_grad=True)  # the end mark runs even if buffer needs no grad
            buffer = _Mark.apply(buffer, anchor, trial.stop)
        out = trial.forward(lambda: execute(candidate, buffer))
        self.measurements += 1
        if out.requires_grad:
            self._pending[(id(layer), key, bucket)] = trial
            return _Mark.apply(out, None, trial.start)
        trial.finish()
        return out

    def summary(self) -> str:
        lines = []
        for key, buckets in sorted(self.table.items()):
            for bucket, entry in sorted(buckets.items(), key=lambda kv: int(kv[0])):
                times = ", ".join(f"{n} {min(v):.3f}" for n, v in entry["times_ms"].items())
                best = Setting(*entry["best"]).name if entry.get("best") else "(tuning)"
                lines.append(f"{key} capacity bucket {bucket}: best {best}; fastest ms: {times}")
        return "\n".join(lines)


def layer_key(layer: MoE) -> str:
    """Everything but the capacity that changes which setting is fastest."""
    return (f"E{layer.num_experts}-k{layer.top_k}-dim{layer.dim}-h{layer.hidden_dim}-{layer.experts.activation}"
            f"-W{layer.ep_size}-{str(layer.experts.w1.dtype).replace('torch.', '')}")


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


def _decide(candidates: list[Setting], times: dict[str, list[float]], group) -> Setting:
    """Rank 0 of the group picks the fastest (best of its trials) and broadcasts it: all ranks agree."""
    choice = torch.tensor([min(range(len(candidates)), key=lambda i: min(times[candidates[i].name]))])
    if group_size(group) > 1:
        if dist.get_backend(group) == "nccl":
            choice = choice.cuda()
        dist.broadcast(choice, src=dist.get_global_rank(group, 0), group=group)
    return candidates[int(choice)]


def _save(path: Path, table: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({"format": "weft.tuning/1", "table": table}, f, indent=2)
    os.replace(tmp, path)


def _load(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"tuning dictionary {path} is not readable JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != "weft.tuning/1" or not isinstance(doc.get("table"), dict):
        raise ValueError(f"tuning dictionary {path} is not a weft tuning file (format weft.tuning/1)")
    return doc["table"]
