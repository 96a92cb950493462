"""GPU check of the fused routing kernels: for the layer configs' routing shapes (T tokens per GPU,
E experts, top-k), `Router.route` with fused=True against the PyTorch path: equal routings
(experts, positions, gates, kept, counts) and the time per call, interleaved (torch, fused,
torch, fused), CUDA-event timed over CALLS calls after WARMUP. Prints a table.
    python3 scripts/routing_kernels.py [--calls 50]
"""
from __future__ import annotations

import argparse

import torch

from weft.moe.routing import Router

SHAPES = {"qwen2": (4096, 64, 4), "phi35": (4096, 16, 2), "mixtral": (4096, 8, 2), "gpt2-moe": (8192, 32, 1),
          "deepseek-like": (4096, 256, 8)}


def time_route(router: Router, logits: torch.Tensor, k: int, cf: float | None, fused: bool, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        router.route(logits, k, cf, fused=fused)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    print("| shape (T, E, k) | capacity | equal | torch ms | fused ms | torch again | fused again | torch / fused |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (T, E, k) in SHAPES.items():
        for cf in (1.0, None):
            logits = torch.randn(T, E, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
            router = Router("topk", E, False, None)
            a, b = (router.route(logits, k, cf, fused=f) for f in (False, True))
            fields = ("experts_S", "positions_S", "gates_S", "counts_E", "token_ids_S")
            fields += ("kept_S",) if cf is not None else ("order_S",)
            equal = all(torch.equal(getattr(a, f), getattr(b, f)) for f in fields)
            for fused in (False, True):
                for _ in range(args.warmup):
                    router.route(logits, k, cf, fused=fused)
            times = [time_route(router, logits, k, cf, fused, args.calls) for fused in (False, True, False, True)]
            ratio = (times[0] + times[2]) / (times[1] + times[3])
            print(f"| {name} ({T}, {E}, {k}) | {'dropless' if cf is None else cf} | {equal} | "
                  + " | ".join(f"{t:.3f}" for t in times) + f" | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
