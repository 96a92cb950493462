"""torch._grouped_mm against cuBLAS's batched matmul on the experts' three products (forward
x @ w, input gradient dy @ w^T, weight gradient x^T @ dy), equal groups, one GPU: ms and
TFLOP/s of each, for the layer configs' shapes (T tokens x k rows, E experts, dim x hidden).
    PYTHONPATH=src python3 scripts/grouped_mm_probe.py [--configs qwen2 phi35 mixtral]"""
import argparse

import torch

from weft.bench.layer import CONFIGS
from weft.profiling import seconds_per_call


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["qwen2", "phi35", "mixtral"])
    args = parser.parse_args()
    dev = torch.device("cuda")
    print(f"{'config':8s} {'product':10s} {'grouped ms':>10s} {'bmm ms':>8s} {'grouped TF/s':>12s} {'bmm TF/s':>9s}")
    for name in args.configs:
        cfg = CONFIGS[name]
        E, D, H = cfg.num_experts, cfg.dim, cfg.hidden_dim
        rows = cfg.tokens_per_rank * cfg.top_k
        C = rows // E
        x = torch.randn(E * C, D, device=dev, dtype=torch.bfloat16)
        dy = torch.randn(E * C, H, device=dev, dtype=torch.bfloat16)
        w = torch.randn(E, D, H, device=dev, dtype=torch.bfloat16)
        offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * C
        flops = 2 * E * C * D * H
        products = {
            "x @ w": (lambda: torch._grouped_mm(x, w, offs=offs), lambda: torch.bmm(x.view(E, C, D), w)),
            "dy @ w^T": (lambda: torch._grouped_mm(dy, w.transpose(1, 2), offs=offs),
                         lambda: torch.bmm(dy.view(E, C, H), w.transpose(1, 2))),
            "x^T @ dy": (lambda: torch._grouped_mm(x.t(), dy, offs=offs),
                         lambda: torch.bmm(x.view(E, C, D).transpose(1, 2), dy.view(E, C, H))),
        }
        for product, (grouped, bmm) in products.items():
            g = seconds_per_call(grouped, dev, calls=20) * 1e3
            b = seconds_per_call(bmm, dev, calls=20) * 1e3
            print(f"{name:8s} {product:10s} {g:10.3f} {b:8.3f} {flops / g / 1e9:12.0f} {flops / b / 1e9:9.0f}")


if __name__ == "__main__":
    main()
