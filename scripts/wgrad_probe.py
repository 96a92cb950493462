"""The experts' grouped weight gradient x^T @ dy (groups along the rows) on one GPU: torch._grouped_mm,
weft's Triton kernel (`weft.kernels.wgrad`, each tile shape given) and cuBLAS's batched matmul
(equal groups only), for the layer configs' shapes as one rank holds them on `--world` GPUs
(4096 tokens a GPU, k rows each, E / W local experts), both weight gradients (w1's: x (dim) by
dy (hidden); w2's: h (hidden) by dy (dim)), equal groups and uneven ones (multinomial counts of a
Zipf-skewed expert load; a trailing "p" on a tile shape runs the kernel persistent, one program
per SM): ms, TFLOP/s and the largest difference from torch._grouped_mm.
    PYTHONPATH=src python3 scripts/wgrad_probe.py [--configs qwen2 phi35 mixtral] [--world 1 2]
        [--tiles 128x128x64w8s3 ...]"""
import argparse

import torch

from weft.bench.layer import CONFIGS
from weft.kernels.wgrad import WgradTiles, grouped_weights_mm_triton
from weft.profiling import seconds_per_call

TILES = ("128x128x64w8s3", "128x128x64w8s4", "128x256x64w8s3", "128x128x64w8s3p", "128x128x64w8s4p", "128x256x64w8s3p",
         "128x128x64w4s4", "128x128x64w4s4p")


def counts(rows: int, groups: int, skew: float, device: torch.device) -> torch.Tensor:
    """Each group's rows, summing to `rows`: equal (skew 0) or multinomial over Zipf(skew) weights."""
    if skew == 0:
        return torch.full((groups,), rows // groups, dtype=torch.int64)
    weights = 1.0 / torch.arange(1, groups + 1, dtype=torch.float64) ** skew
    picks = torch.multinomial(weights, rows, replacement=True, generator=torch.Generator().manual_seed(0))
    return torch.bincount(picks, minlength=groups)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["qwen2", "phi35", "mixtral"])
    parser.add_argument("--world", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--tiles", nargs="+", default=list(TILES))
    parser.add_argument("--skews", nargs="+", type=float, default=[0.0, 1.0])
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    dev = torch.device("cuda")
    tiles = [WgradTiles.parse(t) for t in args.tiles]
    print(f"{'config':8s} {'W':>2s} {'grad':3s} {'skew':>4s} {'kernel':18s} {'ms':>7s} {'TFLOP/s':>8s} "
          f"{'max diff':>9s}")
    for name in args.configs:
        cfg = CONFIGS[name]
        for world in args.world:
            groups = cfg.num_experts // world
            rows = 4096 * cfg.top_k  # a rank receives about its own tokens' k rows
            for grad, (K, N) in (("w1", (cfg.dim, cfg.hidden_dim)), ("w2", (cfg.hidden_dim, cfg.dim))):
                x = torch.randn(rows, K, device=dev, dtype=torch.bfloat16)
                dy = torch.randn(rows, N, device=dev, dtype=torch.bfloat16)
                flops = 2 * rows * K * N
                for skew in args.skews:
                    count_G = counts(rows, groups, skew, dev)
                    ends = torch.cumsum(count_G, 0).to(device=dev, dtype=torch.int32)
                    ref = torch._grouped_mm(x.t(), dy, offs=ends)
                    kernels = {"grouped_mm": lambda: torch._grouped_mm(x.t(), dy, offs=ends)}
                    if skew == 0:
                        C = rows // groups
                        kernels["bmm"] = lambda: torch.bmm(x.view(groups, C, K).transpose(1, 2), dy.view(groups, C, N))
                    for t in tiles:
                        kernels[f"triton {t}"] = lambda t=t: grouped_weights_mm_triton(x, dy, ends, t)
                    for label, fn in kernels.items():
                        diff = (fn().float() - ref.float()).abs().max().item()
                        ms = seconds_per_call(fn, dev, calls=args.calls) * 1e3
                        print(f"{name:8s} {world:2d} {grad:3s} {skew:4.1f} {label:18s} {ms:7.3f} "
                              f"{flops / ms / 1e9:8.0f} {diff:9.3g}", flush=True)


if __name__ == "__main__":
    main()
