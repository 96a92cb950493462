"""Run a function in N spawned gloo processes on the CPU, with a timeout and no hangs.

    results = run_distributed(fn, world_size=4, args=(...,), timeout=120)

`fn(*args)` runs in every process after `torch.distributed` is initialised (gloo over
loopback); it reads its rank with `dist.get_rank()`. The return values come back as a list
in rank order. The first exception in any rank terminates all processes and is re-raised
here with that rank's traceback; a run past `timeout` seconds is killed and reported.
"""
from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch.multiprocessing as mp


class DistributedTestError(RuntimeError):
    """A rank raised, died, or the run timed out."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, backend, env, args, results) -> None:
    try:
        import torch
        import torch.distributed as dist

        os.environ.update({k: str(v) for k, v in (env or {}).items()})
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )
        os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))
        torch.set_num_threads(1)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
        try:
            value = fn(*args)
        finally:
            dist.destroy_process_group()
        results.put(("ok", rank, value))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put(("error", rank, traceback.format_exc()))


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    timeout: float = 180.0,
    backend: str = "gloo",
    env: dict[str, Any] | None = None,
) -> list[Any]:
    """Run `fn(*args)` on `world_size` spawned ranks; return their results in rank order."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, backend, env, args, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world_size:
            try:
                status, rank, value = results.get(timeout=0.2)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise DistributedTestError(
                        f"timed out after {timeout:.0f}s; ranks without a result: "
                        f"{sorted(set(range(world_size)) - set(values))}"
                    ) from None
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in values]
                if dead:
                    raise DistributedTestError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                continue
            if status == "error":
                raise DistributedTestError(f"rank {rank} of {world_size} failed:\n{value}")
            values[rank] = value
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [values[r] for r in range(world_size)]
