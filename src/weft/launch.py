"""Spawn local worker processes that form a torch.distributed world (CPU gloo or one GPU each).

Used by the CLI when it is not run under torchrun, and by the tests (via weft.testing).
The ranks live and die together: the first rank to fail stops the others, and on Linux a rank
gets SIGKILL when its launcher dies (`kill -9`, a scheduler's SIGTERM), so no rank trains on
without it. A rank that dies without a Python exception (a native crash, `os._exit`) is named
with its exit code, before the errors it caused on the other ranks.
"""
from __future__ import annotations

import ctypes
import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# The ranks' rendezvous and collective timeout.
_GROUP_TIMEOUT = timedelta(seconds=120)


class WorkerError(RuntimeError):
    """A spawned rank raised, died, or the run timed out. `report`: the one-line message of a
    `ReportedError` the rank raised (None for other failures, whose traceback is the message)."""

    def __init__(self, message: str, report: str | None = None):
        super().__init__(message)
        self.report = report


class ReportedError(RuntimeError):
    """An error whose message is the whole report for the user (no traceback): a run that stopped
    on purpose, a run folder in use, ... The CLI prints it as one line, `weft: error: ...`."""


PR_SET_PDEATHSIG = 1


def die_with_parent(launcher_pid: int) -> None:
    """Ask the kernel (Linux) to SIGKILL this process when its parent dies; exit at once if the
    launcher is already gone. The parent is the launcher (spawn) or the fork server, which exits
    when the launcher does (forkserver). Elsewhere nothing happens."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # no prctl: the launcher's own cleanup remains
        return
    if os.getppid() != parent or not _alive(launcher_pid):
        os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def exit_code_text(code: int) -> str:
    """'exit code 3' or 'signal SIGSEGV' for a process's exit code."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def free_port() -> int:
    """A port free at this moment (another process may take it before the caller binds it; the
    launcher itself never relies on this: it hosts its rendezvous store on a port it keeps)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(call: bytes, rank, world_size, port, backend, env, launcher_env, results, launcher_pid) -> None:
    die_with_parent(launcher_pid)
    try:
        if launcher_env is not None:  # forked from a server started earlier: the launcher's environment now
            os.environ.clear()
            os.environ.update(launcher_env)
        os.environ.update({k: str(v) for k, v in (env or {}).items()})
        # Unpickled only now: loading fn imports its module, which may read the environment
        # (Triton's interpreter switch is read when a kernel is defined).
        fn, args = pickle.loads(call)
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )
        os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=_GROUP_TIMEOUT)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=_GROUP_TIMEOUT)
        value = fn(*args)
    except BaseException as e:  # noqa: BLE001 - every failure must reach the parent
        # Report before tearing down: closing the group makes the other ranks fail too, and
        # the parent must see the root cause first. The parent terminates the survivors.
        report = str(e) if isinstance(e, ReportedError) else None
        results.put(("error", rank, (traceback.format_exc(), report)))
        return
    dist.barrier()  # nobody tears down while a peer is still inside a collective
    dist.destroy_process_group()
    results.put(("ok", rank, value))


def server_preload(preload: tuple[str, ...] = ()) -> list[str]:
    """The modules a fork server of `run_distributed` imports when it starts: torch, its
    distributed package and `preload`."""
    return ["torch", "torch.distributed", *preload]


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    timeout: float | None = 180.0,
    backend: str = "gloo",
    env: dict[str, Any] | None = None,
    start_method: str = "spawn",
    preload: tuple[str, ...] = (),
) -> list[Any]:
    """Run `fn(*args)` on `world_size` local ranks; return their results in rank order.

    Each rank initialises torch.distributed (gloo over loopback, or NCCL with one GPU per rank)
    before calling `fn`, which reads its rank from `dist.get_rank()`. The first exception in any
    rank terminates all of them and is re-raised here with that rank's traceback; a run past
    `timeout` seconds (None: no limit) is killed and reported. `fn` and `args` must be picklable
    (plain pickle: tensors travel by value).

    `start_method`: "spawn" (a new interpreter per rank) or "forkserver" (ranks forked from one
    server process per launcher that imported torch once, with the launcher's environment as it
    is at this call: a rank starts in milliseconds instead of seconds, for callers that start many
    short worlds, such as the tests). `preload`: more modules the server imports when it starts
    (a server already running keeps what it has), so that a rank does not import them itself.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
    ctx = mp.get_context(start_method)
    launcher_env = None
    if start_method == "forkserver":
        ctx.set_forkserver_preload(server_preload(preload))
        launcher_env = dict(os.environ)
    call = pickle.dumps((fn, args))
    results = ctx.Queue()
    # The launcher hosts the ranks' rendezvous store on a port the OS gives it and keeps bound
    # until the ranks are done: a port chosen free and released before rank 0 binds it can be
    # taken meanwhile (gloo's own connections use ephemeral ports), which failed a CI run.
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=_GROUP_TIMEOUT)
    port = store.port
    procs = [
        ctx.Process(target=_worker, args=(call, r, world_size, port, backend, env, launcher_env, results,
                                          os.getpid()), daemon=True)
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
                dead = _died_silently(procs, values, 0.0)
                if dead is not None:
                    raise WorkerError(dead) from None
                continue
            if status == "error":
                text, report = value
                # A rank that crashed without an exception makes the others fail next ("Connection
                # reset by peer"): name it first, with its exit code.
                dead = _died_silently(procs, values, 1.0, reported=rank)
                if dead is not None:
                    raise WorkerError(f"{dead}; then rank {rank} of {world_size} failed:\n{text}")
                raise WorkerError(f"rank {rank} of {world_size} failed:\n{text}", report)
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


def _died_silently(procs, values: dict, grace: float, reported: int | None = None) -> str | None:
    """'rank R died with ...' for the first rank that exited non-zero without reporting (waiting
    up to `grace` seconds for one to show up), or None."""
    deadline = time.monotonic() + grace
    while True:
        for r, p in enumerate(procs):
            if r != reported and r not in values and p.exitcode not in (None, 0):
                return f"rank {r} died with {exit_code_text(p.exitcode)} without a Python exception"
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)
