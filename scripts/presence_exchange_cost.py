"""Host microseconds of the agreement `reduce_gradients` makes each step on which weights have a
gradient anywhere (`weft.moe.grads._agreed_gradients`: a gloo all-reduce of one flag a weight),
for 80 weights (gpt2-s-moe's count) on 2 and 4 CPU ranks: the mean of 500 calls after the first
(which builds the gloo group), per rank.

    PYTHONPATH=src python3 scripts/presence_exchange_cost.py
"""
from __future__ import annotations

import time

import torch

from weft.moe import grads
from weft.testing import run_distributed


def worker(weights: int, calls: int = 500) -> float:
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(weights)]
    for p in params:
        p.grad = torch.zeros(4)
    grads._agreed_gradients(params, None)  # builds the host group
    start = time.perf_counter()
    for _ in range(calls):
        grads._agreed_gradients(params, None)
    return (time.perf_counter() - start) / calls * 1e6


if __name__ == "__main__":
    for world in (2, 4):
        per_rank = run_distributed(worker, world, args=(80,), timeout=120)
        print(f"{world} ranks: {', '.join(f'{us:.0f}' for us in per_rank)} us a call, by rank")
