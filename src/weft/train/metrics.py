"""Per-step metrics (DIR/metrics.jsonl) and the periodic progress line."""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, TextIO

# Dense bf16 peak per GPU, for MFU; GPUs not listed report no MFU.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12}


def peak_flops(device_name: str) -> float | None:
    for key, value in PEAK_BF16_FLOPS.items():
        if key in device_name:
            return value
    return None


class MetricsLog:
    """Appends one JSON object per line and flushes, so a killed run keeps what it logged.

    `resume_from=N` (a run resumed from its step-N checkpoint) first drops the rows of steps after
    N that the interrupted run logged: they are trained again, and each step is logged once. The
    rewrite is atomic (a temporary file renamed over the log)."""

    def __init__(self, path: Path, resume_from: int | None = None):
        path.parent.mkdir(parents=True, exist_ok=True)
        _drop_partial_last_line(path)
        if resume_from is not None:
            _drop_rows_after(path, resume_from)
        self._file: TextIO = path.open("a")

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _drop_rows_after(path: Path, step: int) -> None:
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
    if len(kept) == len(lines):
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


def _drop_partial_last_line(path: Path) -> None:
    """A run killed mid-write leaves a line without its newline; cut it before appending."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        with path.open("r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class Progress:
    """`step 120/400 | loss 2.412 | val 2.50 | 41.2k tok/s | lr 2.9e-03 | ETA 1m10s` lines."""

    def __init__(self, start_step: int, total_steps: int, every: int):
        self.start_step, self.total, self.every = start_step, total_steps, every
        self.t0 = time.perf_counter()

    def line(self, step: int, loss: float, tokens_per_s: float, lr: float, val_loss: float | None) -> str | None:
        if step % self.every and step != self.total and val_loss is None:
            return None
        done = step - self.start_step
        rate = done / max(time.perf_counter() - self.t0, 1e-9)
        eta = (self.total - step) / rate if rate > 0 else math.inf
        val = f" | val {val_loss:.3f}" if val_loss is not None else ""
        return (f"step {step}/{self.total} | loss {loss:.3f}{val} | {tokens_per_s / 1e3:.1f}k tok/s | "
                f"lr {lr:.1e} | ETA {format_duration(eta)}")
