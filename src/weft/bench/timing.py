"""Timing shared by the benchmarks: an event timer, interleaved rounds of several modes (or Tutel's
protocol: each mode's steps one after another between synchronisations; or back to back, as a
training loop runs them), the slowest rank, and running tuning calls out of the timed steps.

Modes are timed interleaved (one step of each per round, the order rotated), because drifts
within one launch (clocks, host jitter, NCCL, allocator) are larger than the differences between
modes when they are timed one block after another.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from weft.graphs import CaptureError
from weft.launch import ReportedError
from weft.profiling import synchronize, wall_seconds
from weft.train.metrics import format_duration


class Timer:
    """Milliseconds from `begin` to `stop` (CUDA events on GPU); each `lap` marks a point in
    between, read after `stop` as `laps_ms` (events, so no synchronisation inside the region;
    `lap_ms` is the first)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.laps_ms: list[float] = []

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _between(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def begin(self) -> None:
        self.marks, self.laps_ms = [], []
        self.start = self._mark()

    def lap(self) -> None:
        self.marks.append(self._mark())

    @property
    def lap_ms(self) -> float | None:
        return self.laps_ms[0] if self.laps_ms else None

    def stop(self) -> float:
        end = self._mark()
        if self.cuda:
            end.synchronize()
        self.laps_ms = [self._between(self.start, m) for m in self.marks]
        return self._between(self.start, end)


def gpu_state(device: torch.device) -> dict | None:
    """The GPU's SM clock (MHz), power draw (W) and temperature (C), NVML's readings over its last
    sample period (1/6 s to 1 s): what a timed run ran at. Under sustained GEMM load an H200 lowers
    its clock to stay within its power limit, so the same mode can time differently beside modes
    that leave the GPU idle (waiting on a slow link) and beside modes that keep it busy. None off
    CUDA, or where NVML (nvidia-ml-py) cannot be read: the readout is optional, never an error."""
    if device.type != "cuda":
        return None
    try:
        return {"sm_clock_mhz": torch.cuda.clock_rate(device), "power_w": torch.cuda.power_draw(device) / 1e3,
                "temperature_c": torch.cuda.temperature(device)}
    except Exception:  # noqa: BLE001  (no nvidia-ml-py, no driver, an NVML error: no readout)
        return None


def gpu_state_line(states: dict[str, dict]) -> str:
    """The benchmarks' line of `gpu_state` readings, each after its label ("" for none)."""
    readings = (f"SM {s['sm_clock_mhz']:.0f} MHz, {s['power_w']:.0f} W, {s['temperature_c']:.0f} C"
                for s in states.values())
    return "GPU at the end of the timed rounds (rank 0): " + "; ".join(
        f"{label} {reading}" if label else reading for label, reading in zip(states, readings))


def slowest(value: float, device: torch.device) -> float:
    """The largest `value` over the ranks of the default group (the value itself without one)."""
    t = torch.tensor([value], device=device, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def slowest_per_step(times: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Elementwise maximum of a CPU tensor of step times over the ranks: a step takes as long as
    its slowest rank."""
    if not dist.is_initialized():
        return times
    out = times.to(device).contiguous()  # NCCL refuses non-contiguous tensors
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out.cpu()


def interleaved_order(modes: Sequence[str], rounds: int) -> list[list[int]]:
    """Per round, the indices of `modes` in the order they run: each once, the start rotated by
    one every round, so that no mode always runs first (right after the previous round's last
    mode). The cyclic order is kept: otherwise a mode always follows the same one."""
    n = len(modes)
    return [[(r + j) % n for j in range(n)] for r in range(rounds)]


@dataclass
class Run:
    """One mode of an interleaved timing: `switch` puts the model into it, `step(round)` runs one
    timed step (it may call the timer's `lap`), `check` runs after the timer stopped."""

    switch: Callable[[], None]
    step: Callable[[int], None]
    check: Callable[[], None] = lambda: None


class ProgressLog:
    """A benchmark's progress lines on rank 0 (`weft bench model: lancet configured (12.3 s)`):
    each untimed phase as it ends, with its seconds, and the timed rounds at most every
    `every_s` seconds, with their rate and an ETA. Other ranks print nothing."""

    def __init__(self, name: str, rank: int, every_s: float = 10.0):
        self.prefix, self.quiet, self.every_s = f"weft bench {name}:", rank != 0, every_s
        self._last = self._rounds_start = time.perf_counter()
        self._last_round_line = -float("inf")

    def phase(self, what: str) -> None:
        now = time.perf_counter()
        if not self.quiet:
            print(f"{self.prefix} {what} ({now - self._last:.1f} s)", flush=True)
        self._last = self._rounds_start = now

    def round(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if self.quiet or (now - self._last_round_line < self.every_s and done < total):
            return
        self._last_round_line = now
        rate = done / max(now - self._rounds_start, 1e-9)
        print(f"{self.prefix} round {done}/{total} ({rate:.2f} rounds/s, ETA "
              f"{format_duration((total - done) / rate)})", flush=True)


def interleaved_ms(runs: Sequence[Run], steps: int, warmup: int, device: torch.device,
                   timer: Timer | None = None, progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
    """Time `runs` interleaved: `warmup` uncounted rounds, then `steps` counted ones. Returns
    (len(runs), 1 + laps, steps) milliseconds: the whole step, then each lap the steps marked on
    `timer` (the one they use; default a fresh one), each step's time its slowest rank's.
    `progress(done, total)` after each round (e.g. `ProgressLog.round`)."""
    timer = timer or Timer(device)
    times: list[list[list[float]]] = [[] for _ in runs]
    for r, order in enumerate(interleaved_order(range(len(runs)), warmup + steps)):
        for i in order:
            run = runs[i]
            run.switch()
            if dist.is_initialized():
                dist.barrier()
            timer.begin()
            run.step(r)
            elapsed = timer.stop()
            run.check()
            if r >= warmup:
                times[i].append([elapsed, *timer.laps_ms])
        if progress is not None:
            progress(r + 1, warmup + steps)
    return slowest_per_step(torch.tensor(times, dtype=torch.float64).transpose(1, 2), device)


def sequential_ms(runs: Sequence[Run], steps: int, warmup: int, device: torch.device,
                  progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
    """Tutel's helloworld protocol: each run's `warmup` + `steps` steps one after another (run by
    run, no barrier between steps), each timed on the host between two synchronisations of the
    device, the last `steps` kept; rank 0's own times, sent to every rank (Tutel prints rank 0's).
    Returns (len(runs), 1, steps) milliseconds, as `interleaved_ms` without laps. Between steps
    the ranks meet only in the step's own collectives, as in a training loop, so a rank's time
    counts no wait for a barrier's release; a drift of the clocks falls on the modes unevenly
    (list a mode twice to see it). `progress(done, total)` after each run."""
    times = torch.zeros(len(runs), 1, steps, dtype=torch.float64)
    for i, run in enumerate(runs):
        run.switch()
        for s in range(warmup + steps):
            elapsed = wall_seconds(lambda s=s: run.step(s), device) * 1e3
            run.check()
            if s >= warmup:
                times[i, 0, s - warmup] = elapsed
        if progress is not None:
            progress(i + 1, len(runs))
    if dist.is_initialized():
        sent = times.to(device)
        dist.broadcast(sent, src=0)
        times = sent.cpu()
    return times


def back_to_back_ms(runs: Sequence[Run], steps: int, warmup: int, device: torch.device,
                    progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
    """Each run's `warmup` + `steps` steps launched one after another with no synchronisation or
    barrier between them, as a training loop runs them (the host may run ahead of the GPU): step
    i's time is from a mark before it to the mark before step i + 1 (CUDA events; host time
    elsewhere), the last `steps` kept, each the slowest rank's. Returns (len(runs), 1, steps)
    milliseconds, as `interleaved_ms` without laps. `progress(done, total)` after each run."""
    times = torch.zeros(len(runs), 1, steps, dtype=torch.float64)
    timer = Timer(device)
    for i, run in enumerate(runs):
        run.switch()
        for s in range(warmup):
            run.step(s)
        timer.begin()
        for s in range(steps):
            run.step(warmup + s)
            timer.lap()
        timer.stop()
        run.check()
        ends = torch.tensor(timer.laps_ms, dtype=torch.float64)
        times[i, 0] = ends - torch.cat([ends.new_zeros(1), ends[:-1]])
        if progress is not None:
            progress(i + 1, len(runs))
    return slowest_per_step(times, device)


TIMINGS = {"interleaved": interleaved_ms, "sequential": sequential_ms, "back-to-back": back_to_back_ms}


def energy_counter(device: torch.device) -> Callable[[], float] | None:
    """A reader of the GPU's energy counter (NVML's total energy since the driver loaded, in
    millijoules), or None off CUDA or where NVML (nvidia-ml-py) cannot be read: optional, never an
    error."""
    if device.type != "cuda":
        return None
    try:
        import pynvml

        handle = torch.cuda._get_pynvml_handler(device)
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    except Exception:  # noqa: BLE001  (no nvidia-ml-py, no driver, a GPU without the counter: no readout)
        return None
    return lambda: float(pynvml.nvmlDeviceGetTotalEnergyConsumption(handle))


def energy_per_step(runs: Sequence[Run], step_ms: Sequence[float], seconds: float, device: torch.device,
                    read_mj: Callable[[], float] | None = None, rounds: int = 3,
                    progress: Callable[[int, int], None] | None = None) -> list[dict] | None:
    """The energy of each run's step, per GPU: each run's steps back to back in blocks of about
    `seconds` / (rounds * len(runs)) (the number of steps from its timed `step_ms`, the same on every
    rank), the runs' blocks interleaved over `rounds` rounds (`interleaved_order`), the energy
    counter `read_mj` (default `energy_counter`; millijoules) read around each block between two
    synchronisations. Per run: joules a step and mean watts, each the mean over the ranks (each rank
    reads its own GPU), and the blocks' milliseconds a step (the slowest rank's). A GPU at its
    power limit lowers its clock, so under that limit a step's energy, not its time alone, is what
    a change saves. None where no counter can be read."""
    read_mj = read_mj or energy_counter(device)
    if read_mj is None:
        return None
    budget = seconds / (rounds * max(1, len(runs)))
    totals = torch.zeros(len(runs), 3, dtype=torch.float64)  # millijoules, seconds, steps
    for r, order in enumerate(interleaved_order(range(len(runs)), rounds)):
        for i in order:
            run = runs[i]
            run.switch()
            count = max(1, round(budget / max(step_ms[i] * 1e-3, 1e-6)))
            if dist.is_initialized():
                dist.barrier()
            synchronize(device)
            start_mj, start_s = read_mj(), time.perf_counter()
            for s in range(count):
                run.step(s)
            synchronize(device)
            totals[i] += torch.tensor([read_mj() - start_mj, time.perf_counter() - start_s, count],
                                      dtype=torch.float64)
            run.check()
        if progress is not None:
            progress(r + 1, rounds)
    seconds_each = slowest_per_step(totals[:, 1].clone(), device)
    # this GPU's joules a step and watts, summed over the ranks, then their mean
    per_gpu = torch.stack([totals[:, 0] / 1e3 / totals[:, 2], totals[:, 0] / 1e3 / totals[:, 1]], dim=1)
    world = 1
    if dist.is_initialized():
        world = dist.get_world_size()
        sent = per_gpu.to(device)
        dist.all_reduce(sent)
        per_gpu = sent.cpu()
    per_gpu /= world
    return [{"joules_per_step": float(per_gpu[i, 0]), "watts": float(per_gpu[i, 1]),
             "ms_per_step": float(seconds_each[i] * 1e3 / totals[i, 2])} for i in range(len(runs))]


def quartiles(sample: torch.Tensor) -> tuple[float, float, float]:
    """(q1, median, q3) of a 1-D sample."""
    q1, median, q3 = torch.quantile(sample.double(), torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)).tolist()
    return q1, median, q3


@contextlib.contextmanager
def graphs_must_fit(graphed_modes: Sequence[str], workload: str, option: str, device: torch.device) -> Iterator[None]:
    """Around a benchmark's CUDA graph captures and interleaved timing, where every graphed mode's
    graph (its memory pool, the gradients it owns) stays alive at once: running out of GPU memory
    becomes one line naming the modes, the `workload` ("gpt2-l-moe at batch 4"), the `option` that
    graphs them and what to change. A capture that fails for another reason, any other error, and
    any error where no mode is graphed pass through. On 2 x H100, gpt2-l-moe at batch 4 with three
    graphed modes filled 80 GiB, and 32 gpt3-2.7b blocks at batch 16 with three."""
    try:
        yield
    except (torch.OutOfMemoryError, CaptureError) as e:
        if not graphed_modes or isinstance(e, CaptureError) and "out of memory" not in str(e):
            raise
        distinct = list(dict.fromkeys(graphed_modes))
        total = torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else 0.0
        fewer = f"{distinct[0]},{distinct[-1]},{distinct[0]}"
        raise ReportedError(
            f"{option} keeps the graphs of all {len(distinct)} graphed modes ({', '.join(distinct)}) alive for the "
            f"interleaved timing, and {workload} does not fit them in this GPU's {total:.0f} GiB: time fewer modes "
            f"per run (e.g. --modes {fewer}) or a smaller --batch-size") from e
