"""Domino's p1 and p2 chosen by measurement (`--tp-overlap auto`), the way the tuning dictionary
chooses an MoE layer's exchange: every candidate computes the same function, so the fastest one
on this machine, model and batch is simply the one to run.

The candidates are Megatron's schedule (no split) and Domino's row split p1 in {2, 4}, column
split p2 in {2, 4} and their hybrid (2, 2), each only where the batch has p1 sequences and the
model p2 features, and (GPUs that reach each other's memory) each of those splits again with its
all-reduces copied through it (`Domino(reduce="copy")`). Each is timed `trials` times after
`warmup` untimed steps (a training step's forward and backward), candidates interleaved round by
round so that drifts (clocks, allocator) spread over all of them; a candidate's time is its
median, and the slowest rank's median is the one compared, so every rank picks the same.
Decisions are kept in a JSON file keyed by what changes the answer (model shape, batch, TP and
world size, device, torch version, whether copies were candidates) and reused.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from weft.jsonfile import read_json, write_json
from weft.profiling import time_candidates
from weft.tp.schedule import Domino, Sequential

# (p1, p2) of the Domino candidates, beside Megatron's schedule.
DOMINO_SPLITS = ((2, 1), (4, 1), (1, 2), (1, 4), (2, 2))


def schedule_name(schedule) -> str:
    """"none", or "domino p1=P1 p2=P2" ("domino-copy ..." with its all-reduces copied)."""
    return "none" if isinstance(schedule, Sequential) else f"{schedule.name} p1={schedule.p1} p2={schedule.p2}"


def candidate_schedules(batch: int, dim: int, copy: bool = False) -> list:
    """Megatron's schedule and the Domino splits the batch (`batch` sequences) and width allow,
    with `copy` each also with its all-reduces copied through peer memory."""
    splits = [(p1, p2) for p1, p2 in DOMINO_SPLITS if p1 <= batch and p2 <= dim]
    reduces = ("group", "copy") if copy else ("group",)
    return [Sequential()] + [Domino(p1, p2, reduce) for reduce in reduces for p1, p2 in splits]


def choose_schedule(step: Callable[[object], None], batch: int, dim: int, device: torch.device, key: str,
                    cache: str | Path | None = None, trials: int = 3, warmup: int = 1,
                    timer: Callable[[list], list[float]] | None = None, copy: bool = False) -> tuple[object, dict]:
    """The fastest of `candidate_schedules(batch, dim, copy)` for `step` (a training step's forward and
    backward under the given schedule), and a report {"chosen", "times_ms", "from_cache"}. With a
    `cache` file, a decision stored under `key` is reused without timing, and a new one is
    stored (rank 0 writes, atomically). Every rank returns the same schedule. `timer`: seconds per
    schedule by another measurement (e.g. `weft.graphs.time_graphed`, for steps that will run as
    CUDA graphs), in place of timing `step` eagerly."""
    schedules = candidate_schedules(batch, dim, copy)
    names = [schedule_name(s) for s in schedules]
    stored = _cached(cache, key)
    if stored is not None and stored.get("chosen") in names:
        return schedules[names.index(stored["chosen"])], {**stored, "from_cache": True}
    times = timer(schedules) if timer is not None else time_candidates(step, schedules, device, trials, warmup)
    best = min(range(len(schedules)), key=lambda i: (times[i], i))
    report = {"chosen": names[best], "times_ms": {n: t * 1e3 for n, t in zip(names, times)}}
    if cache is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        table = _read(cache)
        table[key] = report
        write_json(cache, table)
    return schedules[best], {**report, "from_cache": False}


def _read(cache: str | Path) -> dict:
    path = Path(cache)
    if not path.exists():
        return {}
    table = read_json(path, f"{path} is missing", "delete it: it only caches measured choices")
    if not isinstance(table, dict):
        raise ValueError(f"{path} is not a cache of tensor-parallel schedules; delete it (it is only a cache)")
    return table


def _cached(cache: str | Path | None, key: str) -> dict | None:
    """The stored decision for `key`, the same on every rank (rank 0's file, broadcast; a cache
    rank 0 cannot read is an error on every rank)."""
    found: list = [None]
    if cache is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        try:
            found = [("ok", _read(cache).get(key))]
        except ValueError as e:
            found = [("error", str(e))]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(found, src=0)
    if found[0] is None:
        return None
    status, value = found[0]
    if status == "error":
        raise ValueError(value)
    return value
