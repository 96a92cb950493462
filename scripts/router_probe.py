"""The router's product in float32 from bf16 rows: the reference (`x.float() @ w.t()`, cuBLAS's
float32 GEMM after a float32 copy of x) against `weft.kernels.router_matmul` (Triton, x read in
bf16), forward alone and forward + backward (the input gradient in bf16, the weight's in float32),
for the layer configs' shapes (4,096 tokens). Each case one CUDA graph, GPU ms a replay (20
replays between events), every case once a round, the median of the rounds; the reference timed
twice. `--tiles T D E ...`: further Triton cases, each kernel at those (BLOCK_T, BLOCK_D, BLOCK_E). Prints a
table and writes JSON to $OUT/router_probe.json.

    PYTHONPATH=src python3 scripts/router_probe.py [--configs qwen2 phi35 mixtral deepseek] [--tiles 64 64 64]
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch

from weft.bench.layer import CONFIGS
from weft.graphs import GraphedStep
from weft.jsonfile import write_json
from weft.kernels import router_matmul as kernel
from weft.profiling import seconds_per_call

DEFAULT_TILES = (kernel.LOGITS_TILES, kernel.INPUT_GRAD_TILES, kernel.WEIGHT_GRAD_TILES)


def cases(config: str, tiles: list[tuple[int, int, int]]) -> dict:
    cfg = CONFIGS[config]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(cfg.tokens_per_rank, cfg.dim, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(cfg.num_experts, cfg.dim, device="cuda", generator=gen) * cfg.dim ** -0.5).requires_grad_()
    g = torch.randn(cfg.tokens_per_rank, cfg.num_experts, device="cuda", generator=gen)

    def reference(backward: bool):
        y = kernel.router_matmul_reference(x, w)
        return torch.autograd.grad(y, (x, w), g) if backward else y

    def triton_at(tiles, backward: bool):
        """The kernels at `tiles` (one triple for all three; None: their defaults), read when the
        graph is captured."""
        def run():
            chosen = (tiles,) * 3 if tiles else DEFAULT_TILES
            kernel.LOGITS_TILES, kernel.INPUT_GRAD_TILES, kernel.WEIGHT_GRAD_TILES = chosen
            y = kernel.router_matmul(x, w)
            return torch.autograd.grad(y, (x, w), g) if backward else y
        return run

    want = [t.float() for t in reference(True)] + [reference(False)]
    built = {}
    for backward in (False, True):
        what = "fwd+bwd" if backward else "fwd"
        built[f"{what} reference"] = lambda b=backward: reference(b)
        for tile in [None, *tiles]:
            name = "triton" if tile is None else "triton {}x{}x{}".format(*tile)
            if not backward:
                got = [t.float() for t in triton_at(tile, True)()] + [triton_at(tile, False)()]
                errors = [f"{(a - b).abs().max().item() / b.abs().max().item():.2g}" for a, b in zip(got, want)]
                print(f"{config} {name}: max error over the largest value: dx {errors[0]}, dw {errors[1]}, "
                      f"logits {errors[2]}")
            built[f"{what} {name}"] = triton_at(tile, backward)
        built[f"{what} reference (again)"] = lambda b=backward: reference(b)
    return built


def probe(config: str, rounds: int, tiles: list[tuple[int, int, int]]) -> list[dict]:
    steps = {name: GraphedStep(lambda _, fn=fn: fn(), [torch.zeros(1, device="cuda")])
             for name, fn in cases(config, tiles).items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name].append(seconds_per_call(step.graph.replay, torch.device("cuda"), 20) * 1e3)
    rows = []
    for name, ms in times.items():
        print(f"{config:8s} {name:32s} {statistics.median(ms):7.4f} ms  ({', '.join(f'{t:.4f}' for t in ms)})",
              flush=True)
        rows.append({"config": config, "case": name, "ms": statistics.median(ms), "rounds_ms": ms})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["qwen2", "phi35", "mixtral", "deepseek"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tiles", type=int, nargs="+", default=[],
                        help="further (BLOCK_T, BLOCK_D, BLOCK_E) triples for the Triton kernels")
    args = parser.parse_args()
    if len(args.tiles) % 3:
        parser.error("--tiles takes triples: BLOCK_T BLOCK_D BLOCK_E")
    tiles = [tuple(args.tiles[i:i + 3]) for i in range(0, len(args.tiles), 3)]
    rows = [row for config in args.configs for row in probe(config, args.rounds, tiles)]
    write_json(os.path.join(os.environ.get("OUT", "."), "router_probe.json"), {"rows": rows})


if __name__ == "__main__":
    main()
