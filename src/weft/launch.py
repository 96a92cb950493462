"""Spawn local worker processes that form a torch.distributed world (CPU gloo or one GPU each).

Used by the CLI when it is not run under torchrun, and by the tests (via weft.testing).
"""
from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp


class WorkerError(RuntimeError):
    """A spawned rank raised, died, or the run timed out."""


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
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
        value = fn(*args)
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        # Report before tearing down: closing the group makes the other ranks fail too, and
        # the parent must see the root cause first. The parent terminates the survivors.
        results.put(("error", rank, traceback.format_exc()))
        return
    dist.barrier()  # nobody tears down while a peer is still inside a collective
    dist.destroy_process_group()
    results.put(("ok", rank, value))


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    timeout: float | None = 180.0,
    backend: str = "gloo",
    env: dict[str, Any] | None = None,
) -> list[Any]:
    """Run `fn(*args)` on `world_size` spawned local ranks; return their results in rank order.

    Each rank initialises torch.distributed (gloo over loopback, or NCCL with one GPU per rank)
    before calling `fn`, which reads its rank from `dist.get_rank()`. The first exception in any
    rank terminates all of them and is re-raised here with that rank's traceback; a run past
    `timeout` seconds (None: no limit) is killed and reported. `fn` must be picklable.
    """
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
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while len(values) < world_size:
            try:
                status, rank, value = results.get(timeout=0.2)
            except queue.Empty:
                if deadline is not None and time.monotonic() > deadline:
                    raise WorkerError(
                        f"timed out after {timeout:.0f}s; ranks without a result: "
                        f"{sorted(set(range(world_size)) - set(values))}"
                    ) from None
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in values]
                if dead:
                    raise WorkerError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                continue
            if status == "error":
                raise WorkerError(f"rank {rank} of {world_size} failed:\n{value}")
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
