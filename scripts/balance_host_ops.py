"""The host's share of a balanced dropless call, on the CPU: aten ops per forward + backward of one
MoE layer on 2 gloo ranks, plain against the same call with one expert copied (Pro-Prophet's
replicated exchange, the call copying it itself), the ops the copy adds, by name, and the host time
per call of a tiny layer plain and with the copy (and of the copy's two collectives alone). On GPUs a
dropless call waits for its counts mid-call, so every op after that read is host time the GPU
waits for, and the rank holding a copy reaches the next collective late.

    python scripts/balance_host_ops.py
"""
from __future__ import annotations

import statistics
import time
from collections import Counter

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from weft import MoE
from weft.moe.exchange import Transfer
from weft.testing import run_distributed


def count_ops() -> None:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(0)
    moe = MoE(64, 128, 8, top_k=2, capacity_factor=None, activation="relu", balance="pro-prophet")
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(rank))

    def call(copies: dict) -> None:
        transfer = Transfer(moe.experts, moe.placement, copies, moe.group) if copies else Transfer.none()
        moe(x.detach().requires_grad_(), transfer=transfer).sum().backward()
        moe.zero_grad(set_to_none=True)

    # Host time per call, with tiny shapes so that the CPU's arithmetic is small: the copy's host
    # work and its two collectives (the broadcast and reduce of one expert's stack, timed alone).
    stack = torch.zeros(1, 2 * 64 * 128)

    def collectives() -> None:
        dist.broadcast(stack, 0)
        dist.reduce(stack, 0)

    tiny = MoE(8, 8, 8, top_k=2, capacity_factor=None, activation="relu", balance="pro-prophet", kernels="torch")
    xt = torch.randn(16, 8, generator=torch.Generator().manual_seed(rank))

    def tiny_call(copies: dict) -> None:
        transfer = Transfer(tiny.experts, tiny.placement, copies, tiny.group) if copies else Transfer.none()
        tiny(xt.detach().requires_grad_(), transfer=transfer).sum().backward()

    timed = {"plain": lambda: tiny_call({}), "copy": lambda: tiny_call({0: frozenset({1})}),
             "broadcast + reduce alone": collectives}
    ms = {name: [] for name in timed}
    for _ in range(2):  # interleaved, twice: the spread is the noise
        for name, fn in timed.items():
            for _ in range(10):
                fn()
            times = []
            for _ in range(100):
                dist.barrier()
                begin = time.perf_counter()
                fn()
                times.append(time.perf_counter() - begin)
            ms[name].append(1e3 * statistics.median(times))

    ops = {}
    for name, copies in (("plain", {}), ("expert 0 copied to rank 1", {0: frozenset({1})})):
        for _ in range(3):
            call(copies)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            call(copies)
        events = [e for e in prof.events() if is_op(e)]
        ops[name] = (Counter(e.name for e in events), Counter(e.name for e in events if not nested(e)))
    if rank == 1:  # the rank that holds the copy
        (plain_name, (plain, plain_top)), (copy_name, (copied, copied_top)) = ops.items()
        print(f"rank 1, aten ops per call (forward + backward): {plain_name} {sum(plain.values())}, "
              f"{copy_name} {sum(copied.values())}; top-level (called from Python or autograd, not from "
              f"another op): {sum(plain_top.values())} and {sum(copied_top.values())}")
        print("added by the copy: " + ", ".join(f"{n.removeprefix('aten::')} {c}"
                                                for n, c in (copied - plain).most_common(20)))
        print("top-level ops added by the copy: " + ", ".join(f"{n.removeprefix('aten::')} {c}"
                                                          for n, c in (copied_top - plain_top).most_common(20)))
        print("host ms per forward + backward of a tiny layer (median of 100, twice): "
              + "; ".join(f"{name} " + " / ".join(f"{v:.2f}" for v in values) for name, values in ms.items()))


def is_op(event) -> bool:
    return event.name.startswith(("aten::", "c10d"))


def nested(event) -> bool:
    """Whether another op called this one (its host cost is inside the caller's)."""
    parent = event.cpu_parent
    while parent is not None:
        if is_op(parent):
            return True
        parent = parent.cpu_parent
    return False


if __name__ == "__main__":
    run_distributed(count_ops, 2, timeout=300)
